"""Task claims of one worker: what to do with a delivery, and what to write when it ends.

This module does not import Celery: it talks to a ``LeaseStore`` and returns decisions that the
consumer's claims (``consumer_claims.py``) carry out on Celery's objects.

A delivery of task ``id`` is decided in this order (one ``get_many_versioned`` and one
``claim_unless_changed``):

1. a ``done/<id>`` tombstone that does not hand the id on to this delivery → **duplicate** (ack
   and drop). A run hands its id on when it published a message under its own id (``self.retry``,
   ``Task.replace``, ``apply_async(task_id=self.request.id)``) or the first task of its
   replacement (the pool child marks it, ``handoffs.py``); the tombstone records that
   (``handoff``), the finished delivery's generation ``(replaced_task_nesting, retries)`` and
   its digest. Only a delivery of a generation at least as high, and not the finished delivery
   itself (same digest), may then run: a redelivery of a finished message, an older message and
   any message after a run that handed nothing on are duplicates (``is_successor``);
2. claim ``task:<id>`` bound to this worker's lease, **in the same atomic store operation as a
   check that the tombstone is still the one just judged** (a finisher that writes it in between
   makes the claim fail with ``RecordChanged``, and the delivery is decided again); a live claim
   elsewhere (or here) → **park** (neither run nor ack) and decide again later (a parked delivery
   reads the claim first, and claims only once it is gone or its lease dead);
3. the delivery count (kept in ``deliveries/<id>`` by whoever requeued the task: the reaper, or
   this worker when a child died) reaches ``crawl_max_deliveries`` → **poison** (end as FAILURE
   without running);
4. otherwise **run** with the claim's token.

On completion the tombstone is written *before* the claim is deleted, so a parked duplicate never
sees "no claim and no tombstone" for a task that has in fact finished.

When a delivery takes over the task of a dead worker, the decision carries an estimate of when that
worker died (``died_at``, for the preemption latency metric): whoever first finds the dead lease
(the reaper, or a worker whose parked copy waited for it) brackets the instant the store expired it
between the last time it was seen alive and the time it was seen dead, and subtracts the lease's
TTL: that is the lease's last successful renewal, the last moment the worker is known to have been
alive (``estimate_death``). The store keeps no renewal time (renewal stays one O(1) round trip),
so the estimate is what the expiry implies.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import keys
from ..errors import LeaseLost, RecordChanged, StoreError
from ..leases.base import Claim, Lease, LeaseStore
from .delivery import Delivery

__all__ = [
    "Arrival",
    "ClaimBook",
    "Claimer",
    "Decision",
    "Held",
    "Outcome",
    "deliveries_key",
    "estimate_death",
    "is_new_publish",
    "is_older_publish",
    "is_successor",
    "json_tag",
    "lenient_float",
    "lenient_int",
    "message_digest",
]

logger = logging.getLogger(__name__)


def deliveries_key(task_id: str) -> str:
    """Record counting how often task ``task_id`` was handed out and not finished."""
    return f"deliveries/{task_id}"


class Outcome(enum.Enum):
    """What the consumer step does with one delivery."""

    RUN = "run"
    PARK = "park"
    DUPLICATE = "duplicate"
    POISON = "poison"
    NO_LEASE = "no-lease"


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """The decision for one delivery.

    Attributes:
        outcome: what to do.
        token: the claim token (RUN and POISON).
        deliveries: the delivery count of this delivery (1 for a first delivery).
        holder: the holder of the live claim that made us park (PARK).
        alive_at: UNIX time just before the read that found that claim alive (PARK).
        died_at: estimated UNIX time the worker whose task this delivery takes over died, when
            it takes over a dead worker's task (RUN; see ``estimate_death``).
        sent_before: see below.
    """

    outcome: Outcome
    token: int | None = None
    deliveries: int = 1
    holder: str | None = None
    alive_at: float | None = None
    died_at: float | None = None
    #: The publishes (``crawl_sent``) the task id already ran for, from the tombstone this
    #: delivery runs after (RUN and POISON): its own end records them with its own.
    sent_before: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Arrival:
    """What one delivery is: fixed when it arrives, the same for its whole lifecycle.

    ``message`` is opaque to this module (the consumer step keeps the kombu message there).
    """

    task_id: str
    delivery_tag: Any
    queue: str | None
    retries: int = 0
    #: ``(replaced_task_nesting, retries)`` of the message (see ``is_successor``).
    generation: tuple[int, int] = (0, 0)
    #: Digest of the message's headers and body: the same for every redelivery of it. Read it
    #: through ``digest_now``: only a decision that found a tombstone, and the tombstone of a
    #: run that handed its id on, need it, so it is computed then (``digest_source``).
    digest: str = ""
    #: Computes the digest when it is first needed (None: ``digest`` is all there is).
    digest_source: Callable[[], str] | None = None
    #: The publish this message belongs to (``crawl_sent``; "" when unmarked, ``publishes.py``).
    sent: str = ""
    #: The registered name of the task (for logs and the poison path).
    task_name: str = ""
    #: Where the message was published to (recorded in the claim).
    exchange: str | None = None
    routing_key: str | None = None
    message: Any = None
    #: Unique per delivery: a message restored twice can reach us twice with the same tag.
    key: int = dataclasses.field(default_factory=itertools.count(1).__next__)

    def digest_now(self) -> str:
        """``digest``, computed from ``digest_source`` on first use."""
        return self.digest or self._computed_digest

    @functools.cached_property
    def _computed_digest(self) -> str:
        return self.digest_source() if self.digest_source is not None else ""


@dataclasses.dataclass(slots=True, eq=False)
class Held:
    """One delivery this worker holds (claimed, or parked without a claim): its ``arrival``
    (what it is, never changed) and the state of its claim, which its lifecycle changes.

    ``delivery`` is opaque to this module: how the consumer step runs or settles it, attached
    once its task's strategy receives it (None for holds made elsewhere).
    """

    arrival: Arrival
    #: The delivery count of this delivery, as its latest decision counted it.
    deliveries: int = 0
    token: int | None = None
    #: The lease the claim was made under, and its holder (for a parked delivery: the holder
    #: of the live claim it waits behind).
    lease_name: str | None = None
    holder: str | None = None
    parked: bool = False
    #: UNIX time the live claim we park behind was last seen alive (see ``Decision.alive_at``).
    alive_at: float | None = None
    #: Set when the lease was lost while the claim was held.
    fenced: bool = False
    #: The run handed its task id on (set from the pool child's mark when it ends).
    handoff: bool = False
    #: Its task acknowledges early (``acks_late=False``): Celery acks it as the run starts, so
    #: its end is recorded before the run could hand its id on; the tombstone then lets a
    #: successor run (a retry, a replacement: another message of the same or a later
    #: generation) as if it had, and a redelivery of the message itself stays a duplicate.
    acked_early: bool = False
    #: The publishes the task id already ran for (``Decision.sent_before``).
    sent_before: tuple[str, ...] = ()
    delivery: Delivery | None = None

    def as_claim(self) -> Claim:
        """This hold as the store's ``Claim`` (for ``drop_claim``)."""
        return Claim(
            key=keys.task_claim(self.arrival.task_id), lease_name=self.lease_name or "",
            holder=self.holder or "", token=self.token or 0, value={}, alive=False,
        )


