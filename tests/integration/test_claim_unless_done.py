"""The done-check and the claim are one atomic store operation; the task-id reuse rule.

Real Redis and etcd stores, real ``Claimer``s. The interleaving "a finisher writes the tombstone
and unclaims between a delivery's tombstone read and its claim" is forced by a store wrapper
that runs the finisher right before the wrapped store's claim call.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_crawl import keys
from celery_crawl.errors import LeaseLost, RecordChanged
from celery_crawl.leases import open_store
from celery_crawl.leases.base import LeaseStore
from celery_crawl.worker.claims import Arrival, Claimer, Held, Outcome, is_successor
from celery_crawl.worker.keeper import Keeper
from tests.servers import EtcdServer, RedisServer


def _open(kind: str, request: pytest.FixtureRequest) -> LeaseStore:
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url
    elif kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url
    elif kind == "memory":
        url = f"memory://cu{uuid.uuid4().hex[:8]}"
    else:
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        url = etcd.url
    return open_store(url, namespace=f"cu{uuid.uuid4().hex[:8]}", timeout_s=2.0)


@pytest.fixture(params=["redis", "etcd"])
def store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    s = _open(request.param, request)
    yield s
    s.close()


@pytest.fixture(params=["redis", "redis-cluster", "etcd", "memory"])
def any_store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    s = _open(request.param, request)
    yield s
    s.close()


class FinishBeforeClaim:
    """The real store, except that the first claim call first runs ``between`` (the finisher
    of the run being decided on), exactly between the decider's tombstone read and its claim."""

    def __init__(self, store: LeaseStore, between: Callable[[], None]) -> None:
        self._store = store
        self._between: Callable[[], None] | None = between
        self.claims = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _fire(self) -> None:
        self.claims += 1
        between, self._between = self._between, None
        if between is not None:
            between()

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self._fire()
        return self._store.claim(*args, **kwargs)

    def claim_unless_changed(self, *args: Any, **kwargs: Any) -> Any:
        self._fire()
        return self._store.claim_unless_changed(*args, **kwargs)


def _keepers(store: LeaseStore) -> tuple[Keeper, Keeper]:
    a, b = Keeper(store, ttl_s=3.0), Keeper(store, ttl_s=3.0)
    a.acquire_blocking(5)
    b.acquire_blocking(5)
    return a, b


def _held(task_id: str, token: int | None, keeper: Keeper, *, digest: str = "",
          generation: tuple[int, int] = (0, 0), **kw: Any) -> Held:
    lease = keeper.lease
    return Held(Arrival(task_id=task_id, delivery_tag="tag-a", queue="q", digest=digest,
                        generation=generation), deliveries=1, token=token,
                lease_name=lease.name if lease else None, holder=keeper.holder, **kw)


def test_a_run_that_finishes_between_the_tombstone_read_and_the_claim_does_not_run_again(
        store: LeaseStore) -> None:
    """Worker A runs task t and finishes (tombstone, then unclaim) exactly after worker B read
    ``done/t`` (absent) and before B claims: B must drop its copy, not run t a second time."""
    a, b = _keepers(store)
    ca = Claimer(store, lambda: a.lease, max_deliveries=5, done_ttl_s=60)
    first = ca.decide("t", delivery_tag="tag-a", queue="q", digest="m1")
    assert first.outcome is Outcome.RUN
    finished = _held("t", first.token, a, digest="m1")
    wrapped = FinishBeforeClaim(store, lambda: ca.finish(finished, state="done"))
    cb = Claimer(wrapped, lambda: b.lease, max_deliveries=5, done_ttl_s=60)  # type: ignore[arg-type]
    copy = cb.decide("t", delivery_tag="tag-b", queue="q", digest="m1")
    assert wrapped.claims == 1  # the finisher did run between the read and the claim
    assert store.get(keys.done("t")) is not None
    assert copy.outcome is Outcome.DUPLICATE, copy
    assert store.claimant(keys.task_claim("t")) is None
    a.stop()
    b.stop()


