"""LeasedScheduler under forced fault interleavings, in-process against a real Redis: a wall
clock set between skew checks, a store error at a slot's fire time, a demotion between taking
an operator command and recording its effect, and long steps of the beat loop (promotion among
millions of foreign keys, a delivery check against a long backlog) that must not outlive the
lease.

Each interleaving is forced (an injected wall clock, foreign data in the store, a hook between
two steps, a populated database), never hoped for with sleeps.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from celery_crawl import keys
from celery_crawl.beat import LeasedScheduler
from celery_crawl.beat.state import EntryState, SkipLog, parse_slot
from celery_crawl.leases import open_store
from celery_crawl.schedules import TzCron
from tests.integration.test_beat_scheduler import EVERY_SECOND, drain, make_app, run_for
from tests.servers import RedisServer, wait_until

MINUTELY = TzCron("* * * * *", "UTC")


@pytest.fixture
def ns() -> str:
    return f"beatf-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def opened() -> Iterator[list[LeasedScheduler]]:
    made: list[LeasedScheduler] = []
    yield made
    for s in made:
        s.close()


class SettableWall:
    """The local wall clock plus an offset a test sets (``date -s`` without root)."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset_s


def lead(app: Any, opened: list[LeasedScheduler], *,
         wall: Callable[[], float] | None = None) -> LeasedScheduler:
    s = LeasedScheduler(app, wall_clock=wall)
    opened.append(s)
    wait_until(lambda: (s.tick(), s.election.is_leader)[1], 15, what="the replica leads")
    return s


def test_a_wall_clock_step_between_skew_checks_publishes_nothing_early(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    """+2 h for about a second, well inside one skew-check interval: nothing is published
    ahead of the reference clock, no slot is recorded skipped, and once the clock is back the
    entry is due at its real next minute (not two hours later)."""
    wall = SettableWall()
    app = make_app(redis_server, ns, {"m": {"task": "t.m", "schedule": MINUTELY}},
                   crawl_beat_lease_ttl=3.0)
    a = lead(app, opened, wall=wall)
    run_for([a], 0.3)
    drain(redis_server, ns)
    wall.offset_s = 7200.0
    run_for([a], 1.0)
    wall.offset_s = 0.0
    wait_until(lambda: (a.tick(), a.election.is_leader)[1], 15,
               what="the replica leads again once its clock is back")
    run_for([a], 0.3)
    real_now = datetime.now(UTC)
    early = [m["crawl_slot"] for m in drain(redis_server, ns)
             if parse_slot(m["crawl_slot"]) > real_now]
    assert early == [], f"published ahead of the reference clock: {early}"
    store = open_store(redis_server.url_db(0), namespace=ns)
    try:
        skips = SkipLog.from_record(store.get(keys.beat_skips("m")))
        assert skips.totals == {}, skips.totals
        st = EntryState.from_record(store.get(keys.beat_entry("m")))
        assert st.last_slot is not None and st.last_slot <= real_now, st.last_slot
    finally:
        store.close()
    nxt = a._next_of.get("m")
    assert nxt is not None and 0 < (nxt - real_now).total_seconds() <= 61, nxt
    assert a._steps is not None and a._steps.steps >= 2  # set ahead, then back


def _poison(server: RedisServer, ns: str, record: str) -> None:
    """Foreign bytes where a record should be: every read of it fails with StoreDataError."""
    server.client(0).hset(f"{ns}:rec:{record}", "v", "not json")


def test_a_store_error_at_fire_time_is_retried_not_counted_as_overlap(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    """The previous run's tombstone cannot be read when a slot fires: the slot is neither
    published nor skipped as ``overlap`` on a guess; it is decided again on the next ticks,
    runs if the store answers in time, and is counted as ``store_error`` only once its window
    has passed."""
    app = make_app(redis_server, ns, {"e": {"task": "t.e", "schedule": EVERY_SECOND}},
                   crawl_beat_lease_ttl=3.0)
    a = lead(app, opened)
    wait_until(lambda: (a.tick(), a.states["e"].last_task_id)[1], 10, what="a first run")
    store = open_store(redis_server.url_db(0), namespace=ns)
    try:
        # A long outage: every slot whose window passes is a store_error skip, none an
        # overlap, and nothing is published on a guess.
        first = a.states["e"].last_task_id
        assert first is not None
        _poison(redis_server, ns, keys.done(first))
        drain(redis_server, ns)
        run_for([a], 3.0)
        assert drain(redis_server, ns) == []
        skips = SkipLog.from_record(store.get(keys.beat_skips("e")))
        assert "overlap" not in skips.totals, skips.totals
        assert skips.totals.get("store_error", 0) >= 1, skips.totals
        redis_server.client(0).delete(f"{ns}:rec:{keys.done(first)}")
        store.put(keys.done(first), {"state": "SUCCESS"})
        second = wait_until(lambda: (a.tick(), a.states["e"].last_task_id != first
                                     and a.states["e"].last_task_id)[1], 5,
                            what="runs again once the store answers")
        # A short one: the slot is left undecided, then runs once the store answers.
        _poison(redis_server, ns, keys.done(second))
        held = wait_until(lambda: (a.tick(), a._undecided.get("e"))[1], 5,
                          interval_s=0.01, what="a slot left undecided")
        drain(redis_server, ns)
        redis_server.client(0).delete(f"{ns}:rec:{keys.done(second)}")
        store.put(keys.done(second), {"state": "SUCCESS"})
        msgs = wait_until(lambda: (a.tick(), drain(redis_server, ns))[1], 5, interval_s=0.01,
                          what="the undecided slot runs")
        assert parse_slot(msgs[0]["crawl_slot"]) == held
        skips = SkipLog.from_record(store.get(keys.beat_skips("e")))
        assert "overlap" not in skips.totals, skips.totals
    finally:
        store.close()
