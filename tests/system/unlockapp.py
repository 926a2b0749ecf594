"""Two Celery apps whose result backend has no native chord join (``file://``), so a chord's
body waits in Celery's ``celery.chord_unlock`` task, which retries itself under its own task id
until the header is ready: ``stock`` (plain Celery) and ``crawl`` (``celery_crawl.install``).

One private redis-server (port from ``UNLOCK_REDIS_PORT``): crawl's broker is db 1 and its lease
store db 0, stock's broker db 3. Results live under ``UNLOCK_RESULTS`` (one directory per app).
"""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_crawl

PORT = int(os.environ.get("UNLOCK_REDIS_PORT") or 6379)
RESULTS = os.environ.get("UNLOCK_RESULTS") or "/tmp/crawl-unlock-results"


def _app(mode: str, broker_db: int) -> Celery:
    folder = os.path.join(RESULTS, mode)
    os.makedirs(folder, exist_ok=True)
    app = Celery(f"unlock_{mode}", broker=f"redis://127.0.0.1:{PORT}/{broker_db}",
                 backend=f"file://{folder}")
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True, task_default_queue=f"unlock-{mode}",
        broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
        worker_hijack_root_logger=True, worker_redirect_stdouts=False,
    )

    @app.task(name="unlock.slow_add", shared=False)
    def slow_add(x: int, y: int, seconds: float) -> int:
        time.sleep(seconds)  # the work the chord waits for: chord_unlock retries meanwhile
        return x + y

    @app.task(name="unlock.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    return app


stock = _app("stock", 3)
crawl = _app("crawl", 1)
crawl.conf.update(crawl_lease_url=f"redis://127.0.0.1:{PORT}/0", crawl_namespace="unlock",
                  crawl_worker_lease_ttl=3, crawl_done_ttl=600, crawl_store_timeout=1.0,
                  crawl_reaper_interval=1.0)
celery_crawl.install(crawl)
APPS = {"stock": stock, "crawl": crawl}
