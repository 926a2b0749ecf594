"""Expiry buckets: TTL'd etcd records share one etcd lease per bucket of expiry instants.

A lease per record (a ``done/<id>`` tombstone, a delivery count) makes the number of live etcd
leases grow with the task rate times the TTL (a day of tombstones at 1 000 tasks/s is 86 M
leases), and each lease's expiry is one more revision. Instead, the instant a record must live
until, ``now + ttl``, is rounded *up* to the end of its bucket (buckets of ``ttl / 16``, whole
seconds, at least 1 s) and every record of that bucket goes under one lease that lives until the
bucket's end. So a record expires no earlier than asked and at most one bucket (plus etcd's
whole-second rounding and the 1 % clock-rate allowance) later; a process keeps at most 17 live
record leases per TTL (the buckets that end within one TTL from now), plus one per
``RECORDS_PER_LEASE`` records written within a TTL, so that one lease's expiry (which deletes
all its keys in one revision) stays a bounded transaction.

Leases are per process (a gRPC channel is), measured on ``CLOCK_BOOTTIME``: a lease granted at
local ``t`` with TTL ``L`` lives at least until ``t + L`` on our clock, since etcd starts
counting when it applies the grant, after we sent it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable

from ._driver import boottime as monotonic
from .base import DRIFT

__all__ = ["BUCKETS_PER_TTL", "RECORDS_PER_LEASE", "ExpiryBuckets"]

#: A TTL is cut into this many buckets: records outlive their TTL by at most 1/16 of it.
BUCKETS_PER_TTL = 16
#: Records one lease carries before its bucket gets a fresh one.
RECORDS_PER_LEASE = 10_000


@dataclasses.dataclass
class _Slot:
    lease_id: int
    ends_at: float  # the bucket's end on CLOCK_BOOTTIME; the lease lives at least until then
    records: int = 0


class ExpiryBuckets:
    """The record leases of one store.

    Args:
        grant: grants an etcd lease of the given whole seconds and returns its id.
        floor_s: the shortest TTL etcd grants (shorter TTLs are raised to it).
        clock: seconds on a monotonic clock.
    """

    def __init__(self, grant: Callable[[int], int], *, floor_s: int,
                 clock: Callable[[], float] = monotonic) -> None:
        self._grant = grant
        self._floor_s = floor_s
        self._clock = clock
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._lock = threading.Lock()
        self.granted = 0

    @staticmethod
    def width(ttl_s: float) -> int:
        """The bucket width for records of ``ttl_s``, whole seconds."""
        return max(1, math.ceil(ttl_s / BUCKETS_PER_TTL))

    def lease_for(self, ttl_s: float, records: int = 1) -> int:
        """The lease id under which ``records`` records that must live ``ttl_s`` go now.

        Grants a lease (one round trip, under the lock: concurrent writers of one bucket share
        it) when the bucket has none yet or its lease is full.
        """
        ttl = max(float(self._floor_s), ttl_s)
        width = self.width(ttl)
        with self._lock:
            now = self._clock()
            for key in [k for k, s in self._slots.items() if s.ends_at <= now]:
                del self._slots[key]
            bucket = math.ceil((now + ttl) / width)
            slot = self._slots.get((width, bucket))
            if slot is None or slot.records + records > RECORDS_PER_LEASE:
                ends_at = bucket * width
                lease_ttl = max(self._floor_s, math.ceil((ends_at - now) * (1 + DRIFT)))
                slot = _Slot(self._grant(lease_ttl), ends_at)
                self.granted += 1
                self._slots[(width, bucket)] = slot
            slot.records += records
            return slot.lease_id

    def forget(self, lease_id: int) -> None:
        """Stop using ``lease_id`` (etcd no longer has it, e.g. it was revoked)."""
        with self._lock:
            for key in [k for k, s in self._slots.items() if s.lease_id == lease_id]:
                del self._slots[key]

    def live(self) -> int:
        """Record leases this store still writes under (for tests and diagnostics)."""
        with self._lock:
            now = self._clock()
            return sum(1 for s in self._slots.values() if s.ends_at > now)
