"""The worker lease, renewed on a dedicated thread whatever the task load.

Renewal is one store round trip every ``ttl/3`` (sooner while failing). The lease is judged on
``CLOCK_BOOTTIME`` against the validity the store computed from *before* the request: once that
instant passes without a successful renewal — the store unreachable, or this process frozen
(SIGSTOP, a VM pause) for longer than the TTL — the lease counts as lost even if a late renewal
would still succeed, because another worker may already have recovered our tasks. A lost lease is
never renewed again: the next one is acquired under a *new* holder id, so claims made under the
old one stay orphaned for the reaper and can never be mistaken for live ones.

The loss is acted on at the local deadline itself, never later: a watchdog thread sleeps until
``valid_until`` and declares the loss there even while a renewal is still blocked on an
unreachable store, and every renewal is bounded by the validity left (an answer after the
deadline is useless). docs/design.md ("Worker lease loss") states the inequality this buys with
the reaper's grace.

Every change of the lease (taken, lost) bumps a *generation*; ``state()`` returns the generation
with the lease under one lock. The consumer side applies states, not events: whatever order its
event loop runs the notifications in, it compares the generation it last applied with the current
one and reconciles to the current state in one step (``claim_step.ClaimStep._reconcile``).

Periodic hooks (the reaper, keeping our unacked broker entries fresh, retrying completion writes
that failed) run on a second thread, so a slow broker or a long reaper pass never delays renewal.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import keys, metrics
from ..errors import LeaseLost, StoreError
from ..leases import make_holder
from ..leases.base import Lease, LeaseStore

__all__ = ["Keeper", "LeaseState", "boottime", "new_holder"]

logger = logging.getLogger(__name__)

ROLE = "worker"


def boottime() -> float:
    """Seconds on ``CLOCK_BOOTTIME`` (monotonic, counts suspend): the clock leases are judged on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def new_holder() -> str:
    """A holder id unique to this process start (``hostname:pid:random``)."""
    return make_holder()


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseState:
    """One generation of the worker lease: the lease held in it, or None after a loss."""

    generation: int
    lease: Lease | None


#: Longest sleep of the watchdog between looks at the clock (its waits run on CLOCK_MONOTONIC,
#: which stops during a suspend; the deadline is judged on CLOCK_BOOTTIME after each wait).
_WATCH_SLICE_S = 0.25


