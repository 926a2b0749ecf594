"""A worker app for the security system test, configured from the environment.

``CRAWL_SEC_BROKER``, ``CRAWL_SEC_BACKEND``, ``CRAWL_SEC_LEASE`` (URLs carrying passwords),
``CRAWL_SEC_NS`` (namespace) and ``CRAWL_SEC_METRICS_PORT``.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

import celery_crawl
from celery_crawl.tasks import IdempotentTask
from celery_crawl.worker import current_claim

_env = os.environ.get

app = Celery("crawlsecw", broker=_env("CRAWL_SEC_BROKER"), backend=_env("CRAWL_SEC_BACKEND"))
app.conf.update(
    crawl_lease_url=_env("CRAWL_SEC_LEASE"),
    crawl_namespace=_env("CRAWL_SEC_NS", "crawlsecw"),
    crawl_worker_lease_ttl=3.0,
    crawl_store_timeout=1.0,
    crawl_metrics_port=int(_env("CRAWL_SEC_METRICS_PORT", "0")) or None,
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
)
celery_crawl.install(app)


@app.task(name="sec.echo", bind=True)
def echo(self: Any) -> dict[str, Any]:
    """What the task sees of the headers a producer may have forged."""
    request = self.request
    return {
        "token": getattr(request, "crawl_claim_token", None),
        "claim": current_claim(),
        "slot": repr(getattr(request, "crawl_slot", None))[:200],
    }


@app.task(name="sec.deadline", bind=True, base=IdempotentTask)
def deadline(self: Any) -> float | None:
    """The time left under whatever ``crawl_deadline`` the message carried."""
    return self.remaining()