class ClaimBook:
    """Thread-safe registry of the deliveries this worker holds (one entry per delivery).

    A hold is *live* (claimed and running, or parked) until its run ends, then *ending* until
    its end is recorded in the store (on its way, in the backlog, riding an ack): its claim is
    still this worker's run's, so nothing may mistake it for a claim whose reply was lost
    (``has_token``). Pool threads (threads pool callbacks), the event loop and the maintenance
    thread all touch it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tag: dict[int, Held] = {}
        self._ending: dict[int, Held] = {}

    def end(self, held: Held) -> Held | None:
        """``held``'s run ended: from live to ending. None if it was not live (released or
        ended already): nothing to record."""
        with self._lock:
            got = self._by_tag.pop(held.arrival.key, None)
            if got is not None and got.token is not None:
                self._ending[got.arrival.key] = got
            return got

    def recorded(self, held: Held) -> None:
        """``held``'s end is recorded in the store (or will never be by this worker)."""
        with self._lock:
            self._ending.pop(held.arrival.key, None)

    def has_token(self, token: int) -> bool:
        """Whether a hold, live or ending, carries claim token ``token``."""
        with self._lock:
            return any(h.token == token for h in self._by_tag.values()) or any(
                h.token == token for h in self._ending.values())

    def ending(self) -> int:
        """How many ends are not recorded yet."""
        with self._lock:
            return len(self._ending)

    def add(self, held: Held) -> None:
        with self._lock:
            self._by_tag[held.arrival.key] = held

    def pop(self, held: Held) -> Held | None:
        """Remove ``held``; None if it was not there (already completed or released)."""
        with self._lock:
            return self._by_tag.pop(held.arrival.key, None)

    def snapshot(self) -> list[Held]:
        with self._lock:
            return list(self._by_tag.values())

    def take_all(self) -> list[Held]:
        """Remove and return every hold (at shutdown)."""
        with self._lock:
            out = list(self._by_tag.values())
            self._by_tag.clear()
            return out

    def take_not_of(self, lease_name: str | None) -> list[Held]:
        """Remove and return the holds that do not belong to lease ``lease_name`` (on a loss).

        A claimed hold belongs to the lease its claim was made under (``Held.lease_name``); a
        parked hold (no claim) belongs to whichever lease is held, so it is taken only when
        ``lease_name`` is None. A delivery claimed under a lease taken after a loss is
        therefore never released by that loss, however late the loss is applied.
        """
        with self._lock:
            out = [h for h in self._by_tag.values()
                   if (lease_name is None if h.parked else h.lease_name != lease_name)]
            for held in out:
                del self._by_tag[held.arrival.key]
            return out

    def tags(self) -> list[Any]:
        """Delivery tags of every hold (claimed and parked), without repeats."""
        with self._lock:
            return list(dict.fromkeys(h.arrival.delivery_tag for h in self._by_tag.values()))

    def counts(self) -> tuple[int, int]:
        """``(claimed, parked)``."""
        with self._lock:
            parked = sum(1 for h in self._by_tag.values() if h.parked)
            return len(self._by_tag) - parked, parked

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_tag)


