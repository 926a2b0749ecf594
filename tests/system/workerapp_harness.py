"""Shared pieces of the worker-lease system tests: environments, workers, reading the sink."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests.procs import Proc, worker_args
from tests.servers import wait_until

APP = "tests.system.workerapp"
TTL_S = 3.0
REAPER_S = 1.0


@dataclass
class Combo:
    """One broker x store x pool combination, with its own namespace and queue."""

    broker: str
    backend: str
    lease: str
    sink: str
    pool: str = "prefork"
    ns: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def queue(self) -> str:
        return f"q-{self.ns}"

    def env(self, **more: str) -> dict[str, str]:
        return {
            "CRAWL_T_BROKER": self.broker, "CRAWL_T_BACKEND": self.backend,
            "CRAWL_T_LEASE": self.lease, "CRAWL_T_NS": self.ns, "CRAWL_T_SINK": self.sink,
            "CRAWL_T_TTL": str(TTL_S), "CRAWL_T_REAPER": str(REAPER_S),
            **self.extra_env, **more,
        }

    def app(self) -> Any:
        """A client app (producer) for this combination."""
        from celery import Celery

        client = Celery("crawltest-client", broker=self.broker, backend=self.backend)
        client.conf.update(broker_connection_retry_on_startup=True, task_serializer="json",
                           broker_transport_options={"socket_timeout": 5})
        return client

    def sink_client(self) -> redis.Redis:
        """One client per combination (closed with its workers)."""
        client = self.__dict__.get("_sink_client")
        if client is None:
            client = redis.Redis.from_url(self.sink, socket_timeout=5, socket_connect_timeout=5)
            self.__dict__["_sink_client"] = client
        return client

    def close(self) -> None:
        client = self.__dict__.pop("_sink_client", None)
        if client is not None:
            client.close()


class Workers:
    """Celery workers of one test; every process group is killed at the end."""

    def __init__(self, combo: Combo, tmp_path: Path) -> None:
        self.combo = combo
        self.tmp_path = tmp_path
        self.procs: dict[str, Proc] = {}

    def start(self, name: str, *, pool: str | None = None, extra: tuple[str, ...] = (),
              env: dict[str, str] | None = None, wait: bool = True) -> Proc:
        hostname = f"{name}-{self.combo.ns}@localhost"
        args = worker_args(APP, pool=pool or self.combo.pool, concurrency=1, hostname=hostname,
                           queues=self.combo.queue, extra=extra)
        proc = Proc(args, env=self.combo.env(**(env or {})),
                    log_path=self.tmp_path / f"{name}.log")
        self.procs[name] = proc
        if wait:
            self.wait_ready(name)
        return proc

    def wait_ready(self, name: str, timeout_s: float = 60) -> None:
        proc = self.procs[name]
        wait_until(lambda: "ready." in proc.log() or not proc.alive(), timeout_s,
                   what=f"worker {name} ready")
        assert proc.alive(), f"worker {name} exited:\n{proc.log()[-3000:]}"

    def hostname(self, name: str) -> str:
        return f"{name}-{self.combo.ns}@localhost"

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.stop(grace_s=3)
        self.combo.close()

    def logs(self) -> str:
        return "\n".join(f"===== {n}\n{p.log()[-6000:]}" for n, p in self.procs.items())


@contextmanager
def workers(combo: Combo, tmp_path: Path) -> Iterator[Workers]:
    ws = Workers(combo, tmp_path)
    try:
        yield ws
    except BaseException:
        print(ws.logs())
        raise
    finally:
        ws.stop_all()


def runs(combo: Combo, key: str, kind: str = "started") -> list[dict[str, Any]]:
    raw = combo.sink_client().lrange(f"{kind}:{key}", 0, -1)
    return [json.loads(r) for r in raw]


def committed(combo: Combo, key: str) -> dict[str, Any] | None:
    raw = combo.sink_client().hget(f"commit:{key}", "value")
    return None if raw is None else json.loads(raw)


def send(combo: Combo, key: str, seconds: float, *, task: str = "crawltest.work",
         task_id: str | None = None, headers: dict[str, str] | None = None) -> str:
    client = combo.app()
    try:
        result = client.send_task(task, args=[key, seconds] if task.endswith("work") else [key],
                                  queue=combo.queue, task_id=task_id, headers=headers)
        return str(result.id)
    finally:
        client.close()
