"""The consumer's side of riding: a channel's claims and ends in its own round trips.

``riding.Riding`` makes the scripts and reads their replies; this wires one consumer channel
to it: it decides at each consumer start whether the channel rides (``riding.riding_for``),
hooks the channel (``ridden_transport.hook``), hands a strategy the claim made on its
message's way in, has an ack carry its run's end, and sweeps what waited too long on the
channel's round trips (claims no strategy took are given back, ends whose ack never came are
recorded another way). Celery-free: the consumer's claims pass the lease, the desk and the
off-loop jobs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from .. import _celery_compat as compat
from .. import _finishing as finishing
from ..leases.base import Lease
from . import celery_requests as requests
from . import ridden_transport
from .claims import Claimer, Held
from .desk import Desk
from .lines import Watch
from .riding import Ended, Riding, riding_for

__all__ = ["RideWiring"]

logger = logging.getLogger("celery_crawl.worker")


class RideWiring:
    """Whether and how the current consumer channel's claims and ends ride.

    Args:
        lease: the worker's current lease.
        desk: the lifecycle (``Desk``), once the lease was first held.
        accepts: whether a delivery of this task name is claimed now (the consumer runs it).
        loop_running: whether the consumer's loop runs.
        submit: run a job on the ``crawl-claims`` thread.
        give_back: drop the claims of holds that will not run here (off the loop).
        drop_if_unheld: ``Desk.drop_if_unheld`` (off the loop).
        overdue_s: how long an end waits for its message's ack.
    """

    def __init__(self, *, lease: Callable[[], Lease | None], desk: Callable[[], Desk],
                 accepts: Callable[[str], bool], loop_running: Callable[[], bool],
                 submit: Callable[[Callable[[], Any]], None],
                 give_back: Callable[[list[Held]], None],
                 drop_if_unheld: Callable[[Held, Lease], Any],
                 overdue_s: Callable[[], float]) -> None:
        self._lease = lease
        self._desk = desk
        self._accepts = accepts
        self._loop_running = loop_running
        self._submit = submit
        self._give_back = give_back
        self._drop_if_unheld = drop_if_unheld
        self._overdue_s = overdue_s
        #: The current channel's riding (None: it does not ride).
        self.riding: Riding | None = None
        self._told_sentinel = False
        self._refusal_logged = False

    def ride(self, channel: Any, store: Any, claimer: Claimer | None, ended: Ended, *,
             timeout_s: float, watch: Watch | None, on_loop: Callable[[], bool]) -> None:
        """Have the claims and ends of ``channel``'s deliveries ride in its own round trips,
        when the lease store is the broker's Redis server and database."""
        if getattr(store, "sentinel", False) and not self._told_sentinel:
            # Sentinel may move the master between the broker's round trips and the store's:
            # claims and ends keep their own round trips (batched), on the master.
            self._told_sentinel = True
            logger.info("celery-crawl: the lease store is behind Sentinel: claims and ends do "
                        "not ride in the broker's round trips (the master may move)")
        riding, refusal = riding_for(store, claimer, channel, ended, timeout_s=timeout_s,
                                     watch=watch, on_loop=on_loop)
        if refusal is not None and not self._refusal_logged:
            self._refusal_logged = True
            logger.warning("celery-crawl: claims and ends do not ride in the broker's round "
                           "trips: %s", refusal)
        if riding is None:
            return
        self.riding = riding
        ridden_transport.hook(channel, self._on_append, self._on_ack)
        logger.info("celery-crawl: the lease store is the broker's Redis database: claims and "
                    "ends ride in the broker's own round trips")

    def unride(self) -> None:
        """The channel is gone (a reconnection, a stop): what waited on its round trips is
        given back (claims no strategy took) or recorded another way (ends)."""
        riding, self.riding = self.riding, None
        if riding is not None:
            ridden_transport.unhook(riding.channel)
            self.sweep(riding, overdue_s=None)

    def sweep(self, riding: Riding, *, overdue_s: float | None) -> None:
        """Read the acks' replies; give back claims no strategy took; record ends whose ack
        is overdue (``overdue_s`` None: every one) another way."""
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
                self._submit(functools.partial(self._give_back, [gone]))
        for held, lease in unknown:
            self._submit(functools.partial(self._drop_if_unheld, held, lease))
        for end in riding.overdue(overdue_s):
            logger.info("celery-crawl: %s[%s]: its ack did not carry its end; recording it "
                        "separately", end.held.arrival.task_name, end.held.arrival.task_id)
            self._desk().failed(end.held, end.state, end.requeue)

    def take(self, message: Any) -> Any:
        """The claim made on ``message``'s way in, if any."""
        riding = self.riding
        return riding.take(message, message.delivery_tag) if riding is not None else None

    def end(self, held: Held, state: str, requeue: bool) -> bool:
        """Have the ack of ``held``'s message carry its end (True), if it rides."""
        riding = self.riding
        lease = self._lease()
        if (riding is None or lease is None or not self._loop_running()
                or not riding.carries(held.arrival.message)
                or compat.channel_gone(held.arrival.message)):
            return False
        held.handoff = finishing.take(held.arrival.task_id) or held.acked_early
        desk = self._desk()
        if not desk.ending(held):
            return True  # released meanwhile: nothing to record
        if not riding.end(held, state, requeue, lease):
            desk.failed(held, state, requeue)
        return True

    def _on_append(self, message: Any, unacked_keys: list[Any], unacked_args: list[Any]
                   ) -> Any:
        """kombu records ``message`` as unacked: its claim rides along (a task message of a
        registered task, under a held lease)."""
        riding = self.riding
        if riding is None or not riding.carries(message):
            return None
        # A claim left from an earlier message never reached a strategy (ends wait for the
        # consumer's timer: their acks come on later turns).
        if riding.has_leftovers():
            self.sweep(riding, overdue_s=self._overdue_s())
        lease = self._lease()
        headers = message.headers
        if (lease is None or not isinstance(headers, dict) or "id" not in headers
                or not self._accepts(str(headers.get("task")))):
            return None
        held = requests.held_or_none(message, str(headers["task"]))
        if held is None:
            return None  # a plain append: the strategy refuses the message
        return riding.claim(held, lease, unacked_keys, unacked_args)

    def _on_ack(self, tag: Any, unacked_keys: list[Any], unacked_args: list[Any]) -> Any:
        riding = self.riding
        return riding.on_ack(tag, unacked_keys, unacked_args) if riding is not None else None
