"""AuditedRedisBackend vs Celery's RedisBackend, side by side on one private redis-server.

    .venv/bin/python benchmarks/backend.py [--tasks 2000]

Per task it stores STARTED then SUCCESS (what a worker with ``task_track_started`` does), then
reads the result with ``AsyncResult.get()``. It reports:

* ``store_result`` and ``AsyncResult.get`` latency (mean, p50, p99), ours vs stock, with ratios;
* round trips per write, counted on the client (one per ``send_packed_command``: a pipeline or
  a script is one) and commands per write on the server (``INFO commandstats`` deltas);
* audit stream bytes per task (``MEMORY USAGE`` of the stream / tasks) and the fence record's
  bytes per task.

Stock and audited writes are interleaved in rounds so that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from celery import Celery, states
from celery.app.task import Context

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.servers import running_redis

_sends = 0
_original_send = redis.connection.AbstractConnection.send_packed_command


def _counting_send(self: Any, command: Any, check_health: bool = True) -> None:
    global _sends
    _sends += 1
    _original_send(self, command, check_health)


def _app(url: str) -> Celery:
    app = Celery(f"bench{uuid.uuid4().hex[:6]}", broker="memory://", backend=url,
                 set_as_current=False)
    app.conf.update(crawl_namespace="bench", result_expires=3600, redis_socket_timeout=5,
                    redis_socket_connect_timeout=5)
    return app


def _commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items()
               if k not in ("cmdstat_info", "cmdstat_config", "cmdstat_memory"))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1000.0  # microseconds


def run(tasks: int) -> int:
    global _sends
    redis.connection.AbstractConnection.send_packed_command = _counting_send  # type: ignore[method-assign]
    with running_redis() as server:
        client = server.client()
        stock = _app(f"redis://127.0.0.1:{server.port}/0")
        ours = _app(f"crawlredis://127.0.0.1:{server.port}/1")
        backends = {"stock": stock.backend, "ours": ours.backend}
        ids = {name: [str(uuid.uuid4()) for _ in range(tasks)] for name in backends}
        request = Context(hostname="bench@host")
        # warm up: connections, script load
        for backend in backends.values():
            warm = str(uuid.uuid4())
            backend.store_result(warm, None, states.STARTED, request=request)
            backend.store_result(warm, 1, states.SUCCESS, request=request)
        store: dict[str, list[float]] = {n: [] for n in backends}
        sends: dict[str, int] = {n: 0 for n in backends}
        cmds: dict[str, int] = {n: 0 for n in backends}
        chunk = 100
        for start in range(0, tasks, chunk):
            for name, backend in backends.items():
                before_cmds, before_sends = _commands(client), _sends
                for task_id in ids[name][start:start + chunk]:
                    store[name].append(_timed(lambda b=backend, t=task_id: b.store_result(
                        t, {"pid": 1, "hostname": "bench@host"}, states.STARTED,
                        request=request)))
                    store[name].append(_timed(lambda b=backend, t=task_id: b.store_result(
                        t, {"url": "https://example.com/", "items": 42}, states.SUCCESS,
                        request=request)))
                sends[name] += _sends - before_sends
                cmds[name] += _commands(client) - before_cmds - 1  # minus our INFO
        get: dict[str, list[float]] = {n: [] for n in backends}
        apps = {"stock": stock, "ours": ours}
        for start in range(0, tasks, chunk):
            for name, app in apps.items():
                for task_id in ids[name][start:start + chunk]:
                    get[name].append(_timed(lambda a=app, t=task_id: a.AsyncResult(t).get(
                        timeout=10)))
        writes = 2 * tasks
        ours_db = server.client(db=1)
        fence_bytes = ours_db.execute_command("MEMORY", "USAGE",
                                              ours.backend.fence_key(ids["ours"][0]))
        stream_bytes = ours_db.execute_command("MEMORY", "USAGE", ours.backend.audit_key,
                                               "SAMPLES", "0")
        result_bytes = ours_db.execute_command(
            "MEMORY", "USAGE", ours.backend.get_key_for_task(ids["ours"][0]))
        stock_result_bytes = client.execute_command(
            "MEMORY", "USAGE", stock.backend.get_key_for_task(ids["stock"][0]))

    def row(label: str, s: float, o: float, unit: str, ratio: bool = True) -> str:
        r = f"{o / s:6.2f}x" if ratio and s else "      "
        return f"{label:<34} {s:>12.1f} {o:>12.1f}  {r}  {unit}"

    print(f"\n{tasks} tasks, {writes} writes each (STARTED + SUCCESS per task), "
          f"redis-server on loopback\n")
    print(f"{'metric':<34} {'stock':>12} {'audited':>12}  {'ratio':>7}  unit")
    print("-" * 80)
    for label, data in (("store_result", store), ("AsyncResult.get (ready result)", get)):
        print(row(f"{label} mean", statistics.fmean(data["stock"]),
                  statistics.fmean(data["ours"]), "us"))
        print(row(f"{label} p50", _percentile(data["stock"], 0.5),
                  _percentile(data["ours"], 0.5), "us"))
        print(row(f"{label} p99", _percentile(data["stock"], 0.99),
                  _percentile(data["ours"], 0.99), "us"))
    print(row("round trips per write (client)", sends["stock"] / writes, sends["ours"] / writes,
              "sends"))
    print(row("server commands per write", cmds["stock"] / writes, cmds["ours"] / writes,
              "calls"))
    print(row("result key bytes per task", stock_result_bytes, result_bytes, "bytes"))
    print(row("fence record bytes per task", 0, fence_bytes, "bytes", ratio=False))
    print(row("audit stream bytes per task", 0, stream_bytes / (tasks + 1), "bytes",
              ratio=False))
    print(row("audit stream bytes per record", 0, stream_bytes / (writes + 2), "bytes",
              ratio=False))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    return run(parser.parse_args().tasks)


if __name__ == "__main__":
    raise SystemExit(main())