def test_claim_unless_changed(store: LeaseStore) -> None:
    a, b = _keepers(store)
    assert a.lease is not None and b.lease is not None
    record = keys.done("g")
    (absent, version), = store.get_many_versioned([record])
    assert (absent, version) == (None, "")
    # The record appears after it was read as absent: refused, nothing written.
    store.put(record, {"state": "done"}, ttl_s=60)
    with pytest.raises(RecordChanged):
        store.claim_unless_changed(a.lease, keys.task_claim("g"), {"n": 1}, record=record,
                                   version=version)
    assert store.claimant(keys.task_claim("g")) is None
    (seen, version), = store.get_many_versioned([record])
    assert seen == {"state": "done"} and version
    token = store.claim_unless_changed(a.lease, keys.task_claim("g"), {"n": 1}, record=record,
                                       version=version)
    assert token
    # A live claim elsewhere: None, as for claim().
    assert store.claim_unless_changed(b.lease, keys.task_claim("g"), {"n": 2}, record=record,
                                      version=version) is None
    # Written again after it was read: refused.
    store.unclaim(a.lease, keys.task_claim("g"))
    store.put(record, {"state": "done", "again": True}, ttl_s=60)
    with pytest.raises(RecordChanged):
        store.claim_unless_changed(b.lease, keys.task_claim("g"), {"n": 2}, record=record,
                                   version=version)
    lease = a.lease
    a.stop(release=True)
    with pytest.raises(LeaseLost):
        store.claim_unless_changed(lease, keys.task_claim("h"), {}, record=keys.done("h"),
                                   version="")
    b.stop()


def test_a_finished_task_is_reopened_only_by_its_own_handoff(store: LeaseStore) -> None:
    """The id-reuse rule: a tombstone without handoff is final whatever the headers say; after a
    handoff, only a newer-or-equal generation with another digest runs, once."""
    a, b = _keepers(store)
    ca = Claimer(store, lambda: a.lease, max_deliveries=5, done_ttl_s=60)
    cb = Claimer(store, lambda: b.lease, max_deliveries=5, done_ttl_s=60)

    # A run that handed nothing on: a forged retries/replaced_task_nesting header is dropped.
    run = ca.decide("f", delivery_tag="x", queue="q", digest="m1")
    ca.finish(_held("f", run.token, a, digest="m1"), state="done")
    for gen in ((0, 1), (1, 0), (5, 5)):
        forged = cb.decide("f", delivery_tag="y", queue="q", generation=gen, digest="forged")
        assert forged.outcome is Outcome.DUPLICATE, gen

    # A run that retried (handoff, generation (0, 0), digest m1).
    run = ca.decide("r", delivery_tag="x", queue="q", digest="m1")
    ca.finish(_held("r", run.token, a, digest="m1", handoff=True), state="done")
    assert cb.decide("r", delivery_tag="x", queue="q", digest="m1").outcome is (
        Outcome.DUPLICATE)  # the finished message redelivered
    retry = cb.decide("r", delivery_tag="y", queue="q", generation=(0, 1), digest="m2")
    assert retry.outcome is Outcome.RUN
    # A copy of the retry while it runs parks; once it finished, the copy is a duplicate.
    assert ca.decide("r", delivery_tag="y2", queue="q", generation=(0, 1),
                     digest="m2").outcome is Outcome.PARK
    cb.finish(_held("r", retry.token, b, digest="m2", generation=(0, 1)), state="done")
    assert ca.decide("r", delivery_tag="y2", queue="q", generation=(0, 1), digest="m2",
                     parked=True).outcome is Outcome.DUPLICATE

    # Older than the handing-off run: a stale copy of an earlier message.
    assert not is_successor({"handoff": True, "gen": [1, 0], "digest": "m3"}, (0, 4), "m0")
    assert is_successor({"handoff": True, "gen": [1, 0], "digest": "m3"}, (2, 0), "m4")
    assert not is_successor({"handoff": "yes", "gen": [0, 0]}, (1, 0), "m4")
    a.stop()
    b.stop()


