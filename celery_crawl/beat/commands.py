"""Operator commands for the beat leader, as records in the store's command queue.

``celery crawl pause|resume|trigger|backfill`` push a record onto ``keys.BEAT_COMMANDS``; the
leader pops the queue (fenced by its lease, so a deposed leader cannot swallow commands) about
twice a second and applies each one without a restart. A queue rather than direct writes keeps
every change of entry state in one writer, the leader.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import UTC, datetime
from typing import Any

from ..errors import ConfigError
from .state import format_slot, parse_slot

__all__ = ["OPS", "Command", "make_command", "parse_command"]

OPS = ("pause", "resume", "trigger", "backfill")
#: Most slots one backfill command publishes.
MAX_BACKFILL = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """One operator command.

    Attributes:
        op: ``pause`` | ``resume`` | ``trigger`` | ``backfill``.
        entry: the entry name.
        start: backfill start (exclusive: slots strictly after it).
        end: backfill end (inclusive).
        issued_at: when the operator issued it.
        issued_by: ``host:pid`` of the CLI.
    """

    op: str
    entry: str
    start: datetime | None = None
    end: datetime | None = None
    issued_at: datetime | None = None
    issued_by: str = ""


def make_command(op: str, entry: str, *, start: datetime | None = None,
                 end: datetime | None = None) -> dict[str, Any]:
    """The queue record of a command; validates it first.

    Raises:
        ConfigError: unknown op, empty entry name, or a backfill range that is missing,
            naive or reversed.
    """
    if op not in OPS:
        raise ConfigError(f"beat command: unknown op {op!r} (one of {', '.join(OPS)})")
    if not entry:
        raise ConfigError("beat command: an entry name is required")
    record: dict[str, Any] = {
        "op": op, "entry": entry, "issued_at": format_slot(datetime.now(UTC)),
        "issued_by": f"{socket.gethostname()}:{os.getpid()}",
    }
    if op == "backfill":
        if start is None or end is None:
            raise ConfigError("backfill: --start and --end are required")
        for label, value in (("--start", start), ("--end", end)):
            if value.tzinfo is None:
                raise ConfigError(f"backfill {label}: {value.isoformat()} has no time zone "
                                  f"(write e.g. 2026-03-01T00:00:00Z)")
        if end < start:
            raise ConfigError("backfill: --end is before --start")
        record["start"] = format_slot(start)
        record["end"] = format_slot(end)
    return record


def parse_command(record: dict[str, Any]) -> Command:
    """A queue record back to a :class:`Command`.

    Raises:
        ValueError: the record is not a command (the leader logs and drops it).
    """
    op = record.get("op")
    entry = record.get("entry")
    if op not in OPS or not isinstance(entry, str) or not entry:
        raise ValueError(f"not a beat command: {record!r}")
    try:
        start = parse_slot(record["start"]) if record.get("start") else None
        end = parse_slot(record["end"]) if record.get("end") else None
        issued = parse_slot(record["issued_at"]) if record.get("issued_at") else None
    except Exception as exc:
        raise ValueError(f"bad time in beat command {record!r}: {exc}") from exc
    if op == "backfill" and (start is None or end is None):
        raise ValueError(f"backfill without a range: {record!r}")
    return Command(op, entry, start, end, issued, str(record.get("issued_by", "")))
