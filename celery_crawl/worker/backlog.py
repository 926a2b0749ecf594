"""Ends of runs this worker could not record when they happened, kept until the store takes them.

A run's end is recorded (tombstone, then the claim deleted) before its message is settled; when
the store cannot be reached, or no lease is held at that moment, the message is settled anyway
and the record waits here. The keeper's hook thread retries it after each renewal, and the last
attempt is made at shutdown, before the lease is released. This module does not import Celery.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import LeaseLost, StoreError
from .claims import Held

__all__ = ["Backlog"]

#: Records one end: ``finish(held, state=..., requeue=...)`` (``Claimer.finish``).
Finish = Callable[..., None]


class Backlog:
    """Thread-safe: the event loop and a threads-pool thread add, the hook thread drains."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Held, str, bool]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, held: Held, state: str, requeue: bool) -> None:
        with self._lock:
            self._pending.append((held, state, requeue))

    def drain(self, finish: Finish) -> None:
        """Record the waiting ends in order; at the first that fails, keep it and the rest for
        the next attempt (the store is down or the lease gone: the others would fail too)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for i, (held, state, requeue) in enumerate(pending):
            try:
                finish(held, state=state, requeue=requeue)
            except (StoreError, LeaseLost):
                with self._lock:
                    self._pending.extend(pending[i:])
                return
