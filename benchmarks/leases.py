"""Lease-store benchmark: renewal cost does not depend on how many claims a lease carries;
claims per second against Redis; what a task lifecycle leaves in etcd.

For each store (a private redis-server and a private etcd, started here) and for one lease
carrying 0, 100 and 10 000 claims it measures renewals per second, round trips per renewal
(from the store's own ``round_trips`` counter) and renewal latency percentiles; then claims per
second, one claim per call and batched with ``claim_many``, Redis being the anchor. This
process loads protobuf's fast (upb) implementation through another library's generated module
before it opens a store, as a process that also runs gRPC services or OpenTelemetry would; the
etcd claims are measured once more in a child process on pure-Python protobuf. Last, task
lifecycles on etcd (claim, ``done/<id>`` tombstone with the default 1-day TTL, unclaim), one
task per call as a worker makes them and batched: revisions, etcd leases and backend bytes
(before compaction) per task. Prints Markdown tables.

Run from the repository root::

    .venv/bin/python -m benchmarks.leases [--seconds 2]

Figures depend on the machine; what must hold everywhere is the "rt/renew" column: 1.00.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Another library's generated protobuf code first: the process now has protobuf's default
# implementation (upb), whatever the etcd store would have preferred.
from google.protobuf import timestamp_pb2  # noqa: F401
from google.protobuf.internal import api_implementation

from celery_crawl.leases import LeaseStore, open_store
from tests.servers import etcd_binary, running_etcd, running_redis

CLAIM_COUNTS = (0, 100, 10_000)
ROOT = Path(__file__).resolve().parents[1]
#: crawl_done_ttl's default: a tombstone lives a day.
DONE_TTL_S = 86_400.0
#: Task lifecycles measured one per call and batched (per-task figures; the first is slow).
LIFECYCLES = {False: 500, True: 2000}
#: Batched claims are measured in this many windows: best and median (the machine is shared).
WINDOWS = 3


def _now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@contextlib.contextmanager
def _stores(kinds: list[str]) -> Iterator[list[tuple[str, LeaseStore, int]]]:
    """``(kind, store, server pid)`` for each kind."""
    with contextlib.ExitStack() as stack:
        out = []
        for kind in kinds:
            server: Any = stack.enter_context(running_redis() if kind == "redis"
                                              else running_etcd())
            store = open_store(server.url, namespace="bench", timeout_s=5.0)
            stack.callback(store.close)
            out.append((kind, store, server.proc.pid))
        yield out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _renewals(store: LeaseStore, claims: int, seconds: float) -> dict[str, float]:
    lease = store.acquire(f"worker:{claims}", 30, f"bench-{claims}")
    assert lease is not None
    for start in range(0, claims, 1000):
        store.claim_many(lease, [(f"task:{claims}:{i}", {"i": i})
                                 for i in range(start, min(claims, start + 1000))])
    for _ in range(20):  # warm up connections and script caches
        lease = store.renew(lease)
    latencies = []
    trips0 = store.round_trips  # type: ignore[attr-defined]
    deadline = _now() + seconds
    while _now() < deadline:
        t0 = _now()
        lease = store.renew(lease)
        latencies.append(_now() - t0)
    trips = store.round_trips - trips0  # type: ignore[attr-defined]
    latencies.sort()
    store.release(lease)
    return {
        "renew_per_s": len(latencies) / sum(latencies),
        "rt_per_renew": trips / len(latencies),
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


def _claims_per_s(store: LeaseStore, seconds: float, pid: int) -> dict[str, float]:
    """Claims per second, one per call and batched (best and median of ``WINDOWS`` windows);
    for the batched ones also the CPU each claim cost this process and the server (what
    bounds the rate on an idle machine, while the rate itself moves with the machine's
    load)."""
    lease = store.acquire("worker:claims", 60, "bench-claims")
    assert lease is not None
    n, t0 = 0, _now()
    while _now() - t0 < seconds:
        store.claim(lease, f"single:{n}", {"n": n})
        n += 1
    single = n / (_now() - t0)
    m, rates, cpu0, server0 = 0, [], time.process_time(), _cpu_s(pid)
    for _ in range(WINDOWS):
        m0, t0 = m, _now()
        while _now() - t0 < seconds:
            store.claim_many(lease, [(f"batch:{m + i}", {"n": m + i}) for i in range(1000)])
            m += 1000
        rates.append((m - m0) / (_now() - t0))
    client_us = (time.process_time() - cpu0) / m * 1e6
    server_us = (_cpu_s(pid) - server0) / m * 1e6
    store.release(lease)
    return {"single": single, "batched": max(rates), "batched_median": statistics.median(rates),
            "client_us": client_us, "server_us": server_us}


def _etcd_raw(store: Any, what: str) -> Any:
    """etcd's ``Status`` or ``LeaseLeases`` reply, through the store's own channel."""
    if what == "status":
        return store._call(what, store._maint.Status, store._rpc.StatusRequest())
    return store._call(what, store._lease_stub.LeaseLeases, store._rpc.LeaseLeasesRequest())


def _lifecycles(store: Any, batched: bool) -> dict[str, float]:
    """``LIFECYCLES[batched]`` task lifecycles: claim, TTL'd ``done/<id>`` tombstone, unclaim."""
    lease = store.acquire(f"worker:life:{batched}", 60, "bench-life")
    assert lease is not None
    tag = "b" if batched else "s"
    status0, leases0 = _etcd_raw(store, "status"), len(_etcd_raw(store, "leases").leases)
    t0 = _now()
    count = LIFECYCLES[batched]
    for base in range(0, count, 100 if batched else 1):
        ids = [f"{tag}{n}" for n in range(base, base + (100 if batched else 1))]
        if batched:
            store.claim_many(lease, [(f"task:{i}", {"n": i}) for i in ids])
            store.put_many([(f"done/{i}", {"state": "SUCCESS"}) for i in ids], ttl_s=DONE_TTL_S)
        else:
            store.claim(lease, f"task:{ids[0]}", {"n": ids[0]})
            store.put(f"done/{ids[0]}", {"state": "SUCCESS"}, ttl_s=DONE_TTL_S)
        for i in ids:
            store.unclaim(lease, f"task:{i}")
    seconds = _now() - t0
    status1, leases1 = _etcd_raw(store, "status"), len(_etcd_raw(store, "leases").leases)
    store.release(lease)
    return {
        "count": count,
        "per_s": count / seconds,
        "revisions": (status1.header.revision - status0.header.revision) / count,
        "leases": (leases1 - leases0) / count,
        "bytes": (status1.dbSize - status0.dbSize) / count,
    }


