"""Celery app of the throughput benchmark (``benchmarks/throughput.py``).

One module serves every setup, chosen by the environment:

* ``TP_BROKER`` / ``TP_BACKEND`` — broker and result backend URLs;
* ``TP_MODE`` — ``stock`` (``acks_late``, plain Redis backend), ``plugins`` (``install(app)``,
  the ``crawlredis://`` backend) or ``idem`` (the same, tasks on ``IdempotentTask``);
* ``TP_LEASE`` — ``crawl_lease_url`` (plugins and idem);
* ``TP_COUNT_DIR`` — when set, every redis-py round trip is counted per server port and each
  process writes its counts there when it exits (the profile run; never the timed one);
* ``TP_TAKE_APART`` — diagnostic setups of ``throughput.py --take-apart`` that each leave one
  part of the plugins out (they break the guarantees and only say what each part costs):
  ``no-steps`` (the worker's lease and claim steps removed: only the audited backend is left),
  ``plain-backend`` (the steps with the stock ``redis://`` backend) and ``empty-scripts``
  (claims and ends built and sent as usual, but the ridden scripts make only kombu's own writes
  on the server: the claims' and ends' server time).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery, signals

import celery_crawl
from celery_crawl.tasks import IdempotentTask

_env = os.environ.get
MODE = _env("TP_MODE", "stock")

app = Celery("tp", broker=_env("TP_BROKER"), backend=_env("TP_BACKEND"))
app.conf.update(
    broker_connection_retry_on_startup=True,
    # crawl_store_timeout's default: riding needs kombu's writes bounded by it (ride_gate.py).
    broker_transport_options={"socket_timeout": 2, "socket_connect_timeout": 5},
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=3600,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,
)
TAKE_APART = _env("TP_TAKE_APART", "")
if TAKE_APART == "plain-backend":
    app.conf.result_backend = str(_env("TP_BACKEND")).replace("crawlredis://", "redis://", 1)
if MODE == "stock":
    app.conf.task_acks_late = True
    app.conf.task_reject_on_worker_lost = True
else:
    app.conf.update(crawl_lease_url=_env("TP_LEASE"), crawl_namespace="tp",
                    crawl_worker_lease_ttl=15, crawl_done_ttl=600)
    celery_crawl.install(app)


def _take_apart(what: str) -> None:
    """Leave one part of the plugins out (``TP_TAKE_APART``; diagnostics only)."""
    from celery_crawl.leases.redis import RedisLeaseStore

    if what == "no-steps":
        for group in ("worker", "consumer"):
            for step in list(app.steps[group]):
                if str(getattr(step, "name", "")).startswith("celery_crawl."):
                    app.steps[group].discard(step)
    elif what == "empty-scripts":
        # Only the broker's own writes that each ridden script makes first (ride_*.lua).
        from importlib import resources

        claim, finish = RedisLeaseStore.claim_command, RedisLeaseStore.finish_command
        pkg = resources.files("celery_crawl.leases")
        shas: dict[str, str] = {}

        def _shas(store: Any) -> dict[str, str]:
            if not shas:
                append = (pkg / "ride_append.lua").read_text()
                ack = (pkg / "ride_ack.lua").read_text()
                shas["claim"] = store._client.script_load(
                    append + "\nreturn {1, redis.call('INCR', 'tp:token')}")
                shas["finish"] = store._client.script_load(ack + "\nreturn 1")
            return shas

        def empty_claim(self: Any, *args: Any, **kw: Any) -> Any:
            command, _ = claim(self, *args, **kw)
            return ("EVALSHA", _shas(self)["claim"], *command[2:]), lambda r: int(r[1])

        def empty_finish(self: Any, *args: Any, **kw: Any) -> Any:
            command, _ = finish(self, *args, **kw)
            return ("EVALSHA", _shas(self)["finish"], *command[2:]), lambda r: None

        RedisLeaseStore.claim_command = empty_claim  # type: ignore[method-assign]
        RedisLeaseStore.finish_command = empty_finish  # type: ignore[method-assign]
    elif what not in ("", "plain-backend"):
        raise SystemExit(f"TP_TAKE_APART: unknown setup {what!r}")


if MODE != "stock":
    _take_apart(TAKE_APART)


@app.task(name="tp.noop")
def noop(i: int) -> int:
    return i


@app.task(name="tp.idem", base=IdempotentTask)
def idem(i: int) -> int:
    return i


# -- round-trip counting (profile run only) ----------------------------------------------------
_counts: Counter[str] = Counter()


def _install_counter() -> None:
    from redis.connection import AbstractConnection

    send = AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        _counts[str(getattr(self, "port", "?"))] += 1
        send(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


def _dump(role: str) -> None:
    out = Path(_env("TP_COUNT_DIR", "."))
    (out / f"{role}-{os.getpid()}.json").write_text(json.dumps(dict(_counts)))


if _env("TP_COUNT_DIR"):
    _install_counter()

    @signals.worker_process_shutdown.connect
    def _child_exit(**_: Any) -> None:
        _dump("child")

    @signals.worker_shutdown.connect
    def _main_exit(**_: Any) -> None:
        _dump("main")

    @signals.worker_process_init.connect
    def _child_start(**_: Any) -> None:
        _counts.clear()  # a forked child starts from zero, not from the parent's counts
