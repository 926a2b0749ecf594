"""Celery app for the schedule-fleet system tests (tests/system/test_beat_fleet.py).

Self-contained (the test copies this file into a project directory of its own, to start the
beat from several working directories). Configured from the environment:

* ``CRAWL_F_BROKER`` / ``CRAWL_F_STORE`` / ``CRAWL_F_NS`` — broker, the Redis of the result
  backend (``crawlredis://``, which is also the lease store, as in the README's own-app path),
  namespace;
* ``CRAWL_F_PATHS`` — ``crawl_schedule_paths`` (``os.pathsep`` separated), default
  ``schedules/*.toml`` (relative: resolved against this module's import root);
* ``CRAWL_F_EXTRA`` — also define a ``beat_schedule`` entry ``extra`` (another schedule);
* ``CRAWL_F_METRICS`` — ``crawl_metrics_port``;
* ``CRAWL_F_MISMATCH`` — ``crawl_beat_schedule_mismatch``.

No worker consumes the queue: the tests read the published messages from the broker.
"""

from __future__ import annotations

import os

from celery import Celery

import celery_crawl
from celery_crawl.schedules import TzCron

_env = os.environ.get

app = Celery("fleettest", broker=_env("CRAWL_F_BROKER"))
app.conf.update(
    broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue=f"q-{_env('CRAWL_F_NS', 'fleettest')}",
    result_backend="crawl" + _env("CRAWL_F_STORE", "redis://127.0.0.1:6379/0"),
    crawl_namespace=_env("CRAWL_F_NS", "fleettest"),
    crawl_beat_lease_ttl=3.0,
    crawl_store_timeout=1.0,
    crawl_schedule_paths=_env("CRAWL_F_PATHS", "schedules/*.toml").split(os.pathsep),
    crawl_metrics_port=int(_env("CRAWL_F_METRICS", "0")) or None,
    crawl_beat_schedule_mismatch=_env("CRAWL_F_MISMATCH", "refuse"),
    beat_schedule=({"extra": {"task": "fleet.record", "schedule": TzCron("0 3 * * *", "UTC")}}
                   if _env("CRAWL_F_EXTRA") else {}),
)
celery_crawl.install(app)
