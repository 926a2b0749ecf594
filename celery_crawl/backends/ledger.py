"""Bookkeeping of idempotency keys on the result backend's Redis (``idem_*.lua``).

One hash per key records which task owns it, the owner run's heartbeat (server time), and the
rollback state per claim token. "Finished" is not stored here: a key is finished when the fence
record of its owning task says a ready state was written (``store.lua``), so a run killed after
storing its result but before any further bookkeeping still counts as finished.

Pool children use this, as Celery always lets them use the result backend; only the lease store
is main-process-only.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kombu.utils.encoding import bytes_to_str

from ..clock import monotonic
from ..errors import StoreError

if TYPE_CHECKING:
    from .audited import AuditedRedisBackend

__all__ = ["Decision", "Heartbeat", "KeyLedger"]

#: Attempts of ``begin`` when the key's owner changes between the script's replies.
_BEGIN_ATTEMPTS = 4


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``KeyLedger.begin`` decided.

    Attributes:
        kind: ``run``, ``rollback``, ``finished``, ``finished-rb``, ``duplicate`` or ``busy``.
        task_id: the task id the key's record belongs to.
        extra: ``rollback``/``finished-rb``: the stored failure (JSON); ``finished``: the
            final rollback outcome if any; ``run``: ``takeover`` when the key was taken from a
            run that died unfinished and was not rolled back.
        rollback_token: ``rollback``: the claim token whose rollback is pending ("" = none).
        abandoned: ``run`` with ``takeover``: the claim tokens of dead runs whose effects
            are to be rolled back before this run starts, oldest first.
        rollback_status: ``finished-rb``: ``done`` or ``failed``.
    """

    kind: str
    task_id: str
    extra: str = ""
    rollback_token: str = ""
    abandoned: tuple[str, ...] = ()
    rollback_status: str = ""


class KeyLedger:
    """Atomic operations on one idempotency key's record.

    Args:
        backend: the audited result backend whose Redis holds the record.
        namespace: ``crawl_namespace``.
        key: the idempotency key.
        heartbeat_ttl_s: a run whose heartbeat is older than this counts as dead.
    """

    def __init__(self, backend: AuditedRedisBackend, namespace: str, key: str,
                 heartbeat_ttl_s: float) -> None:
        self.backend = backend
        self.key = key
        self.record_key = backend.idempotency_key(namespace, key)
        self.heartbeat_ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self.keep_s = int(backend.expires or 0)
        if self.keep_s:
            # The record must outlive a run that is still heart-beating.
            self.keep_s = max(self.keep_s, int(heartbeat_ttl_s * 3) + 1)

    def _call(self, script: Any, args: list[Any], extra_keys: tuple[str, ...] = ()) -> Any:
        backend = self.backend
        return backend.ensure(backend.run_script, (script, [self.record_key, *extra_keys], args))

    def begin(self, task_id: str, token: str, run_id: str, *, force: bool = False) -> Decision:
        """Decide whether this run may start; takes the key when it may (``run``/``rollback``).

        The fence record of the task owning the key is passed as a declared key: guessed to be
        this task's, and, when the script answers ``need`` (nothing written), passed as named.
        """
        args = [task_id, token, run_id, self.heartbeat_ttl_ms, self.keep_s,
                self.backend.fence_prefix, "1" if force else "0"]
        own = self.backend.fence_key(task_id)
        owner_fence = own
        for _ in range(_BEGIN_ATTEMPTS):
            reply = self._call(self.backend.idem_begin_script, args, (own, owner_fence))
            if bytes_to_str(reply[0]) != "need":
                break
            owner_fence = self.backend.fence_key(bytes_to_str(reply[1]))
        else:
            raise StoreError(f"idempotency key {self.key!r} kept changing owner while it was "
                             f"read ({_BEGIN_ATTEMPTS} attempts)")
        parts = [bytes_to_str(p) for p in reply] + ["", "", ""]
        kind, owner_task = parts[0], parts[1]
        if kind == "rollback":
            return Decision(kind, owner_task, extra=parts[2], rollback_token=parts[3])
        if kind == "run" and parts[2] == "takeover":
            return Decision(kind, owner_task, extra=parts[2],
                            abandoned=tuple(parts[3].split(";")))
        if kind == "finished-rb":
            return Decision(kind, owner_task, extra=parts[3], rollback_status=parts[2])
        return Decision(kind, owner_task, extra=parts[2])

    def touch(self, run_id: str) -> bool:
        """Extend this run's heartbeat; False when another run owns the key (we are fenced)."""
        return bool(self._call(self.backend.idem_update_script,
                               ["touch", run_id, self.heartbeat_ttl_ms]))

    def release(self, run_id: str) -> bool:
        """Drop the record (the run will be retried); False when another run owns the key."""
        return bool(self._call(self.backend.idem_update_script,
                               ["release", run_id, self.heartbeat_ttl_ms]))

    def rollback_begin(self, run_id: str, token: str, *, final: bool, failure: str,
                       waited: bool = False) -> str:
        """Take the rollback lock of ``token`` (marks the rollback pending).

        The lock expires a heartbeat TTL after it was taken or last extended
        (``rollback_touch``), so a holder that died releases it without anyone's help.

        Returns:
            ``go`` (this run holds the lock); ``done`` when the rollback already completed for
            this (key, token); ``wait`` while another run holds the lock; ``failed`` when
            ``waited`` and the run waited for gave up; ``fenced`` when a final-failure rollback
            is asked by a run that no longer owns the key.
        """
        return str(bytes_to_str(self._call(self.backend.idem_update_script, [
            "rb_begin", run_id, self.heartbeat_ttl_ms, token, "1" if final else "0", failure,
            "1" if waited else "0"])))

    def rollback_touch(self, run_id: str, token: str) -> bool:
        """Extend this run's rollback lock of ``token``; False when it lost the lock."""
        return bool(self._call(self.backend.idem_update_script,
                               ["rb_touch", run_id, self.heartbeat_ttl_ms, token]))

    def rollback_end(self, run_id: str, token: str, *, final: bool, status: str) -> None:
        """Record the rollback outcome for ``token`` (``done`` or ``failed``)."""
        self._call(self.backend.idem_update_script, [
            "rb_end", run_id, self.heartbeat_ttl_ms, token, "1" if final else "0", status])

    def record(self) -> dict[str, str]:
        """The raw record (for tests and operators)."""
        raw = self.backend.client.hgetall(self.record_key)
        return {bytes_to_str(k): bytes_to_str(v) for k, v in raw.items()}


