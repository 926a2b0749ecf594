"""HA beat: ``celery -A proj beat -S celery_crawl.beat:LeasedScheduler``.

Any number of replicas; only the holder of the leader lease dispatches, each run with a
deterministic task id and its leader token. The Celery-free core lives in :mod:`.election`
(leader state machine), :mod:`.slots` (catch-up planning) and :mod:`.state` (durable records).
"""

from __future__ import annotations

from .scheduler import LeasedScheduler

__all__ = ["LeasedScheduler"]
