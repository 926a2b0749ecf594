"""The finished-task marks, under their old name: they live in :mod:`celery_crawl._finishing`
(below the worker, the result backend and ``IdempotentTask``, which all write or read them)."""

from .._finishing import clear, finished, handed_off, mark, mark_handoff, setup, teardown

__all__ = ["clear", "finished", "handed_off", "mark", "mark_handoff", "setup", "teardown"]
