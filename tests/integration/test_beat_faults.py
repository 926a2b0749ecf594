"""LeasedScheduler under forced fault interleavings, in-process against a real Redis: a wall
clock set between skew checks, a store error at a slot's fire time, a demotion between taking
an operator command and recording its effect, and long steps of the beat loop (promotion among
millions of foreign keys, a delivery check against a long backlog) that must not outlive the
lease.

Each interleaving is forced (an injected wall clock, foreign data in the store, a hook between
two steps, a populated database), never hoped for with sleeps.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from celery_crawl import keys
from celery_crawl.beat import LeasedScheduler
from celery_crawl.beat.commands import make_command
from celery_crawl.beat.index import EntryIndex
from celery_crawl.beat.state import EntryState, Sent, SkipLog, parse_slot
from celery_crawl.errors import NotLeader, StoreError
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
    assert a._dispatch is not None
    nxt = a._dispatch.next_of.get("m")
    assert nxt is not None and 0 < (nxt - real_now).total_seconds() <= 61, nxt
    assert a._guards is not None and a._guards.steps.steps >= 2  # set ahead, then back


def store_get(server: RedisServer, ns: str, key: str) -> Any:
    store = open_store(server.url_db(0), namespace=ns)
    try:
        return store.get(key)
    finally:
        store.close()


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
        assert a._dispatch is not None
        undecided = a._dispatch.undecided
        held = wait_until(lambda: (a.tick(), undecided.get("e"))[1], 5,
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


@pytest.fixture(params=["redis", "etcd"])
def lease_url(request: pytest.FixtureRequest, redis_server: RedisServer) -> str:
    if request.param == "redis":
        return redis_server.url_db(0)
    etcd: Any = request.getfixturevalue("etcd_server")
    return str(etcd.url)


def test_a_command_outlives_a_demotion_between_applying_and_recording_it(
    redis_server: RedisServer, lease_url: str, ns: str, opened: list[LeasedScheduler]
) -> None:
    """The leader applies ``pause`` and loses the lease before the write that records it (the
    lease is released behind its back and a second replica takes over, right after the apply):
    its write is refused, and the command is not lost: the new leader applies it."""
    sched = {"tick": {"task": "t.tick", "schedule": EVERY_SECOND}}
    app = make_app(redis_server, ns, sched, crawl_lease_url=lease_url,
                   crawl_beat_lease_ttl=3.0)
    a = lead(app, opened)
    b = LeasedScheduler(make_app(redis_server, ns, sched, crawl_lease_url=lease_url,
                                 crawl_beat_lease_ttl=3.0))
    opened.append(b)
    other = open_store(lease_url, namespace=ns)
    assert a._commands is not None
    applied = a._commands.apply
    taken_over: list[int] = []

    def apply_then_lose_the_lease(cmd: Any) -> None:
        applied(cmd)
        lease = a.election.lease
        assert lease is not None
        other.release(lease)  # as if it expired while the leader was frozen here
        wait_until(lambda: (b.tick(), b.election.is_leader)[1], 10, what="b takes over")
        taken_over.append(b.election.lease.token if b.election.lease else 0)

    try:
        a._commands.apply = apply_then_lose_the_lease  # type: ignore[method-assign]
        other.push(keys.BEAT_COMMANDS, make_command("pause", "tick"))
        wait_until(lambda: (a.tick(), taken_over)[1], 10, what="a applies the command")
        wait_until(lambda: (a.tick(), not a.election.is_leader)[1], 10,
                   what="a learns it was deposed")
        wait_until(lambda: (b.tick(), b.states.get("tick") and b.states["tick"].paused)[1], 5,
                   what="the new leader applies the command")
        st = EntryState.from_record(other.get(keys.beat_entry("tick")))
        assert st.paused is True and st.token == taken_over[0]
        assert other.peek(keys.BEAT_COMMANDS).items == ()
    finally:
        other.close()


def test_peek_then_put_and_ack_is_one_fenced_write(lease_url: str, ns: str) -> None:
    store = open_store(lease_url, namespace=ns)
    try:
        old = store.acquire("lead", 30, "a")
        assert old is not None
        for n in range(3):
            store.push("cmds", {"n": n})
        taken = store.peek("cmds", limit=2)
        assert taken.items == ({"n": 0}, {"n": 1})
        assert store.peek("cmds").items == ({"n": 0}, {"n": 1}, {"n": 2})  # nothing taken
        store.release(old)
        new = store.acquire("lead", 30, "b")
        assert new is not None
        with pytest.raises(NotLeader):
            store.put_and_ack([("effect", {"by": "old"})], taken, lease=old)
        assert store.get("effect") is None and len(store.peek("cmds").items) == 3
        store.put_and_ack([("effect", {"by": "new"})], taken, lease=new)
        assert store.get("effect") == {"by": "new"}
        assert store.peek("cmds").items == ({"n": 2},)
        with pytest.raises(StoreError, match="head of the queue"):
            store.put_and_ack([("effect", {"by": "twice"})], taken, lease=new)
        assert store.get("effect") == {"by": "new"}
        store.put_and_ack([], store.peek("cmds"), lease=new)
        assert store.peek("cmds").items == ()
    finally:
        store.close()


class LeaseWatch:
    """Samples the leader lease's server-side TTL from its own connection while a step runs:
    the lowest TTL seen, and how often the key was missing once taken (the lease lapsed)."""

    def __init__(self, server: RedisServer, ns: str) -> None:
        self.client = server.client(0)
        self.key = f"{ns}:lease:{keys.BEAT_LEADER}"
        self.min_ms: int | None = None
        self.lapsed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pttl = int(self.client.pttl(self.key))
            if pttl < 0:
                if self.min_ms is not None:  # missing after it was first taken
                    self.lapsed += 1
            else:
                self.min_ms = pttl if self.min_ms is None else min(self.min_ms, pttl)
            self._stop.wait(0.01)

    def __enter__(self) -> LeaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


@pytest.fixture
def crowded_store() -> Iterator[RedisServer]:
    """A lease store sharing its database with 2 M foreign keys (loaded with DEBUG POPULATE)."""
    server = RedisServer(extra=["--enable-debug-command", "yes"]).start()
    try:
        server.client(0).execute_command("DEBUG", "POPULATE", 2_000_000, "foreign", 8)
        yield server
    finally:
        server.cleanup()


def test_promotion_among_millions_of_foreign_keys_keeps_the_lease(
    redis_server: RedisServer, crowded_store: RedisServer, ns: str,
    opened: list[LeasedScheduler]
) -> None:
    """The first promotion builds the entry index with one scan of the whole database (2 M
    keys) and renews the lease between its pages; every later one reads the index and the
    states by key, so it takes no time however many foreign keys there are."""
    sched = {f"e{i}": {"task": "t.e", "schedule": MINUTELY} for i in range(3)}
    app = make_app(redis_server, ns, sched, crawl_lease_url=crowded_store.url_db(0))
    a = LeasedScheduler(app)
    opened.append(a)
    with LeaseWatch(crowded_store, ns) as watch:
        t0 = time.monotonic()
        wait_until(lambda: (a.tick(), a.election.is_leader)[1], 30, what="a leads")
        first = time.monotonic() - t0
        run_for([a], 0.3)
        assert a.election.is_leader and set(a.states) == set(sched)
        t0 = time.monotonic()
        a._promote()
        again = time.monotonic() - t0
    print(f"promotion with 2 M foreign keys: first (index built by a scan) {first:.2f}s, "
          f"again {again:.3f}s; lowest lease ttl seen {watch.min_ms} ms (ttl 1.5 s)")
    assert watch.lapsed == 0, f"the lease lapsed during promotion ({watch.lapsed} samples)"
    assert watch.min_ms is not None and watch.min_ms > 0
    assert a.election.is_leader
    assert again < 1.0, again  # a scan of the database alone takes > 2 s here
    store = open_store(crowded_store.url_db(0), namespace=ns)
    try:
        assert EntryIndex.load(store, between=lambda: None).names == set(sched)
    finally:
        store.close()


def test_a_delivery_check_through_a_long_backlog_keeps_the_lease(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    """A run found neither at a worker nor in a queue 200 k messages long: reading the queue
    is O(backlog), and the leader renews between its reads instead of letting the lease
    lapse, and dispatches an every-second entry meanwhile."""
    sched = {"m": {"task": "t.m", "schedule": MINUTELY},
             "s": {"task": "t.s", "schedule": EVERY_SECOND,
                   "options": {"queue": f"other-{ns}", "crawl_overlap": "allow"}}}
    app = make_app(redis_server, ns, sched, crawl_beat_verify_delivery=1.0)
    a = lead(app, opened)
    assert a._verify is not None
    redis_server.client(1).eval(
        "for i = 1, tonumber(ARGV[1]) do redis.call('LPUSH', KEYS[1], "
        "'{\"headers\": {\"id\": \"backlog-' .. i .. '\"}, \"body\": \"\"}') end",
        1, f"q-{ns}", 200_000)
    run_for([a], 0.6)  # renewed on time after the slow load of the backlog
    assert a.election.is_leader
    st = a.states["m"]
    st.unverified.append(Sent("never-published", "2026-01-01T00:00:00Z", False,
                              time.time() - 1))
    for other in a.states.values():  # only the lost run is due for a look
        for sent in other.unverified:
            if sent.task_id != "never-published":
                sent.check_at = time.time() + 60
    runs_before = a.states["s"].run_count
    skips_before = SkipLog.from_record(store_get(redis_server, ns, keys.beat_skips("s")))
    with LeaseWatch(redis_server, ns) as watch:
        t0 = time.monotonic()
        a._check_deliveries()
        took = time.monotonic() - t0
    redis_server.client(1).delete(f"q-{ns}")
    ran = a.states["s"].run_count - runs_before
    print(f"delivery check through a 200 k backlog: {took:.2f}s, {ran} runs of an "
          f"every-second entry dispatched meanwhile; lowest lease ttl seen {watch.min_ms} ms "
          f"(ttl 1.5 s)")
    assert watch.lapsed == 0, f"the lease lapsed during the check ({watch.lapsed} samples)"
    assert a.election.is_leader
    # Looked for everywhere, resent (by id: a minute boundary during the check adds the
    # minutely entry's own run to the list).
    lost = [sent for sent in st.unverified if sent.task_id == "never-published"]
    assert len(lost) == 1 and lost[0].resent == 1, st.unverified
    assert ran >= int(took) - 1, (ran, took)  # the schedule did not wait for the check
    skips = SkipLog.from_record(store_get(redis_server, ns, keys.beat_skips("s")))
    assert skips.totals == skips_before.totals, (skips_before.totals, skips.totals)
