"""A Celery app for the CLI security tests, configured from the environment.

``CRAWL_SEC_BROKER``, ``CRAWL_SEC_BACKEND``, ``CRAWL_SEC_LEASE`` (URLs, possibly with
passwords), ``CRAWL_SEC_NS`` (namespace) and ``CRAWL_SEC_SCHEDULES`` (a glob of schedule files).
"""

from __future__ import annotations

import os

from celery import Celery

import celery_crawl

_env = os.environ.get

app = Celery("crawlsec", broker=_env("CRAWL_SEC_BROKER", "memory://"),
             backend=_env("CRAWL_SEC_BACKEND"))
app.conf.update(
    crawl_lease_url=_env("CRAWL_SEC_LEASE"),
    crawl_namespace=_env("CRAWL_SEC_NS", "crawlsec"),
    crawl_schedule_paths=[_env("CRAWL_SEC_SCHEDULES", "no-such-dir/*.toml")],
    crawl_store_timeout=1.0,
    redis_socket_timeout=2,
    redis_socket_connect_timeout=2,
    broker_transport_options={"socket_timeout": 2, "socket_connect_timeout": 2},
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
)
celery_crawl.install(app)
