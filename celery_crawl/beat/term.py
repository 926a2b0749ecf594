"""This replica's hold on the leader lease: take it, renew it, lose it, and say so.

:mod:`.election` decides *when* (renew every ttl/3, poll as a standby, validity left); this
module makes the store calls and keeps the lease metrics, and tells the caller when a term
begins (``promote``: load the entry states) and ends (``demoted``: drop them). A lease lost or
refused demotes to standby; the process never exits over it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from .. import keys, metrics
from ..clock import monotonic
from ..errors import CrawlError, FencedError, LeaseError, LeaseLost, StoreError
from ..leases.base import Lease, LeaseStore
from .election import Action, Election

__all__ = ["PRESENCE_TTLS", "ROLE", "Term"]

log = logging.getLogger("celery_crawl.beat")

ROLE = "beat"
#: Presence records live this many TTLs after the last write.
PRESENCE_TTLS = 3


class Term:
    """Acquire, renew and release the ``beat-leader`` lease for one replica.

    Args:
        store: the lease store.
        election: the leader state machine.
        ttl_s: ``crawl_beat_lease_ttl``.
        replica_id: the lease holder's name.
        promote: loads the term's entry states (may raise a store or lease error: the lease
            is then released).
        demoted: called with the reason when leadership ends (drop the term's state).
        presence: this replica's presence record (written every poll).
    """

    def __init__(self, store: LeaseStore, election: Election, *, ttl_s: float, replica_id: str,
                 promote: Callable[[], None], demoted: Callable[[str], None],
                 presence: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self.election = election
        self.ttl_s = ttl_s
        self.replica_id = replica_id
        self.promote = promote
        self.demoted = demoted
        self.presence = presence

    def step(self, now_m: float, *, may_acquire: bool) -> None:
        """Renew, acquire or poll as the election says; write presence when due."""
        action = self.election.action(now_m)
        if action is Action.RENEW:
            self.renew()
        elif action is Action.ACQUIRE and not may_acquire:
            self.election.not_acquired()
        elif action is Action.ACQUIRE:
            self.acquire()
        if self.election.presence_due():
            self.write_presence()

    def acquire(self) -> None:
        try:
            lease = self.store.acquire(keys.BEAT_LEADER, self.ttl_s, self.replica_id)
        except StoreError as exc:
            log.debug("beat: acquire failed: %s", exc)
            lease = None
        if lease is None:
            self.election.not_acquired()
            return
        self.election.acquired(lease)
        metrics.BEAT_IS_LEADER.set(1)
        metrics.BEAT_FAILOVERS.inc()
        metrics.LEASE_TIME_LEFT.labels(ROLE).set(self.election.remaining_s())
        log.warning("beat replica %s is now the leader (token %d)", self.replica_id, lease.token)
        try:
            self.promote()
        except (StoreError, LeaseError, FencedError) as exc:
            log.error("beat: could not load slot state after taking the lease: %s", exc)
            self.demote(f"promotion failed: {exc}", release=True)
        self.write_presence()

    def renew(self) -> None:
        held = self.election.lease
        assert held is not None
        try:
            lease = self.store.renew(held)
        except LeaseLost as exc:
            self._record_loss(held, exc)
            self.demote(f"lease lost: {exc}")
            return
        except StoreError as exc:
            metrics.LEASE_RENEWALS.labels(ROLE, "error").inc()
            metrics.renewal_failed(ROLE, exc)
            if self.election.renew_failed():
                metrics.lease_ended(ROLE, held.valid_until, monotonic())
                self.ended(f"renewal failed until the lease ran out: {exc}")
            else:
                log.warning("beat: renewal failed, retrying (%.2fs of validity left): %s",
                            self.election.remaining_s(), exc)
            return
        self.election.renewed(lease)
        metrics.LEASE_RENEWALS.labels(ROLE, "ok").inc()
        metrics.LEASE_TIME_LEFT.labels(ROLE).set(self.election.remaining_s())

    def keep_alive(self) -> None:
        """Renew during long work (promotion, a delivery check reading a long queue) so the
        lease cannot lapse; raises ``LeaseLost`` to abort the work once it is gone."""
        if self.election.renew_due():
            self.renew()
        if not self.election.is_leader:
            raise LeaseLost("the lease was lost during a long step of the beat loop")

    def fenced_out(self, reason: str) -> None:
        """The store refused a fenced write: the lease is gone (another leader holds it), found
        by the write before the next renewal would have found it. Counted as that renewal's
        ``lease_lost`` and observed as a loss, so the SLIs do not depend on which call came
        first."""
        held = self.election.lease
        if held is not None:
            self._record_loss(held, LeaseLost(reason))
        self.demote(reason)

    @staticmethod
    def _record_loss(held: Lease, exc: LeaseLost) -> None:
        metrics.LEASE_RENEWALS.labels(ROLE, "lost").inc()
        metrics.renewal_failed(ROLE, exc)
        metrics.lease_ended(ROLE, held.valid_until, monotonic())

    def demote(self, reason: str, *, release: bool = False) -> None:
        lease = self.election.lease
        self.election.demote()
        if release and lease is not None:
            with contextlib.suppress(CrawlError):
                self.store.release(lease)
        self.ended(reason)

    def ended(self, reason: str) -> None:
        """Leadership is over (demoted, blocked or run out): metrics, then the caller."""
        metrics.BEAT_IS_LEADER.set(0)
        metrics.LEASE_TIME_LEFT.labels(ROLE).set(0)
        self.demoted(reason)

    def write_presence(self) -> None:
        try:
            self.store.put(keys.beat_presence(self.replica_id), self.presence(),
                           ttl_s=PRESENCE_TTLS * self.ttl_s)
        except StoreError as exc:
            log.debug("beat: presence write failed: %s", exc)
        self.election.presence_written()
