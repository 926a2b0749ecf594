"""The worker's lease keeper on a ``memory://`` store, time moved by hand: the keeper's core logic
(acquire, renew every third of the TTL, lose at the local deadline, take a new lease under a new
holder) checked against a real store's expiry in milliseconds, without a server."""

from __future__ import annotations

import uuid

from celery_crawl.leases.memory import MemoryLeaseStore
from celery_crawl.worker.keeper import Keeper


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_keeper_renews_loses_at_its_deadline_and_starts_over_on_a_memory_store() -> None:
    clock = FakeClock()
    store = MemoryLeaseStore(f"memory://keeper-{uuid.uuid4().hex[:8]}", namespace="app",
                             clock=clock)
    lost: list[str] = []
    keeper = Keeper(store, ttl_s=3.0, clock=clock, on_lost=lost.append)
    first = keeper.acquire_blocking(1.0)
    old_holder = keeper.holder
    assert store.holder(first.name) == (old_holder, first.token)
    claimed = store.claim_many(first, [("task:1", {}), ("task:2", {})])
    assert all(t is not None and t > first.token for t in claimed)

    clock.t += 1.0  # a third of the TTL: the tick renews, in one store operation
    before = store.round_trips
    keeper.tick(hooks=False)
    assert (keeper.renew_ok, store.round_trips - before) == (1, 1)
    renewed = keeper.lease
    assert renewed is not None and renewed.valid_until > first.valid_until

    clock.t += 2.5  # past the first validity, within the renewed one: still held on both sides
    assert keeper.lease is renewed and store.holder(first.name) is not None

    clock.t += 1.0  # no renewal came (a frozen process): keeper and store agree it is over
    assert keeper.check_deadline()
    assert len(lost) == 1 and "expired on our clock" in lost[0]
    assert store.holder(first.name) is None
    assert {c.key for c in store.orphaned_claims()} == {"task:1", "task:2"}

    keeper.tick(hooks=False)  # the next tick takes a new lease under a new holder
    second = keeper.lease
    assert second is not None and second.token > first.token and keeper.holder != old_holder
    assert {c.key for c in store.orphaned_claims()} == {"task:1", "task:2"}, "never adopted"
    again = store.claim(second, "task:1", {})
    assert again is not None and again > max(t or 0 for t in claimed)

    keeper.stop()
    assert store.holder(second.name) is None, "stopping releases the lease"
    # oldest lease first: task:2 is still the first lease's, task:1 the second's
    assert [c.key for c in store.orphaned_claims()] == ["task:2", "task:1"]
