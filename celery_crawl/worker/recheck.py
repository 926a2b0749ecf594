"""Parked deliveries are looked at again: on the consumer's timer, and at once on a hand-off.

A parked delivery waits behind a live claim; its claimant may die, end, or (a retry or a
replacement) hand the id on to it. The consumer's timer re-reads every parked delivery (one
read at a time out on the ``crawl-claims`` thread: a slow store does not pile them up), and a
recorded end that handed its id on wakes the parked copies of that task at once (a
``Task.replace`` or retry would otherwise wait up to a re-check period). A decision is applied
on the loop only if the delivery is still parked here; a claim made meanwhile for a delivery
that is gone is given back. Celery-free.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ..leases.base import Lease
from .claims import ClaimBook, Decision, Held, Outcome

__all__ = ["Recheck"]

Decided = tuple[Decision, Lease | None]


class Recheck:
    """Looks at the parked deliveries again.

    Args:
        book: the holds.
        offloading: whether the caller is the running consumer loop (reads go off it).
        submit: run a job on the ``crawl-claims`` thread (its return runs on the loop).
        in_loop: run a call on the consumer's loop.
        decide: decide and apply here (off the loop).
        decision_for: the store part of a decision (off the loop).
        apply: apply a decision made off the loop (``first=False``).
        give_back: drop the claims of holds that will not run here (off the loop).
    """

    def __init__(self, *, book: ClaimBook, offloading: Callable[[], bool],
                 submit: Callable[[Callable[[], Any]], None],
                 in_loop: Callable[..., None], decide: Callable[[Held], None],
                 decision_for: Callable[[Held], Decided],
                 apply: Callable[[Held, Decision, Lease | None], None],
                 give_back: Callable[[list[Held]], None]) -> None:
        self._book = book
        self._offloading = offloading
        self._submit = submit
        self._in_loop = in_loop
        self._decide = decide
        self._decision_for = decision_for
        self._apply = apply
        self._give_back = give_back
        #: A periodic re-check is out on the ``crawl-claims`` thread.
        self.rechecking = False

    def tick(self) -> None:
        """Consumer timer: look again at every parked delivery."""
        parked = [h for h in self._book.snapshot() if h.parked and not h.fenced]
        if not parked:
            return
        if not self._offloading():
            for held in parked:
                self._decide(held)
            return
        if self.rechecking:  # the last one is still out (a slow store): no pile-up
            return
        self.rechecking = True
        self._submit(functools.partial(self._off_loop, parked, periodic=True))

    def wake(self, task_id: str) -> None:
        """Decide at once the parked deliveries of a task whose run just handed its id on."""
        for other in self._book.snapshot():
            if other.parked and other.arrival.task_id == task_id:
                self._in_loop(self._decide_if_parked, other)

    def _decide_if_parked(self, held: Held) -> None:
        if held.parked and not held.fenced and self._holds(held):
            if self._offloading():
                self._submit(functools.partial(self._off_loop, [held]))
            else:
                self._decide(held)

    def _holds(self, held: Held) -> bool:
        return any(h is held for h in self._book.snapshot())

    def _off_loop(self, parked: list[Held], *, periodic: bool = False) -> Callable[[], None]:
        """Offload thread: the store part of each parked delivery's decision."""
        try:
            decided = [(held, *self._decision_for(held)) for held in parked]
        except BaseException:
            if periodic:
                self.rechecking = False
            raise

        def apply() -> None:
            if periodic:
                self.rechecking = False
            for held, decision, claimed_under in decided:
                self._apply_one(held, decision, claimed_under)

        return apply

    def _apply_one(self, held: Held, decision: Decision, claimed_under: Lease | None) -> None:
        """Loop: apply a parked delivery's decision made off the loop, if it is still parked
        here; a claim made meanwhile for a delivery that is gone (released on a lease loss, or
        dropped on a reconnection) is given back."""
        if held.parked and not held.fenced and self._holds(held):
            self._apply(held, decision, claimed_under)
        elif decision.outcome in (Outcome.RUN, Outcome.POISON) and not self._holds(held):
            # A copy: the hold itself is settled (released or dropped) and may be read still.
            gone = dataclasses.replace(
                held, token=decision.token, parked=False,
                lease_name=claimed_under.name if claimed_under else None,
                holder=claimed_under.holder if claimed_under else None)
            self._submit(functools.partial(self._give_back, [gone]))