class Heartbeat:
    """Keeps a run's ownership of its key (or its rollback lock) alive (a beat every ttl/3).

    A run that stops beating (killed, frozen) loses the key once the TTL passes; the next
    delivery then takes it over, and the frozen run finds itself fenced when it resumes. A
    rollback lock lapses the same way, and the run waiting for it takes it over.

    All runs of a process share one daemon thread (``_Beats``): a thread started and joined per
    run cost more than the run of a short task, while most runs end before their first beat.
    """

    def __init__(self, ledger: KeyLedger, run_id: str,
                 beat: Callable[[], bool] | None = None) -> None:
        self._ledger = ledger
        self._run_id = run_id
        # What one beat extends: the key's ownership by default, or a rollback lock.
        self._extend = beat or (lambda: ledger.touch(run_id))
        self.interval_s = ledger.heartbeat_ttl_ms / 3000.0
        self.fenced = False
        self.stopped = False
        #: Held while a beat of this run is in flight, so ``stop`` returns after it.
        self.busy = threading.Lock()

    def start(self) -> Heartbeat:
        _beats().add(self)
        return self

    def beat(self) -> bool:
        """One beat; False once fenced or stopped (no further beats)."""
        with self.busy:
            if self.stopped:
                return False
            try:
                if not self._extend():
                    self.fenced = True
                    return False
            except Exception:  # a transient Redis error: the next beat retries
                pass
            return True

    def stop(self) -> None:
        self.stopped = True
        with self.busy:  # a beat in flight has ended
            pass


class _Beats:
    """One thread beating every started ``Heartbeat`` of this process when it is due."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Heartbeat]] = []
        self._seq = itertools.count()
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._loop, name="crawl-idem-heartbeat",
                                        daemon=True)
        self._thread.start()

    def add(self, hb: Heartbeat) -> None:
        with self._cond:
            heapq.heappush(self._due, (monotonic() + hb.interval_s, next(self._seq), hb))
            if self._due[0][2] is hb:
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    # Runs that ended are dropped as they come up (no search per stop).
                    while self._due and self._due[0][2].stopped:
                        heapq.heappop(self._due)
                    if not self._due:
                        self._cond.wait()
                        continue
                    wait = self._due[0][0] - monotonic()
                    if wait <= 0:
                        _, _, hb = heapq.heappop(self._due)
                        break
                    self._cond.wait(wait)
            if hb.beat():
                with self._cond:
                    heapq.heappush(self._due,
                                   (monotonic() + hb.interval_s, next(self._seq), hb))


_beats_lock = threading.Lock()
_the_beats: _Beats | None = None


def _beats() -> _Beats:
    """This process's beater (a forked pool child starts its own)."""
    global _the_beats
    with _beats_lock:
        if _the_beats is None or _the_beats.pid != os.getpid():
            _the_beats = _Beats()
        return _the_beats
