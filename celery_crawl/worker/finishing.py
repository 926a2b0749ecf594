"""The finished-task marks live in :mod:`celery_crawl._finishing`: pool children write them from
``IdempotentTask`` and the audited result backend, the worker plugin reads them, and the backend
may not import the worker."""

from __future__ import annotations

from .._finishing import clear, finished, mark, setup, teardown

__all__ = ["clear", "finished", "mark", "setup", "teardown"]
