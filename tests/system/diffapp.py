"""Two Celery apps with the same tasks, for ``test_stock_differences.py``: ``stock`` (plain
Celery, ``task_acks_late`` set by hand as the plugins set it, plain ``redis://`` results) and
``crawl`` (``celery_crawl.install`` with its defaults, the audited ``crawlredis://`` backend).
Task names start with the app's mode: ``install`` drops the broker TTL from the messages of its
own app's tasks only, and both apps publish from the test process.

The broker comes from ``DIFF_BROKER`` (a RabbitMQ vhost, or the private Redis's db 1); results,
the lease store and what the tasks did live on one private redis-server whose port comes from
``DIFF_REDIS_PORT``: crawl results db 0, the lease store db 1 (on a Redis broker: the broker's
own db, so claims ride in kombu's round trips; with RabbitMQ: the claim line), side records db
2, stock results db 4. Each app consumes its own queue (``DIFF_QUEUE``-stock|crawl).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import redis
from celery import Celery

import celery_crawl

PORT = int(os.environ.get("DIFF_REDIS_PORT") or 6379)
BROKER = os.environ.get("DIFF_BROKER") or f"redis://127.0.0.1:{PORT}/1"
QUEUE = os.environ.get("DIFF_QUEUE") or "diff"


def side() -> redis.Redis:
    """Where tasks record what they did (db 2)."""
    return redis.Redis(host="127.0.0.1", port=PORT, db=2, socket_timeout=5,
                       socket_connect_timeout=5)


def _app(mode: str) -> Celery:
    results = (f"redis://127.0.0.1:{PORT}/4" if mode == "stock"
               else f"crawlredis://127.0.0.1:{PORT}/0")
    app = Celery(f"diff_{mode}", broker=BROKER, backend=results, set_as_current=False)
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True, result_expires=600,
        worker_prefetch_multiplier=1, task_default_queue=f"{QUEUE}-{mode}",
        redis_socket_timeout=5, redis_socket_connect_timeout=5,
        broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
        worker_hijack_root_logger=True, worker_redirect_stdouts=False,
    )
    if mode == "stock":
        app.conf.task_acks_late = True
    else:
        app.conf.update(crawl_lease_url=f"redis://127.0.0.1:{PORT}/1",
                        crawl_namespace=f"diff-{QUEUE}", crawl_worker_lease_ttl=3,
                        crawl_store_timeout=1.0, crawl_reaper_interval=1.0)
        celery_crawl.install(app)
    return app


def _tasks(app: Celery, mode: str) -> SimpleNamespace:
    """The tasks, named ``<mode>.<task>``: ``install`` judges a message by its task's name."""
    @app.task(name=f"{mode}.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name=f"{mode}.identity", shared=False)
    def identity(x: Any) -> Any:
        return x

    @app.task(name=f"{mode}.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    @app.task(bind=True, name=f"{mode}.tsum_record", shared=False)
    def tsum_record(self: Any, values: list[int], key: str) -> int:
        side().rpush(f"runs:{key}", json.dumps(self.request.id))
        return sum(values)

    @app.task(bind=True, name=f"{mode}.record", shared=False)
    def record(self: Any, key: str, value: int = 1) -> int:
        side().rpush(f"runs:{key}", json.dumps(self.request.id))
        return value

    @app.task(name=f"{mode}.boom", shared=False)
    def boom(*_: Any) -> None:
        raise ValueError("boom")

    @app.task(name=f"{mode}.on_error", shared=False)
    def on_error(request: Any, exc: Any, traceback: Any, key: str) -> None:
        side().rpush(f"errbacks:{key}", json.dumps([request.id, type(exc).__name__]))

    @app.task(bind=True, name=f"{mode}.block", shared=False)
    def block(self: Any, gate: str) -> str:
        """Holds its worker's only slot until the test opens ``gate:<gate>`` (at most 60 s)."""
        r = side()
        r.set(f"started:{gate}", 1)
        deadline = time.monotonic() + 60
        while not r.exists(f"gate:{gate}") and time.monotonic() < deadline:
            time.sleep(0.05)
        return gate

    @app.task(bind=True, name=f"{mode}.retry_later", shared=False)
    def retry_later(self: Any, key: str) -> None:
        side().rpush(f"runs:{key}", self.request.retries)
        raise self.retry(countdown=30, max_retries=3)

    @app.task(bind=True, name=f"{mode}.retry_acked_early", shared=False, acks_late=False)
    def retry_acked_early(self: Any, key: str) -> int:
        """Acked early (``acks_late=False``), retries once, then returns its retry count. With
        the plugins it retries only after its delivery's end (recorded at the early ack) is in
        the lease store (db 1), the order in which that race usually ends."""
        side().rpush(f"runs:{key}", self.request.retries)
        if self.request.retries:
            return int(self.request.retries)
        if mode == "crawl":
            store = redis.Redis(host="127.0.0.1", port=PORT, db=1, socket_timeout=5)
            deadline = time.monotonic() + 30
            while (not any(store.scan_iter(match=f"*done/{self.request.id}*"))
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        raise self.retry(countdown=0.1)

    @app.task(bind=True, name=f"{mode}.spawn", shared=False)
    def spawn(self: Any, gate: str) -> list[str]:
        """Publishes a blocker and then a child: both inherit this run's deadline."""
        blocker = block.apply_async((gate,))
        child = add.apply_async((2, 3))
        return [blocker.id, child.id]

    return SimpleNamespace(add=add, identity=identity, tsum=tsum, tsum_record=tsum_record,
                           record=record, boom=boom, on_error=on_error, block=block,
                           retry_later=retry_later, retry_acked_early=retry_acked_early,
                           spawn=spawn)


stock = _app("stock")
crawl = _app("crawl")
TASKS = {"stock": _tasks(stock, "stock"), "crawl": _tasks(crawl, "crawl")}
