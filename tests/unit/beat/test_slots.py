"""Catch-up planning with a fixed-period slot source."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_crawl.beat.slots import CatchupPolicy, iter_slots, plan

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


class Every:
    """Slots every ``period_s`` seconds, aligned to the epoch."""

    def __init__(self, period_s: int) -> None:
        self.period_s = period_s

    def next_slot(self, after: datetime) -> datetime:
        ts = int(after.timestamp()) // self.period_s * self.period_s + self.period_s
        return datetime.fromtimestamp(ts, UTC)


def test_fresh_entry_starts_at_next_slot_without_catchup() -> None:
    p = plan(Every(60), None, T0 + timedelta(seconds=30), CatchupPolicy("all"))
    assert p.run == () and p.skipped == ()
    assert p.next_slot == T0 + timedelta(seconds=60)


def test_on_time_slot_runs_under_every_policy() -> None:
    for mode in ("none", "latest", "all"):
        p = plan(Every(1), T0, T0 + timedelta(seconds=1, milliseconds=5), CatchupPolicy(mode))
        assert p.run == (T0 + timedelta(seconds=1),)
        assert p.skipped == ()
        assert p.next_slot == T0 + timedelta(seconds=2)


def test_latest_runs_newest_and_records_the_rest() -> None:
    now = T0 + timedelta(seconds=5, milliseconds=100)
    p = plan(Every(1), T0, now, CatchupPolicy("latest"))
    assert p.run == (T0 + timedelta(seconds=5),)
    (skip,) = p.skipped
    assert (skip.first, skip.last, skip.count, skip.reason) == (
        T0 + timedelta(seconds=1), T0 + timedelta(seconds=4), 4, "superseded")
    assert p.last_slot == T0 + timedelta(seconds=5)


def test_none_skips_late_slots_as_missed() -> None:
    now = T0 + timedelta(seconds=5, milliseconds=100)
    p = plan(Every(1), T0, now, CatchupPolicy("none", grace_s=1.0))
    assert p.run == (T0 + timedelta(seconds=5),)
    assert p.skipped[0].reason == "missed" and p.skipped[0].count == 4


def test_all_is_capped_and_window_is_enforced() -> None:
    now = T0 + timedelta(seconds=30)
    p = plan(Every(1), T0, now, CatchupPolicy("all", window_s=20, max_runs=5))
    reasons = {s.reason: s.count for s in p.skipped}
    assert reasons["outside_window"] == 9  # slots 1..9; slot 10 is exactly 20 s old
    assert len(p.run) == 5 and p.run[-1] == now
    assert reasons["catchup_max"] == 30 - 9 - 5


def test_very_long_absence_is_extrapolated_not_enumerated() -> None:
    now = T0 + timedelta(days=2)
    p = plan(Every(1), T0, now, CatchupPolicy("latest", window_s=60))
    old = p.skipped[0]
    assert old.reason == "outside_window" and old.approx
    assert abs(old.count - (2 * 86400 - 60)) <= 2
    assert p.run == (now,)


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="catchup mode"):
        CatchupPolicy("sometimes")


@settings(max_examples=60)
@given(gap_s=st.integers(0, 400), mode=st.sampled_from(["none", "latest", "all"]),
       window_s=st.integers(0, 200), max_runs=st.integers(1, 20))
def test_every_due_slot_is_run_or_skipped_exactly_once(
    gap_s: int, mode: str, window_s: int, max_runs: int
) -> None:
    src = Every(7)
    last = T0
    now = T0 + timedelta(seconds=gap_s, milliseconds=300)
    p = plan(src, last, now, CatchupPolicy(mode, window_s=window_s, max_runs=max_runs))
    due = list(iter_slots(src, last, now))
    covered = list(p.run)
    for s in p.skipped:
        covered += list(iter_slots(src, s.first - timedelta(microseconds=1), s.last))
        assert s.count == len(list(iter_slots(src, s.first - timedelta(microseconds=1), s.last)))
    assert sorted(covered) == due
    assert p.next_slot is not None and p.next_slot > now
