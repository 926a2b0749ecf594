"""Celery app for the tasks/backend system tests (``celery -A tests.system.tasksapp worker``).

Broker, results and side-effect records live on one private redis-server whose port comes from
``TASKSAPP_REDIS_PORT`` (db 1: broker, db 0: results, db 2: what the tasks did).
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_crawl.tasks import IdempotentTask, remaining

app = Celery("tasksapp")


def configure(port: int) -> None:
    """Point the app at the test's redis-server (before the backend is first used)."""
    app.conf.update(
        broker_url=f"redis://127.0.0.1:{port}/1",
        result_backend=f"crawlredis://127.0.0.1:{port}/0",
        crawl_namespace="tasksapp",
        crawl_worker_lease_ttl=3,
        result_expires=600,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_track_started=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 4, "unacked_restore_interval": 1,
                                  "unacked_restore_throttle": 1},
        redis_socket_timeout=5,
        redis_socket_connect_timeout=5,
        crawl_max_deliveries=int(os.environ.get("TASKSAPP_MAX_DELIVERIES") or 5),
    )
    app._local.__dict__.pop("backend", None)  # a backend made for an earlier server


if os.environ.get("TASKSAPP_REDIS_PORT"):
    configure(int(os.environ["TASKSAPP_REDIS_PORT"]))
if os.environ.get("TASKSAPP_WORKER_PLUGIN") == "1":
    from celery_crawl.worker import install_worker

    install_worker(app)


def side() -> redis.Redis:
    """Client for db 2, where tasks record what they did."""
    port = int(os.environ.get("TASKSAPP_REDIS_PORT") or app.conf.broker_url.rsplit(":", 1)[1]
               .split("/")[0])
    return redis.Redis(host="127.0.0.1", port=port, db=2, socket_timeout=5,
                       socket_connect_timeout=5)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task(bind=True)
def claim_token(self) -> int | None:
    """The claim token the worker plugin gave this run."""
    return getattr(self.request, "crawl_claim_token", None)


@app.task
def total(values: list[int]) -> int:
    return sum(values)


class Recorded(IdempotentTask):  # type: ignore[misc]
    """Records every rollback as ``rollbacks:<name>`` in db 2.

    ``events:<name>`` orders runs of ``slow`` (``run:<claim token>``) and completed rollbacks
    (``rollback:<exception class>:<token rolled back>``).

    Every attempt is recorded in ``rollback-start:<name>`` (task id) and ``rollback-at:<name>``
    (``time.monotonic()``, system-wide on Linux). Hooks set by a test: ``rollback-hang:<name>``
    hangs the first attempt, ``rollback-fails:<name>`` = N fails the first N attempts.
    """

    idempotency_heartbeat_ttl_s = 3.0
    rollback_backoff_s = 0.05

    def rollback(self, exc, task_id, args, kwargs):  # type: ignore[no-untyped-def]
        name = args[0]
        r = side()
        r.rpush(f"rollback-start:{name}", task_id)
        r.rpush(f"rollback-at:{name}", repr(time.monotonic()))
        if r.get(f"rollback-hang:{name}") and r.incr(f"rollback-hung:{name}") == 1:
            time.sleep(60)  # the test kills the worker here
        if r.incr(f"rollback-fail:{name}") <= int(r.get(f"rollback-fails:{name}") or 0):
            raise RuntimeError("rollback failed on purpose")
        r.rpush(f"rollbacks:{name}", task_id)
        r.rpush(f"events:{name}", f"rollback:{type(exc).__name__}:"
                f"{getattr(self.request, 'crawl_rollback_token', None)}")


@app.task(bind=True, base=Recorded)
def flaky(self, name: str, retries: int) -> str:
    """Fails; retries ``retries`` times first (the rollback must run once, at the end)."""
    r = side()
    r.rpush(f"runs:{name}", self.request.id)
    if self.request.retries < retries:
        raise self.retry(countdown=0.05, max_retries=retries)
    raise ValueError(f"{name} failed for good")


@app.task(bind=True, base=Recorded)
def slow(self, name: str, seconds: float, fail: bool = False, gated: bool = False) -> str:
    """Runs for ``seconds`` (gated: until the test sets ``gate:<name>``, at most ``seconds``);
    records its start."""
    r = side()
    r.rpush(f"runs:{name}", self.request.id)
    r.rpush(f"events:{name}", f"run:{getattr(self.request, 'crawl_claim_token', None)}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (gated and r.exists(f"gate:{name}")):
        time.sleep(0.05)
    if fail:
        raise ValueError(f"{name} failed")
    return f"done:{name}"


@app.task(bind=True, base=Recorded)
def suicide(self, name: str) -> None:
    """Kills its own pool process on every delivery: the worker plugin ends it as poison."""
    side().rpush(f"runs:{name}", self.request.id)
    os.kill(os.getpid(), 9)


@app.task(bind=True, base=Recorded)
def usurped(self, name: str) -> str:
    """Records its effect, then loses its key as if a newer run had taken it over while this
    one was frozen after its body (the owner changes before the run's last check)."""
    side().rpush(f"runs:{name}", self.request.id)
    record = self._ledger(self.idempotency_key((name,), {})).record_key
    self.backend.client.hset(record, "owner", f"usurper-{name}")
    return f"done:{name}"


@app.task
def linked(value: object, name: str) -> None:
    """A link callback: records that it was published and ran."""
    side().rpush(f"linked:{name}", repr(value))


class Keyed(Recorded):
    def idempotency_key(self, args, kwargs):  # type: ignore[no-untyped-def]
        return f"keyed:{args[0]}"


@app.task(bind=True, base=Keyed)
def keyed(self, name: str, fail: bool = False) -> dict[str, object]:
    """Keyed by ``name``: a second call with the same name replays the first outcome."""
    side().rpush(f"runs:{name}", self.request.id)
    if fail:
        raise KeyError(f"{name} is broken")
    return {"name": name, "by": self.request.id}


@app.task(bind=True, base=IdempotentTask)
def probe(self, previous: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    """Returns what each link of a chain saw of its deadline."""
    seen = list(previous or [])
    seen.append({
        "id": self.request.id,
        "deadline": getattr(self.request, "crawl_deadline", None),
        "remaining": self.remaining(),
        "expires": self.request.expires,
        "timelimit": list(self.request.timelimit or (None, None)),
    })
    return seen


@app.task(bind=True)
def stock_probe(self, previous: list[dict[str, object]]) -> list[dict[str, object]]:
    """A plain task in the chain: it inherits the deadline through the message headers."""
    return [*previous, {
        "id": self.request.id,
        "deadline": getattr(self.request, "crawl_deadline", None),
        "remaining": remaining(),
        "expires": self.request.expires,
        "timelimit": list(self.request.timelimit or (None, None)),
    }]
