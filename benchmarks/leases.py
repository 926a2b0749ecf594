"""Lease-store benchmark: renewal cost does not depend on how many claims a lease carries.

For each store (a private redis-server and a private etcd, started here) and for one lease
carrying 0, 100 and 10 000 claims it measures renewals per second, round trips per renewal
(from the store's own ``round_trips`` counter) and renewal latency percentiles; then claims per
second, one claim per call and batched with ``claim_many``. Prints a Markdown table.

Run from the repository root::

    .venv/bin/python -m benchmarks.leases [--seconds 2]

Figures depend on the machine; what must hold everywhere is the "rt/renew" column: 1.00.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from celery_crawl.leases import LeaseStore, open_store
from tests.servers import etcd_binary, running_etcd, running_redis

CLAIM_COUNTS = (0, 100, 10_000)


def _now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@contextlib.contextmanager
def _stores(kinds: list[str]) -> Iterator[list[tuple[str, LeaseStore]]]:
    with contextlib.ExitStack() as stack:
        out = []
        for kind in kinds:
            server: Any = stack.enter_context(running_redis() if kind == "redis"
                                              else running_etcd())
            store = open_store(server.url, namespace="bench", timeout_s=5.0)
            stack.callback(store.close)
            out.append((kind, store))
        yield out


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


def _claims_per_s(store: LeaseStore, seconds: float) -> tuple[float, float]:
    lease = store.acquire("worker:claims", 60, "bench-claims")
    assert lease is not None
    n, t0 = 0, _now()
    while _now() - t0 < seconds:
        store.claim(lease, f"single:{n}", {"n": n})
        n += 1
    single = n / (_now() - t0)
    m, t0 = 0, _now()
    while _now() - t0 < seconds:
        store.claim_many(lease, [(f"batch:{m + i}", {"n": m + i}) for i in range(1000)])
        m += 1000
    batched = m / (_now() - t0)
    store.release(lease)
    return single, batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    args = parser.parse_args()
    kinds = ["redis"] + (["etcd"] if etcd_binary() else [])
    if "etcd" not in kinds:
        print("note: no etcd binary on PATH (apt-get install etcd-server): etcd rows left out",
              file=sys.stderr)
    rows = []
    with _stores(kinds) as stores:
        for kind, store in stores:
            for claims in CLAIM_COUNTS:
                rows.append((kind, claims, _renewals(store, claims, args.seconds)))
            single, batched = _claims_per_s(store, args.seconds)
            rows.append((kind, "claims", {"single": single, "batched": batched}))
    print("| store | claims on lease | renewals/s | rt/renew | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, claims, r in rows:
        if claims != "claims":
            print(f"| {kind} | {claims} | {r['renew_per_s']:.0f} | {r['rt_per_renew']:.2f} "
                  f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    print()
    print("| store | claims/s, one per call | claims/s, claim_many |")
    print("|---|---:|---:|")
    for kind, claims, r in rows:
        if claims == "claims":
            print(f"| {kind} | {r['single']:.0f} | {r['batched']:.0f} |")


if __name__ == "__main__":
    main()
