"""The consumer's side of the claim line: claims and ends sent from the loop without waiting.

``store_line.StoreLine`` writes to a Redis lease store that is not the broker's database and
reads the replies when they come; this opens one per consumer start where it can
(``store_line.store_line_for``), sends a fresh delivery's claim and a run's end on it, and hands
what its reply did not decide to the ``crawl-claims`` thread. Celery-free: the consumer's claims
pass the lease, the desk and the decisions' follow-ups.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .. import _finishing as finishing
from ..errors import CrawlError, StoreUnavailable
from ..leases.base import Lease
from . import celery_requests as requests
from .claims import Claimer, Decision, Held
from .desk import Desk
from .lines import Watch
from .store_line import StoreLine, store_line_for

__all__ = ["LineWiring"]

logger = logging.getLogger("celery_crawl.worker")

#: ``ended(held, state, requeue, error)``: an end's reply (None: recorded).
Ended = Callable[[Held, str, bool, CrawlError | None], None]


class LineWiring:
    """The current consumer's claim line, if it has one.

    Args:
        lease: the worker's current lease.
        desk: the lifecycle (``Desk``), once the lease was first held.
        submit: run a job on the ``crawl-claims`` thread (its return runs on the loop).
        decide_off_loop: read a delivery's decision off the loop, after dropping a claim the
            line may have made under the given lease.
        apply: apply a decision on the loop (made under the given lease).
        ended: an end's reply (the same outcomes as a ridden end).
    """

    def __init__(self, *, lease: Callable[[], Lease | None], desk: Callable[[], Desk],
                 submit: Callable[[Callable[[], Any]], None],
                 decide_off_loop: Callable[[Held, Lease | None], Callable[[], None]],
                 apply: Callable[[Held, Decision, Lease | None], None],
                 ended: Ended) -> None:
        self._lease = lease
        self._desk = desk
        self._submit = submit
        self._decide_off_loop = decide_off_loop
        self._apply = apply
        self._ended = ended
        #: The open line (None: claims and ends take another route).
        self.line: StoreLine | None = None

    def open(self, store: Any, claimer: Claimer | None, timeout_s: float,
             watch: Watch | None, later: Callable[[Callable[[], None]], Any] | None) -> None:
        """Open a line to ``store`` if it can have one."""
        self.line = store_line_for(store, claimer, timeout_s, watch, later)
        if self.line is not None:
            logger.info("celery-crawl: claims and ends go out from the consumer's loop on a "
                        "claim line to %s, without waiting", self.line.store.url)

    def close(self) -> None:
        """Wait for the replies of what the loop sent on the line, and close it."""
        line, self.line = self.line, None
        if line is not None:
            line.line.drain()

    def send_claim(self, held: Held) -> bool:
        """Loop: send a fresh delivery's claim on the line (False: not sent)."""
        line = self.line
        lease = self._lease()
        if line is None or lease is None:
            return False

        def undecided() -> None:
            self._submit(functools.partial(self._decide_off_loop, held, None))

        def unknown() -> None:
            self._submit(functools.partial(self._decide_off_loop, held, lease))

        return line.claim(held, lease, lambda d: self._apply(held, d, lease),
                          undecided, unknown)

    def send_end(self, held: Held, state: str, requeue: bool,
                 settle: requests.Settle) -> bool:
        """Loop: send a run's end on the line and settle its message once the reply came (the
        tombstone is written before the ack); False: not sent (nothing done)."""
        line = self.line
        lease = self._lease()
        if (line is None or lease is None or held.token is None
                or lease.name != held.lease_name):
            return False
        held.handoff = finishing.take(held.arrival.task_id) or held.acked_early
        if not self._desk().ending(held):  # released meanwhile: nothing to record
            requests.settle_unless_fenced(held, settle)
            return True

        def ended(error: CrawlError | None) -> None:
            self._ended(held, state, requeue, error)
            requests.settle_unless_fenced(held, settle)

        if not line.end(held, state, requeue, lease, ended):
            ended(StoreUnavailable("the claim line is down"))
        return True