def test_batched_claims_and_finishes_keep_each_item_atomic(store: LeaseStore) -> None:
    """One round trip for a prefetch window's claims: each claim still refuses on its own
    changed record or live claim, and the others are granted; the batched finish writes each
    tombstone and deletes only the claims that are ours."""
    a, b = _keepers(store)
    assert a.lease is not None and b.lease is not None
    store.put(keys.done("m-done"), {"state": "done"}, ttl_s=60)
    held_by_b = store.claim(b.lease, keys.task_claim("m-held"), {"n": 0})
    assert held_by_b is not None
    items: list[Any] = [
        (keys.task_claim(t), {"n": 1}, [(keys.done(t), ""), (f"deliveries/{t}", "")])
        for t in ("m-free", "m-done", "m-held", "m-free2")]
    replies = store.claim_unless_changed_many(a.lease, items)
    assert isinstance(replies[0], int) and isinstance(replies[3], int)
    assert isinstance(replies[1], RecordChanged), replies
    assert replies[2] is None, replies
    assert store.claimant(keys.task_claim("m-done")) is None
    for t in ("m-free", "m-free2"):
        claim = store.claimant(keys.task_claim(t))
        assert claim is not None and claim.alive and claim.lease_name == a.lease.name
    ends = store.finish_claims(a.lease, [
        (keys.task_claim("m-free"), keys.done("m-free"), {"state": "done"}),
        (keys.task_claim("m-held"), keys.done("m-held"), {"state": "done"}),
    ], ttl_s=60)
    assert ends == [True, False]
    assert store.claimant(keys.task_claim("m-free")) is None
    held = store.claimant(keys.task_claim("m-held"))
    assert held is not None and held.alive and held.lease_name == b.lease.name
    assert store.get(keys.done("m-free")) == {"state": "done"}
    # The batch's lease lost: every claim in it is refused, nothing is written.
    stale = a.lease
    a.stop(release=True)
    lost = store.claim_unless_changed_many(
        stale, [(keys.task_claim("m-new"), {"n": 1}, [(keys.done("m-new"), "")])])
    assert isinstance(lost[0], LeaseLost), lost
    assert store.claimant(keys.task_claim("m-new")) is None
    b.stop()


def test_a_guarded_claim_takes_over_the_key_of_a_dead_claimant(any_store: LeaseStore) -> None:
    """The claim guard runs before the claim's own takeover of a key whose claimant's lease is
    gone (on Redis, a second round trip that declares that lease's keys): single and batched,
    and the guard still refuses a changed record on that path."""
    store = any_store
    a, b = _keepers(store)
    c = Keeper(store, ttl_s=3.0)
    c.acquire_blocking(5)
    assert a.lease is not None and b.lease is not None and c.lease is not None
    names = ("t1", "t2", "t3")
    for name in names:
        assert store.claim(a.lease, keys.task_claim(name), {"n": 1})
    a.stop(release=True)  # every claim of a is now a dead claimant's
    versions = {name: store.get_many_versioned([keys.done(name)])[0][1] for name in names}
    token = store.claim_unless_changed(b.lease, keys.task_claim("t1"), {"n": 2},
                                       record=keys.done("t1"), version=versions["t1"])
    assert token
    taken = store.claimant(keys.task_claim("t1"))
    assert taken is not None and taken.holder == b.lease.holder and taken.alive
    store.put(keys.done("t3"), {"state": "SUCCESS"}, ttl_s=60)  # t3 finished meanwhile
    got = store.claim_unless_changed_many(c.lease, [
        (keys.task_claim("t2"), {"n": 2}, [(keys.done("t2"), versions["t2"])]),
        (keys.task_claim("t3"), {"n": 2}, [(keys.done("t3"), versions["t3"])]),
    ])
    assert isinstance(got[0], int) and got[0] > token
    assert isinstance(got[1], RecordChanged)
    t2 = store.claimant(keys.task_claim("t2"))
    assert t2 is not None and t2.holder == c.lease.holder
    t3 = store.claimant(keys.task_claim("t3"))
    assert t3 is None or t3.holder != c.lease.holder  # nothing written for the refused one
    b.stop()
    c.stop()
