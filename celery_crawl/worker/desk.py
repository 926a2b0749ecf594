"""The lifecycle of every delivery a worker holds, in one place, without Celery.

A delivery goes ``arrive -> decide (claim) -> run -> end -> recorded``, whichever path carries
its store calls (the off-loop thread, the claim line, riding in the broker's round trips) and
whichever pool runs it. The ``Desk`` keeps the state of that lifecycle and makes the decisions
that depend on it:

* a hold is *live* while it runs or waits parked, then *ending* from the moment its run ends
  until its end is recorded in the store (sent, in flight on a line or an ack, or waiting in the
  backlog); only then is it forgotten (``ClaimBook``). A claim of this worker that no hold,
  live or ending, carries is a claim call whose reply was lost, and only such a claim is given
  back (``drop_if_unheld``): never the claim of a run whose end is still on its way;
* every end and every give-back names the exact claim (its token) it ends, so a late end of an
  earlier run cannot delete a later claim of the same lease;
* the lease a decision was made under is returned with it.

The consumer's claims (``consumer_claims.py``) move messages and call this; routes only carry
commands.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from .. import keys
from ..errors import LeaseLost, StoreError
from ..leases.base import Lease, LeaseStore
from .backlog import Backlog
from .claims import ClaimBook, Claimer, Decision, Held, Outcome, json_tag

__all__ = ["Desk"]

logger = logging.getLogger("celery_crawl.worker")


class Desk:
    """The lifecycle state of one worker's deliveries, and the decisions made from it.

    Thread-safe as its parts are: the loop, the off-loop thread, pool threads and the keeper's
    hook thread all call it.

    Args:
        store: the lease store.
        claimer: decisions and end records against the store.
        lease: the worker's current lease (None while it holds none).
        book: the holds (live and ending).
        backlog: ends waiting to be recorded.
        on_recorded: told of each end once it is recorded (a parked copy waiting for its
            hand-off is woken).
    """

    def __init__(self, store: LeaseStore, claimer: Claimer, lease: Callable[[], Lease | None],
                 *, book: ClaimBook | None = None, backlog: Backlog | None = None,
                 on_recorded: Callable[[Held], None] = lambda held: None) -> None:
        self.store = store
        self.claimer = claimer
        self._lease = lease
        self.book = book if book is not None else ClaimBook()
        self.backlog = backlog if backlog is not None else Backlog()
        self._on_recorded = on_recorded

    # -- decide ------------------------------------------------------------------------------
    def decide(self, held: Held, *, presume_fresh: bool = True,
               own_claim_dropped: bool = False) -> tuple[Decision, Lease | None]:
        """The decision for ``held`` (fresh or parked), and the lease it was made under.

        Fails closed: a store error parks the delivery (looked at again on the next
        re-check)."""
        lease = self._lease()
        if lease is None:
            return Decision(Outcome.NO_LEASE), None
        a = held.arrival
        try:
            decision = self.claimer.decide(
                a.task_id, delivery_tag=a.delivery_tag, queue=a.queue, exchange=a.exchange,
                routing_key=a.routing_key, retries=a.retries, generation=a.generation,
                digest=a.digest_now(), sent=a.sent, known_deliveries=held.deliveries,
                parked=held.parked,
                holder=held.holder, alive_at=held.alive_at, presume_fresh=presume_fresh,
                under=lease)
        except StoreError as exc:
            logger.warning("celery-crawl: cannot claim %s (%s); parked", held.arrival.task_id, exc)
            decision = Decision(Outcome.PARK, deliveries=held.deliveries, holder=held.holder,
                                alive_at=held.alive_at)
        if (decision.outcome is Outcome.PARK and not own_claim_dropped
                and decision.holder == lease.holder and self.drop_if_unheld(held, lease)):
            # Parked behind a claim of this very delivery under our own lease that no hold
            # here carries, live or ending: a claim call of ours whose reply was lost (and
            # whose drop failed too). Our lease keeps it alive, so waiting would wait forever.
            logger.info("celery-crawl: %s was parked behind a claim of its own whose reply "
                        "was lost; claiming it again", held.arrival.task_id)
            return self.decide(held, presume_fresh=False, own_claim_dropped=True)
        return decision, lease

    def drop_if_unheld(self, held: Held, lease: Lease) -> bool:
        """A claim call for ``held`` whose reply never came may have made its claim: give it
        back if so, naming its token, unless a hold here (live or *ending*) carries that token.
        True when one was given back."""
        with contextlib.suppress(StoreError, LeaseLost):
            current = self.store.claimant(keys.task_claim(held.arrival.task_id))
            if (current is None or current.lease_name != lease.name
                    or current.holder != lease.holder
                    or current.value.get("delivery_tag") != json_tag(held.arrival.delivery_tag)
                    or self.book.has_token(current.token)):
                return False
            return bool(self.store.unclaim(lease, keys.task_claim(held.arrival.task_id),
                                           token=current.token))
        return False

    def claimed(self, held: Held, decision: Decision, under: Lease | None) -> None:
        """``held`` runs (or is poisoned) under the claim ``decision`` made under ``under``."""
        held.parked = False
        held.token = decision.token
        held.deliveries = decision.deliveries
        held.sent_before = decision.sent_before
        held.lease_name = under.name if under else None
        held.holder = under.holder if under else None
        self.book.add(held)

    def parked(self, held: Held, decision: Decision) -> None:
        """``held`` waits behind a live claim (neither run nor settled)."""
        held.parked = True
        held.holder = decision.holder
        held.alive_at = decision.alive_at
        held.deliveries = decision.deliveries
        self.book.add(held)

    def take_unstarted(self, will_run: Callable[[Held], bool], *,
                       everything: bool) -> list[Held]:
        """Forget the holds that will not run here: every one (``everything``: at shutdown,
        after the pool finished) or, after a reconnection, the parked ones and those
        ``will_run`` says Celery no longer runs. Their claims go with ``give_back``."""
        taken: list[Held] = []
        for held in self.book.snapshot():
            if not everything and not held.parked and will_run(held):
                continue
            self.book.pop(held)
            taken.append(held)
        return taken

    def give_back(self, helds: list[Held]) -> None:
        """Drop the claims of holds that will not run here (no tombstone: they run again)."""
        for held in helds:
            if not held.parked and held.token is not None:
                self.drop(held)

    def drop(self, held: Held) -> None:
        """Drop ``held``'s claim, naming its token (an error leaves it to expire with the
        lease or to the reaper)."""
        with contextlib.suppress(StoreError, LeaseLost):
            self.claimer.drop(held)

    # -- end ---------------------------------------------------------------------------------
    def ending(self, held: Held) -> bool:
        """``held``'s run ended: it is *ending* until ``recorded``. False when it was not live
        (released meanwhile): nothing to record."""
        return self.book.end(held) is not None

    def recorded(self, held: Held) -> None:
        """``held``'s end is in the store: forgotten."""
        self.book.recorded(held)
        self._on_recorded(held)

    def failed(self, held: Held, state: str, requeue: bool,
               error: BaseException | None = None) -> None:
        """``held``'s end may not be recorded: it stays *ending*, in the backlog."""
        if error is not None:
            logger.warning("celery-crawl: recording the end of %s failed (%s); will retry",
                           held.arrival.task_id, error)
        self.backlog.add(held, state, requeue)

    def record(self, held: Held, state: str, requeue: bool) -> None:
        """The whole end sequence, waiting for the store: ending, recorded (or backlog)."""
        if not self.ending(held):
            return
        if self._lease() is None:
            self.failed(held, state, requeue)
            return
        try:
            self.claimer.finish(held, state=state, requeue=requeue)
        except (StoreError, LeaseLost) as exc:
            self.failed(held, state, requeue, exc)
            return
        self.recorded(held)

    def record_many(self, ends: list[tuple[Held, str, bool]]) -> None:
        """``record`` for runs that ended together (one store round trip)."""
        live = [(held, state, requeue) for held, state, requeue in ends if self.ending(held)]
        if not live:
            return
        if self._lease() is None:
            for held, state, requeue in live:
                self.failed(held, state, requeue)
            return
        for (held, state, requeue), exc in zip(live, self.claimer.finish_many(live),
                                               strict=True):
            if exc is not None:
                self.failed(held, state, requeue, exc)
            else:
                self.recorded(held)

    def record_stale(self, held: Held, state: str, requeue: bool) -> bool | None:
        """The end of a run whose claim's lease was lost before it ended: recorded if its
        claim is still ours (nobody reaped it). Whether it was (None: the store did not say).
        Either way ``held`` is forgotten: the end names its claim, so it cannot touch
        another."""
        ours: bool | None
        try:
            current = self.store.claimant(keys.task_claim(held.arrival.task_id))
            ours = current is not None and current.token == held.token
        except StoreError:
            ours = None
        finally:
            self.book.recorded(held)
        logger.warning("celery-crawl: %s[%s] ended after its lease was lost (claim %s)",
                       held.arrival.task_name, held.arrival.task_id,
                       {True: "still ours", False: "taken over", None: "unknown"}[ours])
        if ours:
            with contextlib.suppress(StoreError, LeaseLost):
                self.claimer.finish(held, state=state, requeue=requeue)
        return ours

    def drain_backlog(self) -> None:
        """Record the ends that could not be recorded when they happened (keeper hook).

        An end waits here when its outcome is unknown: the store may have executed it (its
        reply was lost) and a later run of the task may have claimed, run and ended since,
        writing a newer tombstone. Writing this end's record again would put the older one
        back (a tombstone that hands the id on to an older generation: a copy of the later
        run's message would run again). So it is written only while the claim still carries
        this run's token, which no later run can take from it: otherwise the end was
        executed, or the claim went to the reaper with its lease (at least once)."""

        def record(held: Held, *, state: str, requeue: bool) -> None:
            current = self.store.claimant(keys.task_claim(held.arrival.task_id))
            if current is not None and current.token == held.token:
                self.claimer.finish(held, state=state, requeue=requeue)
            self.recorded(held)

        self.backlog.drain(record)
