"""Claims and ends that travel in the broker's own round trips.

With ``task_acks_late`` kombu's Redis transport already makes one MULTI/EXEC round trip per
message when it records the message as unacked, and one when it acks it. When the lease store
is the broker's own Redis server and database, a delivery's claim rides in the first and its
end (tombstone, then unclaim) in the second: each of those round trips becomes one script that
makes kombu's writes and then ours (``ride_claim``, ``ride_finish``), so the worker's main
process makes no store round trip of its own for a task that simply runs and succeeds, sends
one command where kombu sent four, and decides the claim before Celery builds the request, on
the same loop turn, with no hand-off to another thread. The end is atomic with the ack, so
nobody sees the message settled without the end recorded.

Only the common case rides: a first claim guarded by "no tombstone and no delivery count", and
the end of a run that acks. Everything else (a tombstone or a live claim found, a failed call, a
reject, a parked delivery) is decided or recorded the usual way, off the loop.

An ack made on the consumer's loop goes out on a line of its own (``lines.ReplyLine``) without
waiting for its reply: the script makes the ack and the end in one atomic step on the server
whatever the client does next, and the reply only says whether the end must go to the backlog
(an error, or no reply: the ack may or may not have been made; the done tombstone drops a
redelivery either way) or a parked copy be woken (a hand-off).

This module does not import Celery; ``ride_wiring.RideWiring`` installs the hooks through
``ridden_transport.hook`` (kombu's Redis transport, subclassed).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis as redis_lib

from .. import _celery_compat as compat
from .._celery_compat import SENT, Ride
from ..errors import CrawlError, StoreUnavailable
from ..leases.base import Lease
from ..leases.redis import RedisLeaseStore
from . import ridden_transport
from .claims import Claimer, Decision, Held
from .lines import ReplyLine, Watch, line_for
from .ride_gate import installed_versions, ride_refusal

__all__ = ["Claimed", "RiddenEnd", "Riding", "riding_for"]

logger = logging.getLogger("celery_crawl.worker")


@dataclasses.dataclass(frozen=True, slots=True)
class Claimed:
    """A delivery claimed in its append round trip, waiting for its strategy to run.

    ``decision`` is None when the reply did not decide it (it is then decided by reading)."""

    held: Held
    decision: Decision | None
    lease: Lease


@dataclasses.dataclass(slots=True)
class RiddenEnd:
    """The end of a run, waiting for its message's ack to carry it."""

    held: Held
    state: str
    requeue: bool
    lease: Lease
    since: float


#: Called once an end's round trip answered: (held, state, requeue, error or None).
Ended = Callable[[Held, str, bool, CrawlError | None], None]


