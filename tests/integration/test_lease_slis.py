"""The lease SLIs as a worker's keeper records them, against a real redis-server and real faults:
renewal failures by cause (a frozen store: timeout; a dead store: refused; a lease the store no
longer has: lease_lost) and the hold-time deviation from the TTL when a lease is lost."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from celery_crawl import metrics
from celery_crawl.leases import open_store
from celery_crawl.leases.base import LeaseStore
from celery_crawl.worker.keeper import Keeper
from tests.servers import RedisServer

TTL_S = 3.0


@pytest.fixture
def store(fresh_redis: RedisServer) -> Iterator[LeaseStore]:
    s = open_store(fresh_redis.url, namespace=f"sli{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    yield s
    s.close()


def _failures(cause: str) -> float:
    return float(metrics.LEASE_RENEWAL_FAILURES.labels("worker", cause)._value.get())


def _deviation() -> tuple[float, float]:
    """(count, sum) of the worker's hold deviation histogram."""
    samples = {s.name: s.value for m in metrics.LEASE_HOLD_DEVIATION.collect()
               for s in m.samples if s.labels.get("role") == "worker"}
    return (samples.get("crawl_lease_hold_deviation_seconds_count", 0.0),
            samples.get("crawl_lease_hold_deviation_seconds_sum", 0.0))


def _keeper(store: LeaseStore, now: list[float]) -> Keeper:
    base = time.clock_gettime(time.CLOCK_BOOTTIME)
    keeper = Keeper(store, ttl_s=TTL_S, clock=lambda: base + now[0])
    keeper.acquire_blocking(5)
    return keeper


def test_failures_by_cause_and_the_deviation_of_a_lease_lost_early(
    store: LeaseStore, fresh_redis: RedisServer,
) -> None:
    assert fresh_redis.proc is not None
    now = [0.0]
    keeper = _keeper(store, now)
    before = {c: _failures(c) for c in ("timeout", "refused", "lease_lost")}
    count0, sum0 = _deviation()
    # The store frozen (SIGSTOP): the renewal gets no answer within the store timeout.
    fresh_redis.proc.send_signal(signal.SIGSTOP)
    try:
        now[0] = 1.1
        keeper.tick(hooks=False)
    finally:
        fresh_redis.proc.send_signal(signal.SIGCONT)
    assert _failures("timeout") - before["timeout"] == 1
    # The store says the lease is gone (here: released behind the keeper's back) one second
    # after its last renewal: held ~2 s less than its TTL.
    lease = keeper.lease
    assert lease is not None
    store.release(lease)
    now[0] = 1.5
    keeper.tick(hooks=False)
    assert keeper.lease is None
    assert _failures("lease_lost") - before["lease_lost"] == 1
    count, total = _deviation()
    assert count - count0 == 1
    assert -TTL_S <= total - sum0 <= -1.0, total - sum0
    # The store dead (connection refused).
    keeper.tick(hooks=False)  # a new lease under a new holder
    assert keeper.lease is not None
    fresh_redis.stop()
    now[0] = 3.0
    keeper.tick(hooks=False)
    assert _failures("refused") - before["refused"] == 1
    assert _failures("timeout") - before["timeout"] == 1
    keeper.stop(release=False)


def test_a_frozen_holder_is_recorded_as_held_past_its_ttl(store: LeaseStore) -> None:
    now = [0.0]
    keeper = _keeper(store, now)
    count0, sum0 = _deviation()
    now[0] = 10.0  # frozen for ~7 s past the TTL (a SIGSTOP, a VM pause)
    keeper.tick(hooks=False)
    assert keeper.lease is None
    count, total = _deviation()
    assert count - count0 == 1
    assert 6.0 <= total - sum0 <= 7.5, total - sum0
    keeper.stop(release=True)


