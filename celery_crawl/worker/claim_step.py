"""The consumer bootstep: every delivery is claimed before Celery builds its request.

``ClaimStep`` lives as long as the consumer (one per worker; Celery restarts it on every broker
reconnection). It wraps each task's strategy so every delivery is claimed first, runs, parks,
drops or poisons it on the claim's decision, records each end before the message is settled, and
re-checks parked duplicates on the consumer's timer. The lease it claims under is the worker
step's (``lease_step.LeaseStep``), found through the worker when Celery builds the consumer.

Everything that touches the consumer, the pool or a kombu message runs on the event loop
(``hub.call_soon`` from the renewal thread); completion writes may also run on a threads-pool
thread (Celery acks from there).

Lease changes reach the loop as "look again", never as events to replay: the hub runs its ready
callbacks in no particular order, so a loss and the re-acquisition after it may run in either
order. ``_reconcile`` reads the keeper's current generation and, once per generation, brings
the worker to that state: consuming iff a lease is held, and every delivery claimed under a
lease other than the current one released. It makes no store call (the loop must not wait on
the store for a lease change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import signal as _signal
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.app.task import Context
from celery.exceptions import InvalidTaskError
from celery.worker import state as worker_state
from kombu.exceptions import ContentDisallowed, DecodeError

from .. import _celery_compat as compat
from .. import _finishing as finishing
from .. import _issued as issued
from .. import keys, metrics
from ..config import CrawlConfig
from ..errors import CrawlError, LeaseLost, PoisonMessage, StoreError, StoreUnavailable
from ..leases.base import Lease, LeaseStore
from . import replay
from .backlog import Backlog
from .broker import BrokerOps
from .claims import (
    ClaimBook,
    Claimer,
    Decision,
    Held,
    Outcome,
    lenient_int,
    message_digest,
)
from .context import CLAIM_HEADER
from .delivery import Delivery
from .desk import Desk
from .keeper import Keeper
from .lease_step import LeaseStep
from .lines import Watch
from .offload import Offloader
from .riding import Riding, riding_for
from .routes import ClaimLine, OffThread, Ridden, Route
from .store_line import StoreLine, store_line_for
from .unforged import strip_claim_token

__all__ = ["ClaimStep"]

logger = logging.getLogger("celery_crawl.worker")

_Ack = Callable[..., Any]


class ClaimStep(bootsteps.StartStopStep):
    """Consumer bootstep: claims every delivery before Celery builds its request.

    Registered with ``LeaseStep`` by ``celery_crawl.worker.install_worker(app)``.
    """

    label = "crawl-claims"
    name = "celery_crawl.worker.steps.ClaimStep"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        # The worker step is built before the consumer (Celery's Consumer step comes last).
        self.lease_step: LeaseStep = c.controller.crawl_lease
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
        self.consuming = True
        self.fenced_count = 0
        self.duplicates = 0
        self.poisoned = 0
        self._closed = False
        self._unprotected: set[str] = set()
        #: The keeper generation last brought about on the loop (``_reconcile``).
        self._applied_generation = 0
        self._reconcile_lock = threading.RLock()
        #: Store calls of deliveries and completions, off the event loop (``offload.py``).
        self._offload = Offloader(self._to_loop, {"decide": self._decide_batch,
                                                  "finish": self._complete_batch})
        self._loop_ident: int | None = None
        #: Between ``start`` and ``stop``: the consumer's loop runs and takes follow-ups.
        self._loop_running = False
        #: The consumer timer's entry re-checking parked deliveries (between start and stop).
        self._recheck_entry: Any = None
        #: A periodic re-check of parked deliveries is out on the offload thread.
        self._rechecking = False
        #: Claims and ends riding in the current channel's own round trips (``riding.py``);
        #: None when the lease store is not the broker's Redis server.
        self._riding: Riding | None = None
        #: The one log line saying claims do not ride behind Sentinel was written.
        self._told_sentinel = False
        #: Claims and ends the loop sends to the lease store without waiting (``store_line``);
        #: None when they ride or the store cannot have one.
        self._line: StoreLine | None = None
        self._ride_refusal_logged = False
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
        self._applied_generation = keeper.state().generation

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
            self._line = store_line_for(self.store, self.claimer, self.config.store_timeout_s,
                                        self._watch(), getattr(hub, "call_soon", None))
            if self._line is not None:
                logger.info("celery-crawl: claims and ends go out from the consumer's loop on "
                            "a claim line to %s, without waiting", self._line.store.url)
        self._route = self._choose_route()
        # The consumer's loop runs on this thread.
        self._loop_ident = threading.get_ident()
        self._loop_running = True
        # Celery's Tasks step has just started consuming on the new channel.
        self.consuming = True
        for name in list(c.strategies):
            c.strategies[name] = self._wrap(name, c.strategies[name])
        self._recheck_entry = c.timer.call_repeatedly(self._recheck_s, self._recheck_parked)
        if self.keeper is not None and self.keeper.lease is None and (
            self.config.on_lease_loss == "cancel"
        ):
            self._stop_consuming(c, "no worker lease held")
        self._reconcile()

    def _choose_route(self) -> Route:
        """The route of this consumer's claims and ends (what ``start`` set up allows)."""
        common: dict[str, Any] = {
            "on_loop": self._offloading, "decide_later": self._decide_later,
            "decide_now": self._decide, "end_later": self._complete_later,
            "end_now": lambda held, state, requeue: self._complete(held, state,
                                                                   requeue=requeue)}
        if self._riding is not None:
            return Ridden(take_claim=self._take_ridden, ride_end=self._ride_end, **common)
        if self._line is not None:
            return ClaimLine(send_claim=self._send_claim, send_end=self._send_end, **common)
        return OffThread(**common)

    def _take_ridden(self, message: Any) -> Any:
        riding = self._riding
        return riding.take(message, message.delivery_tag) if riding is not None else None

    def _ride(self, c: Any) -> None:
        """Have the claims and ends of this consumer's deliveries ride in its channel's own
        round trips, when the lease store is the broker's Redis server and database."""
        store = self.store
        if getattr(store, "sentinel", False) and not self._told_sentinel:
            # Sentinel may move the master between the broker's round trips and the store's:
            # claims and ends keep their own round trips (batched), on the master.
            self._told_sentinel = True
            logger.info("celery-crawl: the lease store is behind Sentinel: claims and ends do "
                        "not ride in the broker's round trips (the master may move)")
        channel = getattr(getattr(c, "task_consumer", None), "channel", None)
        riding, refusal = riding_for(self.store, self.claimer, channel, self._ride_ended,
                                     timeout_s=self.config.store_timeout_s,
                                     watch=self._watch(), on_loop=self._offloading)
        if refusal is not None and not self._ride_refusal_logged:
            self._ride_refusal_logged = True
            logger.warning("celery-crawl: claims and ends do not ride in the broker's round "
                           "trips: %s", refusal)
        if riding is None:
            return
        self._riding = riding
        compat.ride_redis_acks(channel, self._on_append, self._on_ack)
        logger.info("celery-crawl: the lease store is the broker's Redis database: claims and "
                    "ends ride in the broker's own round trips")

    def _watch(self) -> Watch | None:
        """The loop's reader registration, for lines whose replies should be read as soon as
        they come (None on a hub without one)."""
        hub = getattr(self.worker, "hub", None)
        add, remove = (getattr(hub, "add_reader", None), getattr(hub, "remove_reader", None))
        if add is None or remove is None:
            return None
        return add, remove

    def _close_line(self) -> None:
        """Wait for the replies of what the loop sent on the claim line, and close it."""
        line, self._line = self._line, None
        if line is not None:
            line.line.drain()

    def _unride(self) -> None:
        """The channel is gone (a reconnection, a stop): what waited on its round trips is
        given back (claims no strategy took) or recorded another way (ends)."""
        riding, self._riding = self._riding, None
        if riding is not None:
            self._sweep_rides(riding, overdue_s=None)

    def _sweep_rides(self, riding: Riding, *, overdue_s: float | None) -> None:
        line = riding.ack_line
        if line is not None:
            # Acks sent on the loop without waiting: their replies (errors go to the backlog).
            if overdue_s is None:
                line.drain()
            else:
                line.poll(overdue_s)
        claimed, unknown = riding.leftovers()
        for each in claimed:
            if each.decision is not None and each.decision.token is not None:
                gone = dataclasses.replace(each.held, token=each.decision.token,
                                           lease_name=each.lease.name,
                                           holder=each.lease.holder)
                self._offload.submit(functools.partial(self._give_back, [gone],
                                                       restore=False))
        for held, lease in unknown:
            self._offload.submit(functools.partial(self._drop_unheld_job, held, lease))
        for end in riding.overdue(overdue_s):
            logger.info("celery-crawl: %s[%s]: its ack did not carry its end; recording it "
                        "separately", end.held.task_name, end.held.task_id)
            self._defer(end.held, end.state, end.requeue)

    def _drop_unheld_job(self, held: Held, lease: Lease) -> None:
        """Offload job: ``_drop_if_unheld`` (nothing follows on the loop)."""
        self._drop_if_unheld(held, lease)

    def _drop_if_unheld(self, held: Held, lease: Lease) -> bool:
        """``Desk.drop_if_unheld`` (False before the lease was first held)."""
        return self.desk.drop_if_unheld(held, lease) if self.desk is not None else False

    def _on_append(self, message: Any, unacked_keys: list[Any], unacked_args: list[Any]
                   ) -> Any:
        """kombu records ``message`` as unacked: its claim rides along (a task message of a
        registered task, under a held lease)."""
        riding = self._riding
        if riding is None or not riding.carries(message):
            return None
        # A claim left from an earlier message never reached a strategy (ends wait for the
        # consumer's timer: their acks come on later turns).
        if riding.has_leftovers():
            self._sweep_rides(riding, overdue_s=self._ride_overdue_s)
        lease = self.keeper.lease if self.keeper else None
        headers = message.headers
        consumer = self.consumer
        if (lease is None or self._closed or not isinstance(headers, dict)
                or "id" not in headers or consumer is None
                or headers.get("task") not in consumer.strategies):
            return None
        try:
            held = self._held(message, str(headers["task"]))
        except InvalidTaskError:
            return None  # a plain append: the strategy refuses the message
        return riding.claim(held, lease, unacked_keys, unacked_args)

    def _on_ack(self, tag: Any, unacked_keys: list[Any], unacked_args: list[Any]) -> Any:
        riding = self._riding
        return riding.on_ack(tag, unacked_keys, unacked_args) if riding is not None else None

    @property
    def _ride_overdue_s(self) -> float:
        """How long an end waits for its message's ack before it is recorded separately."""
        return max(10.0, 10 * self._recheck_s)

    def _ride_end(self, held: Held, state: str, requeue: bool) -> bool:
        """Have the ack of ``held``'s message carry its end (True), if it rides."""
        riding = self._riding
        lease = self.keeper.lease if self.keeper else None
        if (riding is None or lease is None or not self._loop_running
                or not riding.carries(held.message) or compat.channel_gone(held.message)):
            return False
        held.handoff = finishing.take(held.task_id)
        if not self._the_desk.ending(held):
            return True  # released meanwhile: nothing to record
        if not riding.end(held, state, requeue, lease):
            self._the_desk.failed(held, state, requeue)
        return True

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
        """Drop the claims of deliveries that will not run here (no tombstone: they run again).

        ``everything``: at worker shutdown, after the pool finished, every remaining hold.
        Otherwise (after a reconnection) only those Celery no longer tracks as active or queued
        in a pool that will still run them.
        """
        assert self.claimer is not None
        dropped: list[Held] = []
        for held in self.book.snapshot():
            if not everything and not held.parked and self._will_run(held):
                continue
            self.book.pop(held)
            dropped.append(held)
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
        assert self.claimer is not None
        if restore and self.broker is not None:
            try:
                self.broker.restore([h.delivery_tag for h in dropped])
            except Exception as exc:
                logger.warning("celery-crawl: restoring %d delivery(ies) of the old connection "
                               "failed (%s); kombu's visibility timeout will", len(dropped), exc)
        for held in dropped:
            if not held.parked and held.token is not None:
                with contextlib.suppress(StoreError, LeaseLost):
                    self.claimer.drop(held)

    def _will_run(self, held: Held) -> bool:
        req = worker_state.requests.get(held.task_id)
        if req is None or compat.request_message(req) is not held.message:
            return False
        if req in worker_state.active_requests or req.time_start:
            return True
        if self.pool_name == "threads":
            future = compat.threads_pool_future(req)
            return future is not None and not future.done()
        return False

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

    def shutdown(self, c: Any) -> None:
        self.stop(c)

    # -- deliveries ------------------------------------------------------------------------
    def _wrap(self, task_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        step = self

        def crawl_claimed_strategy(message: Any, body: Any, ack: _Ack, reject: _Ack,
                                   callbacks: Any, **kwargs: Any) -> Any:
            headers = message.headers if isinstance(message.headers, dict) else None
            if headers is None or "id" not in headers:
                # Task protocol 1: headers carry no id; run unprotected (logged once per task),
                # and without a claim token: Celery builds its request from the body and the
                # headers, so neither may bring one in.
                _strip(message)
                if isinstance(body, dict):
                    body.pop(CLAIM_HEADER, None)
                if task_name not in step._unprotected:
                    step._unprotected.add(task_name)
                    logger.warning("celery-crawl: %s arrived in task protocol 1; it runs without "
                                   "a claim (set task_protocol = 2 on the producers)", task_name)
                return original(message, body, ack, reject, callbacks, **kwargs)
            delivery = Delivery(original, body, ack, reject, callbacks, kwargs,
                                consumer=step.consumer)
            claimed = step._route.take(message)
            if claimed is not None and claimed.decision is not None:
                # Claimed in the round trip that recorded the message as unacked.
                claimed.held.delivery = delivery
                step._apply(claimed.held, claimed.decision, claimed.lease, first=True)
                return None
            held = claimed.held if claimed is not None else step._held(message, task_name)
            held.delivery = delivery
            step._route.arrive(held)
            return None

        crawl_claimed_strategy.__wrapped__ = original  # type: ignore[attr-defined]
        return crawl_claimed_strategy

    def _held(self, message: Any, task_name: str) -> Held:
        """A hold for a task message (protocol 2) just received."""
        headers = message.headers
        # Never trust a producer's value, wherever it put one: the token is the claim's.
        _strip(message)
        info = message.delivery_info or {}
        retries = lenient_int(headers.get("retries"))
        return Held(
            task_id=str(headers["id"]), delivery_tag=message.delivery_tag,
            queue=info.get("routing_key"), deliveries=0, retries=retries,
            generation=(lenient_int(headers.get("replaced_task_nesting")), retries),
            digest_source=functools.partial(_digest_of, message), message=message,
            task_name=task_name, exchange=info.get("exchange"),
            routing_key=info.get("routing_key"),
        )

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

    def _send_claim(self, held: Held) -> bool:
        """Loop: send a fresh delivery's claim on the claim line (False: not sent)."""
        line = self._line
        lease = self.keeper.lease if self.keeper else None
        if line is None or lease is None:
            return False

        def undecided() -> None:
            self._offload.submit(functools.partial(self._decide_off_loop, held, None))

        def unknown() -> None:
            self._offload.submit(functools.partial(self._decide_off_loop, held, lease))

        return line.claim(held, lease, lambda d: self._apply_later(held, d, lease),
                          undecided, unknown)

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
        if (_delivery(held).consumer is not self.consumer or self._closed
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
        consumer: Any = self.consumer
        try:
            self._apply(held, decision, claimed_under, first=first)
        except (InvalidTaskError, ContentDisallowed) as exc:
            # What Celery's on_task_received does when the strategy raises these.
            consumer.on_invalid_task(None, held.message, exc)
        except DecodeError as exc:
            consumer.on_decode_error(held.message, exc)

    def _forget_one(self, held: Held) -> None:
        """Drop the claim of a delivery that will not run here, and restore its message."""
        assert self.claimer is not None
        with contextlib.suppress(StoreError, LeaseLost):
            self.claimer.drop(held)
        if self.broker is not None:
            try:
                self.broker.restore([held.delivery_tag])
            except Exception as exc:
                logger.warning("celery-crawl: restoring a delivery of the old connection "
                               "failed (%s); kombu's visibility timeout will", exc)

    def _decision_for(self, held: Held, *, presume_fresh: bool = True
                      ) -> tuple[Decision, Lease | None]:
        """The store part of a decision, and the lease its claim was made under."""
        return self._the_desk.decide(held, presume_fresh=presume_fresh)

    def _waits_for_own_run(self, held: Held, holder: str | None) -> bool:
        """A retry or replacement (a later generation of the message) parked behind a claim
        of this worker, or one that ended while being read: it waits for its own run."""
        own = holder is None or (self.keeper is not None and holder == self.keeper.holder)
        return own and held.generation != (0, 0)

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
                waiting = self._waits_for_own_run(held, decision.holder)
                metrics.WORKER_DUPLICATES_PARKED.labels("waiting" if waiting else "parked").inc()
                if waiting:
                    # A retry or replacement received while the run that published it is
                    # still ending (Celery's normal course, not a fault worth a warning).
                    logger.info("celery-crawl: %s[%s] is a %s waiting for its previous run "
                                "to end%s; parked (not run, not acked) until then",
                                held.task_name, held.task_id,
                                "retry" if held.generation[0] == 0 else "replacement",
                                _on_worker(decision.holder, self.keeper))
                elif decision.holder is None:
                    logger.warning("celery-crawl: %s[%s] is a duplicate delivery whose run's "
                                   "claim ended while being read; parked (not run, not acked) "
                                   "and looked at again shortly", held.task_name, held.task_id)
                else:
                    logger.warning("celery-crawl: %s[%s] is a duplicate delivery: its run "
                                   "holds a live claim%s; parked (not run, not acked) until "
                                   "that claim ends", held.task_name, held.task_id,
                                   _on_worker(decision.holder, self.keeper))
        else:
            # ``claimed_under``: the lease the claim was made under (the keeper may hold a newer
            # one by now).
            waited = not first and self._waits_for_own_run(held, held.holder)
            self._the_desk.claimed(held, decision, claimed_under)
            if not first and not waited:
                metrics.WORKER_DUPLICATES_PARKED.labels("run").inc()
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
                       "duplicate", held.task_name, held.task_id)
        # Its canvas gets the finished run's outcome before the ack (replay.py).
        replay.then_ack(self.app, held.task_name, held.task_id, held.message, self.hostname,
                        functools.partial(self._call_ack, held),
                        self._offload.submit if self._offloading() else None)

    def _run(self, held: Held) -> None:
        run = _delivery(held)
        held.message.headers[CLAIM_HEADER] = held.token

        def on_ack(*args: Any, **kw: Any) -> Any:
            if held.fenced:
                return None
            settle = _settler(held, run.ack, args, kw)
            if not self._lease_valid_for(held):
                return self._complete_stale(held, "done", False, settle)
            return self._route.end(held, "done", False, settle)

        def on_reject(*args: Any, **kw: Any) -> Any:
            if held.fenced:
                return None
            requeue = bool(kw.get("requeue", args[2] if len(args) > 2 else False))
            settle = _settler(held, run.reject, args, kw)
            if not self._lease_valid_for(held):
                return self._complete_stale(held, "rejected", requeue, settle)
            return self._route.end(held, "rejected", requeue, settle)

        try:
            run.strategy(held.message, run.body, on_ack, on_reject, run.callbacks, **run.kwargs)
        except BaseException:
            # Celery refuses the message itself (undecodable body, content type not accepted,
            # invalid task): it rejects it outside our callbacks, so the claim goes here.
            if self.book.pop(held) is not None:
                if self._offloading():
                    self._offload.submit(functools.partial(self._give_back, [held],
                                                           restore=False))
                else:
                    self._give_back([held], restore=False)
            raise

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
        held.handoff = finishing.take(held.task_id)
        held.fenced = True
        if self._offloading():
            self._offload.submit(
                functools.partial(self._stale_end, held, state, requeue, settle))
            return None
        return self._stale_end(held, state, requeue, settle)()

    def _stale_end(self, held: Held, state: str, requeue: bool,
                   settle: Callable[[], Any]) -> Callable[[], Any]:
        """The store part of ``_complete_stale``; returns what to do with the message."""
        assert self.store is not None and self.claimer is not None
        ours: bool | None
        try:
            current = self.store.claimant(keys.task_claim(held.task_id))
            ours = current is not None and current.token == held.token
        except StoreError:
            ours = None
        finally:
            # Recorded below or never: the end names its claim, so it cannot touch another.
            self.book.recorded(held)
        logger.warning("celery-crawl: %s[%s] ended after its lease was lost (claim %s)",
                       held.task_name, held.task_id,
                       {True: "still ours", False: "taken over", None: "unknown"}[ours])
        if ours:
            with contextlib.suppress(StoreError, LeaseLost):
                self.claimer.finish(held, state=state, requeue=requeue)
            return settle
        if ours is None or (self.broker is not None and self.broker.kind != "redis"):
            return settle
        return functools.partial(self._release, held, "claim taken over", requeue=False)

    def _complete_later(self, held: Held, state: str, requeue: bool,
                        settle: Callable[[], Any]) -> None:
        """Record the end on the offload thread, then settle the message on the loop: the
        tombstone is written before the ack, as on the synchronous path."""

        self._offload.submit_item("finish", (held, state, requeue, settle))

    def _send_end(self, held: Held, state: str, requeue: bool,
                  settle: Callable[[], Any]) -> bool:
        """Loop: send a run's end on the claim line and settle its message once the reply
        came (the tombstone is written before the ack); False: not sent (nothing done)."""
        line = self._line
        lease = self.keeper.lease if self.keeper else None
        if (line is None or lease is None or held.token is None
                or lease.name != held.lease_name):
            return False
        held.handoff = finishing.take(held.task_id)
        if not self._the_desk.ending(held):  # released meanwhile: nothing to record
            _settle_unless_fenced(held, settle)
            return True

        def ended(error: CrawlError | None) -> None:
            self._ride_ended(held, state, requeue, error)  # the same outcomes as a ridden end
            _settle_unless_fenced(held, settle)

        if not line.end(held, state, requeue, lease, ended):
            ended(StoreUnavailable("the claim line is down"))
        return True

    def _complete_batch(self, ends: list[tuple[Held, str, bool, Callable[[], Any]]]
                        ) -> list[Callable[[], None]]:
        """Offload thread: record the ends of runs that ended together (one store round trip,
        ``Desk.record_many``), then settle their messages on the loop."""
        for held, _, _, _ in ends:
            held.handoff = finishing.take(held.task_id)
        self._the_desk.record_many([(held, state, requeue) for held, state, requeue, _ in ends])
        return [functools.partial(_settle_unless_fenced, held, settle)
                for held, _, _, settle in ends]

    def _complete(self, held: Held, state: str, *, requeue: bool) -> None:
        """The end sequence, waiting for the store (``Desk.record``)."""
        held.handoff = finishing.take(held.task_id)
        self._the_desk.record(held, state, requeue)

    def _on_recorded(self, held: Held) -> None:
        """An end is recorded: a parked copy waiting for its hand-off is decided at once."""
        if held.handoff:
            self._wake_parked(held.task_id)

    def _wake_parked(self, task_id: str) -> None:
        """Decide at once the parked deliveries of a task whose run just handed its id on (a
        retry or replacement received while that run still held the claim), instead of on the
        next re-check: each ``Task.replace`` or retry would otherwise wait up to a second."""
        for other in self.book.snapshot():
            if other.parked and other.task_id == task_id:
                self._in_loop(self._decide_if_parked, other)

    def _decide_if_parked(self, held: Held) -> None:
        if held.parked and not held.fenced and self._holds(held):
            if self._offloading():
                self._offload.submit(functools.partial(self._recheck_off_loop, [held]))
            else:
                self._decide(held)

    def _holds(self, held: Held) -> bool:
        return any(h is held for h in self.book.snapshot())

    def _defer(self, held: Held, state: str, requeue: bool) -> None:
        self._the_desk.failed(held, state, requeue)

    def drain_backlog(self) -> None:
        """Keeper hook: record the ends that could not be recorded when they happened."""
        self._the_desk.drain_backlog()

    def _call_ack(self, held: Held) -> None:
        ack = _delivery(held).ack
        consumer = self.consumer
        _settler(held, ack, (logger, getattr(consumer, "connection_errors", ())), {})()

    def _poison(self, held: Held) -> None:
        """End a task delivered ``crawl_max_deliveries`` times as FAILURE, without running it.

        Its hook and result write and the record of its end are store and backend calls: off
        the consumer's loop when it runs; the ack follows on the loop."""
        if self._offloading():
            self._offload.submit(functools.partial(self._poison_off_loop, held))
        else:
            self._poison_off_loop(held)()

    def _poison_off_loop(self, held: Held) -> Callable[[], None]:
        name = held.task_name
        task = self.app.tasks.get(name)
        message = held.message
        reason = (f"delivered {held.deliveries} times (crawl_max_deliveries="
                  f"{self.config.max_deliveries}) without finishing; its worker probably died "
                  "running it")
        exc = PoisonMessage(f"{name}[{held.task_id}] {reason}")
        args: Any = ()
        kwargs: Any = {}
        embed: dict[str, Any] = {}
        try:
            payload = message.decode()
            if isinstance(payload, list | tuple) and len(payload) == 3:
                args, kwargs, embed = payload
        except Exception:  # a body we cannot decode still ends as FAILURE
            logger.debug("celery-crawl: cannot decode %s", held.task_id, exc_info=True)
        self.poisoned += 1
        logger.error("celery-crawl: %s[%s] is a poison message: %s", name, held.task_id, reason)
        hook = getattr(task, "crawl_on_poison", None) if task is not None else None
        stored = False
        if callable(hook):
            # The task's own hook rolls back, audits and stores the FAILURE itself.
            try:
                params = inspect.signature(hook).parameters
                extra = {k: v for k, v in (("token", held.token), ("hostname", self.hostname))
                         if k in params}
                hook(held.task_id, args, kwargs, reason, **extra)
                stored = True
            except Exception:
                logger.exception("celery-crawl: crawl_on_poison of %s failed", held.task_id)
        if task is not None and not stored:
            ctx = Context({**message.headers, **(embed or {}), "args": args, "kwargs": kwargs,
                           CLAIM_HEADER: held.token, "hostname": self.hostname,
                           "delivery_info": message.delivery_info})
            try:
                task.backend.mark_as_failure(held.task_id, exc, request=ctx)
            except Exception:
                logger.exception("celery-crawl: storing the poison FAILURE of %s failed",
                                 held.task_id)
        self._complete(held, "FAILURE", requeue=False)
        return functools.partial(_settle_unless_fenced, held,
                                 functools.partial(self._call_ack, held))

    def _recheck_parked(self) -> None:
        """Consumer timer: look again at the parked deliveries (their claimant may have died
        or ended). The reads go to the offload thread; the decisions are applied on the loop.
        Also sweeps what waited too long on the channel's round trips (``_sweep_rides``)."""
        riding = self._riding
        if riding is not None:
            self._sweep_rides(riding, overdue_s=self._ride_overdue_s)
        if self._line is not None:
            self._line.line.poll(self._ride_overdue_s)
        parked = [h for h in self.book.snapshot() if h.parked and not h.fenced]
        if not parked:
            return
        if not self._offloading():
            for held in parked:
                self._decide(held)
            return
        if self._rechecking:  # the last one is still out (a slow store): no pile-up
            return
        self._rechecking = True
        self._offload.submit(functools.partial(self._recheck_off_loop, parked, periodic=True))

    def _recheck_off_loop(self, parked: list[Held], *,
                          periodic: bool = False) -> Callable[[], None]:
        """Offload thread: the store part of each parked delivery's decision."""
        try:
            decided = [(held, *self._decision_for(held)) for held in parked]
        except BaseException:
            if periodic:
                self._rechecking = False
            raise

        def apply() -> None:
            if periodic:
                self._rechecking = False
            for held, decision, claimed_under in decided:
                self._apply_recheck(held, decision, claimed_under)

        return apply

    def _apply_recheck(self, held: Held, decision: Decision,
                       claimed_under: Lease | None) -> None:
        """Loop: apply a parked delivery's decision made off the loop, if it is still parked
        here; a claim made meanwhile for a delivery that is gone (released on a lease loss, or
        dropped on a reconnection) is given back."""
        if held.parked and not held.fenced and self._holds(held):
            self._apply_later(held, decision, claimed_under, first=False)
        elif decision.outcome in (Outcome.RUN, Outcome.POISON) and not self._holds(held):
            # A copy: the hold itself is settled (released or dropped) and may be read still.
            gone = dataclasses.replace(
                held, token=decision.token, parked=False,
                lease_name=claimed_under.name if claimed_under else None,
                holder=claimed_under.holder if claimed_under else None)
            self._offload.submit(functools.partial(self._give_back, [gone], restore=False))

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
        """Bring the worker to the keeper's current lease generation (once per generation).

        Idempotent and order-free: any number of notifications, run in any order, end in the
        state of the latest generation. A loss and a re-acquisition applied together release the
        deliveries of the lost lease and keep consuming; those claimed under the new lease stay.
        """
        keeper = self.keeper
        if keeper is None:
            return
        with self._reconcile_lock:
            state = keeper.state()
            if state.generation == self._applied_generation:
                return
            self._applied_generation = state.generation
            lease = state.lease
            reason = keeper.last_loss or "the worker lease was lost"
            if self.config.on_lease_loss == "continue":
                if lease is None:
                    logger.error(
                        "celery-crawl: crawl_on_lease_loss=continue: %d claimed task(s) keep "
                        "running unprotected (their claims are orphaned and may be recovered "
                        "elsewhere)", len(self.book))
                return
            c = self.consumer
            if lease is None and c is not None and self.consuming:
                self._stop_consuming(c, reason)
            self._fence_lost(lease, reason)
            if lease is not None:
                self._resume_consuming(lease)

    def _fence_lost(self, lease: Lease | None, reason: str) -> None:
        """Cancel and release every delivery not held under ``lease`` (None: every one)."""
        stale = self.book.take_not_of(lease.name if lease is not None else None)
        if not stale:
            return
        # A task whose body has returned and that is only writing its result is kept: killing
        # it would not undo its work, only run it again. Its end is recorded (or, if its
        # claim was reaped meanwhile, forgotten here) when its result write returns.
        ending: list[Held] = []
        fenced: list[Held] = []
        for held in stale:
            kept = not held.parked and finishing.finished(held.task_id)
            (ending if kept else fenced).append(held)
        for held in ending:
            self.book.add(held)
        # A store we cannot reach may have lost our claims (and the delivery tags they record)
        # or be unreachable for the reaper too: requeue ourselves. A store that answered "lost"
        # (or a freeze) means the reaper can see our orphaned claims and restores each tag once.
        requeue = bool(self.keeper and self.keeper.failing)
        cancelled = 0
        for held in fenced:
            finishing.clear(held.task_id)
            held.fenced = True
            if not held.parked:
                self.fenced_count += 1
                cancelled += self._cancel_request(held)
            self._release(held, reason, requeue=requeue)
        logger.error(
            "celery-crawl: lease lost (%s): %s, cancelled %d running/reserved task(s) without "
            "acking, released %d delivery(ies), kept %d whose body had returned (their results "
            "are being written); %s", reason,
            "stopped consuming" if lease is None else "kept consuming",
            cancelled, len(fenced), len(ending),
            "resuming once a new lease is held" if lease is None
            else f"deliveries under the new lease {lease.name} are kept")

    def _resume_consuming(self, lease: Lease) -> None:
        c = self.consumer
        if c is None or self.consuming:
            return
        task_consumer = getattr(c, "task_consumer", None)
        if task_consumer is None:
            return
        try:
            task_consumer.consume()
            self.consuming = True
            logger.warning("celery-crawl: consuming again under lease %s", lease.name)
        except Exception:  # the consumer restarts on connection errors
            logger.exception("celery-crawl: resuming consumption failed")

    def _stop_consuming(self, c: Any, reason: str) -> None:
        task_consumer = getattr(c, "task_consumer", None)
        if task_consumer is not None:
            try:
                task_consumer.cancel()
            except Exception:
                logger.warning("celery-crawl: cancelling the task consumer failed",
                               exc_info=True)
        self.consuming = False
        logger.error("celery-crawl: not consuming tasks: %s", reason)

    def _cancel_request(self, held: Held) -> int:
        req = worker_state.requests.get(held.task_id)
        if req is None or compat.request_message(req) is not held.message:
            return 0
        # Not announced as revoked/retried: the task is not over, it runs elsewhere.
        compat.cancel_quietly(req, getattr(self.consumer, "timer", None))
        pool = self.worker.pool
        if self.pool_name == "prefork":
            with contextlib.suppress(Exception):
                compat.cancel_request(req, pool, _signal.SIGKILL)
            if not req.time_start:
                worker_state.task_ready(req)
            return 1
        # threads pool: a running thread cannot be interrupted; only fencing protects it.
        future = compat.threads_pool_future(req)
        if future is not None and future.cancel():
            worker_state.task_ready(req)
            return 1
        if req.time_start:
            logger.error("celery-crawl: %s[%s] keeps running on the threads pool after the "
                         "lease loss; its writes are fenced by its claim token %s",
                         req.name, req.id, held.token)
        return 0

    def _release(self, held: Held, reason: str, *, requeue: bool = True) -> None:
        """Hand an unacked delivery back without acking it (it must run again somewhere)."""
        message = held.message
        if message is None or message.acknowledged:
            return
        broker = self.broker.kind if self.broker else "amqp"
        try:
            if broker == "redis" and held.token is not None and not requeue:
                # Our claim records this tag: the reaper restores it exactly once. Forget it
                # locally so closing our channel does not restore it a second time.
                compat.forget_unacked_locally(message, held.delivery_tag)
            else:
                message.reject(requeue=True)
        except Exception as exc:  # a dead connection requeues by itself
            logger.info("celery-crawl: releasing %s: %s", held.task_id, exc)

    # -- unacked freshness -----------------------------------------------------------------
    def refresh_unacked(self) -> None:
        """Keeper hook: restart the Redis visibility timeout of every delivery held here."""
        if self.broker is None or self.broker.kind != "redis":
            return
        if self.keeper is None or self.keeper.lease is None:
            return
        tags = list(dict.fromkeys(h.delivery_tag for h in self.book.snapshot() if not h.fenced))
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
            {"task_id": h.task_id, "token": h.token, "delivery_tag": _jsonable(h.delivery_tag),
             "queue": h.queue, "deliveries": h.deliveries, "parked": h.parked,
             "waiting_for": h.holder if h.parked else None}
            for h in self.book.snapshot()
        ]


