"""Expiry buckets (leases/_buckets.py) over a simulated day of writes: every record lives at
least its TTL and at most one bucket longer, and the live leases stay bounded. The arithmetic
only; tests/integration/test_etcd_growth.py runs it against a real etcd."""

from __future__ import annotations

import pytest

from celery_crawl.leases._buckets import BUCKETS_PER_TTL, RECORDS_PER_LEASE, ExpiryBuckets
from celery_crawl.leases.base import DRIFT


class _Sim:
    """A clock moved by hand and a lease table: what etcd would hold, by lease id."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.expires: dict[int, float] = {}

    def grant(self, ttl: int) -> int:
        lease_id = len(self.expires) + 1
        self.expires[lease_id] = self.now + ttl  # etcd counts from when it applies the grant
        return lease_id


@pytest.mark.parametrize(("ttl_s", "step_s"), [(86_400.0, 7.3), (45.0, 0.37), (3.0, 0.05)])
def test_records_expire_on_time_under_a_bounded_number_of_leases(ttl_s: float,
                                                                 step_s: float) -> None:
    sim = _Sim()
    buckets = ExpiryBuckets(sim.grant, floor_s=2, clock=lambda: sim.now)
    width = ExpiryBuckets.width(ttl_s)
    most_live = 0
    for _ in range(round(3 * ttl_s / step_s)):
        lease_id = buckets.lease_for(ttl_s)
        lived = sim.expires[lease_id] - sim.now
        assert lived >= ttl_s, "a record would expire before its TTL"
        assert lived <= ttl_s + width + 1 + ttl_s * 2 * DRIFT, "more than a bucket late"
        live = sum(1 for t in sim.expires.values() if t > sim.now)
        most_live = max(most_live, live)
        sim.now += step_s
    assert most_live <= BUCKETS_PER_TTL + 2, most_live
    assert buckets.live() <= BUCKETS_PER_TTL + 1


def test_a_full_lease_rolls_over_and_a_forgotten_one_is_replaced() -> None:
    sim = _Sim()
    buckets = ExpiryBuckets(sim.grant, floor_s=2, clock=lambda: sim.now)
    first = buckets.lease_for(600.0, RECORDS_PER_LEASE)
    assert buckets.lease_for(600.0) != first, "a full lease takes no more records"
    second = buckets.lease_for(600.0)
    buckets.forget(second)
    assert buckets.lease_for(600.0) not in (first, second)
    assert len(sim.expires) == 3