def test_a_beat_leader_records_the_cause_and_the_deviation(fresh_redis: RedisServer) -> None:
    """The leader's renewals: a frozen store is a timeout; a lease the store no longer has is
    lease_lost, with the hold deviation of a lease dropped early (negative)."""
    from celery_crawl import status
    from celery_crawl.beat import LeasedScheduler
    from tests.integration.test_beat_scheduler import EVERY_SECOND, make_app, run_for

    assert fresh_redis.proc is not None

    def beat_failures(cause: str) -> float:
        return float(metrics.LEASE_RENEWAL_FAILURES.labels("beat", cause)._value.get())

    def beat_deviation() -> tuple[float, float]:
        samples = {s.name: s.value for m in metrics.LEASE_HOLD_DEVIATION.collect()
                   for s in m.samples if s.labels.get("role") == "beat"}
        return (samples.get("crawl_lease_hold_deviation_seconds_count", 0.0),
                samples.get("crawl_lease_hold_deviation_seconds_sum", 0.0))

    ns = f"slib{uuid.uuid4().hex[:6]}"
    sched = LeasedScheduler(make_app(fresh_redis, ns, {
        "tick": {"task": "t.record", "schedule": EVERY_SECOND}}, crawl_store_timeout=0.5))
    try:
        run_for([sched], 1.0)
        assert sched.election.is_leader
        assert status.beat_process(sched)["role"] == "leader"
        before = {"timeout": beat_failures("timeout")}
        fresh_redis.proc.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 15
            while beat_failures("timeout") == before["timeout"] and time.monotonic() < deadline:
                sched.tick()
        finally:
            fresh_redis.proc.send_signal(signal.SIGCONT)
        assert beat_failures("timeout") - before["timeout"] >= 1
        run_for([sched], 1.0)
        lease = sched.election.lease
        assert lease is not None and sched.election.is_leader
        count0, sum0 = beat_deviation()
        # Counted from here: on a loaded machine the freeze above can outlast the lease, and
        # that loss is counted as lease_lost too.
        lost0 = beat_failures("lease_lost")
        other = open_store(fresh_redis.url_db(0), namespace=ns, timeout_s=2.0)
        other.release(lease)
        other.close()
        deadline = time.monotonic() + 15
        while sched.election.lease is lease and time.monotonic() < deadline:
            sched.tick()
            time.sleep(0.02)
        assert beat_failures("lease_lost") - lost0 == 1
        count, total = beat_deviation()
        assert count - count0 == 1 and total - sum0 < 0
    finally:
        sched.close()


def test_a_lease_found_gone_by_a_state_write_counts_as_lost(fresh_redis: RedisServer) -> None:
    """The leader learns that its lease is gone from whichever store call comes first; when a
    fenced state write is refused before the next renewal, the loss is still counted
    (``lease_lost``) and its hold deviation observed, as a renewal would have."""
    from celery_crawl.beat import LeasedScheduler
    from tests.integration.test_beat_scheduler import EVERY_SECOND, make_app, run_for

    def lost() -> float:
        return float(metrics.LEASE_RENEWAL_FAILURES.labels("beat", "lease_lost")._value.get())

    def deviations() -> float:
        return sum(s.value for m in metrics.LEASE_HOLD_DEVIATION.collect() for s in m.samples
                   if s.labels.get("role") == "beat"
                   and s.name == "crawl_lease_hold_deviation_seconds_count")

    ns = f"slic{uuid.uuid4().hex[:6]}"
    sched = LeasedScheduler(make_app(fresh_redis, ns, {
        "tick": {"task": "t.record", "schedule": EVERY_SECOND}}))
    try:
        run_for([sched], 1.0)
        lease = sched.election.lease
        assert lease is not None and sched.election.is_leader
        lost0, dev0 = lost(), deviations()
        other = open_store(fresh_redis.url_db(0), namespace=ns, timeout_s=2.0)
        other.release(lease)
        other.close()
        assert sched._book is not None
        sched._book.queue("tick")
        sched._book.flush()  # the write comes first: refused, fenced by the lost lease
        assert not sched.election.is_leader
        assert lost() - lost0 == 1
        assert deviations() - dev0 == 1
    finally:
        sched.close()
