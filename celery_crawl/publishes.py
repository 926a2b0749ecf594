"""Each publish of a task message carries an id of its own (``crawl_sent``).

A worker drops a delivery whose task id has finished (the ``done/<id>`` tombstone): a broker's
redelivery, a copy restored at a channel close, a message duplicated in transit. Those copies
are the *same publish*, byte for byte. A frozen signature applied again (a frozen chord's header
and body, ``apply_async(task_id=...)`` sent twice) is a *new publish* of the same task id, and
stock Celery runs it again ("each apply is a new run"). The two are byte for byte alike without
a mark, so every message an installed process publishes gets one: a random id set once per
message (a message object sent twice keeps it, as a duplicate must), unless the publisher set
it already. The beat sets it to the slot's task id, so two leaders publishing one slot send the
same publish and the slot runs once.

The worker records the ids of the publishes a task id ran for in its tombstone and runs a later
delivery again only when it carries an id not among them (``worker.claims.is_new_publish``).
Messages without the mark (a producer that never called ``install``) keep the stricter rule:
a finished id is not run again for ``crawl_done_ttl``.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery.signals import before_task_publish

__all__ = ["SENT_HEADER", "mark_publishes"]

#: Message header naming the publish a message belongs to.
SENT_HEADER = "crawl_sent"

_marking = False


def mark_publishes() -> None:
    """Mark every task message this process publishes from now on (``install`` calls it)."""
    global _marking
    _marking = True


def _mark(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    # Protocol 2 only: a protocol-1 message has no task id in its headers, and its worker
    # runs it without a claim anyway.
    if (_marking and headers is not None and "id" in headers and "task" in headers
            and not headers.get(SENT_HEADER)):
        headers[SENT_HEADER] = uuid.uuid4().hex


before_task_publish.connect(_mark, weak=False, dispatch_uid="celery_crawl.publishes.mark")
