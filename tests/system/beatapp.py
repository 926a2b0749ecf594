"""Celery app for the HA-beat system tests and the beat benchmark.

Configured from the environment:

* ``CRAWL_B_BROKER`` — broker URL (Redis);
* ``CRAWL_B_LEASE`` — ``crawl_lease_url`` (Redis or etcd); ``CRAWL_B_NS`` — namespace;
* ``CRAWL_B_TTL`` — ``crawl_beat_lease_ttl``; ``CRAWL_B_SINK`` — Redis URL the task records to;
* ``CRAWL_B_ENTRIES`` — how many every-second entries (``e0``, ``e1`` ...), default 2;
* ``CRAWL_B_CRON`` — their cron expression (default every second, 6 fields);
* ``CRAWL_B_TZ`` — its zone (default UTC);
* ``CRAWL_B_INTERVAL`` — use a Celery interval of this many seconds instead (so stock beat and
  RedBeat, which cannot store a TzCron, run the same burst);
* ``CRAWL_B_METRICS`` — ``crawl_metrics_port``;
* ``CRAWL_B_VERIFY`` — ``crawl_beat_verify_delivery`` (seconds); also installs the worker plugin
  (``crawl_worker_lease_ttl`` 3 s), which the delivery check needs on every worker;
* ``CRAWL_B_REDBEAT_URL`` / ``CRAWL_B_REDBEAT_LOCK`` / ``CRAWL_B_MAX_LOOP`` — RedBeat's Redis,
  lock timeout and ``beat_max_loop_interval`` (benchmark only).

``record`` appends one JSON line ``{entry, slot, id, token, manual}`` to the sink list ``runs``,
so a test can check every (entry, slot) ran exactly once.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery

from celery_crawl.schedules import TzCron

_env = os.environ.get

app = Celery("beattest", broker=_env("CRAWL_B_BROKER"))
_schedule: Any = (float(_env("CRAWL_B_INTERVAL", "0")) if _env("CRAWL_B_INTERVAL")
                  else TzCron(_env("CRAWL_B_CRON", "* * * * * *"), _env("CRAWL_B_TZ", "UTC")))
app.conf.update(
    broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    worker_hijack_root_logger=True,
    worker_redirect_stdouts=False,
    crawl_lease_url=_env("CRAWL_B_LEASE"),
    crawl_namespace=_env("CRAWL_B_NS", "beattest"),
    crawl_beat_lease_ttl=float(_env("CRAWL_B_TTL", "3")),
    crawl_schedule_paths=[],
    crawl_store_timeout=1.0,
    crawl_metrics_port=int(_env("CRAWL_B_METRICS")) if _env("CRAWL_B_METRICS") else None,
    beat_schedule={
        f"e{i}": {"task": "beatapp.record", "schedule": _schedule}
        for i in range(int(_env("CRAWL_B_ENTRIES", "2")))
    },
)
if _env("CRAWL_B_REDBEAT_URL"):
    app.conf.redbeat_redis_url = _env("CRAWL_B_REDBEAT_URL")
    if _env("CRAWL_B_REDBEAT_LOCK"):
        app.conf.redbeat_lock_timeout = int(_env("CRAWL_B_REDBEAT_LOCK", "0"))
if _env("CRAWL_B_MAX_LOOP"):
    app.conf.beat_max_loop_interval = float(_env("CRAWL_B_MAX_LOOP", "0"))

if _env("CRAWL_B_VERIFY"):
    from celery_crawl.worker import install_worker

    app.conf.update(crawl_beat_verify_delivery=float(_env("CRAWL_B_VERIFY", "0")),
                    crawl_worker_lease_ttl=3.0)
    install_worker(app)

_sink: redis.Redis | None = None


def _sink_client() -> redis.Redis | None:
    global _sink
    url = _env("CRAWL_B_SINK")
    if _sink is None and url:
        _sink = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    return _sink


@app.task(name="beatapp.record", bind=True)
def record(self: Any, *args: Any, **kwargs: Any) -> None:
    req = self.request
    line = {
        "entry": getattr(req, "crawl_entry", None),
        "slot": getattr(req, "crawl_slot", None),
        "id": req.id,
        "token": getattr(req, "crawl_leader_token", None),
        "manual": bool(getattr(req, "crawl_manual", False)),
    }
    sink = _sink_client()
    if sink is not None:
        sink.rpush("runs", json.dumps(line))
