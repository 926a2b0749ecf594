"""Schedule sources beside the schedule files and ``beat_schedule``.

``crawl_schedule_sources = ["files", "beat_schedule", "django_celery_beat"]`` adds the enabled
``PeriodicTask`` rows of django-celery-beat (:mod:`.rows`: a row as an entry;
:mod:`.django_db`: reading on change, the fenced write-back). Django is imported only when that
source is opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...config import CrawlConfig
from ...durations import parse_duration

if TYPE_CHECKING:
    from .django_db import DjangoBeatSource

__all__ = ["row_source"]


def row_source(app: Any, config: CrawlConfig | None = None) -> DjangoBeatSource:
    """The django-celery-beat source of ``app`` (not yet read: call ``poll``).

    Raises:
        ConfigError: Django or django-celery-beat is missing.
    """
    from .django_db import DjangoBeatSource

    if config is None:
        namespace = app.conf.get("crawl_namespace") or getattr(app, "main", None) \
            or "celery_crawl"
        timeout_s = parse_duration(app.conf.get("crawl_store_timeout", 2.0),
                                   what="crawl_store_timeout")
    else:
        namespace, timeout_s = config.namespace, config.store_timeout_s
    return DjangoBeatSource(app, namespace=namespace, timeout_s=timeout_s)

