"""Shared pieces of the crawler system tests: env for ``workers.crawler``, workers, the sink."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from celery import Celery

from tests.procs import Proc, celery_args
from tests.servers import RedisServer, wait_until


def crawler_env(redis: RedisServer, tmp: Path, db: int = 0, **extra: str) -> dict[str, str]:
    """Environment of a crawler process talking to the private ``redis`` (db ``db``)."""
    env = {
        "REDIS_URL": redis.url_db(db),
        "CRAWL_LEASE_URL": redis.url_db(db),
        "CRAWL_NAMESPACE": f"t{db}",
        "CRAWL_SINK": str(tmp / "sink.sqlite3"),
        "CRAWL_WORKER_LEASE_TTL": "3",
        "CRAWL_BEAT_LEASE_TTL": "3",
        "CRAWL_BACKOFF_BASE": "0.2",
        "CRAWL_BACKOFF_MAX": "2",
        "CRAWL_BUDGET": "60",
    }
    env.update(extra)
    return env


def start_worker(name: str, env: dict[str, str], tmp: Path, *, concurrency: int = 2) -> Proc:
    args = celery_args("workers.crawler", "worker", "--without-mingle", "--without-gossip",
                       "-P", "prefork", "-c", str(concurrency), "-n", f"{name}@%h",
                       "-Q", "crawl", "-l", "INFO")
    return Proc(args, env=env, log_path=tmp / f"{name}.log")


def wait_ready(*procs: Proc, timeout_s: float = 90) -> None:
    for proc in procs:
        wait_until(lambda p=proc: " ready." in p.log() or not p.alive(), timeout_s,
                   what=f"worker ready ({proc.log_path})")
        assert proc.alive(), proc.log()[-3000:]


def client_app(env: dict[str, str]) -> Celery:
    """A bare Celery app that sends to the crawler's queue by task name."""
    app = Celery("crawler-test", broker=env["REDIS_URL"])
    app.conf.task_default_queue = "crawl"
    return app


def rows(sink: Path) -> dict[str, dict[str, Any]]:
    """Every page row of the sink, by URL (empty before the first write)."""
    if not sink.exists():
        return {}
    conn = sqlite3.connect(str(sink), timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return {r["url"]: dict(r) for r in conn.execute("SELECT * FROM pages")}
    except sqlite3.OperationalError:
        return {}
    finally:
        conn.close()


def events(sink: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(str(sink), timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM events ORDER BY id")]
    finally:
        conn.close()
