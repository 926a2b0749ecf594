"""How a delivery's claim and a run's end travel to the store: one route per consumer start.

The lifecycle is the same whatever the route (``desk.py``); a route only moves commands. The
consumer step picks one when a consumer starts, from what the lease store and the broker
channel allow, and every delivery and end of that consumer goes through it (httpx picks a
transport per URL the same way):

* ``OffThread`` (the default, any store): the loop hands decisions and ends to the
  ``crawl-claims`` thread and gets the follow-ups back; off the loop (a threads-pool thread, a
  loop that is not running) the calls are made where they are;
* ``ClaimLine`` (a Redis store that is not the broker's database): fresh claims and the ends of
  runs that ack are written from the loop on a line without waiting; anything else as
  ``OffThread``;
* ``Ridden`` (the store is the broker's Redis database, ``ride_gate.py`` allowing): claims ride
  in kombu's append round trip (taken when the strategy runs), the ends of runs that ack in its
  ack; anything else as ``OffThread``.

Each method gets what it moves through callables of the consumer step; nothing here imports
Celery or keeps state of a delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .claims import Held

__all__ = ["ClaimLine", "OffThread", "Ridden", "Route"]

#: ``settle()``: ack or reject the message (after its end was recorded or sent with it).
Settle = Callable[[], Any]


class OffThread:
    """The default route.

    Args:
        on_loop: whether the caller is the running consumer loop (its store calls go off it).
        decide_later: queue a fresh delivery's decision for the ``crawl-claims`` thread.
        decide_now: decide here and apply (off the loop).
        end_later: queue an end for the ``crawl-claims`` thread; it settles on the loop.
        end_now: record an end here (off the loop).
    """

    name = "off-loop thread"

    def __init__(self, *, on_loop: Callable[[], bool], decide_later: Callable[[Held], None],
                 decide_now: Callable[[Held], None],
                 end_later: Callable[[Held, str, bool, Settle], None],
                 end_now: Callable[[Held, str, bool], None]) -> None:
        self._on_loop = on_loop
        self._decide_later = decide_later
        self._decide_now = decide_now
        self._end_later = end_later
        self._end_now = end_now

    def take(self, message: Any) -> Any:
        """A claim already made for ``message`` on its way in (riding only)."""
        return None

    def arrive(self, held: Held) -> None:
        """Get a fresh delivery decided (the decision is applied on the loop)."""
        if self._on_loop():
            self._decide_later(held)
        else:
            self._decide_now(held)

    def end(self, held: Held, state: str, requeue: bool, settle: Settle) -> Any:
        """Get a run's end recorded, then its message settled."""
        if self._on_loop():
            self._end_later(held, state, requeue, settle)
            return None
        self._end_now(held, state, requeue)
        return settle()


class ClaimLine(OffThread):
    """Fresh claims and acked ends written from the loop on a line, without waiting.

    Args:
        send_claim: send a fresh delivery's claim (False: not sent, decide it another way).
        send_end: send an end, settling when its reply comes (False: not sent).
    """

    name = "claim line"

    def __init__(self, *, send_claim: Callable[[Held], bool],
                 send_end: Callable[[Held, str, bool, Settle], bool], **kw: Any) -> None:
        super().__init__(**kw)
        self._send_claim = send_claim
        self._send_end = send_end

    def arrive(self, held: Held) -> None:
        if self._on_loop() and self._send_claim(held):
            return
        super().arrive(held)

    def end(self, held: Held, state: str, requeue: bool, settle: Settle) -> Any:
        if state == "done" and self._on_loop() and self._send_end(held, state, requeue, settle):
            return None
        return super().end(held, state, requeue, settle)


class Ridden(OffThread):
    """Claims in kombu's append round trips, acked ends in its acks.

    Args:
        take_claim: the claim made in ``message``'s append, or None.
        ride_end: have the ack carry the end (False: it cannot; record it another way).
    """

    name = "riding"

    def __init__(self, *, take_claim: Callable[[Any], Any],
                 ride_end: Callable[[Held, str, bool], bool], **kw: Any) -> None:
        super().__init__(**kw)
        self._take_claim = take_claim
        self._ride_end = ride_end

    def take(self, message: Any) -> Any:
        return self._take_claim(message)

    def end(self, held: Held, state: str, requeue: bool, settle: Settle) -> Any:
        if state == "done" and self._ride_end(held, state, requeue):
            return settle()
        return super().end(held, state, requeue, settle)


#: Any of the routes above.
Route = OffThread
