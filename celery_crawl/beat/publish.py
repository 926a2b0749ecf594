"""Publishing one run: deterministic task id, crawl headers, retries capped by lease validity.

Every run of ``(entry, slot)`` gets the task id of DESIGN.md, so a run published twice (a crash
between publish and state write, or a leader frozen right after its validity check) is the same
task twice, and the worker's claim on ``task:<id>`` lets only one of them run.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..schedules import task_id_for
from .entries import BeatEntry
from .state import format_slot

__all__ = ["RETRY_INTERVAL_S", "Publisher", "task_id_for"]

#: Pause between publish retries; the number of retries is what fits in the lease's validity.
RETRY_INTERVAL_S = 0.2
#: Publish options the scheduler sets itself; an entry cannot override them.
_RESERVED = ("task_id", "producer", "serializer", "retry", "retry_policy")

class Publisher:
    """Sends runs through one producer (one broker connection for a whole burst).

    Args:
        app: the Celery app.
        namespace: the crawl namespace (part of every task id).
    """

    def __init__(self, app: Any, namespace: str) -> None:
        self.app = app
        self.namespace = namespace

    def publish(
        self,
        entry: BeatEntry,
        slot: datetime,
        *,
        token: int,
        remaining_s: float,
        producer: Any,
        manual: bool = False,
    ) -> str:
        """Publish one run and return its task id.

        Args:
            entry: what to run.
            slot: the run's nominal slot (manual runs: the trigger instant).
            token: the leader token, sent as ``crawl_leader_token``.
            remaining_s: validity left on the leader lease; bounds the retries.
            producer: the scheduler's producer.
            manual: mark the run ``crawl_manual`` (``trigger``/``backfill``).

        Raises:
            Exception: whatever kombu raises once the retries are exhausted.
        """
        task_id = task_id_for(self.namespace, entry.name, slot)
        options = dict(entry.options)
        for reserved in _RESERVED:
            options.pop(reserved, None)
        headers: dict[str, Any] = {
            **(options.pop("headers", None) or {}),
            "crawl_entry": entry.name,
            "crawl_slot": format_slot(slot),
            "crawl_leader_token": token,
        }
        if manual:
            headers["crawl_manual"] = True
        retries = max(0, int(remaining_s / RETRY_INTERVAL_S) - 1)
        self.app.send_task(
            entry.task,
            list(entry.args),
            dict(entry.kwargs),
            task_id=task_id,
            producer=producer,
            headers=headers,
            serializer="json",
            retry=True,
            retry_policy={
                "max_retries": retries,
                "interval_start": 0,
                "interval_step": RETRY_INTERVAL_S,
                "interval_max": RETRY_INTERVAL_S,
            },
            **options,
        )
        return task_id
