"""What a running task can read about its own claim.

The worker's main process writes the claim token into the task message's headers under
``crawl_claim_token`` before the request is built, always overwriting whatever the producer put
there, so a forged header cannot survive. Celery copies message headers into the task's request
context, so the token is ``self.request.crawl_claim_token`` inside the task and
``current_claim()`` anywhere below it (also in prefork children, which never talk to the store).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CLAIM_HEADER", "current_claim"]

#: Message header (and task request attribute) carrying the claim's fencing token.
CLAIM_HEADER = "crawl_claim_token"


def current_claim() -> int | None:
    """The claim token of the task running in this thread, or None outside a claimed task.

    Stamp external writes with it: a sink that refuses tokens older than the newest it has seen
    makes a stale run (a worker resumed after a freeze, its task already re-run elsewhere)
    harmless.
    """
    from celery import current_task

    task: Any = current_task
    if task is None:
        return None
    request = getattr(task, "request", None)
    token = getattr(request, CLAIM_HEADER, None)
    if token is None:
        return None
    try:
        return int(token)
    except (TypeError, ValueError):
        return None
