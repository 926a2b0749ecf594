"""kill -9 of a worker mid-task, on every pool x broker x lease store combination.

Another worker must run the task within ``ttl + reaper interval`` (plus headroom) and the task must
succeed exactly once: one accepted commit in the fenced sink, from the survivor, with a newer claim
token than the dead run's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import EtcdServer, RedisServer, wait_until
from tests.system.workerapp_harness import (
    REAPER_S,
    TTL_S,
    Combo,
    committed,
    runs,
    send,
    workers,
)

pytestmark = [pytest.mark.system]

#: Recovery bound asserted: ttl + reaper interval + one renewal interval + queue/poll slack, x3.
BOUND_S = 3 * (TTL_S + REAPER_S + TTL_S / 3 + 1.0)


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


def make_combo(request: pytest.FixtureRequest, redis_srv: RedisServer, broker: str, store: str,
               pool: str) -> Combo:
    if broker == "rabbit":
        broker_url = request.getfixturevalue("rabbit_url")
    else:
        broker_url = redis_srv.url_db(1)
    if store == "etcd":
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        lease_url = etcd.url
    else:
        lease_url = redis_srv.url_db(0)
    return Combo(broker=broker_url, backend=redis_srv.url_db(2), lease=lease_url,
                 sink=redis_srv.url_db(3), pool=pool)


@pytest.mark.parametrize("store", ["redis", "etcd"])
@pytest.mark.parametrize("broker", ["redis", "rabbit"])
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_kill9_mid_task_runs_elsewhere_exactly_once(
    request: pytest.FixtureRequest, redis_srv: RedisServer, tmp_path: Path,
    pool: str, broker: str, store: str,
) -> None:
    combo = make_combo(request, redis_srv, broker, store, pool)
    key = combo.ns
    with workers(combo, tmp_path) as ws:
        ws.start("a", wait=False)
        ws.start("b", wait=False)
        ws.wait_ready("a")
        ws.wait_ready("b")
        send(combo, key, 1.0)
        first = wait_until(lambda: runs(combo, key), 30, what="first run started")[0]
        victim = "a" if first["host"] == ws.hostname("a") else "b"
        survivor = "b" if victim == "a" else "a"
        t_kill = time.time()
        ws.procs[victim].kill9()
        done = wait_until(lambda: runs(combo, key, "finished"), BOUND_S + 10,
                          what="the task finished on the survivor")
        started = runs(combo, key)
        assert len(started) == 2, started
        second = started[1]
        recovery_s = second["t"] - t_kill
        print(f"{pool}/{broker}/{store}: recovered in {recovery_s:.2f}s")
        assert second["host"] == ws.hostname(survivor)
        assert second["token"] > first["token"]
        assert recovery_s <= BOUND_S, f"recovery took {recovery_s:.1f}s"
        assert len(done) == 1 and done[0]["accepted"], done
        final = committed(combo, key)
        assert final is not None and final["token"] == second["token"]
        # Exactly once: nothing else is started later (the claim is gone, a tombstone exists).
        survivor_proc = ws.procs[survivor]
        wait_until(lambda: "succeeded" in survivor_proc.log(), 10, what="survivor logged success")
        assert len(runs(combo, key)) == 2
