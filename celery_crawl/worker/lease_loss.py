"""What a lease change does to the consumer: stop or resume consuming, cancel and release.

Lease changes reach the loop as "look again", never as events to replay: the hub runs its ready
callbacks in no particular order, so a loss and the re-acquisition after it may run in either
order. ``LeaseLoss.reconcile`` reads the keeper's current generation and, once per generation,
brings the worker to that state: consuming iff a lease is held, and every delivery claimed
under a lease other than the current one cancelled and released. It makes no store call (the
loop must not wait on the store for a lease change). Celery-free: the consumer's claims pass
how a request is cancelled and a message released.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .. import _finishing as finishing
from ..leases.base import Lease
from .claims import ClaimBook, Held
from .keeper import Keeper

__all__ = ["LeaseLoss"]

logger = logging.getLogger("celery_crawl.worker")


class LeaseLoss:
    """The consumer's side of the worker lease's generations.

    Args:
        keeper: the worker's keeper (None before the lease step made it).
        book: the holds (live and ending).
        consumer: Celery's consumer (None before the first start).
        cancel: cancel a hold's request in the pool (1 if it will not run).
        release: hand a hold's message back without acking it (``requeue``: ourselves).
        mode: ``crawl_on_lease_loss`` (``cancel`` or ``continue``).
    """

    def __init__(self, *, keeper: Callable[[], Keeper | None], book: ClaimBook,
                 consumer: Callable[[], Any], cancel: Callable[[Held], int],
                 release: Callable[[Held, str, bool], None], mode: Callable[[], str]) -> None:
        self._keeper = keeper
        self._book = book
        self._consumer = consumer
        self._cancel = cancel
        self._release = release
        self._mode = mode
        #: Whether the task consumer consumes (Celery's Tasks step starts it consuming).
        self.consuming = True
        #: Running or reserved deliveries cancelled on a lease loss.
        self.fenced_count = 0
        #: The keeper generation last brought about on the loop.
        self.applied_generation = 0
        self._lock = threading.RLock()

    def reconcile(self) -> None:
        """Bring the worker to the keeper's current lease generation (once per generation).

        Idempotent and order-free: any number of notifications, run in any order, end in the
        state of the latest generation. A loss and a re-acquisition applied together release the
        deliveries of the lost lease and keep consuming; those claimed under the new lease stay.
        """
        keeper = self._keeper()
        if keeper is None:
            return
        with self._lock:
            state = keeper.state()
            if state.generation == self.applied_generation:
                return
            self.applied_generation = state.generation
            lease = state.lease
            reason = keeper.last_loss or "the worker lease was lost"
            if self._mode() == "continue":
                if lease is None:
                    logger.error(
                        "celery-crawl: crawl_on_lease_loss=continue: %d claimed task(s) keep "
                        "running unprotected (their claims are orphaned and may be recovered "
                        "elsewhere)", len(self._book))
                return
            c = self._consumer()
            if lease is None and c is not None and self.consuming:
                self.stop_consuming(c, reason)
            self._fence_lost(lease, reason, requeue=keeper.failing)
            if lease is not None:
                self._resume_consuming(lease)

    def _fence_lost(self, lease: Lease | None, reason: str, *, requeue: bool) -> None:
        """Cancel and release every delivery not held under ``lease`` (None: every one).

        ``requeue``: a store we cannot reach may have lost our claims (and the delivery tags
        they record) or be unreachable for the reaper too: requeue ourselves. A store that
        answered "lost" (or a freeze) means the reaper can see our orphaned claims and restores
        each tag once."""
        stale = self._book.take_not_of(lease.name if lease is not None else None)
        if not stale:
            return
        # A task whose body has returned and that is only writing its result is kept: killing
        # it would not undo its work, only run it again. Its end is recorded (or, if its
        # claim was reaped meanwhile, forgotten here) when its result write returns.
        ending: list[Held] = []
        fenced: list[Held] = []
        for held in stale:
            kept = not held.parked and finishing.finished(held.arrival.task_id)
            (ending if kept else fenced).append(held)
        for held in ending:
            self._book.add(held)
        cancelled = 0
        for held in fenced:
            finishing.clear(held.arrival.task_id)
            held.fenced = True
            if not held.parked:
                self.fenced_count += 1
                cancelled += self._cancel(held)
            self._release(held, reason, requeue)
        logger.error(
            "celery-crawl: lease lost (%s): %s, cancelled %d running/reserved task(s) without "
            "acking, released %d delivery(ies), kept %d whose body had returned (their results "
            "are being written); %s", reason,
            "stopped consuming" if lease is None else "kept consuming",
            cancelled, len(fenced), len(ending),
            "resuming once a new lease is held" if lease is None
            else f"deliveries under the new lease {lease.name} are kept")

    def _resume_consuming(self, lease: Lease) -> None:
        c = self._consumer()
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

    def stop_consuming(self, c: Any, reason: str) -> None:
        """Cancel the task consumer: nothing is received until a lease is held again."""
        task_consumer = getattr(c, "task_consumer", None)
        if task_consumer is not None:
            try:
                task_consumer.cancel()
            except Exception:
                logger.warning("celery-crawl: cancelling the task consumer failed",
                               exc_info=True)
        self.consuming = False
        logger.error("celery-crawl: not consuming tasks: %s", reason)
