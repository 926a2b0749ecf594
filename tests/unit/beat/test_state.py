"""Entry state and skip-log records round-trip and reject garbage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from celery_crawl.beat.slots import SkipRange
from celery_crawl.beat.state import (
    MAX_SKIP_RANGES,
    EntryState,
    Sent,
    SkipLog,
    format_slot,
    parse_slot,
)
from celery_crawl.errors import StoreDataError

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def test_slot_format_roundtrip() -> None:
    assert format_slot(T0) == "2026-03-01T12:00:00Z"
    assert parse_slot("2026-03-01T12:00:00Z") == T0
    with pytest.raises(StoreDataError, match="beat/entry/x"):
        parse_slot("yesterday", key="beat/entry/x")


def test_entry_state_roundtrip() -> None:
    st = EntryState("fp1", T0, 3, "tid", T0, True, T0 + timedelta(seconds=1), 42)
    assert EntryState.from_record(st.to_record()) == st
    with pytest.raises(StoreDataError):
        EntryState.from_record({"nofingerprint": 1}, key="k")


def test_unverified_runs_roundtrip_and_are_absent_when_empty() -> None:
    st = EntryState("fp1", T0, unverified=[Sent("tid", "2026-03-01T12:00:00Z", False, 1.5, 2)])
    record = st.to_record()
    assert record["unverified"] == [["tid", "2026-03-01T12:00:00Z", False, 1.5, 2]]
    assert EntryState.from_record(record) == st
    assert "unverified" not in EntryState("fp1").to_record()  # older readers see no change
    with pytest.raises(StoreDataError, match="beat/entry/x"):
        EntryState.from_record({"fingerprint": "f", "unverified": [[1, 2]]}, key="beat/entry/x")


def test_skip_log_merges_contiguous_ranges_and_caps() -> None:
    log = SkipLog()
    s1 = SkipRange(T0, T0, 1, "overlap")
    s2 = SkipRange(T0 + timedelta(seconds=1), T0 + timedelta(seconds=1), 1, "overlap")
    log.add(s1, contiguous=False)
    log.add(s2, contiguous=True)
    assert len(log.ranges) == 1 and log.ranges[0].count == 2
    assert log.covers(T0 + timedelta(seconds=1)) == "overlap"
    log.add(SkipRange(T0 + timedelta(seconds=2), T0 + timedelta(seconds=2), 1, "paused"),
            contiguous=True)
    assert len(log.ranges) == 2
    for i in range(3, 3 + 2 * MAX_SKIP_RANGES):
        t = T0 + timedelta(seconds=i)
        log.add(SkipRange(t, t, 1, "overlap"), contiguous=False)
    assert len(log.ranges) == MAX_SKIP_RANGES
    assert log.totals["overlap"] == 2 + 2 * MAX_SKIP_RANGES
    again = SkipLog.from_record(log.to_record())
    assert again == log
