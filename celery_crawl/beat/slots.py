"""Slot arithmetic without Celery: which slots of an entry run now, which are skipped and why.

A *slot* is the nominal UTC instant of one run (DESIGN.md "Schedules"); ``(entry, slot)`` is the
run's identity. Given the last slot an entry ran (or skipped) and the current instant, ``plan``
decides, by the entry's catch-up policy, which due slots are published and which are recorded
as skipped, as counted ranges with a reason:

``none``      only a slot that is on time (at most ``grace_s`` late) runs; older ones are
              skipped as ``missed``.
``latest``    the newest due slot runs; the older ones are skipped as ``superseded``.
``all``       every due slot runs, the newest ``catchup_max`` of them; the rest are skipped as
              ``catchup_max``.

Whatever the policy, slots older than ``catchup_window`` are skipped as ``outside_window`` (an
on-time slot is never outside the window). An entry without a last slot (new, or its definition
changed) starts afresh at its next slot: there is no catch-up for a definition that did not
exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Protocol

from ..schedules.policies import CATCHUP_POLICIES, Catchup, CatchupPolicy

__all__ = [
    "CATCHUP_MODES",
    "CatchupPolicy",
    "Plan",
    "SkipRange",
    "SlotSource",
    "blame",
    "iter_slots",
    "plan",
]

CATCHUP_MODES = CATCHUP_POLICIES
#: Most slots enumerated one by one when an entry was left alone for very long; beyond this the
#: skipped range's count is extrapolated from the period and marked approximate.
_MAX_ENUMERATED = 10_000


class SlotSource(Protocol):
    """Anything that yields the first slot strictly after an instant (TzCron, adapters)."""

    def next_slot(self, after: datetime) -> datetime | None:  # pragma: no cover - protocol
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class SkipRange:
    """Consecutive slots of one entry not run, for one reason.

    ``approx`` is True when ``count`` was extrapolated rather than counted slot by slot.
    """

    first: datetime
    last: datetime
    count: int
    reason: str
    approx: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What to do with an entry at one instant.

    Attributes:
        run: slots to publish now, oldest first.
        skipped: ranges recorded as skipped, oldest first.
        last_slot: the newest slot handled (run or skipped), to store as the entry's position.
        next_slot: the first slot strictly after ``now``, or None when the schedule has ended.
    """

    run: tuple[datetime, ...]
    skipped: tuple[SkipRange, ...]
    last_slot: datetime | None
    next_slot: datetime | None


def iter_slots(
    source: SlotSource, after: datetime, until: datetime, *, limit: int = _MAX_ENUMERATED
) -> Iterator[datetime]:
    """Slots ``s`` with ``after < s <= until``, at most ``limit`` of them."""
    cur = after
    for _ in range(limit):
        nxt = source.next_slot(cur)
        if nxt is None or nxt > until:
            return
        if nxt <= cur:  # a broken source must not spin forever
            return
        yield nxt
        cur = nxt


def plan(
    source: SlotSource,
    last_slot: datetime | None,
    now: datetime,
    policy: CatchupPolicy,
) -> Plan:
    """Decide which due slots of one entry run at ``now``.

    Args:
        source: the entry's schedule.
        last_slot: the newest slot already handled, or None for a fresh start.
        now: the current aware UTC instant.
        policy: the entry's catch-up policy.
    """
    if last_slot is None:
        return Plan((), (), None, source.next_slot(now))
    window_start = now - timedelta(seconds=policy.window_s)
    on_time_after = now - timedelta(seconds=policy.grace_s)
    skipped: list[SkipRange] = []

    # Slots older than the window: counted, never run. Jump when there are very many.
    old_end = min(window_start, on_time_after) - timedelta(microseconds=1)
    cursor = last_slot
    first_old: datetime | None = None
    prev_old: datetime | None = None
    count_old = 0
    for s in iter_slots(source, cursor, old_end):
        first_old = first_old or s
        prev_old, cursor = cursor, s
        count_old += 1
    if first_old is not None:
        if count_old >= _MAX_ENUMERATED and prev_old is not None:
            # Too many to count one by one: extrapolate from the period and skip to the end.
            period_s = (cursor - prev_old).total_seconds() or 1.0
            extra = int((old_end - cursor).total_seconds() / period_s)
            skipped.append(SkipRange(first_old, old_end, count_old + extra, "outside_window",
                                     approx=True))
            cursor = old_end
        else:
            skipped.append(SkipRange(first_old, cursor, count_old, "outside_window"))

    due = list(iter_slots(source, cursor, now))
    late = [s for s in due if s < on_time_after]
    on_time = [s for s in due if s >= on_time_after]
    run: list[datetime]
    if policy.mode is Catchup.NONE:
        run = on_time
        if late:
            skipped.append(SkipRange(late[0], late[-1], len(late), "missed"))
    elif policy.mode is Catchup.LATEST:
        run = due[-1:]
        older = due[:-1]
        if older:
            skipped.append(SkipRange(older[0], older[-1], len(older), "superseded"))
    else:
        run = due[-policy.max_runs:]
        older = due[: -policy.max_runs] if len(due) > policy.max_runs else []
        if older:
            skipped.append(SkipRange(older[0], older[-1], len(older), "catchup_max"))
    newest = due[-1] if due else cursor
    return Plan(tuple(run), tuple(skipped), newest, source.next_slot(max(now, newest)))


def blame(skipped: tuple[SkipRange, ...], slot: datetime, reason: str,
          source: SlotSource) -> tuple[SkipRange, ...]:
    """``skipped`` with ``slot`` given its own range and ``reason``.

    A slot that could not be decided when it was due (the store could not tell whether the
    previous run was still in flight) was retried on later ticks; when the plan finally skips
    it (missed, superseded, outside the window) the skip is the store's doing, not the
    policy's, and it is counted as such. The other slots of its range keep their reason.
    """
    out: list[SkipRange] = []
    for r in skipped:
        if not r.first <= slot <= r.last:
            out.append(r)
            continue
        before = list(iter_slots(source, r.first - timedelta(microseconds=1),
                                 slot - timedelta(microseconds=1), limit=r.count))
        if before:
            out.append(SkipRange(before[0], before[-1], len(before), r.reason, r.approx))
        out.append(SkipRange(slot, slot, 1, reason))
        rest = r.count - len(before) - 1
        after = source.next_slot(slot)
        if rest > 0 and after is not None and after <= r.last:
            out.append(SkipRange(after, r.last, rest, r.reason, r.approx))
    return tuple(out)
