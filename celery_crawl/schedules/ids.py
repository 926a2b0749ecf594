"""The identity of a run: ``(entry, slot)`` and the task id derived from it."""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import NAMESPACE_URL, uuid5

__all__ = ["format_slot", "task_id_for", "task_id_for_text"]


def format_slot(slot: datetime) -> str:
    """A slot as ``YYYY-MM-DDTHH:MM:SSZ`` in UTC (the form used in ids and headers)."""
    if slot.tzinfo is None:
        raise ValueError(f"slot must be an aware datetime, got naive {slot!r}")
    return f"{slot.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def task_id_for(namespace: str, entry: str, slot: datetime) -> str:
    """The task id of the run of ``entry`` at ``slot``: the same on every replica, so a run
    published twice (a failover, a retried publish) is one task to the workers.
    """
    return task_id_for_text(namespace, entry, format_slot(slot))


def task_id_for_text(namespace: str, entry: str, slot_text: str) -> str:
    """``task_id_for`` with the slot already formatted (a burst formats its slot once)."""
    return str(uuid5(NAMESPACE_URL, f"{namespace}|{entry}|{slot_text}"))
