"""Throughput benchmark: how fast one worker drains a queue, stock Celery against the plugins.

Run: ``.venv/bin/python -m benchmarks.throughput [--tasks 3000] [--repeat 2] [--quick]``
(needs redis-server; the RabbitMQ rows are skipped when RabbitMQ is not on 127.0.0.1:5672).

For every broker (Redis, RabbitMQ) x pool (prefork ``-c 2``, threads ``-c 4``) x setup:

* ``stock`` — Celery with ``task_acks_late`` and the plain ``redis://`` result backend;
* ``plugins`` — ``celery_crawl.install(app)`` and the audited ``crawlredis://`` backend;
* ``idem`` — the same, with the task on ``IdempotentTask``;

N no-op tasks are queued first, then one worker is started; the rate is N over the time from
the first to the last result's ``date_done``. Setups are interleaved and each is run ``repeat``
times (best kept), so a drift of the machine's load hits all of them alike. The table's ratio is
against stock Celery in the same broker x pool.

A second, untimed run of each setup profiles where the extra time goes: the worker is started
on an empty queue, warmed up, then fed N tasks; every redis-py round trip is counted by server
(broker, result backend and lease store are three servers here, so each count is attributed),
and the CPU of the worker's main process, of its pool children and of the Redis servers is read
from ``/proc`` (on two cores every process's CPU per task counts: they share the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from celery import Celery  # noqa: E402

from tests.servers import RedisServer, delete_rabbit_vhost, make_rabbit_vhost  # noqa: E402

CELERY = str(Path(sys.executable).with_name("celery"))
APP = "benchmarks._throughput_app"
MODES = ("stock", "plugins", "idem")
POOLS = {"prefork": 2, "threads": 4}
TASK = {"stock": "tp.noop", "plugins": "tp.noop", "idem": "tp.idem"}


@dataclass
class Setup:
    broker: str  # "redis" | "rabbitmq"
    pool: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.broker}/{self.pool}/{self.mode}"


@dataclass
class Servers:
    """The servers of one run: broker, backend and lease store, shared or separate."""

    broker_url: str
    backend: RedisServer
    lease: RedisServer
    vhost: str | None = None
    owned: list[RedisServer] = field(default_factory=list)

    def backend_url(self, mode: str) -> str:
        scheme = "redis" if mode == "stock" else "crawlredis"
        return f"{scheme}://127.0.0.1:{self.backend.port}/0"

    def close(self) -> None:
        for server in self.owned:
            server.cleanup()
        if self.vhost:
            delete_rabbit_vhost(self.vhost)


def servers_for(broker: str, *, separate: bool) -> Servers:
    backend = RedisServer().start()
    owned = [backend]
    lease = backend
    if separate:
        lease = RedisServer().start()
        owned.append(lease)
    vhost = None
    if broker == "redis":
        broker_server = RedisServer().start() if separate else backend
        if separate:
            owned.append(broker_server)
        broker_url = broker_server.url
    else:
        vhost = make_rabbit_vhost()
        assert vhost, "RabbitMQ is not reachable"
        broker_url = f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    return Servers(broker_url, backend, lease, vhost, owned)


def client_app(servers: Servers, mode: str) -> Celery:
    app = Celery("tp-client", broker=servers.broker_url, backend=servers.backend_url(mode))
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                    broker_connection_retry_on_startup=True)
    return app


def publish(app: Celery, mode: str, queue: str, n: int) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(n)]
    with app.producer_or_acquire() as producer:
        for i, task_id in enumerate(ids):
            app.send_task(TASK[mode], args=[i], task_id=task_id, queue=queue,
                          producer=producer)
    return ids


def start_worker(setup: Setup, servers: Servers, queue: str, log: Path,
                 extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TP_MODE": setup.mode,
           "TP_BROKER": servers.broker_url, "TP_BACKEND": servers.backend_url(setup.mode),
           "TP_LEASE": servers.lease.url, **(extra_env or {})}
    args = [CELERY, "-A", APP, "worker", "-P", setup.pool, "-c", str(POOLS[setup.pool]),
            "-Q", queue, "-n", f"tp-{uuid.uuid4().hex[:6]}@bench", "-l", "WARNING",
            "--without-mingle", "--without-gossip", "--without-heartbeat"]
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, cwd=str(ROOT), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop_worker(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Warm shutdown (SIGTERM to the main process), then kill the group if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    proc.wait(timeout=10)


def wait_results(app: Celery, ids: list[str], timeout_s: float,
                 proc: subprocess.Popen[bytes], log: Path) -> list[dict[str, Any]]:
    """Poll the result keys until every task has a ready result; return their metas."""
    backend = app.backend
    client = backend.client
    keys = [backend.get_key_for_task(task_id) for task_id in ids]
    deadline = time.monotonic() + timeout_s
    pending = list(range(len(ids)))
    while pending:
        if time.monotonic() > deadline or proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{len(pending)} of {len(ids)} results missing; worker log:\n"
                               f"{tail}")
        still = []
        for start in range(0, len(pending), 1000):
            chunk = pending[start:start + 1000]
            values = client.mget([keys[i] for i in chunk])
            still.extend(i for i, v in zip(chunk, values, strict=True) if v is None)
        pending = still
        if pending:
            time.sleep(0.2)
    return [backend.get_task_meta(task_id) for task_id in ids]


def drain_rate(metas: list[dict[str, Any]]) -> tuple[float, float]:
    """(tasks per second from the first to the last result, seconds)."""
    done = sorted(_ts(m["date_done"]) for m in metas)
    bad = [m for m in metas if m.get("status") != "SUCCESS"]
    if bad:
        raise RuntimeError(f"{len(bad)} tasks did not succeed, e.g. {bad[0]}")
    span = done[-1] - done[0]
    return (len(done) - 1) / span if span > 0 else float("inf"), span


def _ts(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def timed(setup: Setup, n: int, workdir: Path, extra_env: dict[str, str] | None = None) -> float:
    """One cold drain: N tasks queued, then one worker started; tasks per second."""
    servers = servers_for(setup.broker, separate=False)
    queue = f"tp-{uuid.uuid4().hex[:8]}"
    log = workdir / f"{setup.label.replace('/', '-')}-{queue}.log"
    proc = None
    try:
        app = client_app(servers, setup.mode)
        ids = publish(app, setup.mode, queue, n)
        proc = start_worker(setup, servers, queue, log, extra_env)
        metas = wait_results(app, ids, timeout_s=max(120.0, n / 20), proc=proc, log=log)
        return drain_rate(metas)[0]
    finally:
        if proc is not None:
            stop_worker(proc)
        servers.close()


def _cpu(proc: psutil.Process) -> tuple[float, float]:
    """(CPU seconds of the main process, CPU seconds of its pool children)."""
    main = proc.cpu_times()
    children = 0.0
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        children += t.user + t.system
    return main.user + main.system, children


def _redis_cpu(servers: Servers) -> float:
    """CPU seconds of the run's own Redis servers (the benchmark starts them; RabbitMQ is not
    counted). It includes the N publishes and the result polling, alike for every setup."""
    total = 0.0
    for server in servers.owned:
        if server.proc is not None:
            t = psutil.Process(server.proc.pid).cpu_times()
            total += t.user + t.system
    return total


def profile(setup: Setup, n: int, workdir: Path, *, separate: bool = True) -> dict[str, Any]:
    """Round trips per task by server and CPU per task, on a warm worker fed N tasks.

    ``separate=False`` puts broker, backend and lease store on one server, as the timed run
    does: a Redis broker's round trips then carry the claims and ends (``worker/riding.py``),
    and every round trip is counted under the broker."""
    servers = servers_for(setup.broker, separate=separate)
    queue = f"tp-{uuid.uuid4().hex[:8]}"
    counts = Path(tempfile.mkdtemp(prefix="tp-counts-", dir=workdir))
    log = workdir / f"profile-{setup.label.replace('/', '-')}-{queue}.log"
    proc = None
    try:
        app = client_app(servers, setup.mode)
        proc = start_worker(setup, servers, queue, log, {"TP_COUNT_DIR": str(counts)})
        warm = publish(app, setup.mode, queue, 20)
        wait_results(app, warm, 120, proc, log)
        ps = psutil.Process(proc.pid)
        cpu0, redis0 = _cpu(ps), _redis_cpu(servers)
        ids = publish(app, setup.mode, queue, n)
        wait_results(app, ids, max(120.0, n / 20), proc, log)
        cpu1, redis1 = _cpu(ps), _redis_cpu(servers)
        stop_worker(proc)
        proc = None
        main: Counter[str] = Counter()
        child: Counter[str] = Counter()
        for path in counts.glob("*.json"):
            (main if path.name.startswith("main-") else child).update(json.loads(
                path.read_text()))
        ports = {"broker": str(_port(servers.broker_url)), "backend": str(servers.backend.port),
                 "lease": str(servers.lease.port)}
        if not separate:
            ports = {"broker": ports["broker"], "backend": "-", "lease": "-"}
        total = n + len(warm)
        return {
            "rt": {f"{where}:{role}": (src[port] / total)
                   for role, src in (("main", main), ("child", child))
                   for where, port in ports.items()},
            "cpu_main_ms": (cpu1[0] - cpu0[0]) * 1000 / n,
            "cpu_child_ms": (cpu1[1] - cpu0[1]) * 1000 / n,
            "cpu_redis_ms": (redis1 - redis0) * 1000 / n,
        }
    finally:
        if proc is not None:
            stop_worker(proc)
        servers.close()
        shutil.rmtree(counts, ignore_errors=True)


#: ``TP_TAKE_APART`` setups of ``_throughput_app``: each leaves one part of the plugins out.
TAKE_APART = ("no-steps", "plain-backend", "empty-scripts")


def take_apart(pools: list[str], n: int, repeat: int, workdir: Path) -> None:
    """What each part of the plugins costs: stock, the plugins, and the plugins with one part
    left out, interleaved, on a Redis broker (medians of ``repeat`` runs)."""
    rows = [("stock", ""), ("plugins", ""), *(("plugins", what) for what in TAKE_APART)]
    print("# Taken apart (diagnostics: each setup leaves one part out and breaks guarantees)\n")
    for pool in pools:
        rates: dict[str, list[float]] = {}
        for _ in range(repeat):
            for mode, what in rows:
                env = {"TP_TAKE_APART": what} if what else None
                rate = timed(Setup("redis", pool, mode), n, workdir, env)
                rates.setdefault(what or mode, []).append(rate)
                print(f"  redis/{pool}/{what or mode:<14} {rate:8.1f} tasks/s", flush=True)
        stock = statistics.median(rates["stock"])
        print()
        print("| pool | setup | tasks/s (median) | ratio vs stock |")
        print("|---|---|---|---|")
        for label, got in rates.items():
            median = statistics.median(got)
            print(f"| {pool} | {label} | {median:.0f} | {median / stock:.2f} |")
        print()


def _port(url: str) -> int:
    rest = url.split("://", 1)[1].split("/", 1)[0]
    return int(rest.rsplit(":", 1)[1]) if ":" in rest else 5672


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--brokers", default="redis,rabbitmq")
    parser.add_argument("--pools", default="prefork,threads")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="300 tasks, one repeat")
    parser.add_argument("--take-apart", action="store_true",
                        help="only the diagnostic runs leaving one part of the plugins out")
    args = parser.parse_args(argv)
    n, repeat = (300, 1) if args.quick else (args.tasks, args.repeat)
    if args.take_apart:
        workdir = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
        take_apart(args.pools.split(","), n, repeat, workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    brokers = [b for b in args.brokers.split(",") if b]
    if "rabbitmq" in brokers:
        probe = make_rabbit_vhost()
        if probe is None:
            print("RabbitMQ not reachable on 127.0.0.1:5672: its rows are skipped")
            brokers.remove("rabbitmq")
        else:
            delete_rabbit_vhost(probe)
    workdir = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    print(f"# Throughput: one worker draining {n} queued no-op tasks "
          f"(best of {repeat}; logs in {workdir})\n")
    rates: dict[str, list[float]] = {}
    for broker in brokers:
        for pool in args.pools.split(","):
            for _ in range(repeat):
                for mode in MODES:
                    setup = Setup(broker, pool, mode)
                    rate = timed(setup, n, workdir)
                    rates.setdefault(setup.label, []).append(rate)
                    print(f"  {setup.label:<26} {rate:8.1f} tasks/s", flush=True)
    print()
    # Both ratios: best against best, and median against median (a threads pool's stock rate
    # moves by up to 50% between runs here, so one lucky stock run decides the first).
    print("| broker | pool | setup | tasks/s (best) | median | ratio vs stock (best) "
          "| ratio vs stock (median) |")
    print("|---|---|---|---|---|---|---|")
    for broker in brokers:
        for pool in args.pools.split(","):
            stock_rates = rates[Setup(broker, pool, "stock").label]
            stock, stock_median = max(stock_rates), statistics.median(stock_rates)
            for mode in MODES:
                got = rates[Setup(broker, pool, mode).label]
                median = statistics.median(got)
                print(f"| {broker} | {pool} -c {POOLS[pool]} | {mode} | {max(got):.0f} | "
                      f"{median:.0f} | {max(got) / stock:.2f} | {median / stock_median:.2f} |")
    if args.no_profile:
        return 0
    print()
    print("# Where the time goes: per task, on a warm worker (broker, backend and lease "
          "store on separate servers)\n")
    print("| broker | pool | setup | broker RT main/child | backend RT main/child "
          "| lease RT main/child | CPU main ms | CPU children ms | CPU redis ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for broker in brokers:
        for pool in args.pools.split(","):
            for mode in MODES:
                p = profile(Setup(broker, pool, mode), n, workdir)
                rt = p["rt"]

                def pair(where: str, rt: dict[str, float] = rt) -> str:
                    return f"{rt[where + ':main']:.2f} / {rt[where + ':child']:.2f}"

                broker_rt = pair("broker") if broker == "redis" else "(amqp)"
                print(f"| {broker} | {pool} | {mode} | {broker_rt} | {pair('backend')} | "
                      f"{pair('lease')} | {p['cpu_main_ms']:.2f} | {p['cpu_child_ms']:.2f} | "
                      f"{p['cpu_redis_ms']:.2f} |", flush=True)
    if "redis" not in brokers:
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    print()
    print("# The same on one server (as timed): every round trip counted under the broker, "
          "claims and ends riding in the broker's own\n")
    print("| broker | pool | setup | all RT main/child | CPU main ms | CPU children ms "
          "| CPU redis ms |")
    print("|---|---|---|---|---|---|---|")
    for pool in args.pools.split(","):
        for mode in MODES:
            p = profile(Setup("redis", pool, mode), n, workdir, separate=False)
            rt = p["rt"]
            print(f"| redis | {pool} | {mode} | {rt['broker:main']:.2f} / "
                  f"{rt['broker:child']:.2f} | {p['cpu_main_ms']:.2f} | "
                  f"{p['cpu_child_ms']:.2f} | {p['cpu_redis_ms']:.2f} |", flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