class Claimer:
    """Decisions and completion writes for one worker, against its current lease.

    Args:
        store: the lease store (main process only).
        lease: returns the worker's current lease, or None while it holds none.
        max_deliveries: ``crawl_max_deliveries``.
        done_ttl_s: ``crawl_done_ttl``: how long tombstones and delivery counts are kept.
        worker: hostname recorded in claims (for ``status`` and ``crawl_leases``).
        recheck_s: how often parked deliveries are looked at again (bounds ``died_at``).
    """

    def __init__(
        self,
        store: LeaseStore,
        lease: Callable[[], Lease | None],
        *,
        max_deliveries: int,
        done_ttl_s: float,
        worker: str = "",
        recheck_s: float = 1.0,
    ) -> None:
        self.store = store
        self._lease = lease
        self.max_deliveries = max_deliveries
        self.done_ttl_s = done_ttl_s
        self.worker = worker
        self.recheck_s = recheck_s

    def decide(
        self,
        task_id: str,
        *,
        delivery_tag: Any,
        queue: str | None,
        exchange: str | None = None,
        routing_key: str | None = None,
        retries: int = 0,
        generation: tuple[int, int] | None = None,
        digest: str = "",
        sent: str = "",
        known_deliveries: int = 0,
        parked: bool = False,
        holder: str | None = None,
        alive_at: float | None = None,
        presume_fresh: bool = True,
        under: Lease | None = None,
    ) -> Decision:
        """Decide one delivery (a fresh one, or a parked one being looked at again).

        Args:
            generation: ``(replaced_task_nesting, retries)`` of the message (default
                ``(0, retries)``); digest: ``message_digest`` of it (see ``is_successor``);
                sent: its publish id (see ``is_new_publish``).
            known_deliveries: a delivery count already known from a claimant seen while parked.
            parked: a parked delivery looked at again: the claim is read before claiming, so a
                claim still alive costs no claim attempt and a dead one is recognised as the
                task of a dead worker (``Decision.died_at``).
            holder: the holder of the live claim we parked behind (``Decision.holder``).
            alive_at: when that claim was last seen alive (``Decision.alive_at``).
            presume_fresh: a delivery not parked is first claimed guarded by "no tombstone and
                no delivery count" (one round trip); False reads them first.
            under: claim under this lease rather than the current one (a batch's lease).

        Raises:
            StoreError: the store failed; the caller requeues the message (fails closed).
        """
        gen = generation if generation is not None else (0, retries)
        for attempt in range(4):
            lease = under if under is not None else self._lease()
            if lease is None:
                return Decision(Outcome.NO_LEASE)
            try:
                return self._decide_once(
                    lease, task_id, delivery_tag=delivery_tag, queue=queue, exchange=exchange,
                    routing_key=routing_key, retries=retries, generation=gen, digest=digest,
                    sent=sent, known_deliveries=known_deliveries, parked=parked, holder=holder,
                    alive_at=alive_at,
                    presume_fresh=presume_fresh and attempt == 0 and not parked)
            except RecordChanged:
                # A first guess that there is no tombstone nor delivery count was wrong, or a
                # run of this id ended meanwhile: read them and judge.
                continue
        return Decision(Outcome.PARK, deliveries=known_deliveries, holder=holder,
                        alive_at=alive_at)

    def decide_fresh(self, helds: list[Held]) -> tuple[list[Decision], Lease | None]:
        """Decide deliveries received together, none of them parked, and the lease their
        claims are made under.

        Each is first claimed guarded by "no tombstone and no delivery count", all in one store
        round trip (``claim_unless_changed_many``: each claim stays atomic with its own check);
        those the guess was wrong for, or that found a live claim, are then decided one by one
        as ``decide`` does.

        Raises:
            StoreError: the batch call failed; the caller parks them all (fails closed).
        """
        lease = self._lease()
        if lease is None:
            return [Decision(Outcome.NO_LEASE) for _ in helds], None
        replies = self.store.claim_unless_changed_many(
            lease, [self.fresh_item(held, lease) for held in helds])
        out: list[Decision] = []
        for held, reply in zip(helds, replies, strict=True):
            decided = self.fresh_decision(held, reply)
            if decided is not None:
                out.append(decided)
            elif reply is None or isinstance(reply, RecordChanged):
                a = held.arrival
                out.append(self.decide(
                    a.task_id, delivery_tag=a.delivery_tag, queue=a.queue, exchange=a.exchange,
                    routing_key=a.routing_key, retries=a.retries, generation=a.generation,
                    digest=a.digest_now(), sent=a.sent,
                    known_deliveries=held.deliveries, presume_fresh=False, under=lease))
            else:
                # This one call failed (the others stand): fail closed, look again later.
                logger.warning("celery-crawl: cannot claim %s (%s); parked",
                               held.arrival.task_id, reply)
                out.append(Decision(Outcome.PARK, deliveries=held.deliveries))
        return out, lease

    def fresh_item(self, held: Held, lease: Lease
                   ) -> tuple[str, dict[str, Any], list[tuple[str, str]]]:
        """The first claim of a fresh delivery, as ``(claim key, value, guarded records)``:
        guarded by "no tombstone and no delivery count" (most deliveries are a task's first)."""
        task_id = held.arrival.task_id
        return (keys.task_claim(task_id), self._value(lease, held, held.deliveries + 1),
                [(keys.done(task_id), ""), (deliveries_key(task_id), "")])

    def fresh_decision(self, held: Held, reply: int | Exception | None) -> Decision | None:
        """What the reply to ``fresh_item``'s claim decides, or None when the delivery must be
        decided by reading first (a tombstone or count exists, a live claim holds the task, or
        the call failed)."""
        deliveries = held.deliveries + 1
        if isinstance(reply, int):
            return Decision(Outcome.POISON if deliveries >= self.max_deliveries
                            else Outcome.RUN, token=reply, deliveries=deliveries)
        if isinstance(reply, LeaseLost):
            return Decision(Outcome.NO_LEASE)
        return None

    def end_item(self, held: Held, state: str, requeue: bool
                 ) -> tuple[str, str, dict[str, Any]]:
        """The end of a claimed delivery as ``(claim key, record key, record)`` (see
        ``finish``)."""
        record, value = self._end_record(held, state, requeue)
        return keys.task_claim(held.arrival.task_id), record, value

    def _value(self, lease: Lease, held: Held, deliveries: int) -> dict[str, Any]:
        return {
            "lease": lease.name, "worker": self.worker,
            "delivery_tag": json_tag(held.arrival.delivery_tag), "queue": held.arrival.queue,
            "exchange": held.arrival.exchange, "routing_key": held.arrival.routing_key,
            "deliveries": deliveries, "retries": held.arrival.retries, "ttl_s": lease.ttl_s,
            "claimed_at": time.time(),
        }

    def _decide_once(self, lease: Lease, task_id: str, *, delivery_tag: Any, queue: str | None,
                     exchange: str | None, routing_key: str | None, retries: int,
                     generation: tuple[int, int], digest: str, sent: str,
                     known_deliveries: int, parked: bool, holder: str | None,
                     alive_at: float | None, presume_fresh: bool = False) -> Decision:
        key = keys.task_claim(task_id)
        done_key = keys.done(task_id)
        count_key = deliveries_key(task_id)
        done: dict[str, Any] | None
        seen: dict[str, Any] | None
        if presume_fresh:
            # Most deliveries are a task's first: claim at once, guarded by "no tombstone and
            # no delivery count" (one round trip); either present → RecordChanged, and the
            # caller reads them and decides as below.
            done, version, seen, seen_version = None, "", None, ""
        else:
            (done, version), (seen, seen_version) = self.store.get_many_versioned(
                [done_key, count_key])
        if done is not None and (is_older_publish(done, sent) or not (
                is_successor(done, generation, digest) or is_new_publish(done, sent))):
            return Decision(Outcome.DUPLICATE)
        before = publishes_of(done)
        prior = max(known_deliveries, lenient_int((seen or {}).get("n")))
        # Set by the reaper when it found the previous claimant's lease dead.
        died_at = lenient_float((seen or {}).get("died_at"))
        if parked:
            read_at = time.time()
            current = self.store.claimant(key)
            if current is not None:
                prior = max(prior, lenient_int(current.value.get("deliveries")))
                if current.alive:
                    return Decision(Outcome.PARK, holder=current.holder, deliveries=prior,
                                    alive_at=read_at)
                # We saw it alive and now dead: its lease expired in between.
                died_at = estimate_death(
                    dead_at=time.time(),
                    alive_at=alive_at if current.holder == holder else None,
                    ttl_s=lenient_float(current.value.get("ttl_s")) or lease.ttl_s,
                    claimed_at=lenient_float(current.value.get("claimed_at")),
                    window_s=self.recheck_s)
        deliveries = prior + 1
        value = {
            "lease": lease.name, "worker": self.worker, "delivery_tag": json_tag(delivery_tag),
            "queue": queue, "exchange": exchange, "routing_key": routing_key,
            "deliveries": deliveries, "retries": retries, "ttl_s": lease.ttl_s,
            "claimed_at": time.time(),
        }
        try:
            token = self.store.claim_unless_changed(
                lease, key, value, record=done_key, version=version,
                also=[(count_key, seen_version)] if presume_fresh else ())
        except LeaseLost:
            return Decision(Outcome.NO_LEASE)
        if token is None:
            read_at = time.time()
            current = self.store.claimant(key)
            if current is None:
                # Ended between our two calls: look again on the next re-check.
                return Decision(Outcome.PARK, deliveries=prior)
            counted = max(prior, lenient_int(current.value.get("deliveries")))
            if current.alive:
                return Decision(Outcome.PARK, holder=current.holder, deliveries=counted,
                                alive_at=read_at)
            # Its lease died between claim and claimant: count it and try again next time.
            return Decision(Outcome.PARK, holder=current.holder, deliveries=counted)
        if deliveries >= self.max_deliveries:
            return Decision(Outcome.POISON, token=token, deliveries=deliveries,
                            sent_before=before)
        return Decision(Outcome.RUN, token=token, deliveries=deliveries, died_at=died_at,
                        sent_before=before)

    def finish(self, held: Held, *, state: str, requeue: bool = False) -> None:
        """Record the end of a claimed delivery.

        ``requeue`` (the message goes back to the broker, e.g. its child died and
        ``task_reject_on_worker_lost`` requeues it): the delivery count is kept and the claim
        deleted. Otherwise the tombstone is written first, then the claim deleted.

        Raises:
            StoreError: the caller retries later (``Keeper`` keeps a backlog).
        """
        lease = self._lease()
        record = self._end_record(held, state, requeue)
        if held.token is not None and lease is not None and lease.name == held.lease_name:
            # Record and unclaim in one atomic store operation (record first).
            self.store.finish_claim(lease, keys.task_claim(held.arrival.task_id), *record,
                                    ttl_s=self.done_ttl_s, token=held.token)
            return
        self.store.put(*record, ttl_s=self.done_ttl_s)
        self.drop(held, lease)

    def finish_many(self, ends: list[tuple[Held, str, bool]]) -> list[Exception | None]:
        """``finish`` for many ``(held, state, requeue)``: those claimed under the current lease
        in one store round trip (``finish_claims``), the others one by one. Per item: None, or
        the error that ``finish`` would have raised (the caller retries it later)."""
        lease = self._lease()
        out: list[Exception | None] = [None] * len(ends)
        batch: list[int] = []
        for i, (held, state, requeue) in enumerate(ends):
            if held.token is not None and lease is not None and lease.name == held.lease_name:
                batch.append(i)
            else:
                try:
                    self.finish(held, state=state, requeue=requeue)
                except (StoreError, LeaseLost) as exc:
                    out[i] = exc
        if batch and lease is not None:
            items = []
            tokens: list[int | None] = []
            for i in batch:
                held, state, requeue = ends[i]
                record, value = self._end_record(held, state, requeue)
                items.append((keys.task_claim(held.arrival.task_id), record, value))
                tokens.append(held.token)
            try:
                replies = self.store.finish_claims(lease, items, ttl_s=self.done_ttl_s,
                                                   tokens=tokens)
            except StoreError as exc:
                replies = [exc] * len(items)
            for i, reply in zip(batch, replies, strict=True):
                if isinstance(reply, Exception):
                    out[i] = reply
        return out

    def _end_record(self, held: Held, state: str, requeue: bool) -> tuple[str, dict[str, Any]]:
        if requeue:
            return deliveries_key(held.arrival.task_id), {"n": held.deliveries}
        # Only a tombstone that hands the id on is ever compared by digest (``is_successor``).
        return (keys.done(held.arrival.task_id),
                {"state": state, "token": held.token, "retries": held.arrival.retries,
                 "gen": list(held.arrival.generation),
                 "digest": held.arrival.digest_now() if held.handoff else "",
                 "handoff": held.handoff, "sent": ran_for(held),
                 "worker": self.worker, "at": time.time()})

    def drop(self, held: Held, lease: Lease | None = None) -> None:
        """Delete the claim of ``held`` if it is still ours (no tombstone)."""
        if held.token is None:
            return
        lease = lease if lease is not None else self._lease()
        if lease is not None and lease.name == held.lease_name:
            try:
                self.store.unclaim(lease, keys.task_claim(held.arrival.task_id), token=held.token)
                return
            except LeaseLost:
                pass
        # The lease that made the claim is gone: the claim is orphaned; drop it by token.
        self.store.drop_claim(held.as_claim())


