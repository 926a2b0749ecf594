"""A poison message ends as FAILURE without running: its task's hook, or Celery's backend.

A delivery found at ``crawl_max_deliveries`` probably killed every worker that ran it; it is
not run again. Its task's ``crawl_on_poison`` hook (rolling back, auditing and storing the
FAILURE itself) or else the task's result backend records why; the claim's end and the ack
follow in the consumer's claims.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from celery.app.task import Context

from ..errors import PoisonMessage
from .claims import Held
from .context import CLAIM_HEADER

__all__ = ["store_poison_failure"]

logger = logging.getLogger("celery_crawl.worker")


def store_poison_failure(app: Any, held: Held, *, hostname: str, max_deliveries: int) -> None:
    """Store ``held``'s FAILURE (the task's hook, else its backend). Off the loop: these are
    the task's and the backend's calls."""
    name = held.arrival.task_name
    task = app.tasks.get(name)
    message = held.arrival.message
    reason = (f"delivered {held.deliveries} times (crawl_max_deliveries={max_deliveries}) "
              "without finishing; its worker probably died running it")
    exc = PoisonMessage(f"{name}[{held.arrival.task_id}] {reason}")
    args: Any = ()
    kwargs: Any = {}
    embed: dict[str, Any] = {}
    try:
        payload = message.decode()
        if isinstance(payload, list | tuple) and len(payload) == 3:
            args, kwargs, embed = payload
    except Exception:  # a body we cannot decode still ends as FAILURE
        logger.debug("celery-crawl: cannot decode %s", held.arrival.task_id, exc_info=True)
    logger.error("celery-crawl: %s[%s] is a poison message: %s", name, held.arrival.task_id, reason)
    hook = getattr(task, "crawl_on_poison", None) if task is not None else None
    if callable(hook):
        # The task's own hook rolls back, audits and stores the FAILURE itself.
        try:
            params = inspect.signature(hook).parameters
            extra = {k: v for k, v in (("token", held.token), ("hostname", hostname))
                     if k in params}
            hook(held.arrival.task_id, args, kwargs, reason, **extra)
            return
        except Exception:
            logger.exception("celery-crawl: crawl_on_poison of %s failed", held.arrival.task_id)
    if task is None:
        return
    ctx = Context({**message.headers, **(embed or {}), "args": args, "kwargs": kwargs,
                   CLAIM_HEADER: held.token, "hostname": hostname,
                   "delivery_info": message.delivery_info})
    try:
        task.backend.mark_as_failure(held.arrival.task_id, exc, request=ctx)
    except Exception:
        logger.exception("celery-crawl: storing the poison FAILURE of %s failed",
                         held.arrival.task_id)
