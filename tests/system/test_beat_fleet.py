"""Beat replicas that disagree about the schedule, with real ``celery beat`` processes.

One project directory holds the app (a copy of ``fleetapp.py``: the README's own-app path,
``install(app)`` with a ``crawlredis://`` result backend as the lease store and a TOML schedule
file) and its schedule files; replicas are started from other working directories. No worker
runs: the published messages are read from the broker's queue, so every (entry, slot) published
is seen, duplicates included.

* Two replicas started from two directories read the same files (relative paths resolve
  against the app's import root), show the same schedule fingerprint, and the fleet records it.
  A replica with another schedule and one with none refuse to lead, say why with the
  fingerprints, are marked in ``crawl status`` and in their ``/metrics``; after a kill -9 of
  the leader the other healthy replica takes over, never one of them.
* A rolling deploy of two replicas from schedule v1 to v2: the first v2 replica waits while a
  v1 replica lives, leads once the last v1 replica stopped and adopts v2 (only then is the
  state of the entry v2 dropped removed); each slot of the entries both versions share was
  published exactly once, none missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from celery_crawl import keys
from celery_crawl.beat.state import parse_slot
from celery_crawl.leases import open_store
from tests.procs import ROOT, Proc, celery_args
from tests.servers import RedisServer, free_port, wait_until

pytestmark = pytest.mark.system

TTL_S = 3.0
#: a leader after kill -9: ttl + 1 s, with 3x headroom
KILL_BOUND_S = 3 * (TTL_S + 1.0)
#: a beat process up and writing its presence (celery import on a loaded 2-core machine)
START_BOUND_S = 30.0

ENTRY = """
[entries.{name}]
task = "fleet.record"
cron = "* * * * * *"
tz = "Asia/Shanghai"
catchup = "all"
catchup_window = "10m"
"""


def _schedule(path: Path, *names: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "s.toml").write_text("".join(ENTRY.format(name=n) for n in names))
    return path


class Fleet:
    """Beat replicas of one app, each in its own session; the broker queue as the record."""

    def __init__(self, tmp: Path, store: RedisServer, broker: RedisServer) -> None:
        self.tmp = tmp
        self.ns = f"fl-{uuid.uuid4().hex[:6]}"
        self.project = tmp / "project"
        self.project.mkdir()
        shutil.copy(ROOT / "tests" / "system" / "fleetapp.py", self.project / "fleetproj.py")
        self.broker = broker
        self.env = {"CRAWL_F_BROKER": broker.url_db(0), "CRAWL_F_STORE": store.url,
                    "CRAWL_F_NS": self.ns, "PYTHONPATH": str(self.project)}
        self.store = open_store(store.url, namespace=self.ns, timeout_s=2.0)
        self.beats: list[Proc] = []
        self.stopped = False

    def beat(self, cwd: Path, **env: str) -> Proc:
        cwd.mkdir(parents=True, exist_ok=True)
        n = len(self.beats) + 1
        # As the README's own-app path runs it: install(app) chose the scheduler.
        proc = Proc(celery_args("fleetproj", "beat", "-l", "INFO",
                                "-s", str(self.tmp / f"unused-{n}")),
                    env={**self.env, **env}, cwd=cwd, log_path=self.tmp / f"beat-{n}.log")
        self.beats.append(proc)
        return proc

    def presence(self, proc: Proc) -> dict[str, Any] | None:
        for rec in self.store.scan(keys.beat_presence("")).values():
            if rec.get("pid") == proc.pid:
                return dict(rec)
        return None

    def up(self, proc: Proc) -> dict[str, Any]:
        return dict(wait_until(lambda: self.presence(proc), START_BOUND_S,
                               what=f"presence of {proc.log_path.name}"))

    def leader(self) -> tuple[int, int]:
        """``(pid, token)`` of the leader."""
        holder, token = wait_until(lambda: self.store.holder(keys.BEAT_LEADER), KILL_BOUND_S,
                                   what="a leader")
        return int(holder.split(":")[1]), token

    def messages(self) -> list[dict[str, Any]]:
        raw = self.broker.client(0).lrange(f"q-{self.ns}", 0, -1)
        return [json.loads(m)["headers"] for m in raw]

    def per_slot(self, entry: str) -> Counter[str]:
        return Counter(h["crawl_slot"] for h in self.messages() if h["crawl_entry"] == entry)

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-2500:]}" for p in self.beats)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for p in self.beats:
            if p.alive():
                p.signal_group(signal.SIGTERM)
        for p in self.beats:
            p.stop(grace_s=5)
        self.store.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    store, broker = RedisServer().start(), RedisServer().start()
    try:
        yield store, broker
    finally:
        broker.cleanup()
        store.cleanup()


@pytest.fixture
def fleet(tmp_path: Path, servers: tuple[RedisServer, RedisServer]) -> Iterator[Fleet]:
    f = Fleet(tmp_path, *servers)
    try:
        yield f
    finally:
        f.stop()


def _crawl_status(fleet: Fleet, cwd: Path) -> str:
    env = {**os.environ, **fleet.env,
           "PYTHONPATH": os.pathsep.join((str(fleet.project), str(ROOT)))}
    out = subprocess.run(celery_args("fleetproj", "crawl", "status"), env=env, cwd=str(cwd),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_replicas_from_two_directories_and_the_ones_that_disagree(fleet: Fleet) -> None:
    _schedule(fleet.project / "schedules", "a", "b")
    one, two = fleet.tmp / "one", fleet.tmp / "two"
    # The empty replica starts with the first two: should it lead before they are up, it
    # adopts nothing and steps down once it sees them.
    a, b = fleet.beat(one), fleet.beat(two)
    empty = fleet.beat(fleet.tmp / "four", CRAWL_F_PATHS="nowhere/*.toml")
    pa, pb = fleet.up(a), fleet.up(b)
    assert pa["entries"] == pb["entries"] == 2 and pa["schedule"] == pb["schedule"], (pa, pb)
    good = pa["schedule"]
    wait_until(lambda: (fleet.store.get(keys.BEAT_SCHEDULE) or {}).get("fingerprint") == good,
               KILL_BOUND_S, what="the fleet records the schedule")
    # At a fleet's first start the first leader's schedule becomes the fleet's: the replica
    # with another schedule joins a running fleet.
    port = free_port()
    other = fleet.beat(fleet.tmp / "three", CRAWL_F_EXTRA="1", CRAWL_F_METRICS=str(port))
    # The banner names the replica id the process really uses.
    banner = re.search(r"replica=(\S+)", a.log())
    assert banner and banner.group(1) == pa["id"], a.log()[:3000]
    assert str(fleet.project.resolve()) in a.log()  # the stated base of the schedule paths

    po, pe = fleet.up(other), fleet.up(empty)
    assert po["entries"] == 3 and po["schedule"] != good and pe["entries"] == 0
    wait_until(lambda: "refusing to lead" in other.log() and "refusing to lead" in empty.log(),
               START_BOUND_S, what="the disagreeing replicas say why")
    assert f"schedule {po['schedule']} (3 entries) differs from the fleet's {good}" \
        in other.log(), other.log()[-3000:]
    assert "crawl_beat_schedule_mismatch=refuse" in other.log()
    assert "schedule is empty" in empty.log()
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "crawl_beat_schedule_mismatch 1.0" in metrics
    assert f'crawl_beat_schedule_info{{fingerprint="{po["schedule"]}"}} 1.0' in metrics
    assert "crawl_beat_schedule_entries 3.0" in metrics

    status = _crawl_status(fleet, two)
    differs = [line for line in status.splitlines() if "SCHEDULE DIFFERS" in line]
    assert sorted(po["id"] in line or pe["id"] in line for line in differs) == [True, True], \
        status
    assert f"schedule: {good} (2 entries)" in status, status

    # kill -9 of the leader: the other healthy replica leads, never a disagreeing one.
    pid, token = fleet.leader()
    leader, standby = (a, b) if pid == a.pid else (b, a)
    assert pid in (a.pid, b.pid), fleet.logs()
    leader.kill9()
    got = wait_until(lambda: (h := fleet.leader()) and h[1] > token and h, KILL_BOUND_S,
                     what="a new leader")
    assert got[0] == standby.pid, fleet.logs()
    # It goes on dispatching where the stored state stood (a's state was never collected).
    wait_until(lambda: any(h["crawl_leader_token"] == got[1] for h in fleet.messages()),
               KILL_BOUND_S, what="runs of the new leader")
    for name in ("a", "b"):
        assert fleet.store.get(keys.beat_entry(name)) is not None
    assert fleet.leader()[0] == standby.pid and other.alive() and empty.alive()


def test_a_rolling_deploy_from_v1_to_v2(fleet: Fleet) -> None:
    v1 = _schedule(fleet.tmp / "v1", "a", "b", "gone")
    v2 = _schedule(fleet.tmp / "v2", "a", "b", "new")
    a = fleet.beat(fleet.tmp / "one", CRAWL_F_PATHS=str(v1 / "*.toml"))
    b = fleet.beat(fleet.tmp / "two", CRAWL_F_PATHS=str(v1 / "*.toml"))
    old = fleet.up(a)["schedule"]
    fleet.up(b)
    pid, token = fleet.leader()
    wait_until(lambda: len(fleet.per_slot("a")) >= 2, KILL_BOUND_S, what="runs on v1")
    # Replace the standby first: the v2 replica waits while the v1 leader lives.
    first, second = (b, a) if pid == a.pid else (a, b)
    first.stop(grace_s=10)
    b2 = fleet.beat(fleet.tmp / "two", CRAWL_F_PATHS=str(v2 / "*.toml"))
    new = fleet.up(b2)["schedule"]
    assert new != old
    wait_until(lambda: f"differs from the fleet's {old}" in b2.log(), START_BOUND_S,
               what="the v2 replica waits for the v1 one")
    assert fleet.store.get(keys.beat_entry("gone")) is not None
    assert fleet.leader() == (second.pid, token)
    # Then the v1 leader: the v2 replica takes over and adopts v2.
    second.stop(grace_s=10)
    got = wait_until(lambda: (h := fleet.leader()) and h[1] > token and h, KILL_BOUND_S,
                     what="the v2 replica leads")
    assert got[0] == b2.pid, fleet.logs()
    wait_until(lambda: (fleet.store.get(keys.BEAT_SCHEDULE) or {}).get("fingerprint") == new,
               KILL_BOUND_S, what="the fleet adopts v2")
    wait_until(lambda: fleet.store.get(keys.beat_entry("gone")) is None, KILL_BOUND_S,
               what="the dropped entry's state is collected")
    a2 = fleet.beat(fleet.tmp / "one", CRAWL_F_PATHS=str(v2 / "*.toml"))
    assert fleet.up(a2)["schedule"] == new
    wait_until(lambda: len(fleet.per_slot("new")) >= 2, KILL_BOUND_S, what="runs of v2")
    fleet.stop()
    for entry in ("a", "b"):
        slots = fleet.per_slot(entry)
        twice = {s: n for s, n in slots.items() if n > 1}
        assert not twice, f"{entry}: slots published more than once: {twice}"
        ran = sorted(parse_slot(s) for s in slots)
        missing = []
        slot = ran[0]
        while slot <= ran[-1]:
            if f"{slot:%Y-%m-%dT%H:%M:%SZ}" not in slots:
                missing.append(slot)
            slot += timedelta(seconds=1)
        assert not missing, f"{entry}: slots never published: {missing}"
        tokens = {h["crawl_leader_token"] for h in fleet.messages() if h["crawl_entry"] == entry}
        assert {token, got[1]} <= tokens, tokens  # the slots checked span the deploy
    # Each publish is logged at INFO: entry, slot in the entry's zone and in UTC, id, token.
    line = re.search(r"beat: published new slot (\S+Z) = (\S+ \S+) CST in Asia/Shanghai as "
                     r"(\S+), token (\d+)", b2.log())
    assert line, b2.log()[-3000:]
    slot = parse_slot(line.group(1))
    assert line.group(2) == f"{slot + timedelta(hours=8):%Y-%m-%d %H:%M:%S}"
    assert int(line.group(4)) == got[1]
