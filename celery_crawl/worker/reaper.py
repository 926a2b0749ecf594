"""The reaper: one worker at a time returns the tasks of dead workers to their queues.

Any worker may hold the ``reaper`` lease; the holder looks every ``crawl_reaper_interval`` for
claims whose lease is dead (``orphaned_claims``). For each it keeps the delivery count (so a task
that keeps killing its worker ends as poison after ``crawl_max_deliveries``), asks the broker to
redeliver exactly the claimed delivery tags (Redis: kombu's ``restore_by_tag``; RabbitMQ: the
broker already requeued them when the dead connection closed) and then drops the claim. A claim is
dropped only after its tag was restored, so a reaper that dies half-way leaves work for the next
one rather than a stuck task; ``restore_by_tag`` is idempotent, so doing it twice is harmless.

Bound (Redis broker): a task of a worker killed at time T runs elsewhere by about
``T + ttl + reaper_interval`` (+ one renewal interval of slack, + queue wait).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import keys, metrics
from ..errors import LeaseLost, StoreError
from ..leases.base import Lease, LeaseStore
from .broker import BrokerOps
from .claims import record_requeues
from .keeper import boottime

__all__ = ["Reaper"]

logger = logging.getLogger(__name__)


class Reaper:
    """Elected reaper running on the keeper thread.

    Args:
        store: the lease store.
        broker: broker operations (restore by tag).
        holder: returns this worker's current holder id (the reaper lease uses it).
        ttl_s: TTL of the reaper lease (the worker TTL).
        interval_s: ``crawl_reaper_interval``.
        done_ttl_s: how long delivery counts are kept.
        limit: claims handled per pass.
    """

    def __init__(
        self,
        store: LeaseStore,
        broker: BrokerOps,
        *,
        holder: Callable[[], str],
        ttl_s: float,
        interval_s: float,
        done_ttl_s: float,
        limit: int = 1000,
        clock: Callable[[], float] = boottime,
    ) -> None:
        self.store = store
        self.broker = broker
        self.holder = holder
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.done_ttl_s = done_ttl_s
        self.limit = limit
        self.clock = clock
        self._lease: Lease | None = None
        self._next = 0.0
        self.recovered = 0
        self.passes = 0

    @property
    def leading(self) -> bool:
        lease = self._lease
        return lease is not None and self.clock() < lease.valid_until

    def __call__(self) -> None:
        """A keeper hook: run a pass when due."""
        if self.clock() < self._next:
            return
        self._next = self.clock() + self.interval_s
        if self._hold():
            self.run_once()

    def _hold(self) -> bool:
        lease = self._lease
        try:
            if lease is not None and self.clock() < lease.valid_until and lease.holder == (
                self.holder()
            ):
                self._lease = self.store.renew(lease)
            else:
                self._lease = self.store.acquire(keys.REAPER, self.ttl_s, self.holder())
        except LeaseLost:
            self._lease = None
        except StoreError as exc:
            logger.debug("celery-crawl: reaper lease: %s", exc)
            if lease is not None and self.clock() >= lease.valid_until:
                self._lease = None
        return self.leading

    def run_once(self) -> int:
        """Recover every orphaned claim found in one pass; returns how many were recovered."""
        self.passes += 1
        claims = self.store.orphaned_claims(limit=self.limit)
        if not claims:
            return 0
        t0 = time.monotonic()
        record_requeues(self.store, claims, self.done_ttl_s)
        # Drop first (compare-and-delete on the claim token), restore only what we dropped: a
        # claim re-taken since we read it belongs to a live delivery whose tag must not be
        # restored again.
        dropped_claims = [c for c in claims if self.store.drop_claim(c)]
        dropped = len(dropped_claims)
        tags = [c.value.get("delivery_tag") for c in dropped_claims]
        try:
            self.broker.restore([t for t in tags if t is not None])
        except Exception:
            logger.error(
                "celery-crawl: restoring delivery tags %s failed; kombu's visibility timeout "
                "will redeliver them", tags, exc_info=True)
            raise
        self.recovered += dropped
        metrics.WORKER_RECOVERIES.inc(dropped)
        logger.warning(
            "celery-crawl: reaper recovered %d task(s) of dead worker lease(s) %s in %.3fs "
            "(broker: %s)", dropped, sorted({c.lease_name for c in claims}),
            time.monotonic() - t0, self.broker.kind,
        )
        return dropped

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(StoreError):
                self.store.release(lease)

    def info(self) -> dict[str, Any]:
        return {"reaper": self.leading, "reaper_recovered": self.recovered}
