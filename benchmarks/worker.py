"""Worker lease benchmark: dead-worker recovery time and renewal cost, side by side.

Run: ``.venv/bin/python benchmarks/worker.py [--quick]`` (needs redis-server; RabbitMQ and etcd
rows are skipped when those are missing). Prints two Markdown tables:

1. time from ``kill -9`` of the worker running a task to the task *starting* on another worker:
   celery-crawl (worker TTL 3 s and the default 15 s) vs stock Celery ``acks_late`` (Redis broker:
   the default ``visibility_timeout`` of 3600 s is reported from configuration, not waited for;
   a tuned 60 s one is measured with kombu's restore sweep tuned to every second; RabbitMQ:
   redelivery when the dead connection closes);
2. lease-store round trips and CPU per renewal with 1, 100 and 1000 claimed (running or reserved)
   tasks, plus the broker call that keeps their unacked entries fresh (Redis broker).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_crawl import keys  # noqa: E402
from celery_crawl.leases import open_store  # noqa: E402
from celery_crawl.worker.keeper import Keeper  # noqa: E402
from tests.servers import (  # noqa: E402
    EtcdServer,
    RedisServer,
    delete_rabbit_vhost,
    etcd_binary,
    make_rabbit_vhost,
    wait_until,
)
from tests.system.workerapp_harness import Combo, Workers, runs, send  # noqa: E402


def recovery(combo: Combo, label: str, *, stock: bool, ttl_s: float, timeout_s: float,
             extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Seconds from kill -9 of the worker running a task to the task starting elsewhere."""
    env = dict(extra_env or {})
    env["CRAWL_T_TTL"] = str(ttl_s)
    env["CRAWL_T_REAPER"] = str(ttl_s / 3)
    if stock:
        env["CRAWL_T_STOCK"] = "1"
    combo.extra_env.update(env)
    key = combo.ns
    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    ws = Workers(combo, tmp)
    try:
        ws.start("a", wait=False)
        ws.start("b", wait=False)
        ws.wait_ready("a")
        ws.wait_ready("b")
        send(combo, key, 1.0)
        first = wait_until(lambda: runs(combo, key), 60, what="first run")[0]
        victim = "a" if first["host"] == ws.hostname("a") else "b"
        t_kill = time.time()
        ws.procs[victim].kill9()
        try:
            wait_until(lambda: len(runs(combo, key)) >= 2, timeout_s, interval_s=0.05,
                       what="recovery")
            second = runs(combo, key)[1]
            latency: float | None = second["t"] - t_kill
        except AssertionError:
            latency = None
        wait_until(lambda: runs(combo, key, "finished") or latency is None, 30,
                   what="finish")
        n_runs = len(runs(combo, key))
    finally:
        ws.stop_all()
    return {"setup": label, "latency_s": latency, "runs": n_runs}


