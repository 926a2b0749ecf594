"""``celery-crawl up --sentinel``: the demo fleet on one master, two replicas and three
sentinels, every process knowing only the sentinels' addresses, through a ``SENTINEL FAILOVER``
issued while it runs (the command the banner prints)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from tests.servers import wait_until
from tests.system.test_up import Up, _worker_environ, assert_clean, runs_per_entry, summary_of

pytestmark = [pytest.mark.system, pytest.mark.slow]

_FAILOVER = re.compile(r"redis-cli -p (\d+) SENTINEL FAILOVER (\w+)")
_RUN = re.compile(r"run of demo-[\w-]+ slot")


def test_up_sentinel_runs_the_demo_through_a_failover(tmp_path: Path) -> None:
    up = Up(tmp_path, "--sentinel", "--no-flower", "--duration", "40")
    try:
        try:
            env = _worker_environ(up)
        except AssertionError as exc:
            raise AssertionError(up.output[-3000:]) from exc
        port, master = up.wait_for(_FAILOVER, 60).groups()
        wait_until(lambda: _RUN.search(up.output), 60, interval_s=0.2, what="a first demo run")
        sentinel = redis.Redis(host="127.0.0.1", port=int(port), socket_timeout=5,
                               decode_responses=True)
        before = sentinel.sentinel_get_master_addr_by_name(master)
        sentinel.execute_command("SENTINEL", "FAILOVER", master)
        wait_until(lambda: sentinel.sentinel_get_master_addr_by_name(master) != before, 30,
                   interval_s=0.1, what="the sentinels to name a new master")
        mark = len(up.output.splitlines())
        wait_until(lambda: any(_RUN.search(x) for x in up.output.splitlines()[mark:]), 60,
                   interval_s=0.2, what="a demo run after the failover")
        out = up.finish()
    finally:
        up.kill()
    assert_clean(out, up.proc.returncode)
    # Configured with the sentinels' addresses only: no process was given a data node.
    for name in ("REDIS_URL", "CRAWL_LEASE_URL"):
        assert env[name].startswith("redis+sentinel://"), (name, env[name])
    assert "CRAWL_BROKER_URL" not in env and "CRAWL_RESULT_URL" not in env
    assert f"127.0.0.1:{before[1]}" not in env["REDIS_URL"]
    runs = runs_per_entry(summary_of(out))
    assert runs.get("demo-news", (0, 0, 0))[1] >= 3, summary_of(out)
    assert all(dups == 0 for _, _, dups in runs.values()), summary_of(out)