#: Headers a broker may add or change on redelivery (RabbitMQ quorum queues: x-delivery-count).
_VOLATILE = ("x-",)


def message_digest(headers: Mapping[str, Any], body: Any, *, without: str = "") -> str:
    """Digest of a task message as published: the same for every redelivery of it, different
    for any other message of the same task id (a retry, a replacement, a re-publish). Header
    ``without`` (the claim token, which the worker writes) is left out."""
    kept = {k: v for k, v in headers.items()
            if isinstance(k, str) and not k.startswith(_VOLATILE) and k != without}
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(kept, sort_keys=True, default=str).encode())
    h.update(b"\0")
    h.update(body if isinstance(body, bytes) else str(body).encode("utf-8", "surrogateescape"))
    return h.hexdigest()


#: How many publishes of one task id a tombstone remembers (the newest).
MAX_PUBLISHES = 16


def is_new_publish(done: Mapping[str, Any], sent: str) -> bool:
    """Whether a delivery is a new publish of a finished task id, which runs again.

    A frozen signature applied again is a new publish of the same id and runs again, as on
    stock Celery; a redelivery, a restored or duplicated copy carries the publish id of a run
    recorded in tombstone ``done`` and does not (``publishes.py``). An unmarked message, or a
    tombstone that records no publish ids, keeps the stricter rule: not again.
    """
    recorded = done.get("sent")
    return bool(sent) and isinstance(recorded, list) and sent not in recorded


