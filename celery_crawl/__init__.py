"""celery-crawl: plugins that make stock Celery safe for fleets of periodic crawlers.

``celery_crawl.install(app)`` wires every plugin into an existing Celery app; the result backend
is chosen by URL (``result_backend = "crawlredis://..."``) and tasks opt in with
``@app.task(base=IdempotentTask)``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._celery_compat import config_source
from .config import CrawlConfig
from .errors import (
    AbandonedRun,
    ConfigError,
    CrawlError,
    FencedError,
    LeaseError,
    LeaseLost,
    NotLeader,
    PoisonMessage,
    ReplayError,
    RollbackFailed,
    ScheduleError,
    ScheduleFileError,
    SerializationRefused,
    StoreDataError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TaskIdReused,
    UnsupportedSetup,
)
from .leases import Claim, Lease, LeaseStore, open_store
from .schedules import TzCron
from .worker import current_claim

if TYPE_CHECKING:
    from .backends import AuditedRedisBackend
    from .beat import LeasedScheduler
    from .tasks import IdempotentTask

__all__ = [
    "AbandonedRun",
    "AuditedRedisBackend",
    "Claim",
    "ConfigError",
    "CrawlConfig",
    "CrawlError",
    "FencedError",
    "IdempotentTask",
    "Lease",
    "LeaseError",
    "LeaseLost",
    "LeaseStore",
    "LeasedScheduler",
    "NotLeader",
    "PoisonMessage",
    "ReplayError",
    "RollbackFailed",
    "ScheduleError",
    "ScheduleFileError",
    "SerializationRefused",
    "StoreDataError",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TaskIdReused",
    "TzCron",
    "UnsupportedSetup",
    "__version__",
    "current_claim",
    "install",
    "open_store",
]

__version__ = "0.1.0"

logger = logging.getLogger(__name__)

_BEAT_SCHEDULER = "celery_crawl.beat:LeasedScheduler"
_LAZY = {
    "AuditedRedisBackend": ".backends",
    "LeasedScheduler": ".beat",
    "IdempotentTask": ".tasks",
}


def __getattr__(name: str) -> Any:
    # Celery-facing classes import Celery's beat/backend machinery: load them when asked for.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_crawl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)


def install(app: Any) -> CrawlConfig:
    """Wire celery-crawl into ``app``; idempotent.

    Validates the ``crawl_*`` settings, registers the worker's lease and claim bootsteps (they
    only act inside ``celery worker``), makes ``LeasedScheduler`` the default beat scheduler unless
    the app chose one, turns on deadline propagation for every task the app publishes, and
    publishes the app's tasks without the broker's per-message TTL (an expired task is revoked
    and recorded by the worker that receives it, instead of vanishing from a RabbitMQ queue),
    and marks each publish with an id of its own (``publishes.py``: a frozen signature applied
    again runs again, a redelivered copy does not).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: naming the bad setting.
    """
    from . import publishes, tasks  # connect to before_task_publish
    from .worker import install_worker

    config = CrawlConfig.from_app(app)
    install_worker(app, config)
    tasks.keep_expiring_messages(app)
    publishes.mark_publishes()
    if not _app_sets(app, "beat_scheduler"):
        app.conf.beat_scheduler = _BEAT_SCHEDULER
    return config


def _app_sets(app: Any, key: str) -> bool:
    conf = app.conf
    if key in getattr(conf, "changes", {}):
        return True
    source = config_source(app)
    if isinstance(source, dict):
        return key in source
    return source is not None and hasattr(source, key)
