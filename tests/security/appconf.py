"""The settings the security test apps share: a worker on ACL/TLS servers given by URL."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

import celery_crawl


def security_app(main: str, **extra: Any) -> Celery:
    """A Celery app on ``CRAWL_SEC_BROKER``/``CRAWL_SEC_BACKEND``/``CRAWL_SEC_LEASE`` with
    short timeouts everywhere (a refused credential must fail fast), the plugins installed."""
    env = os.environ.get
    app = Celery(main, broker=env("CRAWL_SEC_BROKER"), backend=env("CRAWL_SEC_BACKEND"))
    app.conf.update(
        crawl_lease_url=env("CRAWL_SEC_LEASE"),
        crawl_namespace=env("CRAWL_SEC_NS", main),
        crawl_worker_lease_ttl=3.0,
        crawl_store_timeout=1.0,
        crawl_schedule_paths=["no-such-dir/*.toml"],
        redis_socket_timeout=5,
        redis_socket_connect_timeout=5,
        broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=True,
        worker_redirect_stdouts=False,
        **extra,
    )
    celery_crawl.install(app)
    return app
