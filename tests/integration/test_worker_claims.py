"""The worker's lease keeper, claim decisions and reaper against real Redis and etcd stores.

No Celery processes here: these pin the store-side behaviour the system tests rely on, cheaply.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from celery_crawl import keys
from celery_crawl.leases import open_store
from celery_crawl.leases.base import LeaseStore
from celery_crawl.worker.broker import AmqpBroker
from celery_crawl.worker.claims import Arrival, Claimer, Held, Outcome, deliveries_key
from celery_crawl.worker.guards import check_memory, check_pool
from celery_crawl.worker.keeper import Keeper
from celery_crawl.worker.reaper import ORPHAN_GRACE_S, Reaper
from tests.servers import EtcdServer, RedisServer, wait_until


@pytest.fixture(params=["redis", "etcd"])
def store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    import uuid

    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url
    else:
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        url = etcd.url
    s = open_store(url, namespace=f"wc{uuid.uuid4().hex[:8]}", timeout_s=2.0)
    yield s
    s.close()


def test_1000_claims_renewed_with_one_round_trip(store: LeaseStore) -> None:
    keeper = Keeper(store, ttl_s=3.0)
    lease = keeper.acquire_blocking(5)
    items = [(keys.task_claim(f"t{i}"), {"delivery_tag": f"tag{i}", "deliveries": 1})
             for i in range(1000)]
    for start in range(0, 1000, 100):
        tokens = store.claim_many(lease, items[start:start + 100])
        assert all(tokens)
    for _ in range(3):
        before = store.round_trips
        keeper._next_renew = 0.0
        keeper.tick()
        assert store.round_trips - before == 1
    assert keeper.renew_ok == 3
    assert len(store.claims_of(lease.name)) == 1000
    keeper.stop(release=True)


def test_decisions_park_duplicate_poison(store: LeaseStore) -> None:
    a, b = Keeper(store, ttl_s=3.0), Keeper(store, ttl_s=3.0)
    a.acquire_blocking(5)
    b.acquire_blocking(5)
    ca = Claimer(store, lambda: a.lease, max_deliveries=3, done_ttl_s=60)
    cb = Claimer(store, lambda: b.lease, max_deliveries=3, done_ttl_s=60)
    first = ca.decide("t1", delivery_tag="x1", queue="q")
    assert first.outcome is Outcome.RUN and first.token and first.deliveries == 1
    parked = cb.decide("t1", delivery_tag="x2", queue="q")
    assert parked.outcome is Outcome.PARK and parked.holder == a.holder
    held = Held(Arrival(task_id="t1", delivery_tag="x1", queue="q"), deliveries=1,
                token=first.token, lease_name=a.lease.name if a.lease else None,
                holder=a.holder)
    ca.finish(held, state="done")
    assert store.claimant(keys.task_claim("t1")) is None
    assert cb.decide("t1", delivery_tag="x2", queue="q").outcome is Outcome.DUPLICATE
    # A header alone reopens nothing: the run handed its id on to no retry.
    assert cb.decide("t1", delivery_tag="x3", queue="q", retries=1).outcome is (
        Outcome.DUPLICATE)
    # A run that retried hands its id on: the retry (one more retry) runs.
    again = ca.decide("t3", delivery_tag="z1", queue="q", digest="m1")
    ca.finish(dataclasses.replace(
        held, arrival=dataclasses.replace(held.arrival, task_id="t3", digest="m1"),
        token=again.token, handoff=True), state="done")
    assert cb.decide("t3", delivery_tag="z2", queue="q", retries=1,
                     digest="m2").outcome is Outcome.RUN
    # Requeued twice (its child died): the third delivery is poison.
    store.put(deliveries_key("t2"), {"n": 2}, ttl_s=60)
    assert ca.decide("t2", delivery_tag="y", queue="q").outcome is Outcome.POISON
    a.stop()
    b.stop()


def test_reaper_drops_orphans_of_a_dead_lease(store: LeaseStore) -> None:
    dead, alive = Keeper(store, ttl_s=3.0), Keeper(store, ttl_s=3.0)
    lease = dead.acquire_blocking(5)
    alive.acquire_blocking(5)
    store.claim_many(lease, [(keys.task_claim("r1"), {"delivery_tag": "d1", "deliveries": 1}),
                             (keys.task_claim("r2"), {"delivery_tag": "d2", "deliveries": 2})])
    dead.stop(release=True)  # as if its lease expired
    reaper = Reaper(store, AmqpBroker(), holder=lambda: alive.holder, ttl_s=3.0,
                    interval_s=0.0, done_ttl_s=60)
    reaper()
    # First sighting: orphans get ORPHAN_GRACE_S for their worker to record ends it could not
    # write during a store outage; the next pass comes after the grace, not a whole interval.
    assert reaper.leading and reaper.recovered == 0
    assert len(store.orphaned_claims()) == 2  # still there
    t0 = time.monotonic()
    wait_until(lambda: (reaper(), reaper.recovered == 2)[1], 5 * ORPHAN_GRACE_S,
               interval_s=0.05, what="the orphans reaped after the grace")
    assert time.monotonic() - t0 >= ORPHAN_GRACE_S * 0.9
    assert store.claimant(keys.task_claim("r1")) is None
    assert store.get(deliveries_key("r2")) is not None
    assert store.get(deliveries_key("r2"))["n"] == 2  # type: ignore[index]
    reaper.release()
    alive.stop()


#: How far a death estimate may be from the dead lease's last renewal: half the finder's
#: polling window plus etcd's expiry granularity (its lessor revokes expired leases every 0.5 s).
ESTIMATE_SLACK_S = 0.75


def _renewed_then_dead(store: LeaseStore, task_ids: list[str]) -> tuple[Keeper, float]:
    """A worker lease that claims ``task_ids``, renews once more and then stops renewing (as
    if its worker were killed); returns the keeper and the wall time of that last renewal."""
    dead = Keeper(store, ttl_s=3.0)
    lease = dead.acquire_blocking(5)
    store.claim_many(lease, [(keys.task_claim(t), {"delivery_tag": f"d-{t}", "deliveries": 1,
                                                   "ttl_s": lease.ttl_s,
                                                   "claimed_at": time.time()})
                             for t in task_ids])
    time.sleep(0.3)  # the renewal below must be distinguishable from the claims
    renewed_at = time.time()
    dead._next_renew = 0.0
    dead.tick(hooks=False)
    assert dead.renew_ok == 1
    return dead, renewed_at


def test_reaper_estimates_the_death_and_the_next_run_carries_it(store: LeaseStore) -> None:
    alive = Keeper(store, ttl_s=3.0)
    alive.acquire_blocking(5)
    alive.start()  # renewed on its thread while the other lease dies
    dead, renewed_at = _renewed_then_dead(store, ["e1", "e2"])
    reaper = Reaper(store, AmqpBroker(), holder=lambda: alive.holder, ttl_s=3.0,
                    interval_s=0.2, done_ttl_s=60)

    def reaped() -> bool:
        reaper()
        return reaper.recovered == 2

    wait_until(reaped, 3 * (3.0 + 1.0), interval_s=0.05, what="the reaper found the dead lease")
    found_at = time.time()
    record = store.get(deliveries_key("e1"))
    assert record is not None and record["n"] == 1
    # The lease's last renewal, not the moment the reaper found it dead (a TTL later).
    assert abs(record["died_at"] - renewed_at) <= ESTIMATE_SLACK_S, (record, renewed_at)
    assert found_at - record["died_at"] >= 3.0 - ESTIMATE_SLACK_S
    claimer = Claimer(store, lambda: alive.lease, max_deliveries=5, done_ttl_s=60)
    decision = claimer.decide("e1", delivery_tag="d-e1-again", queue="q")
    assert decision.outcome is Outcome.RUN and decision.deliveries == 2
    assert decision.died_at == record["died_at"]
    # A first delivery of a task nobody died running carries no estimate.
    fresh = claimer.decide("e-fresh", delivery_tag="f", queue="q")
    assert fresh.outcome is Outcome.RUN and fresh.died_at is None
    reaper.release()
    dead.stop(release=False)
    alive.stop()


def test_parked_delivery_estimates_the_death_of_the_claimant(store: LeaseStore) -> None:
    alive = Keeper(store, ttl_s=3.0)
    alive.acquire_blocking(5)
    alive.start()  # renewed on its thread while the other lease dies
    dead, renewed_at = _renewed_then_dead(store, ["p1"])
    claimer = Claimer(store, lambda: alive.lease, max_deliveries=5, done_ttl_s=60,
                      recheck_s=0.1)
    held = Held(Arrival(task_id="p1", delivery_tag="d-p1-copy", queue="q"))
    first = claimer.decide("p1", delivery_tag=held.arrival.delivery_tag, queue="q")
    assert first.outcome is Outcome.PARK and first.holder == dead.holder
    assert first.alive_at is not None
    held.parked, held.holder, held.alive_at = True, first.holder, first.alive_at
    held.deliveries = first.deliveries

    def taken_over() -> object:
        decision = claimer.decide("p1", delivery_tag=held.arrival.delivery_tag, queue="q",
                                  known_deliveries=held.deliveries, parked=True,
                                  holder=held.holder, alive_at=held.alive_at)
        if decision.outcome is Outcome.PARK:
            held.holder, held.alive_at = decision.holder, decision.alive_at
            return None
        return decision

    decision = wait_until(taken_over, 3 * (3.0 + 1.0), interval_s=0.1,
                          what="the parked copy took the dead claim over")
    assert decision.outcome is Outcome.RUN and decision.deliveries == 2
    assert decision.died_at is not None
    assert abs(decision.died_at - renewed_at) <= ESTIMATE_SLACK_S, (decision, renewed_at)
    current = store.claimant(keys.task_claim("p1"))
    assert current is not None and current.alive and current.holder == alive.holder
    dead.stop(release=False)
    alive.stop()


def test_guards() -> None:
    from celery_crawl.errors import UnsupportedSetup

    assert check_pool("prefork") == "prefork"
    assert check_pool("threads") == "threads"
    for bad in ("solo", "gevent", "eventlet"):
        with pytest.raises(UnsupportedSetup, match=bad):
            check_pool(bad)
    with pytest.raises(UnsupportedSetup, match="crawl_min_memory"):
        check_memory(2 * 1024**3, None, limit_bytes=1024**3)
    assert check_memory(None, 200_000, limit_bytes=1024**3) == 1024**3


def test_keeper_loses_the_lease_after_a_freeze_and_takes_a_new_holder(store: LeaseStore) -> None:
    """A clock jump past the validity (a SIGSTOP, a VM pause) is a loss even if the store would
    still renew; the next lease has a new holder, so old claims stay orphaned."""
    now = [0.0]
    import time as _time

    base = _time.clock_gettime(_time.CLOCK_BOOTTIME)
    losses: list[str] = []
    regained: list[object] = []
    keeper = Keeper(store, ttl_s=3.0, clock=lambda: base + now[0], on_lost=losses.append,
                    on_acquired=regained.append)
    first = keeper.acquire_blocking(5)
    old_holder = keeper.holder
    now[0] = 10.0  # frozen for longer than the TTL
    keeper.tick()
    assert keeper.lease is None and len(losses) == 1 and "expired on our clock" in losses[0]
    now[0] = 0.0  # running again (the store's validity is computed on the real clock)
    keeper.tick()  # acquires again, under a new holder
    assert keeper.lease is not None and keeper.holder != old_holder
    assert keeper.lease.token > first.token and regained
    assert keeper.info()["lease_losses"] == 1
    keeper.stop(release=True)
