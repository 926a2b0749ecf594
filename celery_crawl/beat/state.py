"""Durable per-entry state of the beat leader, as JSON records in the lease store.

``keys.beat_entry(name)`` holds where an entry stands (:class:`EntryState`); ``keys.beat_skips
(name)`` holds its skipped slots as counted ranges with a reason (:class:`SkipLog`). Both are
written only with the leader lease (``store.put(..., lease=...)``), so a deposed leader's late
write is refused by the store instead of rewinding its successor.

Ordering: a run is *published first and recorded second*. A crash in between makes the next
leader publish that slot again under the same deterministic task id, which the worker's claim
deduplicates; the reverse order could lose a run.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from ..errors import StoreDataError
from .slots import SkipRange

__all__ = ["MAX_SKIP_RANGES", "EntryState", "Sent", "SkipLog", "format_slot", "parse_slot"]

#: Ranges kept per entry; older ones are folded into the per-reason totals.
MAX_SKIP_RANGES = 100


def format_slot(slot: datetime) -> str:
    """ISO-8601 UTC with a ``Z`` and microseconds only when present (the header format)."""
    utc = slot.astimezone(UTC)
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if utc.microsecond else "%Y-%m-%dT%H:%M:%SZ"
    return utc.strftime(fmt)


def parse_slot(text: str, *, key: str = "") -> datetime:
    """Inverse of :func:`format_slot`; a malformed value raises ``StoreDataError``."""
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError, AttributeError) as exc:
        raise StoreDataError(f"{key}: {text!r} is not an ISO UTC slot") from exc
    if value.tzinfo is None:
        raise StoreDataError(f"{key}: slot {text!r} has no time zone")
    try:
        return value.astimezone(UTC)
    except OverflowError as exc:  # e.g. 0001-01-01T00:00:00+01:00 has no UTC instant
        raise StoreDataError(f"{key}: slot {text!r} is out of range") from exc


@dataclasses.dataclass(slots=True)
class Sent:
    """A published run not yet seen at a worker (``crawl_beat_verify_delivery``).

    Attributes:
        task_id: the run's task id.
        slot: its slot as published (``crawl_slot``; manual runs: the trigger instant).
        manual: published by ``trigger``/``backfill``.
        check_at: when to look for it next (epoch seconds: the next leader reads it too).
        resent: how many times it was published again after being found nowhere.
    """

    task_id: str
    slot: str
    manual: bool
    check_at: float
    resent: int = 0

    def to_record(self) -> list[Any]:
        return [self.task_id, self.slot, self.manual, round(self.check_at, 3), self.resent]

    @classmethod
    def from_record(cls, value: Any) -> Sent:
        task_id, slot, manual, check_at, resent = value
        if not isinstance(task_id, str) or not isinstance(slot, str):
            raise TypeError("unverified: task id and slot must be strings")
        return cls(task_id, slot, bool(manual), float(check_at), int(resent))


@dataclasses.dataclass(slots=True)
class EntryState:
    """Where one entry stands.

    Attributes:
        fingerprint: of the entry's definition when this state was started; a different one
            means the definition changed and the entry starts afresh.
        last_slot: newest slot run or skipped (None: nothing yet).
        run_count: runs published under this fingerprint (manual runs included).
        last_task_id: id of the newest published run, for overlap decisions.
        last_run_slot: slot of that run (manual runs: the trigger instant).
        paused: operator override (``celery crawl pause|resume``); None follows the definition.
        buffered_slot: a slot held back by ``overlap = "buffer_one"`` until the previous run ends.
        token: leader token of the last write (informational; the store fences on its own).
        unverified: published runs not yet seen at a worker (only with
            ``crawl_beat_verify_delivery``), kept here so a new leader goes on checking them.
    """

    fingerprint: str
    last_slot: datetime | None = None
    run_count: int = 0
    last_task_id: str | None = None
    last_run_slot: datetime | None = None
    paused: bool | None = None
    buffered_slot: datetime | None = None
    token: int | None = None
    unverified: list[Sent] = dataclasses.field(default_factory=list)

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "last_slot": format_slot(self.last_slot) if self.last_slot else None,
            "run_count": self.run_count,
            "last_task_id": self.last_task_id,
            "last_run_slot": format_slot(self.last_run_slot) if self.last_run_slot else None,
            "paused": self.paused,
            "buffered_slot": format_slot(self.buffered_slot) if self.buffered_slot else None,
            "token": self.token,
        }
        if self.unverified:
            record["unverified"] = [u.to_record() for u in self.unverified]
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any], *, key: str = "") -> EntryState:
        """Rebuild from a stored record; anything malformed raises ``StoreDataError``."""
        try:
            return cls(
                fingerprint=str(record["fingerprint"]),
                last_slot=_opt_slot(record.get("last_slot"), key),
                run_count=int(record.get("run_count") or 0),
                last_task_id=_opt(record.get("last_task_id"), str, "last_task_id"),
                last_run_slot=_opt_slot(record.get("last_run_slot"), key),
                paused=_opt(record.get("paused"), bool, "paused"),
                buffered_slot=_opt_slot(record.get("buffered_slot"), key),
                token=_opt(record.get("token"), int, "token"),
                unverified=[Sent.from_record(u) for u in record.get("unverified") or ()],
            )
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise StoreDataError(f"{key}: not an entry state record ({exc})") from exc


def _opt(value: Any, kind: type[Any], field: str) -> Any:
    """``value`` if None or of ``kind`` (bool is not an int here); else a TypeError naming it."""
    if value is None or (isinstance(value, kind)
                         and not (kind is int and isinstance(value, bool))):
        return value
    raise TypeError(f"{field} must be {kind.__name__} or null, got {type(value).__name__}")


def _opt_slot(value: Any, key: str) -> datetime | None:
    return None if value is None else parse_slot(value, key=key)


@dataclasses.dataclass(slots=True)
class SkipLog:
    """Skipped slots of one entry: recent ranges plus all-time totals per reason."""

    ranges: list[SkipRange] = dataclasses.field(default_factory=list)
    totals: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, skip: SkipRange, *, contiguous: bool) -> None:
        """Record ``skip``; merged into the newest range when it continues it (``contiguous``:
        no slot was run or skipped for another reason in between) with the same reason."""
        self.totals[skip.reason] = self.totals.get(skip.reason, 0) + skip.count
        last = self.ranges[-1] if self.ranges else None
        if (contiguous and last is not None and last.reason == skip.reason
                and last.last < skip.first):
            self.ranges[-1] = SkipRange(last.first, skip.last, last.count + skip.count,
                                        skip.reason, last.approx or skip.approx)
        else:
            self.ranges.append(skip)
            del self.ranges[:-MAX_SKIP_RANGES]

    def covers(self, slot: datetime) -> str | None:
        """The reason ``slot`` was skipped, if a kept range holds it (ranges hold every slot
        between ``first`` and ``last`` of the entry's schedule)."""
        for r in reversed(self.ranges):
            if r.first <= slot <= r.last:
                return r.reason
        return None

    def to_record(self) -> dict[str, Any]:
        return {
            "ranges": [
                {"first": format_slot(r.first), "last": format_slot(r.last), "count": r.count,
                 "reason": r.reason, **({"approx": True} if r.approx else {})}
                for r in self.ranges
            ],
            "totals": dict(self.totals),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any] | None, *, key: str = "") -> SkipLog:
        if not record:
            return cls()
        try:
            ranges = [
                SkipRange(parse_slot(r["first"], key=key), parse_slot(r["last"], key=key),
                          int(r["count"]), str(r["reason"]), bool(r.get("approx", False)))
                for r in record.get("ranges", [])
            ]
            totals = {str(k): int(v) for k, v in (record.get("totals") or {}).items()}
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise StoreDataError(f"{key}: not a skip log record ({exc})") from exc
        return cls(ranges, totals)
