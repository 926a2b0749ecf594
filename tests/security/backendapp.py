"""A worker app whose result backend user has only the documented least-privilege rights.

Configured from the environment: ``CRAWL_SEC_BROKER``, ``CRAWL_SEC_BACKEND``,
``CRAWL_SEC_LEASE`` (URLs, each with its own ACL user) and ``CRAWL_SEC_NS`` (namespace).
"""

from __future__ import annotations

import os
from typing import Any

from celery_crawl.tasks import IdempotentTask
from tests.security.appconf import security_app

_env = os.environ.get

app = security_app("crawlsecb", task_track_started=True, result_expires=600)


@app.task(name="secb.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="secb.total")
def total(values: list[int]) -> int:
    return sum(values)


class Keyed(IdempotentTask):  # type: ignore[misc]
    """Keyed by the first argument; its rollback does nothing but is recorded."""

    idempotency_heartbeat_ttl_s = 3.0
    rollback_backoff_s = 0.05

    def idempotency_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return f"secb:{args[0]}"

    def rollback(self, exc: BaseException, task_id: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        pass


@app.task(name="secb.keyed", bind=True, base=Keyed)
def keyed(self: Any, name: str, fail: bool = False) -> dict[str, Any]:
    """Keyed by ``name``: a second call replays the first outcome (``by`` names its run)."""
    if fail:
        raise KeyError(f"{name} is broken")
    return {"name": name, "by": self.request.id}
