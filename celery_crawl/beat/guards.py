"""Reasons a replica must not lead: an unfit lease store, a skewed wall clock, a clock just set.

* **Store fitness**: a store that may evict keys (Redis ``maxmemory-policy`` other than
  ``noeviction``) can drop the leader lease or a fencing record under memory pressure, so a
  replica refuses to lead on it (read again every minute); a store without persistence only
  warns (state does not survive a restart of it).
* **Clock skew**: slot names are wall-clock instants, so a replica whose wall clock is more than
  ``crawl_max_clock_skew`` off the reference clock (the store's ``TIME``) does not lead; one
  whose offset was never measured does not either (fail closed).
* **Clock steps** (:mod:`.clockstep`): a wall clock set since the last calibration is measured
  again before anything is decided on it; until then nothing is dispatched or acquired.

A reason blocks the election (:meth:`.election.Election.block`); a leader that becomes blocked
releases its lease at once so a healthy replica takes over without waiting for the TTL.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from ..clock import Clock, monotonic
from ..errors import CrawlError, StoreError
from ..leases.base import LeaseStore
from .clockstep import Step, StepGuard
from .election import Election

__all__ = ["EVICTION_CHECK_S", "SKEW_CHECK_S", "Guards"]

log = logging.getLogger("celery_crawl.beat")

#: How often the wall clock is compared with the reference clock.
SKEW_CHECK_S = 10.0
#: How often the store's eviction policy is read again.
EVICTION_CHECK_S = 60.0
#: A standing block reason is logged again this often.
_BLOCK_LOG_S = 30.0


class Guards:
    """The block reasons of one replica, checked on their own schedules.

    Args:
        store: the lease store (its ``eviction_risk``/``persistence``, when it has them).
        clock: the calibrated clock (its reference may be None: no skew guard).
        election: blocked and unblocked here.
        max_skew_s: ``crawl_max_clock_skew``.
        store_timeout_s: a standby's budget for one multi-request measurement.
        demoted: called with the reason when a block ends this replica's leadership.
        replica_id: for the log.
    """

    def __init__(self, store: LeaseStore, clock: Clock, election: Election, *,
                 max_skew_s: float, store_timeout_s: float, demoted: Callable[[str], None],
                 replica_id: str = "") -> None:
        self.store = store
        self.clock = clock
        self.election = election
        self.max_skew_s = max_skew_s
        self.store_timeout_s = store_timeout_s
        self.demoted = demoted
        self.replica_id = replica_id
        self.steps = StepGuard(clock, max_skew_s / 2)
        #: the wall clock was set and is not measured again yet
        self.stepped = False
        self.next_skew = 0.0
        self.next_eviction = 0.0
        self.skew_reason: str | None = None
        self.eviction_reason: str | None = None
        #: set by the scheduler from the fleet's schedule (:mod:`.fleet`)
        self.schedule_reason: str | None = None
        self._last_block_log = 0.0

    @property
    def reason(self) -> str | None:
        return self.eviction_reason or self.skew_reason or self.schedule_reason

    def poll(self, now_m: float) -> None:
        """Run the skew and store checks that are due."""
        if now_m >= self.next_skew:
            self.check_skew()
        if now_m >= self.next_eviction:
            self.check_store()

    def check_store(self) -> None:
        store = self.store
        eviction = getattr(store, "eviction_risk", None)
        if eviction is not None:
            try:
                risk = eviction()
            except StoreError as exc:
                log.warning("beat: cannot read the store's eviction policy: %s", exc)
                risk = None
            if risk and not self.eviction_reason:
                log.error("beat: refusing to lead: %s", risk)
            self.eviction_reason = f"refusing to lead: {risk}" if risk else None
        persistence = getattr(store, "persistence", None)
        if persistence is not None and self.next_eviction == 0.0:
            try:
                p = persistence()
                if not p.get("aof_enabled") and not p.get("rdb"):
                    log.warning("beat: the lease store %s has neither AOF nor RDB persistence: "
                                "slot state will not survive a restart of it (runs may repeat "
                                "or be missed after one)", getattr(store, "url", ""))
            except StoreError as exc:
                log.warning("beat: cannot read the store's persistence settings: %s", exc)
        self.next_eviction = monotonic() + EVICTION_CHECK_S
        self.apply()

    def check_step(self) -> None:
        """Every tick: a wall clock set since the last calibration is measured again before
        anything is decided on it (see ``clockstep``)."""
        verdict = self.steps.check(deadline=self.deadline())
        self.stepped = verdict is Step.UNKNOWN
        if verdict is Step.REMEASURED:
            self.next_skew = monotonic() + SKEW_CHECK_S
            self.judge_skew(self.clock.offset_s)

    def deadline(self) -> float:
        """When a multi-request step of the election (clock samples) must stop starting
        requests: half the leader's validity left, so the renewal after it is still in time."""
        if self.election.is_leader:
            return monotonic() + self.election.remaining_s() / 2
        return monotonic() + self.store_timeout_s

    def check_skew(self) -> None:
        if self.clock.reference is None:
            self.next_skew = float("inf")
            return
        offset = self.clock.maybe_recalibrate(SKEW_CHECK_S, k=3, deadline=self.deadline())
        self.next_skew = monotonic() + SKEW_CHECK_S
        self.judge_skew(offset)

    def judge_skew(self, offset: float | None) -> None:
        if offset is None:
            # Never measured: fail closed (a replica whose skew is unknown may be the skewed
            # one) and try again soon. A failed re-measurement keeps the last known offset.
            self.skew_reason = ("not leading: the wall clock could not be compared with the "
                                "reference clock yet (crawl_max_clock_skew guard)")
            self.next_skew = monotonic() + 1.0
            self.apply()
            return
        if abs(offset) > self.max_skew_s:
            self.skew_reason = (
                f"not leading: this replica's wall clock is {-offset:+.3f}s off the reference "
                f"clock, more than crawl_max_clock_skew={self.max_skew_s:g}s")
        else:
            if self.skew_reason:
                log.warning("beat: wall clock back within %gs of the reference (offset %+.3fs)",
                            self.max_skew_s, -offset)
            self.skew_reason = None
        self.apply()

    def apply(self) -> None:
        """Block or unblock the election; a leader blocked here steps down cleanly."""
        reason = self.reason
        was_leader = self.election.is_leader
        lease = self.election.lease
        changed = reason != self.election.blocked_reason
        self.election.block(reason)
        if was_leader and not self.election.is_leader and lease is not None:
            # Step down cleanly so a healthy replica takes over at once, not after the TTL.
            with contextlib.suppress(CrawlError):
                self.store.release(lease)
        now = monotonic()
        if reason and (changed or now - self._last_block_log >= _BLOCK_LOG_S):
            self._last_block_log = now
            log.error("beat replica %s: %s", self.replica_id, reason)
        if was_leader and not self.election.is_leader:
            self.demoted(reason or "blocked")
