"""The reaper: one worker at a time returns the tasks of dead workers to their queues.

Any worker may hold the ``reaper`` lease; the holder looks every ``crawl_reaper_interval`` for
claims whose lease is dead (``orphaned_claims``). For each it keeps the delivery count (so a task
that keeps killing its worker ends as poison after ``crawl_max_deliveries``) together with the
estimated instant the worker died, then drops the claim (compare-and-delete on its token) and,
for the claims it dropped only, asks the broker to redeliver exactly their delivery tags (Redis:
kombu's ``restore_by_tag``; RabbitMQ: the broker already requeued them when the dead connection
closed). Dropping first means a claim re-taken since the pass read it (a live delivery with the
same tag) is never restored a second time, and two reapers never restore one tag twice. The
consequence: a reaper that dies between dropping and restoring leaves the message unacked with no
claim pointing at it, so no later pass finds it; kombu's visibility timeout redelivers it.

Death estimate: a lease the reaper finds dead expired after its previous complete pass (while it
held the reaper lease; otherwise one interval earlier) and before this one; the middle of that
window minus the lease's TTL is its last renewal (``claims.estimate_death``). The worker that
runs the task next observes the preemption latency from it.

Grace: an orphaned claim is reaped only once it has been seen orphaned for the grace
(``orphan_grace(crawl_store_timeout)``; a claim seen for the first time makes the next pass come
that much later, not a whole interval). The grace is what keeps a task from running on two
workers at once: a worker cut off from the store stops its tasks at its local deadline, which
comes before the store expires its lease, plus at most one store call on its event loop
(``crawl_store_timeout``) and a little scheduling; the grace covers that, stretched by the clock
drift (the inequality is in docs/design.md, "Worker lease loss"). After an outage of the store
that every worker lost, the leases of all of them expired at once; the grace also lets a worker
whose task had finished its body during the outage record that end (ack, tombstone) before its
claim is reaped and the task run again.

Bound (Redis broker): a task of a worker killed at time T runs elsewhere by about
``T + ttl + reaper_interval + grace`` (+ one renewal interval of slack, + queue wait).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import keys, metrics
from ..errors import LeaseLost, StoreError
from ..leases.base import DRIFT, Claim, Lease, LeaseStore
from .broker import BrokerOps
from .claims import estimate_death, lenient_float, record_requeues
from .keeper import boottime

__all__ = ["ACT_SLACK_S", "ORPHAN_GRACE_S", "Reaper", "orphan_grace"]

#: What a worker may take, beyond one store call on its event loop, between its local lease
#: deadline and its tasks being stopped: the watchdog's wakeup, the loop's own work, the kill.
ACT_SLACK_S = 0.5


def orphan_grace(store_timeout_s: float) -> float:
    """How long a claim must have been seen orphaned before it is reaped.

    ``(store_timeout + ACT_SLACK_S) / (1 - DRIFT)``: a worker that lost its lease stops its
    tasks within ``store_timeout + ACT_SLACK_S`` of its local deadline, which is no later than
    the store's expiry; the reaper's grace, measured on its own clock, must outlast that on the
    loser's clock (docs/design.md, "Worker lease loss").
    """
    return (store_timeout_s + ACT_SLACK_S) / (1 - DRIFT)


#: The grace with the default ``crawl_store_timeout`` (2 s).
ORPHAN_GRACE_S = orphan_grace(2.0)

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
        grace_s: how long a claim must have been seen orphaned before it is reaped
            (``orphan_grace(crawl_store_timeout)``).
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
        grace_s: float = ORPHAN_GRACE_S,
    ) -> None:
        self.store = store
        self.broker = broker
        self.holder = holder
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.done_ttl_s = done_ttl_s
        self.limit = limit
        self.clock = clock
        self.grace_s = grace_s
        self._lease: Lease | None = None
        self._next = 0.0
        #: UNIX time of this reaper's last complete pass while it held the lease since.
        self._last_pass_at: float | None = None
        #: (claim key, claim token) -> when this reaper first saw it orphaned (boottime, UNIX
        #: time) and its last pass before that (UNIX time, or None): the death estimate's window.
        self._seen: dict[tuple[str, int], tuple[float, float, float | None]] = {}
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
        if lease is None or self._lease is None or self._lease.token != lease.token:
            # Not reaping continuously: another reaper may have passed meanwhile.
            self._last_pass_at = None
            self._seen = {}
        return self.leading

    def run_once(self) -> int:
        """Recover every orphaned claim found in one pass; returns how many were recovered."""
        self.passes += 1
        read_at = time.time()
        found = self.store.orphaned_claims(limit=self.limit)
        found_at = time.time()
        now = self.clock()
        first = (now, found_at, self._last_pass_at)
        seen = {(c.key, c.token): self._seen.get((c.key, c.token), first) for c in found}
        self._seen = seen
        claims = [c for c in found if now - seen[(c.key, c.token)][0] >= self.grace_s]
        if len(claims) < len(found):  # some seen for the first time: look again after the grace
            self._next = min(self._next, now + self.grace_s)
        if not claims:
            if not found:
                self._last_pass_at = read_at
            return 0
        t0 = time.monotonic()
        record_requeues(self.store, claims, self.done_ttl_s,
                        died_at=self._death_estimates(claims, seen))
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
        # A truncated pass left orphans unread: they may have died before this pass.
        self._last_pass_at = read_at if len(claims) < self.limit else None
        logger.warning(
            "celery-crawl: reaper recovered %d task(s) of dead worker lease(s) %s in %.3fs "
            "(broker: %s)", dropped, sorted({c.lease_name for c in claims}),
            time.monotonic() - t0, self.broker.kind,
        )
        return dropped

    def _death_estimates(
        self, claims: list[Claim], seen: dict[tuple[str, int], tuple[float, float, float | None]],
    ) -> dict[str, float]:
        """Estimated death instant of each dead lease among ``claims``, by lease name: within
        the window from the pass before the lease was first seen dead to that first sighting
        (the grace that follows is not part of it)."""
        by_lease: dict[str, list[Claim]] = {}
        for claim in claims:
            by_lease.setdefault(claim.lease_name, []).append(claim)
        out: dict[str, float] = {}
        for name, own in by_lease.items():
            claimed = [lenient_float(c.value.get("claimed_at")) for c in own]
            ttls = [lenient_float(c.value.get("ttl_s")) for c in own]
            _, dead_at, alive_at = min((seen[(c.key, c.token)] for c in own), key=lambda t: t[0])
            out[name] = estimate_death(
                dead_at=dead_at, alive_at=alive_at,
                ttl_s=max((t for t in ttls if t), default=self.ttl_s),
                claimed_at=max((t for t in claimed if t), default=None),
                window_s=self.interval_s)
        return out

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(StoreError):
                self.store.release(lease)

    def info(self) -> dict[str, Any]:
        return {"reaper": self.leading, "reaper_recovered": self.recovered}
