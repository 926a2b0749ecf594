"""Task-id reuse that Celery does itself, seen where it happens: in the run that publishes it.

``self.retry()``, ``Task.replace()`` and ``apply_async(task_id=self.request.id)`` publish the
next run of a task under the id of the run that is still going. The worker plugin would drop
that message as a duplicate of the finished run (the done tombstone) unless the finished run's
tombstone says that it handed its id on. Only the publishing run knows, so this receiver of
``before_task_publish`` (connected in every worker process, prefork children included) marks
it (``finishing.mark_handoff``) when the current worker task, one claimed by the plugin,
publishes

* a message under its own id (retry, a replacement by a single task, a re-publish), which it
  also stamps with a random ``crawl_handoff`` header so the message's digest differs from every
  earlier message of that id; or
* the first task of its replacement (a chain or a chord whose last task carries the id): a
  message whose ``replaced_task_nesting`` is higher than the run's own.

The main process reads the mark when the run's message is acked and writes it into the done
tombstone (``claims.is_successor``). A producer's header cannot set the mark: it is a file
private to the worker, written only by a run of the plugin.
"""

from __future__ import annotations

import secrets
from typing import Any

from celery.signals import before_task_publish

from .. import _finishing as finishing
from .claims import lenient_int
from .context import CLAIM_HEADER

__all__ = ["HANDOFF_HEADER", "connect"]

#: Random per re-publish, so that a message published under a running task's own id never has
#: the digest of an earlier message of that id.
HANDOFF_HEADER = "crawl_handoff"

_connected = False


def _current_request() -> Any:
    from celery import current_task

    task: Any = current_task
    if task is None:
        return None
    request = getattr(task, "request", None)
    if request is None or getattr(request, "called_directly", True):
        return None
    if getattr(request, CLAIM_HEADER, None) is None:
        return None
    return request


def note_publish(sender: Any = None, headers: dict[str, Any] | None = None,
                 **_: Any) -> None:
    """Mark the current claimed run as handing its id on, when this publish does."""
    if not isinstance(headers, dict):
        return
    request = _current_request()
    if request is None or not request.id:
        return
    if headers.get("id") == request.id:
        headers[HANDOFF_HEADER] = secrets.token_hex(8)
        finishing.mark_handoff(str(request.id))
    elif lenient_int(headers.get("replaced_task_nesting")) > lenient_int(
            getattr(request, "replaced_task_nesting", 0)):
        finishing.mark_handoff(str(request.id))


def connect() -> None:
    """Connect the receiver once per process (``install_worker``)."""
    global _connected
    if not _connected:
        before_task_publish.connect(note_publish, weak=False,
                                    dispatch_uid="celery_crawl.worker.handoffs")
        _connected = True