def _claims_on_pure_python(seconds: float) -> dict[str, Any] | None:
    """The etcd claims measured again in a child process on pure-Python protobuf."""
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    out = subprocess.run([sys.executable, "-m", "benchmarks.leases", "--etcd-claims-only",
                          "--seconds", str(seconds)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        print(f"pure-Python child failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--etcd-claims-only", action="store_true",
                        help="measure etcd claims only, print them as JSON (for the child)")
    args = parser.parse_args()
    impl = api_implementation.Type()
    if args.etcd_claims_only:
        with _stores(["etcd"]) as stores:
            _, store, pid = stores[0]
            print(json.dumps({**_claims_per_s(store, args.seconds, pid), "impl": impl}))
        return
    kinds = ["redis"] + (["etcd"] if etcd_binary() else [])
    if "etcd" not in kinds:
        print("note: no etcd binary on PATH (apt-get install etcd-server): etcd rows left out",
              file=sys.stderr)
    rows = []
    claims: list[tuple[str, str, dict[str, float]]] = []
    lives: list[tuple[str, dict[str, float]]] = []
    with _stores(kinds) as stores:
        for kind, store, pid in stores:
            for count in CLAIM_COUNTS:
                rows.append((kind, count, _renewals(store, count, args.seconds)))
            claims.append((kind, impl if kind == "etcd" else "-",
                           _claims_per_s(store, args.seconds, pid)))
            if kind == "etcd":
                lives = [("one task per call", _lifecycles(store, batched=False)),
                         ("batches of 100", _lifecycles(store, batched=True))]
    if "etcd" in kinds:
        child = _claims_on_pure_python(args.seconds)
        if child is not None:
            claims.append(("etcd", str(child.pop("impl")), child))
    print("| store | claims on lease | renewals/s | rt/renew | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, count, r in rows:
        print(f"| {kind} | {count} | {r['renew_per_s']:.0f} | {r['rt_per_renew']:.2f} "
              f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    print()
    anchor = next(r["batched"] for kind, _, r in claims if kind == "redis")
    print(f"| store | protobuf | claims/s, one per call | claims/s, claim_many (best of "
          f"{WINDOWS}; median) | claim_many ratio to Redis | client CPU µs/claim "
          f"| server CPU µs/claim |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, pb, r in claims:
        print(f"| {kind} | {pb} | {r['single']:.0f} | {r['batched']:.0f}; "
              f"{r['batched_median']:.0f} | {r['batched'] / anchor:.2f}x "
              f"| {r['client_us']:.1f} | {r['server_us']:.1f} |")
    if lives:
        print()
        print(f"| etcd task lifecycles (protobuf {impl}) | tasks | lifecycles/s "
              f"| revisions/task | etcd leases granted/task | backend bytes/task |")
        print("|---|---:|---:|---:|---:|---:|")
        for what, r in lives:
            print(f"| {what} | {r['count']:.0f} | {r['per_s']:.0f} | {r['revisions']:.2f} "
                  f"| {r['leases']:.4f} | {r['bytes']:.0f} |")


if __name__ == "__main__":
    main()
