"""Django settings of the test project, from the environment.

* ``CRAWL_DJ_DB`` — ``sqlite:///path/to/db.sqlite3`` or
  ``postgresql://user@host:port/name``;
* ``CRAWL_DJ_BROKER`` — the broker (and, unless ``CRAWL_DJ_BACKEND`` says otherwise, result
  backend) URL; ``CRAWL_DJ_QUEUE`` — the default queue;
* ``CRAWL_DJ_LEASE`` — ``crawl_lease_url``; ``CRAWL_DJ_NS`` — namespace;
* ``CRAWL_DJ_SCHEDULER`` — set to ``stock`` to keep django-celery-beat's own scheduler.

The Celery part is what django-celery-beat's documentation shows (``CELERY_`` settings read
with ``config_from_object("django.conf:settings", namespace="CELERY")``); moving to the leased
scheduler is the two ``CELERY_BEAT_SCHEDULER``/``CELERY_CRAWL_SCHEDULE_SOURCES`` lines.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

_env = os.environ.get

SECRET_KEY = "crawl-tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_db = urlsplit(_env("CRAWL_DJ_DB", "sqlite:///:memory:"))
if _db.scheme == "sqlite":
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                             "NAME": _db.path[1:] if _db.path != "/:memory:" else ":memory:",
                             "OPTIONS": {"timeout": 5}}}
else:
    DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql",
                             "NAME": _db.path.lstrip("/"), "USER": _db.username or "postgres",
                             "HOST": _db.hostname, "PORT": str(_db.port or 5432),
                             "OPTIONS": {"connect_timeout": 2}}}

CELERY_BROKER_URL = _env("CRAWL_DJ_BROKER")
CELERY_RESULT_BACKEND = _env("CRAWL_DJ_BACKEND", _env("CRAWL_DJ_BROKER")) or None
CELERY_TASK_DEFAULT_QUEUE = _env("CRAWL_DJ_QUEUE", "celery")
CELERY_TIMEZONE = "UTC"
CELERY_TASK_IGNORE_RESULT = True
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
if _env("CRAWL_DJ_SCHEDULER") != "stock":
    CELERY_BEAT_SCHEDULER = "celery_crawl.beat:LeasedScheduler"
    CELERY_CRAWL_SCHEDULE_SOURCES = ["files", "beat_schedule", "django_celery_beat"]
CELERY_CRAWL_LEASE_URL = _env("CRAWL_DJ_LEASE")
CELERY_CRAWL_NAMESPACE = _env("CRAWL_DJ_NS", "djbeat")
CELERY_CRAWL_BEAT_LEASE_TTL = 3.0
CELERY_CRAWL_STORE_TIMEOUT = 1.0
CELERY_CRAWL_SCHEDULE_PATHS: list[str] = []
