"""Store failover: what happens to leases, fencing tokens and slot state when the store fails over.

Redis replicates asynchronously. These tests show, on a real primary + replica, exactly what that
costs (docs/durability.md states it for users):

* promoting the replica while the old primary still runs splits the brain: both sides grant the
  leader lease (each side's tokens stay above every token issued before the split);
* ``crawl_redis_wait_replicas`` makes the old side fail closed (renewals and acquisitions need an
  acknowledgement that no longer comes), but claims and fenced record writes are only counted
  as unacknowledged, not refused;
* promoting a lagging replica after the primary died loses acknowledged writes: slot state goes
  back, but no token already issued is issued again (a token is max(INCR, TIME in us)), nor
  after a restart from an older RDB snapshot.

etcd replicates through raft: killing the leader member and then a follower, leases, tokens and
records come through, and the leader change extends every lease (by the election timeout).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import pytest

from celery_crawl import keys
from celery_crawl.errors import LeaseLost, StoreError
from celery_crawl.leases import Lease, LeaseStore, open_store
from tests.clusters import EtcdCluster, RedisReplicaPair, etcd_cluster, redis_replica_pair
from tests.servers import RedisServer, wait_until

__all__ = ["etcd_cluster", "redis_replica_pair"]  # fixtures used by the tests below

pytestmark = pytest.mark.slow

TTL_S = 3.0
NS = "failover"
LEADER = keys.BEAT_LEADER
SLOT = keys.beat_entry("prices")


@pytest.fixture
def stores() -> Iterator[list[LeaseStore]]:
    """Collects the stores a test opens so they are closed at teardown."""
    opened: list[LeaseStore] = []
    yield opened
    for store in opened:
        store.close()


def _open(stores: list[LeaseStore], url: str, **kw: object) -> LeaseStore:
    store = open_store(url, namespace=NS, timeout_s=2.0, **kw)  # type: ignore[arg-type]
    stores.append(store)
    return store


def _acquire_eventually(store: LeaseStore, name: str, holder: str, bound_s: float):
    return wait_until(lambda: store.acquire(name, TTL_S, holder), bound_s, interval_s=0.1,
                      what=f"{holder} to acquire {name!r} on {store.url}")


def _acquire_while_renewing(new: LeaseStore, holder: str, old: LeaseStore, lease: Lease
                            ) -> tuple[Lease, Lease]:
    """Acquire ``LEADER`` on ``new`` while ``lease`` keeps being renewed on ``old``."""
    deadline = time.monotonic() + 3 * TTL_S
    while time.monotonic() < deadline:
        lease = old.renew(lease)
        got = new.acquire(LEADER, TTL_S, holder)
        if got is not None:
            return got, lease
        time.sleep(0.2)
    raise AssertionError(f"{holder} did not acquire {LEADER!r} on {new.url} within {3 * TTL_S}s")


# -- Redis: asynchronous replication ----------------------------------------------------------
def test_promotion_while_old_primary_runs_splits_leases_and_tokens(
    redis_replica_pair: RedisReplicaPair, stores: list[LeaseStore]
) -> None:
    pair = redis_replica_pair
    old = _open(stores, pair.primary.url)
    a = old.acquire(LEADER, TTL_S, "beat-a")
    assert a is not None
    old.put(SLOT, {"last_slot": "10:00:01"}, lease=a)
    pair.wait_synced()

    pair.promote()  # the old primary was only cut off, it keeps serving its clients
    new = _open(stores, pair.replica.url)
    assert new.holder(LEADER) == ("beat-a", a.token), "the lease was replicated"
    assert new.get(SLOT) == {"last_slot": "10:00:01"}

    # beat-b, talking to the new primary, waits out the replicated TTL and leads there ...
    # ... while beat-a keeps renewing on the old primary: two leaders at once.
    b, a = _acquire_while_renewing(new, "beat-b", old, a)
    assert b.token > a.token
    assert old.holder(LEADER) == ("beat-a", a.token)
    assert new.holder(LEADER) == ("beat-b", b.token)

    # Both sides continue from the same counter, but a token is max(INCR, TIME in us): each
    # side's next token is above every token issued before the split, and the two do not meet.
    w = old.acquire(keys.worker_lease("w1"), TTL_S, "w1")
    assert w is not None
    assert w.token > a.token and w.token != b.token

    # Slot state diverges: each side accepts the writes of its own leader.
    old.put(SLOT, {"last_slot": "10:00:02", "by": "a"}, lease=a)
    new.put(SLOT, {"last_slot": "10:00:02", "by": "b"}, lease=b)
    assert old.get(SLOT) != new.get(SLOT)


def test_wait_replicas_makes_the_cut_off_primary_fail_closed(
    redis_replica_pair: RedisReplicaPair, stores: list[LeaseStore]
) -> None:
    pair = redis_replica_pair
    old = _open(stores, pair.primary.url, redis_wait_replicas=1)
    a = old.acquire(LEADER, TTL_S, "beat-a")
    assert a is not None, "one replica acknowledged the acquisition"
    w = old.acquire(keys.worker_lease("w1"), TTL_S, "w1")
    assert w is not None
    a = old.renew(a)  # the first call loads the script
    trips = old.round_trips  # type: ignore[attr-defined]
    a = old.renew(a)
    assert old.round_trips - trips == 1, "WAIT is pipelined after the script: one round trip"  # type: ignore[attr-defined]

    pair.promote()
    wait_until(lambda: pair.replica_count() == 0, 10, what="old primary to lose its replica")

    # The old primary cannot get an acknowledgement any more: its leader steps down ...
    t0 = time.monotonic()
    with pytest.raises(LeaseLost):
        old.renew(a)
    assert time.monotonic() - t0 < 3 * 2.0, "WAIT is bounded by the store timeout"
    # ... and nobody can take the lease there.
    assert old.acquire(LEADER, TTL_S, "beat-c") is None
    # Claims and fenced record writes are not refused, only counted as unacknowledged.
    unacked = old.unacked_writes  # type: ignore[attr-defined]
    assert old.claim(w, keys.task_claim("t1"), {"q": "crawl"}) is not None
    assert old.unacked_writes == unacked + 1  # type: ignore[attr-defined]

    # The new primary has a single leader once the replicated TTL ran out.
    new = _open(stores, pair.replica.url)
    b = _acquire_eventually(new, LEADER, "beat-b", 3 * TTL_S)
    assert b.token > a.token


def test_lagging_replica_promoted_after_primary_death_loses_writes_but_not_tokens(
    redis_replica_pair: RedisReplicaPair, stores: list[LeaseStore]
) -> None:
    pair = redis_replica_pair
    primary = _open(stores, pair.primary.url)
    a = primary.acquire(LEADER, TTL_S, "beat-a")
    assert a is not None
    primary.put(SLOT, {"last_slot": "10:00:01"}, lease=a)
    pair.wait_synced()

    pair.cut_link()  # the replica falls behind: the primary goes on acknowledging writes
    primary.put(SLOT, {"last_slot": "10:00:05"}, lease=a)
    w = primary.acquire(keys.worker_lease("w1"), TTL_S, "w1")
    assert w is not None
    issued = primary.claim(w, keys.task_claim("prices-10:00:05"), {"q": "crawl"})
    assert issued is not None
    pair.primary.stop()  # kill -9: everything the replica did not get is gone
    pair.promote()

    new = _open(stores, pair.replica.url)
    assert new.get(SLOT) == {"last_slot": "10:00:01"}, "acknowledged slot state went back"
    assert new.claimant(keys.task_claim("prices-10:00:05")) is None, "the claim is lost"
    assert int(pair.replica.client().get(f"{NS}:token")) < issued, "the counter went back"
    b = _acquire_eventually(new, LEADER, "beat-b", 3 * TTL_S)
    assert b.token > issued, "a token at or below one the dead primary issued was issued again"


def test_restart_from_an_older_rdb_snapshot_never_issues_a_token_again(
    fresh_redis: RedisServer, stores: list[LeaseStore]
) -> None:
    store = _open(stores, fresh_redis.url)
    first = store.acquire(keys.worker_lease("w0"), TTL_S, "w0")
    assert first is not None
    client = fresh_redis.client()
    client.save()
    older = fresh_redis.dir / "older.rdb"
    shutil.copyfile(fresh_redis.dir / "dump.rdb", older)  # the snapshot a backup restores
    issued = [store.acquire(keys.worker_lease(f"w{i}"), TTL_S, f"w{i}") for i in range(1, 4)]
    top = max(lease.token for lease in issued if lease is not None)
    store.close()

    fresh_redis.stop()
    shutil.copyfile(older, fresh_redis.dir / "dump.rdb")
    fresh_redis.start()
    assert int(fresh_redis.client().get(f"{NS}:token")) < top, "the counter went back"
    again = _open(stores, fresh_redis.url)
    tokens = [again.acquire(keys.worker_lease(f"v{i}"), TTL_S, f"v{i}") for i in range(3)]
    assert all(t is not None and t.token > top for t in tokens), (
        f"tokens {[t and t.token for t in tokens]} after the restore, {top} issued before")
    assert len({t.token for t in tokens if t is not None}) == 3


# -- etcd: raft ---------------------------------------------------------------------------------
def _etcd_driver_or_skip() -> None:
    try:
        from celery_crawl.leases import etcd  # noqa: F401
    except ImportError as exc:
        reason = f"the etcd lease store (celery_crawl.leases.etcd) is not available: {exc}"
        if os.environ.get("CRAWL_REQUIRE_ETCD") == "1":
            pytest.fail(f"{reason} (CRAWL_REQUIRE_ETCD=1)")
        pytest.skip(reason)


def _renew_through(store: LeaseStore, lease: Lease, bound_s: float) -> tuple[Lease, int]:
    """Renew ``lease`` every 0.3 s until a renewal succeeds after errors stopped, within
    ``bound_s``. Store errors during an election are expected; ``LeaseLost`` is not."""
    deadline = time.monotonic() + bound_s
    errors = 0
    while True:
        try:
            return store.renew(lease), errors
        except LeaseLost:
            raise
        except StoreError:
            errors += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_etcd_leader_and_follower_kills_leases_and_records_come_through(
    etcd_cluster: EtcdCluster, stores: list[LeaseStore]
) -> None:
    _etcd_driver_or_skip()
    cluster = etcd_cluster
    leader = cluster.wait_leader()
    member = cluster.followers()[0]
    # Two clients: one on a follower only (the leader's death is a pure raft failover for it),
    # one on every member with the leader first (its channel has to move to another member).
    single = _open(stores, member.url)
    others = [m for m in cluster.members if m is not leader]
    multi = _open(stores, "etcd://" + ",".join(m.endpoint for m in [leader, *others]))
    a = single.acquire(LEADER, TTL_S, "beat-a")
    assert a is not None
    single.put(SLOT, {"last_slot": "10:00:01"}, lease=a)
    w = multi.acquire(keys.worker_lease("w1"), TTL_S, "w1")
    assert w is not None
    claim_token = multi.claim(w, keys.task_claim("t1"), {"q": "crawl"})
    assert claim_token is not None
    idle = single.acquire("idle", TTL_S, "never-renewed")
    assert idle is not None
    t_idle = time.monotonic()

    leader.kill()
    t_kill = time.monotonic()
    cluster.wait_leader(not_=leader)
    a, _ = _renew_through(single, a, 10.0)  # same lease, same token: nothing was lost
    w, _ = _renew_through(multi, w, 10.0)
    assert single.holder(LEADER) == ("beat-a", a.token)
    assert single.get(SLOT) == {"last_slot": "10:00:01"}
    claim = multi.claimant(keys.task_claim("t1"))
    assert claim is not None and claim.alive and claim.token == claim_token
    single.put(SLOT, {"last_slot": "10:00:02"}, lease=a)

    # The new leader extended every lease by its election timeout: the idle lease outlives
    # its TTL (a dead holder's lease can hold a takeover back by that much).
    def idle_free() -> bool:
        nonlocal a, w
        a = single.renew(a)
        w = multi.renew(w)
        return single.holder("idle") is None

    wait_until(idle_free, 6 * TTL_S, interval_s=0.2, what="the idle lease to expire")
    lived_s = time.monotonic() - t_idle
    print(f"idle lease with ttl {TTL_S}s lived {lived_s:.1f}s across the leader change")
    assert t_kill - t_idle < TTL_S
    assert lived_s > TTL_S + 1.0, f"lease lived {lived_s:.1f}s, not extended past its TTL"

    leader.start()
    wait_until(lambda: leader.status() is not None, 30, what="old leader back as a member")
    follower = next(m for m in cluster.followers() if m is not member)
    follower.kill()
    a, _ = _renew_through(single, a, 10.0)  # a majority is left: leases keep renewing
    w, _ = _renew_through(multi, w, 10.0)
    single.put(SLOT, {"last_slot": "10:00:03"}, lease=a)
    assert multi.get(SLOT) == {"last_slot": "10:00:03"}
    b = multi.acquire("after", TTL_S, "beat-b")
    assert b is not None and b.token > a.token, "tokens keep increasing across both failovers"
