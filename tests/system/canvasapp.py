"""Two Celery apps with the same canvas tasks, for ``test_canvas.py``: ``stock`` (plain Celery,
plain ``redis://`` results) and ``crawl`` (``celery_crawl.install``, the audited ``crawlredis://``
backend, the lease store on the same Redis).

One app per (stock|crawl, prefork|threads), each with its own default queue, e.g.
``celery -A tests.system.canvasapp:crawl_threads worker -P threads``. One private redis-server
whose port comes from ``CANVAS_REDIS_PORT``: crawl uses db 1 (broker and leases) and db 0
(results), stock db 3 and db 4, and every task records what it did in db 2.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import redis
from celery import Celery, chain, group

import celery_crawl
from celery_crawl.backends import AuditedRedisBackend
from celery_crawl.worker import current_claim

PORT = int(os.environ.get("CANVAS_REDIS_PORT") or 6379)

_FENCED_WRITE = """
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1])
return 1
"""


def side() -> redis.Redis:
    """Where tasks record what they did (db 2)."""
    return redis.Redis(host="127.0.0.1", port=PORT, db=2, socket_timeout=5,
                       socket_connect_timeout=5)


class HeldChordBackend(AuditedRedisBackend):  # type: ignore[misc]
    """The audited backend, except that a chord part returned by the worker named in
    ``chord-hold:<task id>`` (db 2) waits for ``chord-go:<task id>`` first: a test holds the
    newer run between its result write and its chord part, where the stale run can slip in."""

    def on_chord_part_return(self, request: Any, state: Any, result: Any, **kw: Any) -> Any:
        r = side()
        held = r.get(f"chord-hold:{request.id}")
        if held is not None and held.decode() == request.hostname:
            deadline = time.monotonic() + 60
            while not r.exists(f"chord-go:{request.id}") and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().on_chord_part_return(request, state, result, **kw)


def _app(name: str, *, broker_db: int, results: str) -> Celery:
    app = Celery(name, broker=f"redis://127.0.0.1:{PORT}/{broker_db}", backend=results)
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True, result_expires=600,
        redis_socket_timeout=5, redis_socket_connect_timeout=5,
        broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
        worker_hijack_root_logger=True, worker_redirect_stdouts=False,
    )
    return app


def _tasks(app: Celery) -> SimpleNamespace:
    @app.task(name="canvas.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="canvas.mul", shared=False)
    def mul(x: int, y: int) -> int:
        return x * y

    @app.task(name="canvas.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    @app.task(name="canvas.boom", shared=False)
    def boom(*_: Any) -> None:
        raise ValueError("boom")

    @app.task(name="canvas.note", shared=False)
    def note(value: Any, key: str) -> Any:
        """A link callback: records the value it was called with."""
        side().rpush(f"links:{key}", json.dumps(value))
        return value

    @app.task(name="canvas.on_error", shared=False)
    def on_error(request: Any, exc: Any, traceback: Any, key: str) -> None:
        """A link_error errback: records which task failed, and how."""
        side().rpush(f"errbacks:{key}", json.dumps([request.id, type(exc).__name__]))

    @app.task(bind=True, name="canvas.replace_with", shared=False)
    def replace_with(self: Any, x: int, kind: str) -> Any:
        """Replaces itself by a canvas built from ``x``."""
        sigs = {
            "single": lambda: add.s(x, 1),
            "chain": lambda: chain(add.s(x, 1), mul.s(2)),
            "group": lambda: group(add.s(x, i) for i in range(3)),
            "chain_group": lambda: chain(add.s(x, 1), group(mul.s(i) for i in range(1, 4))),
            "second": lambda: replace_with.s(x * 10, "single"),
            "boom": lambda: boom.s(x),
        }
        raise self.replace(sigs[kind]())

    @app.task(bind=True, name="canvas.retry_then", shared=False)
    def retry_then(self: Any, x: int, key: str, times: int) -> int:
        side().rpush(f"runs:{key}", self.request.retries)
        if self.request.retries < times:
            raise self.retry(countdown=0.2, max_retries=times)
        return x

    @app.task(bind=True, name="canvas.autoretry", autoretry_for=(KeyError,), shared=False,
              default_retry_delay=0.1, max_retries=3)
    def autoretry(self: Any, x: int, key: str, failures: int) -> int:
        if side().incr(f"tries:{key}") <= failures:
            raise KeyError(key)
        return x

    @app.task(bind=True, name="canvas.record", shared=False)
    def record(self: Any, key: str, again: bool = False) -> int:
        """Records each run; with ``again``, the first run re-publishes itself under its own id."""
        n = int(side().rpush(f"runs:{key}", json.dumps(self.request.id)))
        if again and n == 1:
            self.apply_async((key,), {"again": True}, task_id=self.request.id)
        return n

    @app.task(name="canvas.gated_add", shared=False)
    def gated_add(x: int, y: int, gate: str) -> int:
        """``x + y`` once the test opens ``gate:<gate>`` (at most 60 s)."""
        r = side()
        deadline = time.monotonic() + 60
        while not r.exists(f"gate:{gate}") and time.monotonic() < deadline:
            time.sleep(0.05)
        return x + y

    @app.task(bind=True, name="canvas.fenced_part", shared=False)
    def fenced_part(self: Any, key: str) -> int:
        """Records its start, waits for ``gate:<key>``, then commits through a write fenced by
        its claim token; a stale run (an older token than the committed one) fails."""
        r = side()
        token = current_claim()
        r.rpush(f"runs:{key}", json.dumps({"token": token, "host": self.request.hostname}))
        deadline = time.monotonic() + 60
        while not r.exists(f"gate:{key}") and time.monotonic() < deadline:
            time.sleep(0.05)
        accepted = bool(r.eval(_FENCED_WRITE, 1, f"commit:{key}", token or 0))
        r.rpush(f"ends:{key}", json.dumps({"token": token, "accepted": accepted}))
        if not accepted:
            raise ValueError(f"stale run of {key} (token {token})")
        return 100

    return SimpleNamespace(add=add, mul=mul, tsum=tsum, boom=boom, note=note,
                           on_error=on_error, replace_with=replace_with, retry_then=retry_then,
                           autoretry=autoretry, gated_add=gated_add, fenced_part=fenced_part,
                           record=record)


def _make(mode: str, pool: str) -> Celery:
    if mode == "stock":
        app = _app(f"canvas_stock_{pool}", broker_db=3, results=f"redis://127.0.0.1:{PORT}/4")
    else:
        app = _app(f"canvas_crawl_{pool}", broker_db=1,
                   results=f"tests.system.canvasapp:HeldChordBackend+redis://127.0.0.1:{PORT}/0")
        # The lease store on the broker's database: claims and ends ride in kombu's round trips.
        app.conf.update(crawl_lease_url=f"redis://127.0.0.1:{PORT}/1",
                        crawl_namespace="canvas", crawl_worker_lease_ttl=3, crawl_done_ttl=600,
                        crawl_store_timeout=1.0, crawl_reaper_interval=1.0)
        celery_crawl.install(app)
    # One queue per worker: a canvas stays on the worker its test chose.
    app.conf.task_default_queue = f"canvas-{mode}-{pool}"
    return app


MODES = ("stock", "crawl")
POOLS = ("prefork", "threads")
APPS = {(mode, pool): _make(mode, pool) for mode in MODES for pool in POOLS}
TASKS = {key: _tasks(app) for key, app in APPS.items()}
stock_prefork = APPS["stock", "prefork"]
stock_threads = APPS["stock", "threads"]
crawl_prefork = APPS["crawl", "prefork"]
crawl_threads = APPS["crawl", "threads"]
