"""Claims and ends sent from the consumer's loop to a Redis lease store, without waiting.

When the lease store is not the broker's own Redis database (a RabbitMQ broker, a lease store
on a server of its own), nothing can ride in the broker's round trips (``riding.py``), and each
delivery needs its claim before it runs and each run its end before its ack. Made on another
thread (``offload.py``), every claim and end cost the main process a hand-off to that thread,
its wake-up, its wait for the interpreter lock held by the loop, and a wake-up of the loop to
apply the result. Here the loop sends the same one-script call itself on a connection of its
own (``lines.ReplyLine``) and goes on; the reply is read when the socket has it, on the loop,
and the decision applied or the ack made right there.

Only the common case goes this way: a fresh delivery's first claim, guarded by "no tombstone
and no delivery count", and the end of a run that acks under the lease it was claimed under.
A reply that does not decide (a tombstone or count exists, a live claim holds the task, an
error) is decided by reading, off the loop; no reply at all (the line failed) means the claim
may have been made, so it is dropped if it was before the delivery is decided again.

Celery-free: ``ClaimStep`` passes what to do with each outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CrawlError, StoreUnavailable
from ..leases.base import Lease
from ..leases.redis import RedisLeaseStore
from .claims import Claimer, Decision, Held
from .lines import ReplyLine, Watch, line_for

__all__ = ["StoreLine", "store_line_for"]


class StoreLine:
    """The claims and ends the consumer's loop sends to the lease store without waiting.

    Args:
        store: the Redis lease store.
        claimer: makes the claims' and ends' items and reads their replies.
        line: the connection they go out on.
    """

    def __init__(self, store: RedisLeaseStore, claimer: Claimer, line: ReplyLine) -> None:
        self.store = store
        self.claimer = claimer
        self.line = line

    def claim(self, held: Held, lease: Lease,
              decided: Callable[[Decision], None],
              undecided: Callable[[], None],
              unknown: Callable[[], None]) -> bool:
        """Send the first claim of fresh delivery ``held`` under ``lease``. Its reply calls
        ``decided`` (the decision to apply), ``undecided`` (decide it by reading) or
        ``unknown`` (no reply: the claim may or may not have been made). False when it could
        not be sent (nothing will be called): decide it another way."""
        command, outcome = self.store.claim_command(lease, *self.claimer.fresh_item(held, lease))

        def after(reply: Any) -> None:
            if reply is None:
                unknown()
                return
            decision = self.claimer.fresh_decision(held, outcome(reply))
            if decision is None:
                undecided()
            else:
                decided(decision)

        return self.line.send(command, after)

    def end(self, held: Held, state: str, requeue: bool, lease: Lease,
            ended: Callable[[CrawlError | None], None]) -> bool:
        """Send the end of ``held``'s run (tombstone, then unclaim, in one script); its reply
        calls ``ended`` with None (recorded) or the error (the line failed: it may or may not
        have been recorded). False when it could not be sent."""
        claim_key, record, value = self.claimer.end_item(held, state, requeue)
        command, outcome = self.store.finish_command(lease, claim_key, record, value,
                                                     ttl_s=self.claimer.done_ttl_s,
                                                     token=held.token)

        def after(reply: Any) -> None:
            ended(StoreUnavailable(f"{self.store.url}: the claim line failed before the end's "
                                   f"reply came") if reply is None else outcome(reply))

        return self.line.send(command, after)


def store_line_for(store: Any, claimer: Claimer | None, timeout_s: float,
                   watch: Watch | None,
                   later: Callable[[Callable[[], None]], Any] | None = None
                   ) -> StoreLine | None:
    """A ``StoreLine`` to ``store`` when it can have one: a Redis lease store that is neither a
    cluster nor waits for replicas (``RedisLeaseStore.line_pool``), and a loop whose reader
    registration wakes on the replies (``watch``: without it they would wait for the next send
    or the consumer's timer). ``later``: the loop's ``call_soon``, so the commands of one turn
    are written together."""
    if not isinstance(store, RedisLeaseStore) or claimer is None or watch is None:
        return None
    pool = store.line_pool()
    if pool is None:
        return None
    return StoreLine(store, claimer, line_for(pool, timeout_s, name="claim line", watch=watch,
                                              later=later))
