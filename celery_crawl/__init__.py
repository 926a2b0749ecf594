"""celery-crawl: plugins that make stock Celery safe for fleets of periodic crawlers.

``celery_crawl.install(app)`` wires every plugin into an existing Celery app.
"""

from __future__ import annotations

from typing import Any

from .config import CrawlConfig
from .errors import (
    ConfigError,
    CrawlError,
    FencedError,
    LeaseError,
    LeaseLost,
    NotLeader,
    ScheduleError,
    ScheduleFileError,
    SerializationRefused,
    StoreDataError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    UnsupportedSetup,
)

__all__ = [
    "ConfigError",
    "CrawlConfig",
    "CrawlError",
    "FencedError",
    "LeaseError",
    "LeaseLost",
    "NotLeader",
    "ScheduleError",
    "ScheduleFileError",
    "SerializationRefused",
    "StoreDataError",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "UnsupportedSetup",
    "__version__",
    "install",
]

__version__ = "0.1.0"


def install(app: Any) -> CrawlConfig:
    """Wire celery-crawl into ``app`` and validate its ``crawl_*`` settings.

    Returns the validated configuration. Raises ``ConfigError`` naming the bad setting.
    """
    config = CrawlConfig.from_app(app)
    app.conf.setdefault("crawl_namespace", config.namespace)
    return config
