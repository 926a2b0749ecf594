"""Celery's hub as far as the worker steps use it, except that nothing runs by itself: the
callbacks the steps schedule wait until a test runs them, in the order it chooses."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class QueuedHub:
    """``call_soon`` queues; ``run`` and ``run_reversed`` run what is pending."""

    def __init__(self) -> None:
        self.pending: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._lock = threading.Lock()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            self.pending.append((fn, args))

    def _take(self) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
        with self._lock:
            todo, self.pending = self.pending, []
        return todo

    def run(self) -> int:
        """Run what is pending, oldest first."""
        todo = self._take()
        for fn, args in todo:
            fn(*args)
        return len(todo)

    def run_reversed(self) -> int:
        """Run what is pending, newest first (an order kombu's ready set may choose)."""
        todo = self._take()
        for fn, args in reversed(todo):
            fn(*args)
        return len(todo)


def stub_consumer(worker: Any, strategies: dict[str, Any], conn: Any, channel: Any) -> Any:
    """The consumer attributes the claim step reads, around a real connection and channel
    (the worker integration tests drive its strategies by hand)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        controller=worker, strategies=strategies, connection=conn,
        task_consumer=SimpleNamespace(channel=channel, cancel=lambda: None,
                                      consume=lambda: None),
        connection_errors=(),
        timer=SimpleNamespace(call_repeatedly=lambda *a: SimpleNamespace(cancel=lambda: None)),
        on_connection_error_after_connected=lambda exc: None)
