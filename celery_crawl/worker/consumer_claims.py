"""The consumer's claims: every delivery is claimed before Celery builds its request.

``ConsumerClaims`` lives as long as the worker (``claim_step.ClaimStep`` builds it once and
starts it again on every broker reconnection). It wraps each task's strategy so every
delivery is claimed first, runs, parks, drops or poisons it on the claim's decision, records
each end before the message is settled, and re-checks parked duplicates on the consumer's
timer. The lease it claims under is the worker step's (``lease_step.LeaseStep``), found
through the worker when Celery builds the consumer.

Everything that touches the consumer, the pool or a kombu message runs on the event loop
(``hub.call_soon`` from the renewal thread); completion writes may also run on a threads-pool
thread (Celery acks from there).

Lease changes reach the loop as "look again" (``lease_loss.LeaseLoss.reconcile``): once per
keeper generation, consuming iff a lease is held, and every delivery claimed under a lease other
than the current one released.

What is here is the glue of the lifecycle's calls; its parts are named modules: ``desk.py`` (the
lifecycle state), ``routes.py`` (how claims and ends travel), ``celery_requests.py`` (Celery's
side of a delivery), ``lease_loss.py``, ``recheck.py``, ``ride_wiring.py``, ``line_wiring.py``,
``park_words.py`` and ``poison.py``. Celery-free: no Celery or kombu import.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _celery_compat as compat
from .. import _finishing as finishing
from .. import _issued as issued
from .. import metrics
from ..config import CrawlConfig
from ..errors import StoreError
from ..leases.base import Lease, LeaseStore
from . import celery_requests as requests
from . import park_words
from .backlog import Backlog
from .broker import BrokerOps
from .claims import (
    ClaimBook,
    Claimer,
    Decision,
    Held,
    Outcome,
)
from .delivery import Delivery
from .desk import Desk
from .keeper import Keeper
from .lease_loss import LeaseLoss
from .lease_step import LeaseStep
from .line_wiring import LineWiring
from .lines import Watch
from .offload import Offloader
from .poison import store_poison_failure
from .recheck import Recheck
from .ride_wiring import RideWiring
from .riding import Riding
from .routes import ClaimLine, OffThread, Ridden, Route
from .store_line import StoreLine

__all__ = ["ConsumerClaims"]

logger = logging.getLogger("celery_crawl.worker")

class ConsumerClaims:
    """The consumer's claims: every delivery is claimed before Celery builds its request.

    Built by ``claim_step.ClaimStep`` and hung on the consumer as ``c.crawl_claims``; the
    worker step holds it as its ``ClaimSide``.
    """

    def __init__(self, lease_step: LeaseStep) -> None:
        self.lease_step = lease_step
        self.lease_step.claim_step = self
        # Every request of this worker gets its claim token from here (``_issued.py``).
        issued.vouch()
        self.book = ClaimBook()
        # Read when scraped: no gauge update per delivery.
        metrics.WORKER_CLAIMS.set_function(self.book.__len__)
        self.backlog = Backlog()
        self.claimer: Claimer | None = None
        #: The one lifecycle of every delivery (``desk.py``): made once the lease is held.
        self.desk: Desk | None = None
        self.consumer: Any = None
        #: Stop/resume consuming, cancel and release on the lease's changes (``lease_loss``).
        self.lease_loss = LeaseLoss(
            keeper=lambda: self.keeper, book=self.book, consumer=lambda: self.consumer,
            cancel=self._cancel_request, mode=lambda: self.config.on_lease_loss,
            release=lambda held, reason, requeue: self._release(held, reason,
                                                                requeue=requeue))
        self.duplicates = 0
        self.poisoned = 0
        self._closed = False
        self._unprotected: set[str] = set()
        #: Store calls of deliveries and completions, off the event loop (``offload.py``).
        self._offload = Offloader(self._to_loop, {"decide": self._decide_batch,
                                                  "finish": self._complete_batch})
        self._loop_ident: int | None = None
        #: Between ``start`` and ``stop``: the consumer's loop runs and takes follow-ups.
        self._loop_running = False
        #: The consumer timer's entry re-checking parked deliveries (between start and stop).
        self._recheck_entry: Any = None
        #: Parked deliveries looked at again (``recheck.py``).
        self.recheck = Recheck(
            book=self.book, offloading=self._offloading, submit=self._offload.submit,
            in_loop=self._in_loop, decide=self._decide,
            decision_for=lambda held: self._decision_for(held),
            apply=lambda held, decision, under: self._apply_later(held, decision, under,
                                                                  first=False),
            give_back=lambda helds: self._give_back(helds, restore=False))
        #: Claims and ends riding in the current channel's own round trips (``ride_wiring``).
        self.rides = RideWiring(
            lease=self._claim_lease, desk=lambda: self._the_desk,
            accepts=self._accepts, loop_running=lambda: self._loop_running,
            submit=self._offload.submit,
            give_back=lambda helds: self._give_back(helds, restore=False),
            drop_if_unheld=self._drop_if_unheld, overdue_s=lambda: self._ride_overdue_s)
        #: Claims and ends the loop sends to the lease store without waiting (``line_wiring``).
        self.lines = LineWiring(
            lease=self._claim_lease, desk=lambda: self._the_desk, submit=self._offload.submit,
            decide_off_loop=self._decide_off_loop,
            apply=lambda held, decision, under: self._apply_later(held, decision, under),
            ended=self._ride_ended)
        #: How claims and ends travel (``routes.py``), chosen again at every consumer start.
        self._route: Route = self._choose_route()

    # -- what the worker step holds ----------------------------------------------------------
    @property
    def app(self) -> Any:
        return self.lease_step.app

    @property
    def config(self) -> CrawlConfig:
        return self.lease_step.config

    @property
    def worker(self) -> Any:
        return self.lease_step.worker

    @property
    def hostname(self) -> str:
        return self.lease_step.hostname

    @property
    def pool_name(self) -> str:
        return self.lease_step.pool_name

    @property
    def store(self) -> LeaseStore | None:
        return self.lease_step.store

    @property
    def broker(self) -> BrokerOps | None:
        return self.lease_step.broker

    @property
    def keeper(self) -> Keeper | None:
        return self.lease_step.keeper

    # -- worker lease lifecycle (called by LeaseStep) ---------------------------------------
    def bind_lease(self, store: LeaseStore, keeper: Keeper) -> None:
        """The worker lease is held: claims can be made under it from now on."""
        config = self.config
        self.claimer = Claimer(store, self._claim_lease,
                               max_deliveries=config.max_deliveries,
                               done_ttl_s=config.done_ttl_s, worker=self.hostname,
                               recheck_s=self._recheck_s)
        self.desk = Desk(store, self.claimer, self._claim_lease, book=self.book,
                         backlog=self.backlog, on_recorded=self._on_recorded)
        self.lease_loss.applied_generation = keeper.state().generation

    def release_deliveries(self, *, lease_held: bool) -> None:
        """The worker lease is about to be released (the pool has finished): record what ended,
        and drop the claims of deliveries that will not run."""
        self._closed = True
        self._offload.stop()
        riding = self._riding
        if riding is not None and riding.ack_line is not None:
            riding.ack_line.drain()  # what the acks sent last recorded, before the backlog
        self._close_line()
        if lease_held:
            self.drain_backlog()
            self._forget_unstarted(everything=True)

    # -- consumer start/stop ----------------------------------------------------------------
    def start(self, c: Any) -> None:
        """Wrap every task strategy of a (re)started consumer and start re-checking parked."""
        compat.guard_connection_close(c)
        if self.consumer is not None:
            # A reconnection: Celery dropped the reserved requests of the old channel (the broker
            # redelivers them), so their claims must go too or the copies would park forever.
            self._forget_unstarted(everything=False)
        self._unride()
        self._close_line()  # a start without a stop first: the old line's replies are read
        self.consumer = c
        self._ride(c)
        if self._riding is None and compat.fast_paths_ok():
            hub = getattr(self.worker, "hub", None)
            self.lines.open(self.store, self.claimer, self.config.store_timeout_s,
                            self._watch(), getattr(hub, "call_soon", None))
        self._route = self._choose_route()
        # The consumer's loop runs on this thread.
        self._loop_ident = threading.get_ident()
        self._loop_running = True
        # Celery's Tasks step has just started consuming on the new channel.
        self.lease_loss.consuming = True
        for name in list(c.strategies):
            c.strategies[name] = self._wrap(name, c.strategies[name])
        self._recheck_entry = c.timer.call_repeatedly(self._recheck_s, self._recheck_parked)
        if self.keeper is not None and self.keeper.lease is None and (
            self.config.on_lease_loss == "cancel"
        ):
            self.lease_loss.stop_consuming(c, "no worker lease held")
        self._reconcile()

    def _choose_route(self) -> Route:
        """The route of this consumer's claims and ends (what ``start`` set up allows)."""
        common: dict[str, Any] = {
            "on_loop": self._offloading, "decide_later": self._decide_later,
            "decide_now": self._decide, "end_later": self._complete_later,
            "end_now": lambda held, state, requeue: self._complete(held, state,
                                                                   requeue=requeue)}
        if self._riding is not None:
            return Ridden(take_claim=self.rides.take, ride_end=self.rides.end, **common)
        if self._line is not None:
            return ClaimLine(send_claim=self.lines.send_claim, send_end=self.lines.send_end,
                             **common)
        return OffThread(**common)

    def _ride(self, c: Any) -> None:
        """Have this consumer's claims and ends ride in its channel's round trips, if they
        may (``ride_wiring.py``)."""
        self.rides.ride(getattr(getattr(c, "task_consumer", None), "channel", None),
                        self.store, self.claimer, self._ride_ended,
                        timeout_s=self.config.store_timeout_s, watch=self._watch(),
                        on_loop=self._offloading)

    @property
    def _riding(self) -> Riding | None:
        return self.rides.riding

    def _watch(self) -> Watch | None:
        """The loop's reader registration, for lines whose replies should be read as soon as
        they come (None on a hub without one)."""
        hub = getattr(self.worker, "hub", None)
        add, remove = (getattr(hub, "add_reader", None), getattr(hub, "remove_reader", None))
        if add is None or remove is None:
            return None
        return add, remove

    def _close_line(self) -> None:
        self.lines.close()

    @property
    def _line(self) -> StoreLine | None:
        return self.lines.line

    def _unride(self) -> None:
        self.rides.unride()

    def _sweep_rides(self, riding: Riding, *, overdue_s: float | None) -> None:
        self.rides.sweep(riding, overdue_s=overdue_s)

    def _drop_if_unheld(self, held: Held, lease: Lease) -> bool:
        """``Desk.drop_if_unheld`` (False before the lease was first held)."""
        return self.desk.drop_if_unheld(held, lease) if self.desk is not None else False

    @property
    def _ride_overdue_s(self) -> float:
        """How long an end waits for its message's ack before it is recorded separately."""
        return max(10.0, 10 * self._recheck_s)

    def _ride_ended(self, held: Held, state: str, requeue: bool,
                    error: Exception | None) -> None:
        """The round trip that carried an end answered."""
        if error is not None:
            self._the_desk.failed(held, state, requeue, error)
        else:
            self._the_desk.recorded(held)

    @property
    def _recheck_s(self) -> float:
        """How often parked deliveries are looked at again."""
        return min(1.0, self.config.worker_lease_ttl_s / 3)

    def _forget_unstarted(self, *, everything: bool) -> None:
        """Drop the claims of deliveries that will not run here (``Desk.take_unstarted``)."""
        dropped = self._the_desk.take_unstarted(
            lambda held: requests.will_run(held, self.pool_name), everything=everything)
        if not dropped:
            return
        if everything:
            self._give_back(dropped, restore=False)
        else:
            # A reconnection: the consumer's loop is about to run; the store and broker calls
            # go to the offload thread.
            self._offload.submit(functools.partial(self._give_back, dropped, restore=True))

    def _give_back(self, dropped: list[Held], *, restore: bool) -> None:
        """Drop the claims of deliveries that will not run here (and, after a reconnection,
        restore their messages: the old channel could not, its connection is gone; on Redis
        they would wait for the visibility timeout. Idempotent if it did)."""
        if restore:
            self._restore(dropped)
        self._the_desk.give_back(dropped)

    def _restore(self, helds: list[Held]) -> None:
        if self.broker is None:
            return
        try:
            self.broker.restore([h.arrival.delivery_tag for h in helds])
        except Exception as exc:
            logger.warning("celery-crawl: restoring %d delivery(ies) of the old connection "
                           "failed (%s); kombu's visibility timeout will", len(helds), exc)

    def stop(self, c: Any) -> None:
        # The loop has stopped (shutdown, or a lost connection): what is still queued off the
        # loop finishes now, its follow-ups run on the offload thread while this thread waits
        # (acks of recorded ends go out; decisions are not applied, see ``_apply_later``).
        self._loop_running = False
        self._unride()
        self._close_line()
        self._offload.stop()
        entry, self._recheck_entry = self._recheck_entry, None
        if entry is not None:
            with contextlib.suppress(Exception):
                entry.cancel()

    # -- deliveries ------------------------------------------------------------------------
    def _accepts(self, task_name: str) -> bool:
        """Whether a delivery of ``task_name`` is claimed now (this consumer runs it)."""
        consumer = self.consumer
        return (not self._closed and consumer is not None
                and task_name in consumer.strategies)

    def _wrap(self, task_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        return requests.claimed_strategy(task_name, original, consumer=lambda: self.consumer,
                                         unprotected=self._unprotected, arrive=self._arrive)

    def _arrive(self, message: Any, task_name: str, delivery: Delivery) -> None:
        """A protocol-2 message reached its strategy: claimed on its way in (riding), or
        handed to the route to be claimed."""
        claimed = self._route.take(message)
        if claimed is not None and claimed.decision is not None:
            # Claimed in the round trip that recorded the message as unacked.
            claimed.held.delivery = delivery
            self._apply(claimed.held, claimed.decision, claimed.lease, first=True)
            return
        held = claimed.held if claimed is not None else requests.held_for(message, task_name)
        held.delivery = delivery
        self._route.arrive(held)

    def _claim_lease(self) -> Lease | None:
        """The worker's current lease (``Desk`` returns the one each decision was made
        under with the decision)."""
        return self.keeper.lease if self.keeper else None

    @property
    def _the_desk(self) -> Desk:
        assert self.desk is not None, "no lease was ever held: nothing to decide or record"
        return self.desk

    def _offloading(self) -> bool:
        """Whether store calls of this thread go to the offload thread: only on the running
        event loop (a threads-pool thread may block; so may a loop that is not running)."""
        return (getattr(self.worker, "hub", None) is not None and not self._closed
                and self._loop_running and threading.get_ident() == self._loop_ident)

    def _to_loop(self, fn: Callable[[], None]) -> None:
        """Follow-ups of offloaded jobs: on the loop while it runs, else here (``stop``
        waits for this thread meanwhile)."""
        if self._loop_running:
            self._in_loop(fn)
        else:
            fn()

    def _decide_off_loop(self, held: Held, unknown_under: Lease | None
                         ) -> Callable[[], None]:
        """Offload thread: decide by reading a delivery whose claim line reply did not decide
        it; ``unknown_under``: the line failed before its reply, so the claim it sent under
        that lease may have been made: dropped first if so (the delivery is not held yet)."""
        if unknown_under is not None:
            self._drop_if_unheld(held, unknown_under)
        decision, claimed_under = self._decision_for(held, presume_fresh=False)
        return functools.partial(self._apply_later, held, decision, claimed_under)

    def _decide_later(self, held: Held) -> None:
        """Decide a fresh delivery on the offload thread; apply the decision on the loop."""
        self._offload.submit_item("decide", held)

    def _decide_batch(self, helds: list[Held]) -> list[Callable[[], None]]:
        """Offload thread: decide deliveries received together (``Claimer.decide_fresh``)."""
        assert self.claimer is not None
        try:
            decisions, lease = self.claimer.decide_fresh(helds)
        except StoreError as exc:
            # Fail closed: neither run nor drop; look again on the next re-check.
            logger.warning("celery-crawl: cannot claim %d delivery(ies) (%s); parked",
                           len(helds), exc)
            decisions, lease = [Decision(Outcome.PARK, deliveries=h.deliveries)
                                for h in helds], None
        return [functools.partial(self._apply_later, held, decision, lease)
                for held, decision in zip(helds, decisions, strict=True)]

    def _apply_later(self, held: Held, decision: Decision, claimed_under: Lease | None, *,
                     first: bool = True) -> None:
        """Apply a decision made off the loop, unless the world changed while it was made: the
        consumer was rebuilt (Celery dropped the reserved deliveries of the old connection) or
        the lease the claim was made under is no longer the current one."""
        claimed = decision.outcome in (Outcome.RUN, Outcome.POISON)
        if (requests.delivery_of(held).consumer is not self.consumer or self._closed
                or not self._loop_running):
            if claimed:
                held.token, held.deliveries = decision.token, decision.deliveries
                held.lease_name = claimed_under.name if claimed_under else None
                held.holder = claimed_under.holder if claimed_under else None
                if self._loop_running:
                    self._offload.submit(lambda: self._forget_one(held))
                else:
                    self._forget_one(held)
            return
        if claimed and self.config.on_lease_loss == "cancel":
            lease = self.keeper.lease if self.keeper else None
            if lease is None or claimed_under is None or lease.name != claimed_under.name:
                # Claimed under a lease lost meanwhile: released like the deliveries of that
                # lease were (its claim stays orphaned for the reaper).
                held.token = decision.token
                held.fenced = True
                self._release(held, "the worker lease was lost",
                              requeue=bool(self.keeper and self.keeper.failing))
                return
        requests.apply_or_refuse(self.consumer, held, functools.partial(
            self._apply, held, decision, claimed_under, first=first))

    def _forget_one(self, held: Held) -> None:
        """Drop the claim of a delivery that will not run here, and restore its message."""
        self._the_desk.drop(held)
        self._restore([held])

    def _decision_for(self, held: Held, *, presume_fresh: bool = True
                      ) -> tuple[Decision, Lease | None]:
        """The store part of a decision, and the lease its claim was made under."""
        return self._the_desk.decide(held, presume_fresh=presume_fresh)

    @property
    def _own_holder(self) -> str | None:
        return self.keeper.holder if self.keeper is not None else None

    def _decide(self, held: Held) -> None:
        first = not held.parked
        decision, claimed_under = self._decision_for(held)
        self._apply(held, decision, claimed_under, first=first)

    def _apply(self, held: Held, decision: Decision, claimed_under: Lease | None, *,
               first: bool) -> None:
        outcome = decision.outcome
        if outcome is Outcome.NO_LEASE:
            self.book.pop(held)
            self._release(held, "no worker lease held")
        elif outcome is Outcome.DUPLICATE:
            self._drop_duplicate(held)
        elif outcome is Outcome.PARK:
            self._the_desk.parked(held, decision)
            if first:
                park_words.say_parked(held, decision, self._own_holder)
        else:
            # ``claimed_under``: the lease the claim was made under (the keeper may hold a newer
            # one by now).
            if not first:
                park_words.run_after_parking(held, self._own_holder)
            self._the_desk.claimed(held, decision, claimed_under)
            if outcome is Outcome.POISON:
                self._poison(held)
            else:
                self._run(held)
                if decision.died_at is not None:
                    # The task of a dead worker, now handed to the pool here: from its death.
                    metrics.WORKER_PREEMPTION_LATENCY.observe(
                        max(0.0, time.time() - decision.died_at))

    def _drop_duplicate(self, held: Held) -> None:
        """The one place a delivery is dropped as a duplicate of a finished run (its done
        tombstone hands the id on to no newer message): acked, never run."""
        self.book.pop(held)
        self.duplicates += 1
        metrics.WORKER_DUPLICATES_PARKED.labels("dropped").inc()
        logger.warning("celery-crawl: %s[%s] already finished (done tombstone) and handed "
                       "its id on to no newer message; dropping this delivery as a "
                       "duplicate", held.arrival.task_name, held.arrival.task_id)
        # Its canvas gets the finished run's outcome before the ack (replay.py).
        requests.ack_dropped(self.app, held, self.hostname,
                             functools.partial(self._call_ack, held),
                             self._offload.submit if self._offloading() else None)

    def _run(self, held: Held) -> None:
        task = self.app.tasks.get(held.arrival.task_name)
        held.acked_early = task is not None and not getattr(task, "acks_late", True)
        requests.run(held, self._end, self._refused)

    def _end(self, held: Held, state: str, requeue: bool, settle: requests.Settle) -> Any:
        """A run acked or rejected its message: record its end, then settle."""
        if not self._lease_valid_for(held):
            return self._complete_stale(held, state, requeue, settle)
        return self._route.end(held, state, requeue, settle)

    def _refused(self, held: Held) -> None:
        """Celery refused a claimed message itself: its claim is given back."""
        if self.book.pop(held) is not None:
            if self._offloading():
                self._offload.submit(functools.partial(self._give_back, [held],
                                                       restore=False))
            else:
                self._give_back([held], restore=False)

    def _lease_valid_for(self, held: Held) -> bool:
        lease = self.keeper.lease if self.keeper else None
        return lease is not None and lease.name == held.lease_name

    def _complete_stale(self, held: Held, state: str, requeue: bool,
                        settle: Callable[[], Any]) -> Any:
        """A task ended after its claim's lease was lost (noticed before the loss handler ran).

        If the claim is still ours (nobody reaped it) the run counts: settle the message and
        record the end. If it was reaped, the Redis delivery tag may already belong to the
        redelivered copy running elsewhere, so the message is only forgotten locally (acking it
        would delete the other worker's unacked entry); RabbitMQ knows whether the delivery is
        still ours, so it is settled normally. The store calls run off the consumer's loop.
        """
        self.book.end(held)
        held.handoff = finishing.take(held.arrival.task_id) or held.acked_early
        held.fenced = True
        if self._offloading():
            self._offload.submit(
                functools.partial(self._stale_end, held, state, requeue, settle))
            return None
        return self._stale_end(held, state, requeue, settle)()

    def _stale_end(self, held: Held, state: str, requeue: bool,
                   settle: Callable[[], Any]) -> Callable[[], Any]:
        """The store part of ``_complete_stale`` (``Desk.record_stale``); returns what to do
        with the message."""
        ours = self._the_desk.record_stale(held, state, requeue)
        if ours or ours is None or (self.broker is not None
                                    and not self.broker.tags_outlive_delivery):
            return settle
        return functools.partial(self._release, held, "claim taken over", requeue=False)

    def _complete_later(self, held: Held, state: str, requeue: bool,
                        settle: Callable[[], Any]) -> None:
        """Record the end on the offload thread, then settle the message on the loop: the
        tombstone is written before the ack, as on the synchronous path."""

        self._offload.submit_item("finish", (held, state, requeue, settle))

    def _complete_batch(self, ends: list[tuple[Held, str, bool, Callable[[], Any]]]
                        ) -> list[Callable[[], None]]:
        """Offload thread: record the ends of runs that ended together (one store round trip,
        ``Desk.record_many``), then settle their messages on the loop."""
        for held, _, _, _ in ends:
            held.handoff = finishing.take(held.arrival.task_id) or held.acked_early
        self._the_desk.record_many([(held, state, requeue) for held, state, requeue, _ in ends])
        return [functools.partial(requests.settle_unless_fenced, held, settle)
                for held, _, _, settle in ends]

    def _complete(self, held: Held, state: str, *, requeue: bool) -> None:
        """The end sequence, waiting for the store (``Desk.record``)."""
        held.handoff = finishing.take(held.arrival.task_id) or held.acked_early
        self._the_desk.record(held, state, requeue)

    def _on_recorded(self, held: Held) -> None:
        """An end is recorded: a parked copy waiting for its hand-off is decided at once."""
        if held.handoff:
            self._wake_parked(held.arrival.task_id)

    def _wake_parked(self, task_id: str) -> None:
        """Decide at once the parked deliveries of a task whose run just handed its id on (a
        retry or replacement received while that run still held the claim)."""
        self.recheck.wake(task_id)

    def _defer(self, held: Held, state: str, requeue: bool) -> None:
        self._the_desk.failed(held, state, requeue)

    def drain_backlog(self) -> None:
        """Keeper hook: record the ends that could not be recorded when they happened."""
        self._the_desk.drain_backlog()

    def _call_ack(self, held: Held) -> None:
        requests.ack(held, self.consumer)

    def _poison(self, held: Held) -> None:
        """End a task delivered ``crawl_max_deliveries`` times as FAILURE, without running it.

        Its hook and result write and the record of its end are store and backend calls: off
        the consumer's loop when it runs; the ack follows on the loop."""
        if self._offloading():
            self._offload.submit(functools.partial(self._poison_off_loop, held))
        else:
            self._poison_off_loop(held)()

    def _poison_off_loop(self, held: Held) -> Callable[[], None]:
        self.poisoned += 1
        store_poison_failure(self.app, held, hostname=self.hostname,
                             max_deliveries=self.config.max_deliveries)
        self._complete(held, "FAILURE", requeue=False)
        return functools.partial(requests.settle_unless_fenced, held,
                                 functools.partial(self._call_ack, held))

    def _recheck_parked(self) -> None:
        """Consumer timer: look again at the parked deliveries (``recheck.py``), after
        sweeping what waited too long on the channel's round trips (``_sweep_rides``)."""
        riding = self._riding
        if riding is not None:
            self._sweep_rides(riding, overdue_s=self._ride_overdue_s)
        if self._line is not None:
            self._line.line.poll(self._ride_overdue_s)
        self.recheck.tick()

    @property
    def _rechecking(self) -> bool:
        return self.recheck.rechecking

    # -- lease loss / regain ---------------------------------------------------------------
    def _in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        hub = getattr(self.worker, "hub", None)
        if hub is not None:
            hub.call_soon(fn, *args)
        else:
            fn(*args)

    def changed_from_thread(self) -> None:
        """The keeper's lease changed (renewal thread): reconcile on the loop."""
        self._in_loop(self._reconcile)

    def _reconcile(self) -> None:
        """Bring the worker to the keeper's current lease generation (``lease_loss.py``)."""
        self.lease_loss.reconcile()

    @property
    def consuming(self) -> bool:
        return self.lease_loss.consuming

    @property
    def fenced_count(self) -> int:
        return self.lease_loss.fenced_count

    def _cancel_request(self, held: Held) -> int:
        return requests.cancel_request(held, pool=self.worker.pool, pool_name=self.pool_name,
                                       timer=getattr(self.consumer, "timer", None))

    def _release(self, held: Held, reason: str, *, requeue: bool = True) -> None:
        """Hand an unacked delivery back without acking it (it must run again somewhere)."""
        message = held.arrival.message
        if message is None or message.acknowledged:
            return
        try:
            if self.broker is None:
                message.reject(requeue=True)
            else:
                self.broker.release(message, held.arrival.delivery_tag,
                                    reaper_restores=held.token is not None and not requeue)
        except Exception as exc:  # a dead connection requeues by itself
            logger.info("celery-crawl: releasing %s: %s", held.arrival.task_id, exc)

    # -- unacked freshness -----------------------------------------------------------------
    def refresh_unacked(self) -> None:
        """Keeper hook: restart the Redis visibility timeout of every delivery held here."""
        if self.broker is None or not self.broker.tags_outlive_delivery:
            return
        if self.keeper is None or self.keeper.lease is None:
            return
        tags = list(dict.fromkeys(h.arrival.delivery_tag for h in self.book.snapshot()
                                  if not h.fenced))
        if tags:
            self.broker.refresh(tags)


    # -- visibility ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The delivery side of ``LeaseStep.status()``."""
        claimed, parked = self.book.counts()
        return {
            "claims": claimed, "parked": parked, "consuming": self.consuming,
            "fenced": self.fenced_count, "duplicates_dropped": self.duplicates,
            "poisoned": self.poisoned, "backlog": len(self.backlog),
            "rides_broker": self._riding is not None,
            "claim_line": self._line is not None, "route": self._route.name,
        }

    def claims(self) -> list[dict[str, Any]]:
        return [
            {"task_id": h.arrival.task_id, "token": h.token,
             "delivery_tag": _jsonable(h.arrival.delivery_tag),
             "queue": h.arrival.queue, "deliveries": h.deliveries, "parked": h.parked,
             "waiting_for": h.holder if h.parked else None}
            for h in self.book.snapshot()
        ]


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, int | str | float) or value is None else str(value)

