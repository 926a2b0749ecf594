"""The worker lease, renewed on a dedicated thread whatever the task load.

Renewal is one store round trip every ``ttl/3`` (sooner while failing). The lease is judged on
``CLOCK_BOOTTIME`` against the validity the store computed from *before* the request: once that
instant passes without a successful renewal — the store unreachable, or this process frozen
(SIGSTOP, a VM pause) for longer than the TTL — the lease counts as lost even if a late renewal
would still succeed, because another worker may already have recovered our tasks. A lost lease is
never renewed again: the next one is acquired under a *new* holder id, so claims made under the
old one stay orphaned for the reaper and can never be mistaken for live ones.

Periodic hooks (the reaper, keeping our unacked broker entries fresh, retrying completion writes
that failed) run on a second thread, so a slow broker or a long reaper pass never delays renewal.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .. import keys, metrics
from ..errors import LeaseLost, StoreError
from ..leases.base import Lease, LeaseStore

__all__ = ["Keeper", "boottime", "new_holder"]

logger = logging.getLogger(__name__)

ROLE = "worker"


def boottime() -> float:
    """Seconds on ``CLOCK_BOOTTIME`` (monotonic, counts suspend): the clock leases are judged on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def new_holder() -> str:
    """A holder id unique to this process start (``hostname:pid:random``)."""
    try:
        from ..leases import make_holder
    except ImportError:
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    return str(make_holder())


class Keeper:
    """Holds and renews one worker lease on its own thread.

    Args:
        store: the lease store.
        ttl_s: ``crawl_worker_lease_ttl``.
        on_lost: called (on the keeper thread) with a reason when the lease is lost.
        on_acquired: called (on the keeper thread) with the lease after a *re*-acquisition.
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
        hooks: list[Callable[[], None]] | None = None,
        clock: Callable[[], float] = boottime,
        holder_factory: Callable[[], str] = new_holder,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.on_acquired = on_acquired
        self.hooks = list(hooks or [])
        self.clock = clock
        self._holder_factory = holder_factory
        self._lease: Lease | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hooks_thread: threading.Thread | None = None
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

    def stop(self, *, release: bool = True) -> None:
        """Stop renewing and (by default) release the lease so our claims are reaped at once."""
        self._stop.set()
        for thread in (self._thread, self._hooks_thread):
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
            self._lose(
                f"lease {lease.name} (token {lease.token}) expired on our clock "
                f"{now - lease.valid_until:.1f}s ago without a successful renewal (process "
                "frozen, or the store unreachable)"
            )
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
        with self._lock:
            self._lease = lease
        self._next_renew = self.clock() + self.interval_s
        if reacquire:
            logger.warning("celery-crawl: new worker lease %s (token %s) held; resuming",
                           lease.name, lease.token)
            self.on_acquired(lease)
        return lease

    def _renew(self, lease: Lease) -> None:
        t0 = time.perf_counter()
        sent = self.clock()
        try:
            new = self.store.renew(lease)
        except LeaseLost as exc:
            self.renew_failed += 1
            self.failing = False
            metrics.LEASE_RENEWALS.labels(ROLE, "lost").inc()
            metrics.renewal_failed(ROLE, exc)
            self._lose(f"the store says lease {lease.name} is lost: {exc}")
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
                self._lose(f"the store was unreachable past the lease's validity: {exc}")
            return
        finally:
            self.renew_seconds += time.perf_counter() - t0
        self.renew_ok += 1
        self.failing = False
        metrics.LEASE_RENEWALS.labels(ROLE, "ok").inc()
        with self._lock:
            if self._lease is lease:
                self._lease = new
        self._next_renew = sent + self.interval_s

    def _lose(self, reason: str) -> None:
        with self._lock:
            lost, self._lease = self._lease, None
        if lost is None:
            return
        metrics.lease_ended(ROLE, lost.valid_until, self.clock())
        self.losses += 1
        self.last_loss = reason
        metrics.WORKER_LEASE_LOSSES.inc()
        logger.error("celery-crawl: worker lease lost: %s", reason)
        try:
            self.on_lost(reason)
        except Exception:
            logger.exception("celery-crawl: handling the lease loss failed")

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
            "time_left_s": self.time_left(),
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