def renewal_cost(url: str, label: str, sizes: tuple[int, ...], rounds: int,
                 broker: RedisServer | None) -> list[dict[str, Any]]:
    """Round trips and CPU per renewal with N claims held."""
    out = []
    for n in sizes:
        store = open_store(url, namespace=f"bw{uuid.uuid4().hex[:8]}", timeout_s=5.0)
        keeper = Keeper(store, ttl_s=30.0)
        lease = keeper.acquire_blocking(10)
        items = [(keys.task_claim(f"t{i}"), {"delivery_tag": f"tag{i}", "deliveries": 1})
                 for i in range(n)]
        for start in range(0, n, 100):
            store.claim_many(lease, items[start:start + 100])
        trips, cpu, wall = [], [], []
        for _ in range(rounds):
            before = store.round_trips
            c0, w0 = time.process_time(), time.perf_counter()
            keeper._renew(keeper._lease)  # type: ignore[arg-type]
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            trips.append(store.round_trips - before)
        refresh_ms = None
        if broker is not None:
            client = broker.client(1)
            tags = [f"tag{i}" for i in range(n)]
            client.zadd("unacked_index", {t: time.time() for t in tags})
            r0 = time.perf_counter()
            for _ in range(rounds):
                client.zadd("unacked_index", {t: time.time() for t in tags}, xx=True)
            refresh_ms = (time.perf_counter() - r0) / rounds * 1000
            client.delete("unacked_index")
            client.close()
        out.append({"store": label, "claims": n,
                    "round_trips": statistics.mean(trips),
                    "cpu_ms": statistics.mean(cpu) * 1000,
                    "wall_ms": statistics.median(wall) * 1000,
                    "refresh_ms": refresh_ms})
        keeper.stop(release=True)
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the slow stock 60 s row "
                        "and the 15 s TTL row")
    args = parser.parse_args()
    redis_srv = RedisServer().start()
    etcd = EtcdServer().start() if etcd_binary() else None
    vhost = make_rabbit_vhost()
    rows: list[dict[str, Any]] = []

    def combo(broker: str) -> Combo:
        url = (f"amqp://guest:guest@127.0.0.1:5672/{vhost}" if broker == "rabbit"
               else redis_srv.url_db(1))
        return Combo(broker=url, backend=redis_srv.url_db(2), lease=redis_srv.url_db(0),
                     sink=redis_srv.url_db(3), pool="prefork")

    try:
        rows.append(recovery(combo("redis"), "celery-crawl, Redis broker, ttl 3 s", stock=False,
                             ttl_s=3, timeout_s=60))
        if vhost:
            rows.append(recovery(combo("rabbit"), "celery-crawl, RabbitMQ, ttl 3 s",
                                 stock=False, ttl_s=3, timeout_s=60))
        if not args.quick:
            rows.append(recovery(combo("redis"), "celery-crawl, Redis broker, ttl 15 s "
                                 "(default)", stock=False, ttl_s=15, timeout_s=90))
            rows.append(recovery(combo("redis"), "stock acks_late, Redis, visibility_timeout "
                                 "60 s (sweep every 1 s)", stock=True, ttl_s=3, timeout_s=200,
                                 extra_env={"CRAWL_T_VT": "60"}))
        if vhost:
            rows.append(recovery(combo("rabbit"), "stock acks_late, RabbitMQ", stock=True,
                                 ttl_s=3, timeout_s=60))
        rows.append({"setup": "stock acks_late, Redis, visibility_timeout 3600 s (default)",
                     "latency_s": "3600-3700 (configuration; not waited for)", "runs": "-"})
        cost = renewal_cost(redis_srv.url, "redis", (1, 100, 1000), 50, redis_srv)
        if etcd is not None:
            cost += renewal_cost(etcd.url, "etcd", (1, 100, 1000), 50, None)
    finally:
        if vhost:
            delete_rabbit_vhost(vhost)
        if etcd is not None:
            etcd.cleanup()
        redis_srv.cleanup()

    print("\n### Recovery after kill -9 (task start elsewhere)\n")
    print("| setup | kill -9 -> running elsewhere | runs started |")
    print("|---|---|---|")
    for r in rows:
        lat = r["latency_s"]
        shown = f"{lat:.2f} s" if isinstance(lat, float) else ("not within timeout"
                                                               if lat is None else lat)
        print(f"| {r['setup']} | {shown} | {r['runs']} |")
    print("\n### Cost per renewal (50 renewals each)\n")
    print("| store | claims held | store round trips / renewal | CPU / renewal | wall / renewal "
          "| broker unacked refresh |")
    print("|---|---|---|---|---|---|")
    for c in cost:
        ref = "-" if c["refresh_ms"] is None else f"{c['refresh_ms']:.2f} ms"
        print(f"| {c['store']} | {c['claims']} | {c['round_trips']:.0f} | {c['cpu_ms']:.3f} ms "
              f"| {c['wall_ms']:.2f} ms | {ref} |")


if __name__ == "__main__":
    main()
