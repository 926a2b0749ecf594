"""HA beat: ``celery -A proj beat -S celery_crawl.beat:LeasedScheduler``.

Any number of replicas; only the holder of the leader lease dispatches, each run with a
deterministic task id and its leader token. :mod:`.scheduler` is the Celery adapter; the
Celery-free cores are :mod:`.election` (leader state machine), :mod:`.term` (lease calls),
:mod:`.guards` (store fitness, clock skew), :mod:`.book` (entry states), :mod:`.dispatch` (due
heap, catch-up, overlap), :mod:`.commands`, :mod:`.reload`, :mod:`.slots` and :mod:`.state`;
:mod:`.assembly` builds the app's schedule for the beat and the CLI alike.
"""

from __future__ import annotations

from .scheduler import LeasedScheduler

__all__ = ["LeasedScheduler"]