def _strip(message: Any) -> None:
    """``strip_claim_token``; a body it cannot write back is left for Celery to refuse (its
    embed then still carries the key: the message must not run)."""
    try:
        strip_claim_token(message)
    except Exception as exc:
        logger.error("celery-crawl: cannot remove a forged claim token from a message (%s); "
                     "refusing it", exc)
        raise InvalidTaskError(f"a {CLAIM_HEADER} in the body that cannot be removed") from exc


def _settle_unless_fenced(held: Held, settle: Callable[[], Any]) -> None:
    """Settle a message whose end was recorded, unless a lease loss released it meanwhile."""
    if not held.fenced:
        settle()


def _settler(held: Held, settle: Callable[..., Any], args: tuple[Any, ...],
             kw: dict[str, Any]) -> Callable[[], Any]:
    """Ack or reject ``held``, unless its channel is gone (then the end is already recorded:
    the tombstone drops the redelivery, or the claim's drop lets it run again)."""

    def call() -> Any:
        if compat.channel_gone(held.message):
            logger.warning("celery-crawl: %s[%s]: its broker connection is gone; not acking "
                           "on it (kombu's visibility timeout redelivers the message later, and "
                           "the done tombstone drops that copy)", held.task_name,
                           held.task_id)
            return None
        return settle(*args, **kw)

    return call


def _delivery(held: Held) -> Delivery:
    """The strategy's arguments of a hold made by ``crawl_claimed_strategy`` (every hold of
    this step is)."""
    assert held.delivery is not None, f"hold of {held.task_id} carries no delivery"
    return held.delivery


def _digest_of(message: Any) -> str:
    """The digest of a task message as published (its claim-token header is the worker's)."""
    return message_digest(message.headers, message.body, without=CLAIM_HEADER)


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, int | str | float) or value is None else str(value)


def _on_worker(holder: str | None, keeper: Any) -> str:
    """`` on worker X`` for the log: this worker, another one, or unknown (ended meanwhile)."""
    if holder is None:
        return " (that run's claim ended while being read; looked at again shortly)"
    if keeper is not None and holder == keeper.holder:
        return " on this worker"
    return f" on worker {holder}"