def is_older_publish(done: Mapping[str, Any], sent: str) -> bool:
    """Whether a delivery belongs to a publish that ran before the one whose run wrote
    tombstone ``done`` (the last it records): a duplicate, whatever hand-on the later run made.

    Its generation cannot tell: a frozen signature applied again has the generation of the
    first publish, so after the new publish's run retried or was replaced, a late copy of the
    first would look like a successor of it.
    """
    return bool(sent) and sent in publishes_of(done)[:-1]


def publishes_of(done: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The publish ids tombstone ``done`` records (none for no tombstone)."""
    recorded = (done or {}).get("sent")
    if not isinstance(recorded, list):
        return ()
    return tuple(str(x) for x in recorded if isinstance(x, str))


def ran_for(held: Held) -> list[str]:
    """The publish ids the tombstone of ``held``'s end records: those before it, then its
    own, the newest ``MAX_PUBLISHES``."""
    sent = held.arrival.sent
    out = [s for s in held.sent_before if s != sent]
    if sent:
        out.append(sent)  # the last one is the publish of the run that wrote it
    return out[-MAX_PUBLISHES:]


def is_successor(done: Mapping[str, Any], generation: tuple[int, int], digest: str) -> bool:
    """Whether a delivery may run after the run that wrote tombstone ``done``.

    Only if that run handed its id on (``handoff``: the pool child saw it publish a message
    under its own id, or the first task of its replacement), the delivery is not the finished
    delivery itself (another digest) and its generation ``(replaced_task_nesting, retries)`` is
    not older than the finished one's (``Task.replace`` raises the nesting, ``retry`` the
    retries). A tombstone without ``handoff`` is final: no header reopens it.
    """
    if done.get("handoff") is not True:
        return False
    if digest and done.get("digest") == digest:
        return False
    raw = done.get("gen")
    finished = ((lenient_int(raw[0]), lenient_int(raw[1])) if isinstance(raw, list)
                and len(raw) == 2 else (0, lenient_int(done.get("retries"))))
    return generation >= finished


def record_requeues(store: LeaseStore, claims: list[Claim], ttl_s: float,
                    died_at: Mapping[str, float] | None = None) -> None:
    """Keep the delivery counts of orphaned claims before they are dropped (reaper).

    ``died_at`` maps a dead lease's name to the estimated instant its worker died; the worker
    that runs the task next reads it from the same record (``Decision.died_at``).
    """
    items: list[tuple[str, Mapping[str, Any]]] = []
    now = time.time()
    for claim in claims:
        task_id = claim.key.split("task:", 1)[-1]
        record: dict[str, Any] = {"n": lenient_int(claim.value.get("deliveries")),
                                  "recovered_at": now}
        died = (died_at or {}).get(claim.lease_name)
        if died is not None:
            record["died_at"] = died
        items.append((deliveries_key(task_id), record))
    if items:
        store.put_many(items, ttl_s=ttl_s)


def estimate_death(*, dead_at: float, alive_at: float | None, ttl_s: float,
                   claimed_at: float | None, window_s: float) -> float:
    """Estimated UNIX time a worker died, from when its lease was seen alive and then dead.

    The store expired the lease ``ttl_s`` after its last successful renewal, at some instant
    after ``alive_at`` (unknown: ``window_s`` before ``dead_at``, the interval at which the
    finder looks) and after the worker's latest claim ``claimed_at`` (it was alive then), and no
    later than ``dead_at``. The middle of that window minus ``ttl_s`` is the estimated last
    renewal, returned as the death instant (never before ``claimed_at``). The worker really died
    between that renewal and the next one, due ``ttl/3`` later, so a latency measured from the
    estimate is at most ``ttl/3`` too long, give or take half the window.
    """
    start = dead_at - window_s if alive_at is None else alive_at
    if claimed_at is not None:
        start = max(start, claimed_at)
    start = min(start, dead_at)
    died = (start + dead_at) / 2 - ttl_s
    if claimed_at is not None:
        died = max(died, min(claimed_at, dead_at))
    return died


def lenient_float(value: object) -> float | None:
    """A finite float from a record written by someone else; None for anything unusable."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def lenient_int(value: object) -> int:
    """An int from a header or record written by someone else; 0 for anything unusable."""
    if not isinstance(value, int | float | str):
        return 0
    try:
        return int(value)
    except ValueError:
        return 0


def json_tag(tag: Any) -> Any:
    """A delivery tag as JSON can hold it (kombu's Redis tags are str, AMQP's int)."""
    return tag if isinstance(tag, int | str) or tag is None else str(tag)

