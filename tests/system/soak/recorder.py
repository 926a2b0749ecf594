"""The soak's Celery app: ``celery -A tests.system.soak.recorder worker|beat``.

Everything comes from ``SOAK_*`` environment variables written by ``stack.Stack`` so that beat
replicas and workers of one run share one configuration:

``SOAK_BROKER_URL``, ``SOAK_BACKEND_URL``, ``SOAK_LEASE_URL``, ``SOAK_NAMESPACE``,
``SOAK_SCHEDULES`` (glob of schedule files), ``SOAK_SINK_URL`` (the evidence Redis),
``SOAK_BEAT_TTL``, ``SOAK_WORKER_TTL``, ``SOAK_VERIFY_DELIVERY`` (``crawl_beat_verify_delivery``,
4 s), ``SOAK_SENTINEL_MASTER`` (the master's name when the broker is ``sentinel://``).

The task ``record`` stamps its external write with the claim token the worker step gives it, the
way a real crawler should stamp its output: the sink accepts a write for ``(entry, slot)`` only
if its token is not older than the newest accepted one. Every start and every accepted or
refused completion is appended to a list in the sink, so the ledger sees all of it.

Its ``rollback`` undoes the write of the run it is called for (``crawl_rollback_token``): the
run that takes a key over from a worker killed after the write but before the result undoes
that write first, and raises the slot's token floor to its own token so the dead run, were it
only frozen, cannot write again. The undo is an append to ``soak:undone``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

SINK_STARTS = "soak:starts"
SINK_DONE = "soak:done"
SINK_FENCED = "soak:fenced"
SINK_UNDONE = "soak:undone"
_TOKEN_KEY = "soak:token:{entry}|{slot}"

# A run registers its token when it starts (the newest token wins), and its final write is
# accepted only if no newer run has registered since: a stale run resumed after a freeze cannot
# make its effect stick once the run that replaced it has begun. ``tonumber`` is exact for
# tokens below 2**53 (Redis TIME in microseconds is about 2**50).
_REGISTER = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('RPUSH', KEYS[2], ARGV[2])
return 1
"""
_FENCED_WRITE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local tok = tonumber(ARGV[1])
if tok < cur then
  redis.call('RPUSH', KEYS[3], ARGV[2])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[2])
return 1
"""

try:  # the idempotent base (issue E); the soak runs without it, and says so
    from celery_crawl.tasks import IdempotentTask as _Base  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on what is installed
    from celery import Task as _Base

HAS_IDEMPOTENT_TASK = _Base.__name__ == "IdempotentTask"


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise RuntimeError(f"{name} is not set (the soak's stack sets it)")
    return value


app = Celery("soak")
app.conf.update(
    broker_url=_env("SOAK_BROKER_URL", "redis://127.0.0.1:1/0"),
    result_backend=_env("SOAK_BACKEND_URL", "redis://127.0.0.1:1/0"),
    crawl_lease_url=_env("SOAK_LEASE_URL", "redis://127.0.0.1:1/0"),
    crawl_namespace=_env("SOAK_NAMESPACE", "soak"),
    crawl_schedule_paths=[_env("SOAK_SCHEDULES", "/nonexistent/*.toml")],
    crawl_beat_lease_ttl=float(_env("SOAK_BEAT_TTL", "3")),
    crawl_worker_lease_ttl=float(_env("SOAK_WORKER_TTL", "3")),
    crawl_store_timeout=1.0,
    # Every soak worker runs the worker plugin: a run lost between the Redis broker and a
    # worker (popped, then the worker killed) is published again by the leader.
    crawl_beat_verify_delivery=float(_env("SOAK_VERIFY_DELIVERY", "4")),
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600, **(
        {"master_name": os.environ["SOAK_SENTINEL_MASTER"]}
        if os.environ.get("SOAK_SENTINEL_MASTER") else {})},
    result_backend_transport_options={"retry_policy": {"timeout": 5.0}},
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=True,
    beat_max_loop_interval=1,
    timezone="UTC",
    enable_utc=True,
)

from celery_crawl import install as _install  # noqa: E402 - after the settings it validates
from celery_crawl.worker import install_worker  # noqa: E402

_install(app)
install_worker(app)  # idempotent; install() may already have done it

_sink: redis.Redis | None = None


def sink() -> redis.Redis:
    """The evidence Redis (per process; prefork children open their own after fork)."""
    global _sink
    if _sink is None:
        _sink = redis.Redis.from_url(_env("SOAK_SINK_URL"), socket_timeout=5,
                                     socket_connect_timeout=5, retry_on_timeout=True)
    return _sink


def _claim_token(task: Any) -> int | None:
    token = getattr(task.request, "crawl_claim_token", None)
    if token is None:
        try:
            from celery_crawl import current_claim  # type: ignore[attr-defined]

            claim = current_claim()
            token = getattr(claim, "token", claim)
        except Exception:
            token = None
    return int(token) if isinstance(token, int | str) and str(token).isdigit() else None


class _Recorder(_Base):  # type: ignore[misc,valid-type]
    def rollback(self, exc: BaseException, task_id: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        req = self.request
        entry = getattr(req, "crawl_entry", None) or (args[0] if args else None)
        slot = getattr(req, "crawl_slot", None)
        undone = getattr(req, "crawl_rollback_token", None)
        own = _claim_token(self)
        key = _TOKEN_KEY.format(entry=entry, slot=slot)
        # Raise the slot's floor to this run's token, then record the undo (the ledger voids
        # accepted writes of the undone token for that slot).
        sink().eval(_REGISTER, 2, key, SINK_UNDONE, -1 if own is None else own,
                    json.dumps({"task_id": req.id, "entry": entry, "slot": slot,
                                "claim_token": undone, "by_token": own,
                                "reason": type(exc).__name__, "worker": req.hostname,
                                "t": time.time()}))


@app.task(bind=True, base=_Recorder, name="soak.record", acks_late=True)
def record(self: Any, entry: str, duration_s: float = 0.0) -> dict[str, Any]:
    """One scheduled run: note its start, work for ``duration_s``, write the fenced result."""
    req = self.request
    base = {
        "task_id": req.id,
        "entry": getattr(req, "crawl_entry", None) or entry,
        "slot": getattr(req, "crawl_slot", None),
        "leader_token": getattr(req, "crawl_leader_token", None),
        "claim_token": _claim_token(self),
        "worker": req.hostname,
        "pid": os.getppid(),
        "delivery": (req.delivery_info or {}).get("redelivered"),
    }
    t_start = time.time()
    token = base["claim_token"]
    key = _TOKEN_KEY.format(entry=base["entry"], slot=base["slot"])
    sink().eval(_REGISTER, 2, key, SINK_STARTS, -1 if token is None else token,
                json.dumps({**base, "t": t_start}))
    if duration_s:
        time.sleep(duration_s)
    done = {**base, "t_start": t_start, "t": time.time()}
    accepted = sink().eval(_FENCED_WRITE, 3, key, SINK_DONE, SINK_FENCED,
                           -1 if token is None else token, json.dumps(done))
    return {"entry": base["entry"], "slot": base["slot"], "accepted": bool(accepted)}
