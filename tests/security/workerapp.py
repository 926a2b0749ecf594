"""A worker app for the security system test, configured from the environment.

``CRAWL_SEC_BROKER``, ``CRAWL_SEC_BACKEND``, ``CRAWL_SEC_LEASE`` (URLs carrying passwords),
``CRAWL_SEC_NS`` (namespace) and ``CRAWL_SEC_METRICS_PORT``.
"""

from __future__ import annotations

import os
from typing import Any

from celery_crawl.tasks import IdempotentTask
from celery_crawl.worker import current_claim
from tests.security.appconf import security_app

_env = os.environ.get

app = security_app("crawlsecw", crawl_metrics_port=int(_env("CRAWL_SEC_METRICS_PORT", "0")) or None)


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
