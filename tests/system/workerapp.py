"""Celery app for the worker-lease system tests and the worker benchmark.

Configured from the environment so one module serves every pool x broker x store combination:

* ``CRAWL_T_BROKER`` / ``CRAWL_T_BACKEND`` — broker and result backend URLs;
* ``CRAWL_T_LEASE`` — ``crawl_lease_url``; ``CRAWL_T_NS`` — ``crawl_namespace``;
* ``CRAWL_T_TTL`` — ``crawl_worker_lease_ttl`` (seconds); ``CRAWL_T_REAPER`` — reaper interval;
* ``CRAWL_T_VT`` — Redis ``visibility_timeout`` (with the restore sweep every second);
* ``CRAWL_T_SINK`` — Redis URL of the fenced sink the tasks write to;
* ``CRAWL_T_STOCK=1`` — stock Celery with ``acks_late`` only (benchmark baseline);
* ``CRAWL_T_MAX_DELIVERIES``, ``CRAWL_T_ON_LOSS``, ``CRAWL_T_STORE_TIMEOUT`` — the
  corresponding ``crawl_*`` settings;
* ``CRAWL_T_BACKEND_TIMEOUT`` — the result backend's socket timeout (its writes then retry
  every 3 s).

The sink is the external system a crawl writes to: every run appends to ``started:<key>``;
``commit:<key>`` is a write that refuses tokens older than the stored one (a fenced write), so a
stale run resumed after a freeze cannot overwrite the newer run's result.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_crawl.worker import current_claim, install_worker

_env = os.environ.get

app = Celery("crawltest", broker=_env("CRAWL_T_BROKER"), backend=_env("CRAWL_T_BACKEND"))
transport: dict[str, Any] = {"socket_timeout": float(_env("CRAWL_T_BROKER_SOCKET_TIMEOUT", "5")),
                             "socket_connect_timeout": 5}
if _env("CRAWL_T_VT"):
    transport.update(visibility_timeout=float(_env("CRAWL_T_VT", "3600")),
                     unacked_restore_interval=1, unacked_restore_throttle=1)
app.conf.update(
    broker_transport_options=transport,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_hijack_root_logger=True,
    worker_redirect_stdouts=False,
    result_expires=3600,
)
if _env("CRAWL_T_STOCK") == "1":
    app.conf.task_acks_late = True
    app.conf.task_reject_on_worker_lost = True
else:
    app.conf.update(
        crawl_lease_url=_env("CRAWL_T_LEASE"),
        crawl_namespace=_env("CRAWL_T_NS", "crawltest"),
        crawl_worker_lease_ttl=float(_env("CRAWL_T_TTL", "3")),
        crawl_max_deliveries=int(_env("CRAWL_T_MAX_DELIVERIES", "5")),
        crawl_on_lease_loss=_env("CRAWL_T_ON_LOSS", "cancel"),
        crawl_done_ttl=600,
        crawl_store_timeout=float(_env("CRAWL_T_STORE_TIMEOUT", "1")),
    )
    if _env("CRAWL_T_REAPER"):
        app.conf.crawl_reaper_interval = float(_env("CRAWL_T_REAPER", "1"))
    install_worker(app)
if _env("CRAWL_T_BACKEND_TIMEOUT"):  # result writes time out and are retried 3 s apart
    app.conf.redis_socket_timeout = float(_env("CRAWL_T_BACKEND_TIMEOUT", "1"))
    app.conf.result_backend_transport_options = {"retry_policy": {
        "max_retries": 30, "interval_start": 3, "interval_step": 0, "interval_max": 3}}

_FENCED_WRITE = """
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and tonumber(cur) > tonumber(ARGV[1]) then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  return 0
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return 1
"""

_sink: tuple[int, redis.Redis] | None = None


def sink() -> redis.Redis:
    """This process's sink client (one per prefork child: never shared across fork)."""
    global _sink
    if _sink is None or _sink[0] != os.getpid():
        client = redis.Redis.from_url(_env("CRAWL_T_SINK") or "redis://127.0.0.1:1/0",
                                      socket_timeout=5, socket_connect_timeout=5)
        _sink = (os.getpid(), client)
    return _sink[1]


@app.task(bind=True, name="crawltest.work")
def work(self: Any, key: str, seconds: float = 0.0) -> bool:
    """Record a start, work for ``seconds``, then commit through the fenced write."""
    token = current_claim()
    header = getattr(self.request, "crawl_claim_token", None)
    run = {"token": token, "header": header, "host": self.request.hostname, "pid": os.getpid(),
           "t": time.time(), "id": self.request.id}
    client = sink()
    client.rpush(f"started:{key}", json.dumps(run))
    # Counted steps, not a deadline: time spent frozen (SIGSTOP) does not count as work done.
    for _ in range(round(seconds / 0.02)):
        time.sleep(0.02)
    accepted = bool(client.eval(_FENCED_WRITE, 2, f"commit:{key}", f"refused:{key}",
                                token if token is not None else 0, json.dumps(run)))
    client.rpush(f"finished:{key}", json.dumps({**run, "accepted": accepted, "t": time.time()}))
    return accepted


@app.task(bind=True, name="crawltest.pulse")
def pulse(self: Any, key: str, seconds: float = 0.0) -> bool:
    """``work`` that also records a heartbeat every 20 ms in ``pulse:<key>`` (host, time): two
    runs overlapped iff one's heartbeats continue after the other started."""
    token = current_claim()
    run = {"token": token, "host": self.request.hostname, "pid": os.getpid(), "t": time.time(),
           "id": self.request.id}
    client = sink()
    client.rpush(f"started:{key}", json.dumps(run))
    for _ in range(round(seconds / 0.02)):
        client.rpush(f"pulse:{key}", json.dumps({"host": run["host"], "t": time.time()}))
        time.sleep(0.02)
    accepted = bool(client.eval(_FENCED_WRITE, 2, f"commit:{key}", f"refused:{key}",
                                token if token is not None else 0, json.dumps(run)))
    client.rpush(f"finished:{key}", json.dumps({**run, "accepted": accepted, "t": time.time()}))
    return accepted


@app.task(bind=True, name="crawltest.die")
def die(self: Any, key: str) -> None:
    """Kill the process running it (a poison message that OOM-kills its child)."""
    sink().rpush(f"started:{key}", json.dumps({"token": current_claim(), "pid": os.getpid(),
                                               "host": self.request.hostname}))
    os._exit(137)