class Keeper:
    """Holds and renews one worker lease on its own thread.

    Args:
        store: the lease store.
        ttl_s: ``crawl_worker_lease_ttl``.
        on_lost: called (on the keeper or watchdog thread) with a reason when the lease is lost.
        on_acquired: called (on the keeper thread) with the lease after a *re*-acquisition.
        on_change: called (on the keeper or watchdog thread) after every new generation, after
            ``on_lost``/``on_acquired``; the receiver reads ``state()``.
        hooks: called every ``min(1 s, ttl/3)`` on their own thread (exceptions are logged).
        clock: ``CLOCK_BOOTTIME`` seconds; injectable for tests.
    """

    def __init__(
        self,
        store: LeaseStore,
        *,
        ttl_s: float,
        on_lost: Callable[[str], None] = lambda reason: None,
        on_acquired: Callable[[Lease], None] = lambda lease: None,
        on_change: Callable[[], None] = lambda: None,
        hooks: list[Callable[[], None]] | None = None,
        clock: Callable[[], float] = boottime,
        holder_factory: Callable[[], str] = new_holder,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.on_acquired = on_acquired
        self.on_change = on_change
        self.hooks = list(hooks or [])
        self.clock = clock
        self._holder_factory = holder_factory
        self._lease: Lease | None = None
        self._generation = 0
        self._lock = threading.Lock()
        #: Notified whenever ``_lease`` changes (wakes the watchdog for the new deadline).
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hooks_thread: threading.Thread | None = None
        self._watch_thread: threading.Thread | None = None
        self._next_renew = 0.0
        self.renew_ok = 0
        self.renew_failed = 0
        self.losses = 0
        self.last_error: str | None = None
        self.last_loss: str | None = None
        self.renew_seconds = 0.0
        #: True while the last store call of this keeper failed (the store looks unreachable).
        self.failing = False
        self.holder = holder_factory()

    # -- state -----------------------------------------------------------------------------
    @property
    def lease(self) -> Lease | None:
        """The current lease while it is valid on our clock, else None."""
        with self._lock:
            lease = self._lease
        if lease is not None and self.clock() >= lease.valid_until:
            return None
        return lease

    def state(self) -> LeaseState:
        """The current generation and its lease, read together."""
        with self._lock:
            return LeaseState(self._generation, self._lease)

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    def time_left(self) -> float | None:
        with self._lock:
            lease = self._lease
        return None if lease is None else round(lease.remaining(self.clock()), 3)

    # -- lifecycle -------------------------------------------------------------------------
    def acquire_blocking(self, timeout_s: float) -> Lease:
        """Take the first lease, retrying until ``timeout_s``.

        Raises:
            StoreError: the last store error when no lease could be taken in time.
        """
        deadline = self.clock() + timeout_s
        while True:
            try:
                lease = self._acquire()
                if lease is not None:
                    return lease
                last: Exception = StoreError("the store refused a fresh worker lease")
            except StoreError as exc:
                last = exc
            if self.clock() >= deadline:
                raise last
            time.sleep(min(0.5, self.interval_s))

    def start(self) -> None:
        """Start the renewal thread (after ``acquire_blocking``)."""
        self._thread = threading.Thread(target=self._run, name="crawl-lease", daemon=True)
        self._thread.start()
        self._hooks_thread = threading.Thread(target=self._run_hooks, name="crawl-lease-hooks",
                                              daemon=True)
        self._hooks_thread.start()
        self._watch_thread = threading.Thread(target=self._watch, name="crawl-lease-watchdog",
                                              daemon=True)
        self._watch_thread.start()

    def stop(self, *, release: bool = True) -> None:
        """Stop renewing and (by default) release the lease so our claims are reaped at once."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        for thread in (self._thread, self._hooks_thread, self._watch_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self.ttl_s + 5)
        with self._lock:
            lease, self._lease = self._lease, None
        if release and lease is not None:
            try:
                self.store.release(lease)
            except StoreError as exc:
                logger.warning("celery-crawl: releasing the worker lease failed: %s", exc)

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick(hooks=False)
            self._stop.wait(self._delay())

    def _watch(self) -> None:
        """Declare the loss at the local deadline, whatever the renewal thread is blocked on."""
        while not self._stop.is_set():
            with self._changed:
                lease = self._lease
                left = None if lease is None else lease.valid_until - self.clock()
                if left is None or left > 0:
                    self._changed.wait(_WATCH_SLICE_S if left is None
                                       else min(left, _WATCH_SLICE_S))
                    continue
            self.check_deadline()

    def check_deadline(self) -> bool:
        """Declare the lease lost if its validity has run out on our clock; True if it was."""
        with self._lock:
            lease = self._lease
        if lease is None:
            return False
        now = self.clock()
        if now < lease.valid_until:
            return False
        return self._lose(
            f"lease {lease.name} (token {lease.token}) expired on our clock "
            f"{now - lease.valid_until:.1f}s ago without a successful renewal (process "
            "frozen, or the store unreachable)", lease)

    def _run_hooks(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s)):
            self.run_hooks()

    def _delay(self) -> float:
        with self._lock:
            holding = self._lease is not None
        if not holding:
            return min(1.0, self.interval_s)
        return max(0.05, min(self._next_renew - self.clock(), self.interval_s))

    def tick(self, *, hooks: bool = True) -> None:
        """One renewal attempt (or acquisition while holding none), then (``hooks``) the hooks."""
        now = self.clock()
        with self._lock:
            lease = self._lease
        if lease is None:
            try:
                self._acquire(reacquire=True)
                self.failing = False
            except StoreError as exc:
                self.last_error = str(exc)
                self.failing = True
        elif now >= lease.valid_until:
            self.check_deadline()
        elif now >= self._next_renew:
            self._renew(lease)
        self._publish_metrics()
        if hooks:
            self.run_hooks()

    def run_hooks(self) -> None:
        """Run every periodic hook once; a failing hook is logged, never raised."""
        for hook in self.hooks:
            try:
                hook()
            except Exception as exc:
                logger.warning("celery-crawl: periodic %s failed: %s", _name(hook), exc)

    def _acquire(self, *, reacquire: bool = False) -> Lease | None:
        if reacquire:
            self.holder = self._holder_factory()
        lease = self.store.acquire(keys.worker_lease(self.holder), self.ttl_s, self.holder)
        if lease is None:
            return None
        with self._changed:
            self._lease = lease
            self._generation += 1
            self._changed.notify_all()
        self._next_renew = self.clock() + self.interval_s
        if reacquire:
            logger.warning("celery-crawl: new worker lease %s (token %s) held; resuming",
                           lease.name, lease.token)
            self.on_acquired(lease)
            self._notify()
        return lease

    def _renew(self, lease: Lease) -> None:
        t0 = time.perf_counter()
        sent = self.clock()
        left = lease.valid_until - sent
        if left <= 0:
            self.check_deadline()
            return
        try:
            # An answer after the deadline cannot save the lease: wait no longer than that.
            new = self.store.renew(lease, timeout_s=left)
        except LeaseLost as exc:
            self.renew_failed += 1
            self.failing = False
            metrics.LEASE_RENEWALS.labels(ROLE, "lost").inc()
            metrics.renewal_failed(ROLE, exc)
            self._lose(f"the store says lease {lease.name} is lost: {exc}", lease)
            return
        except StoreError as exc:
            self.renew_failed += 1
            self.failing = True
            self.last_error = str(exc)
            metrics.LEASE_RENEWALS.labels(ROLE, "error").inc()
            metrics.renewal_failed(ROLE, exc)
            left = lease.valid_until - self.clock()
            logger.warning("celery-crawl: renewing the worker lease failed (%.1fs of validity "
                           "left): %s", left, exc)
            # Retry well before the validity runs out.
            self._next_renew = self.clock() + max(0.2, min(self.interval_s / 3, left / 3))
            if left <= 0:
                self._lose(f"the store was unreachable past the lease's validity: {exc}", lease)
            return
        finally:
            self.renew_seconds += time.perf_counter() - t0
        self.renew_ok += 1
        self.failing = False
        metrics.LEASE_RENEWALS.labels(ROLE, "ok").inc()
        with self._changed:
            # Adopted only within the old validity: past it the watchdog has declared (or is
            # about to declare) the loss, and a loss is final.
            adopted = self._lease is lease and self.clock() < lease.valid_until
            if adopted:
                self._lease = new
                self._changed.notify_all()
        if not adopted:
            self.check_deadline()
            return
        self._next_renew = sent + self.interval_s

    def _lose(self, reason: str, lease: Lease | None = None) -> bool:
        """End the current lease (only ``lease``, when given); True if this call ended it."""
        with self._changed:
            lost = self._lease
            if lost is None or (lease is not None and lost is not lease):
                return False
            self._lease = None
            self._generation += 1
            # Set with the generation: whoever reads the new state reads its reason.
            self.losses += 1
            self.last_loss = reason
            self._changed.notify_all()
        metrics.lease_ended(ROLE, lost.valid_until, self.clock())
        metrics.WORKER_LEASE_LOSSES.inc()
        logger.error("celery-crawl: worker lease lost: %s", reason)
        try:
            self.on_lost(reason)
        except Exception:
            logger.exception("celery-crawl: handling the lease loss failed")
        self._notify()
        return True

    def _notify(self) -> None:
        try:
            self.on_change()
        except Exception:
            logger.exception("celery-crawl: announcing the new lease generation failed")

    def _publish_metrics(self) -> None:
        left = self.time_left()
        metrics.LEASE_TIME_LEFT.labels(ROLE).set(max(left or 0.0, 0.0))

    def info(self) -> dict[str, Any]:
        """Figures for ``celery inspect stats`` and ``crawl_leases``."""
        with self._lock:
            lease = self._lease
        total = self.renew_ok + self.renew_failed
        return {
            "holder": self.holder,
            "lease": lease.name if lease else None,
            "token": lease.token if lease else None,
            "generation": self._generation,
            "lease_time_left_s": self.time_left(),
            "ttl_s": self.ttl_s,
            "renew_ok": self.renew_ok,
            "renew_failed": self.renew_failed,
            "renew_success_rate": round(self.renew_ok / total, 4) if total else None,
            "lease_losses": self.losses,
            "last_loss": self.last_loss,
            "last_error": self.last_error,
        }


def _name(fn: Callable[[], None]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