class Riding:
    """The claims and ends of one broker channel that ride in its round trips.

    Args:
        store: the lease store, on the broker's server (``RedisLeaseStore.shares_server``).
        claimer: makes the claims' and ends' items and reads their replies.
        channel: the broker channel whose round trips carry them.
        ended: told how each end's round trip went.
    """

    def __init__(self, store: RedisLeaseStore, claimer: Claimer, channel: Any,
                 ended: Ended, *, ack_line: ReplyLine | None = None,
                 on_loop: Callable[[], bool] = lambda: False) -> None:
        self.store = store
        self.claimer = claimer
        self.channel = channel
        self._ended = ended
        #: Where acks made on the consumer's loop are sent without waiting.
        self.ack_line = ack_line
        self._on_loop = on_loop
        self._lock = threading.Lock()
        self._claimed: dict[Any, Claimed] = {}
        #: Appends whose round trip failed: their claim may or may not have been made.
        self._unknown: list[tuple[Held, Lease]] = []
        self._ends: dict[Any, RiddenEnd] = {}

    # -- claims ------------------------------------------------------------------------------
    def claim(self, held: Held, lease: Lease, unacked_keys: list[Any],
              unacked_args: list[Any]) -> Ride:
        """The claim of a fresh delivery, to ride in its append round trip (after the broker's
        unacked record, ``unacked_keys``/``unacked_args``)."""
        command, outcome = self.store.claim_command(
            lease, *self.claimer.fresh_item(held, lease), unacked=(unacked_keys, unacked_args))

        def after(reply: Any) -> None:
            with self._lock:
                if reply is None:
                    self._unknown.append((held, lease))
                    return
                decision = self.claimer.fresh_decision(held, outcome(reply))
                self._claimed[held.arrival.delivery_tag] = Claimed(held, decision, lease)

        return command, after

    def take(self, message: Any, tag: Any) -> Claimed | None:
        """The claim made in ``message``'s append, for its strategy (None if none rode)."""
        with self._lock:
            got = self._claimed.get(tag)
            if got is None or got.held.arrival.message is not message:
                return None
            del self._claimed[tag]
            return got

    def has_leftovers(self) -> bool:
        """Whether ``leftovers`` has anything (a cheap look, without the lock)."""
        return bool(self._claimed) or bool(self._unknown)

    def leftovers(self) -> tuple[list[Claimed], list[tuple[Held, Lease]]]:
        """Claims no strategy took (Celery refused the message before it: an unknown task, a
        body it could not decode) and appends whose round trip failed; forgotten here."""
        with self._lock:
            claimed, self._claimed = list(self._claimed.values()), {}
            unknown, self._unknown = self._unknown, []
        return claimed, unknown

    # -- ends --------------------------------------------------------------------------------
    def carries(self, message: Any) -> bool:
        """Whether ``message``'s ack goes through this channel's round trips."""
        return getattr(message, "channel", None) is self.channel

    def end(self, held: Held, state: str, requeue: bool, lease: Lease) -> bool:
        """Have the ack of ``held``'s message carry its end. False (nothing registered) when
        another end waits on the same delivery tag: record this one the usual way."""
        with self._lock:
            if held.arrival.delivery_tag in self._ends:
                return False
            self._ends[held.arrival.delivery_tag] = RiddenEnd(held, state, requeue, lease,
                                                      time.monotonic())
        return True

    def on_ack(self, tag: Any, unacked_keys: list[Any], unacked_args: list[Any]
               ) -> Ride | object | None:
        """The end waiting on ``tag``, to ride in its ack round trip after the broker's own
        writes (``unacked_keys``/``unacked_args``); None: a plain ack; ``SENT``: sent on the
        ack line (an ack on the consumer's loop), its reply read later."""
        with self._lock:
            waiting = self._ends.pop(tag, None)
        if waiting is None:
            return None
        claim_key, record, value = self.claimer.end_item(waiting.held, waiting.state,
                                                         waiting.requeue)
        command, outcome = self.store.finish_command(
            waiting.lease, claim_key, record, value, ttl_s=self.claimer.done_ttl_s,
            token=waiting.held.token, unacked=(unacked_keys, unacked_args))

        def after(reply: Any) -> None:
            error = (StoreUnavailable("the broker round trip carrying the end failed")
                     if reply is None else outcome(reply))
            self._ended(waiting.held, waiting.state, waiting.requeue, error)

        if self.ack_line is not None and self._on_loop():

            def after_sent(reply: Any) -> None:
                if (isinstance(reply, redis_lib.ResponseError)
                        and str(reply).startswith(compat.KOMBU_ERROR)):
                    # kombu's own writes failed in the script (nothing else ran): the message
                    # stays unacked on the server; its end goes to the backlog below.
                    logger.warning("celery-crawl: kombu's ack of %s failed on the server (%s); "
                                   "kombu's visibility timeout redelivers it and its done "
                                   "tombstone drops that copy", tag, reply)
                elif isinstance(reply, redis_lib.exceptions.NoScriptError):
                    # The server ran none of it: kombu's own ack writes, then the end later.
                    try:
                        compat.remove_unacked(self.channel, tag)
                    except Exception as exc:
                        logger.warning("celery-crawl: acking %s after a NOSCRIPT failed (%s); "
                                       "kombu's visibility timeout redelivers it and its done "
                                       "tombstone drops that copy", tag, exc)
                after(reply)

            if self.ack_line.send(command, after_sent):
                return SENT
        return command, after

    def overdue(self, older_than_s: float | None = None) -> list[RiddenEnd]:
        """Ends whose ack has not come for ``older_than_s`` (all of them when None): the ack
        failed or will not come (a lost connection); forgotten here, for the caller to record
        another way."""
        now = time.monotonic()
        with self._lock:
            out = [e for e in self._ends.values()
                   if older_than_s is None or now - e.since >= older_than_s]
            for each in out:
                del self._ends[each.held.arrival.delivery_tag]
        return out


def riding_for(store: Any, claimer: Claimer | None, channel: Any, ended: Ended, *,
               timeout_s: float, watch: Watch | None,
               on_loop: Callable[[], bool]) -> tuple[Riding | None, str | None]:
    """A ``Riding`` for broker ``channel`` when the lease store is the broker's own Redis server
    and database, and ``ride_gate.ride_refusal`` allows it (tested versions, a broker socket
    timeout bounded by ``timeout_s``: ``crawl_store_timeout``). ``(None, None)``: riding does
    not apply (another store or transport); ``(None, reason)``: it applies but is refused."""
    if not isinstance(store, RedisLeaseStore) or claimer is None or channel is None:
        return None, None
    where = compat.redis_channel_server(channel)
    if where is None or not store.shares_server(where):
        return None, None
    refusal = ride_refusal(*installed_versions(),
                           socket_timeout_s=channel.pool.connection_kwargs.get("socket_timeout"),
                           store_timeout_s=timeout_s)
    if refusal is not None:
        return None, refusal
    if not isinstance(channel, ridden_transport.Channel):
        return None, ("the broker's transport is not celery-crawl's Redis transport "
                      "(install_worker sets it as broker_transport unless the app chose its "
                      "own)")
    return Riding(store, claimer, channel, ended,
                  ack_line=line_for(channel.pool, timeout_s, name="ack line", watch=watch),
                  on_loop=on_loop), None
