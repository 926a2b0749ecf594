"""Real workers losing their lease while the rest of the world goes on: the store forgets the
lease (the worker takes a new one and consumes again), and a partition between one worker and
the lease store, the worker keeping its broker (the task never runs on two workers at once).

Redis broker, Redis store, prefork pool; a TCP proxy (tests/tcpproxy.py) between each worker
and the store makes the partition.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import RedisServer, wait_until
from tests.system.workerapp_harness import TTL_S, Combo, runs, send, workers
from tests.tcpproxy import TcpProxy

pytestmark = [pytest.mark.system]


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


def _combo(redis_srv: RedisServer) -> Combo:
    return Combo(broker=redis_srv.url_db(1), backend=redis_srv.url_db(2),
                 lease=redis_srv.url_db(0), sink=redis_srv.url_db(3), pool="prefork")


def _pulse(combo: Combo, key: str, seconds: float) -> None:
    client = combo.app()
    try:
        client.send_task("crawltest.pulse", args=[key, seconds], queue=combo.queue)
    finally:
        client.close()


def _pulses(combo: Combo, key: str) -> list[dict[str, Any]]:
    return [json.loads(r) for r in combo.sink_client().lrange(f"pulse:{key}", 0, -1)]


def test_lease_forgotten_by_the_store_is_replaced_and_consumption_resumes(
    redis_srv: RedisServer, tmp_path: Path,
) -> None:
    combo = _combo(redis_srv)
    key, later = f"{combo.ns}-a", f"{combo.ns}-b"
    store = redis_srv.client(0)
    with workers(combo, tmp_path) as ws:
        proc = ws.start("a")
        send(combo, key, 3.0)
        first = wait_until(lambda: runs(combo, key), 30, what="the task started")[0]
        lease_keys = store.keys(f"{combo.ns}:lease:worker:*")
        assert len(lease_keys) == 1, lease_keys
        store.delete(*lease_keys)  # the next renewal is refused: the lease is lost
        wait_until(lambda: "worker lease lost" in proc.log(), 3 * TTL_S, what="the loss")
        wait_until(lambda: "new worker lease" in proc.log(), 3 * TTL_S + 10,
                   what="a new lease")
        send(combo, later, 0.2)
        wait_until(lambda: runs(combo, later, "finished"), 30,
                   what="a task sent after the new lease ran (consumption resumed)")
        # The run cut off by the loss is recovered (reaper) and runs once more, to the end.
        rerun = wait_until(lambda: len(runs(combo, key)) >= 2 and runs(combo, key)[1], 60,
                           what="the cancelled task ran again")
        assert rerun["token"] > first["token"]
        done = wait_until(lambda: runs(combo, key, "finished"), 30, what="the rerun finished")
        assert [r["accepted"] for r in done] == [True]
        assert len(runs(combo, key)) == 2 and len(runs(combo, later)) == 1
        status = store.keys(f"{combo.ns}:lease:worker:*")
        assert len(status) == 1 and status != lease_keys


def test_worker_cut_off_from_the_store_stops_before_its_task_runs_elsewhere(
    redis_srv: RedisServer, tmp_path: Path,
) -> None:
    """A store timeout close to the TTL: a renewal hung in the partition returns long after the
    lease's validity. The cut-off worker must have stopped the task before anyone else starts
    it (no heartbeat of the first run after the second run's start)."""
    combo = _combo(redis_srv)
    combo.extra_env.update(CRAWL_T_TTL="6", CRAWL_T_STORE_TIMEOUT="5.9", CRAWL_T_REAPER="0.5")
    key = combo.ns
    with TcpProxy("127.0.0.1", redis_srv.port) as pa, \
            TcpProxy("127.0.0.1", redis_srv.port) as pb, workers(combo, tmp_path) as ws:
        proxies = {"a": pa, "b": pb}
        for name, proxy in proxies.items():
            ws.start(name, wait=False, env={"CRAWL_T_LEASE": f"redis://127.0.0.1:{proxy.port}/0"})
        for name in proxies:
            ws.wait_ready(name)
        _pulse(combo, key, 40.0)
        first = wait_until(lambda: runs(combo, key), 30, what="the task started")[0]
        victim = "a" if first["host"] == ws.hostname("a") else "b"
        cut = proxies[victim]
        wait_until(lambda: _pulses(combo, key), 10, what="heartbeats")
        cut.black_hole()
        t_cut = time.time()
        try:
            second = wait_until(
                lambda: [r for r in runs(combo, key) if r["host"] != first["host"]], 60,
                what="the task started on the other worker")[0]
            wait_until(lambda: "worker lease lost" in ws.procs[victim].log(), 10,
                       what="the cut-off worker noticed its loss")
        finally:
            cut.passthrough()
        beats = [p["t"] for p in _pulses(combo, key) if p["host"] == first["host"]]
        overlap = [t for t in beats if t >= second["t"]]
        assert not overlap, (f"the first run beat {len(overlap)} times after the second started "
                             f"(last {max(beats) - second['t']:.2f}s after it)")
        print(f"partition at +0; first run's last heartbeat at +{max(beats) - t_cut:.2f}s; "
              f"second run started at +{second['t'] - t_cut:.2f}s")
