"""HA beat with real processes: three ``celery beat -S celery_crawl.beat:LeasedScheduler``
replicas, a real worker recording every run, and real faults.

Redis store (one shared cluster, scenarios in order): kill -9 of the leader, SIGSTOP beyond the
TTL then SIGCONT, SIGTERM handoff, a restart of the store (AOF on), a replica whose wall clock
is 30 s off (libfaketime preloaded into that replica only), a leader whose wall clock is set
2 h ahead for a second (libfaketime with an offset file read at every call, monotonic clocks
untouched). etcd store: kill -9 of the leader.
At the end of each cluster every (entry, slot) between its first run and its stored position
ran exactly once (one task id; the same id delivered twice counts as deduplicated, which the
worker plugin's claim makes harmless) or is recorded as skipped with a reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_crawl import keys
from celery_crawl.beat.state import EntryState, SkipLog, parse_slot
from celery_crawl.leases import open_store
from celery_crawl.schedules import task_id_for
from tests.procs import ROOT, Proc, celery_args, faketime_lib, worker_args
from tests.servers import EtcdServer, RedisServer, etcd_binary, missing_tool, wait_until

pytestmark = pytest.mark.system

TTL_S = 3.0
ENTRIES = ("e0", "e1")
#: bound for "a standby took over after kill -9 / SIGSTOP": ttl + 1 s, with 3x headroom
KILL_BOUND_S = 3 * (TTL_S + 1.0)
#: bound for the SIGTERM handoff: 1 s, with headroom for a loaded 2-core machine
TERM_BOUND_S = 3.0


class Cluster:
    """Beat replicas, one worker, a sink; all processes in their own session."""

    def __init__(self, *, lease_url: str, broker: RedisServer, logs: Path, ns: str) -> None:
        self.lease_url = lease_url
        self.broker = broker
        self.logs = logs
        self.ns = ns
        self.beats: list[Proc] = []
        self.others: list[Proc] = []
        self.n = 0
        #: leader changes forced by the tests; each may publish a slot twice under one id
        self.faults = 0
        self.env = {
            "CRAWL_B_BROKER": broker.url_db(0),
            "CRAWL_B_LEASE": lease_url,
            "CRAWL_B_NS": ns,
            "CRAWL_B_TTL": str(TTL_S),
            "CRAWL_B_SINK": broker.url_db(2),
        }
        self.store = open_store(lease_url, namespace=ns, timeout_s=2.0)

    def spawn_beat(self, *, env: dict[str, str] | None = None, preload: str | None = None,
                   tag: str = "beat", launcher: list[str] | None = None) -> Proc:
        self.n += 1
        args = celery_args("tests.system.beatapp", "beat", "-S",
                           "celery_crawl.beat:LeasedScheduler", "-l", "INFO",
                           "-s", str(self.logs / f"unused-{self.n}"))
        if launcher is not None:  # another way to start the same celery command
            args = [*launcher, *args[1:]]
        proc = Proc(args,
                    env={**self.env, **(env or {})}, preload=preload,
                    log_path=self.logs / f"{tag}-{self.n}.log")
        self.beats.append(proc)
        return proc

    def spawn_worker(self) -> None:
        self.others.append(Proc(
            worker_args("tests.system.beatapp", pool="threads", concurrency=4,
                        hostname=f"w-{self.ns}@%h"),
            env=self.env, log_path=self.logs / "worker.log"))

    def holder(self) -> tuple[str, int] | None:
        try:
            return self.store.holder(keys.BEAT_LEADER)
        except Exception:
            return None

    def leader_proc(self) -> tuple[Proc, int]:
        got = wait_until(self.holder, KILL_BOUND_S, what="a beat leader")
        pid = int(got[0].split(":")[1])
        for p in self.beats:
            if p.pid == pid:
                return p, got[1]
        raise AssertionError(f"leader {got} is not one of our replicas")

    def wait_new_leader(self, old_token: int, bound_s: float) -> tuple[float, tuple[str, int]]:
        t0 = time.monotonic()
        got = wait_until(lambda: (h := self.holder()) and h[1] > old_token and h,
                         bound_s, interval_s=0.02, what="a new leader")
        return time.monotonic() - t0, got

    def runs(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.broker.client(2).lrange("runs", 0, -1)]

    def wait_runs(self, more: int, timeout_s: float = 15) -> None:
        base = len(self.runs())
        wait_until(lambda: len(self.runs()) >= base + more, timeout_s,
                   what=f"{more} more runs")

    def alive_beats(self) -> list[Proc]:
        return [p for p in self.beats if p.alive()]

    def stop(self) -> None:
        procs = self.beats + self.others
        for p in procs:  # SIGTERM everyone first, so the grace periods overlap
            if p.alive():
                p.signal_group(signal.SIGCONT)
                p.signal_group(signal.SIGTERM)
        for p in procs:
            p.stop(grace_s=3)
        self.store.close()

    def check_ledger(self) -> dict[str, int]:
        """Every slot from each entry's first run to its stored position: exactly one task id
        ran, or the slot is recorded as skipped with a reason."""
        runs = [r for r in self.runs() if not r["manual"]]
        by_slot: dict[tuple[str, str], Counter[str]] = {}
        for r in runs:
            by_slot.setdefault((r["entry"], r["slot"]), Counter())[r["id"]] += 1
        stats = {"runs": 0, "deduplicated": 0, "skipped": 0}
        for (entry, slot), ids in by_slot.items():
            assert len(ids) == 1, f"{entry} {slot} ran under several ids: {ids}"
            (tid, count), = ids.items()
            assert tid == task_id_for(self.ns, entry, parse_slot(slot))
            stats["runs"] += 1
            stats["deduplicated"] += count - 1
        # A slot published twice under one id happens only around a leader change (a crash
        # between publish and state write, a freeze after the validity check): at most one
        # per entry per forced change, never a steady stream.
        assert stats["deduplicated"] <= self.faults * len(ENTRIES), (stats, self.faults)
        for entry in ENTRIES:
            state = EntryState.from_record(self.store.get(keys.beat_entry(entry)))
            skips = SkipLog.from_record(self.store.get(keys.beat_skips(entry)))
            ran = sorted(parse_slot(s) for (e, s) in by_slot if e == entry)
            assert ran, f"{entry} never ran"
            assert state.last_slot is not None
            slot = ran[0]
            while slot <= min(state.last_slot, ran[-1]):
                if (entry, f"{slot:%Y-%m-%dT%H:%M:%SZ}") not in by_slot:
                    reason = skips.covers(slot)
                    assert reason, f"{entry} slot {slot} neither ran nor was recorded skipped"
                    stats["skipped"] += 1
                slot += timedelta(seconds=1)
        return stats


def _beat_logs(cluster: Cluster) -> str:
    return "\n".join(f"--- {p.log_path.name}\n{p.log()[-3000:]}" for p in cluster.beats)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster,
                                                                              RedisServer]]:
    logs = tmp_path_factory.mktemp("beat-redis")
    store = RedisServer(appendonly=True).start()
    broker = RedisServer().start()
    cluster = Cluster(lease_url=store.url, broker=broker, logs=logs,
                      ns=f"bha-{uuid.uuid4().hex[:6]}")
    try:
        cluster.spawn_worker()
        for _ in range(3):
            cluster.spawn_beat()
        yield cluster, store
    finally:
        cluster.stop()
        broker.cleanup()
        store.cleanup()


def test_one_leader_dispatches(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    cluster, _ = redis_cluster
    _leader, token = cluster.leader_proc()
    cluster.wait_runs(4, timeout_s=30)
    tokens = {r["token"] for r in cluster.runs()}
    assert tokens == {token}, _beat_logs(cluster)
    presence = wait_until(lambda: len(cluster.store.scan(keys.beat_presence(""))) == 3 and
                          cluster.store.scan(keys.beat_presence("")), 10, what="3 presences")
    assert sorted(r["role"] for r in presence.values()) == ["leader", "standby", "standby"]
    assert all(r["clock_offset_s"] is not None for r in presence.values())


def test_kill9_of_the_leader(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    cluster, _ = redis_cluster
    leader, token = cluster.leader_proc()
    cluster.faults += 1
    leader.kill9()
    took, _ = cluster.wait_new_leader(token, KILL_BOUND_S)
    print(f"kill -9 failover (redis): {took:.2f}s")
    cluster.wait_runs(2)
    cluster.spawn_beat()


def test_two_stock_beats_both_dispatch(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    """The reference for the failover above, on the same Celery: two stock ``celery beat``
    replicas of the same schedule each publish every run, twice the rate of one dispatcher."""
    cluster, _ = redis_cluster
    db = 5  # a broker database of its own: no worker consumes these
    env = {"CRAWL_B_BROKER": cluster.broker.url_db(db), "CRAWL_B_INTERVAL": "1"}
    procs = [Proc(celery_args("tests.system.beatapp", "beat", "-l", "INFO",
                              "-s", str(cluster.logs / f"stock-{i}")),
                  env={**cluster.env, **env}, log_path=cluster.logs / f"stock-beat-{i}.log")
             for i in range(2)]
    client = cluster.broker.client(db)
    try:
        wait_until(lambda: all("Scheduler: Sending" in p.log() for p in procs), 60,
                   what="both stock beats publishing")
        start_n, t0 = client.llen("celery"), time.monotonic()
        wait_until(lambda: client.llen("celery") >= start_n + 16, 30, what="16 more messages")
        rate = (client.llen("celery") - start_n) / (time.monotonic() - t0)
    finally:
        for p in procs:
            p.stop(grace_s=3)
    # Two entries every second: one dispatcher publishes 2 a second, two stock replicas 4.
    assert rate > 3.0, f"{rate:.1f} messages/s"


def test_sigstop_beyond_ttl_then_sigcont(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    cluster, _ = redis_cluster
    leader, token = cluster.leader_proc()
    cluster.faults += 1
    leader.signal_group(signal.SIGSTOP)
    frozen_at = time.time()
    try:
        cluster.wait_new_leader(token, KILL_BOUND_S)
        cluster.wait_runs(2)
    finally:
        leader.signal_group(signal.SIGCONT)
    wait_until(lambda: "stopped dispatching and is standing by" in leader.log(), 15,
               what="the resumed leader demotes")
    assert leader.alive(), "a demoted leader must not exit"
    late = [r for r in cluster.runs() if r["token"] == token
            and parse_slot(r["slot"]).timestamp() > frozen_at + 1]
    assert late == [], f"the frozen leader dispatched after resuming: {late}"


def test_sigterm_hands_over_within_a_second(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    cluster, _ = redis_cluster
    leader, token = cluster.leader_proc()
    cluster.faults += 1
    leader.signal_group(signal.SIGTERM)
    took, _ = cluster.wait_new_leader(token, TERM_BOUND_S)
    print(f"SIGTERM handoff (redis): {took:.2f}s")
    assert took <= TERM_BOUND_S
    wait_until(lambda: not leader.alive(), 10, what="the old leader exits on SIGTERM")
    assert "released the leader lease" in leader.log()
    cluster.wait_runs(2)
    cluster.spawn_beat()


def test_store_restart_with_aof(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    """The store is down for longer than the TTL, then comes back from its AOF: the leader
    lease is gone or lost, a leader is elected with a higher token (the counter survived),
    entry state continues where it stood and dispatch resumes."""
    cluster, store = redis_cluster
    _, token = cluster.leader_proc()
    before = {e: EntryState.from_record(cluster.store.get(keys.beat_entry(e))) for e in ENTRIES}
    cluster.faults += 1
    store.restart(down_s=TTL_S + 1.0)
    took, (_, new_token) = cluster.wait_new_leader(token, KILL_BOUND_S + TTL_S)
    print(f"leader after a {TTL_S + 1.0:.0f} s store outage: {took:.2f}s, token {new_token}")
    assert new_token > token
    cluster.wait_runs(4, timeout_s=20)
    for e in ENTRIES:
        after = EntryState.from_record(cluster.store.get(keys.beat_entry(e)))
        assert before[e].last_slot is not None and after.last_slot is not None
        assert after.last_slot > before[e].last_slot
        assert after.run_count > before[e].run_count


def test_skewed_replica_never_leads(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    cluster, _ = redis_cluster
    lib = faketime_lib()
    if lib is None:
        missing_tool("libfaketime not installed (apt-get install faketime)")
    # A constant +30 s on every clock. FAKETIME_DONT_FAKE_MONOTONIC=1 is not used: with
    # libfaketime 0.9.10 it makes Python's time.sleep (clock_nanosleep on CLOCK_MONOTONIC,
    # TIMER_ABSTIME) fail with EINVAL. A constant shift of the monotonic clocks changes no
    # duration, so lease validity is judged exactly as without it; only the wall clock matters.
    skewed = cluster.spawn_beat(env={"FAKETIME": "+30s"}, preload=lib, tag="skewed")
    wait_until(lambda: "wall clock is" in skewed.log(), 30, what="the skewed replica says so")
    healthy = [p for p in cluster.alive_beats() if p is not skewed]
    cluster.faults += 1
    for p in healthy:
        p.stop(grace_s=5)
    # Only the skewed replica is left: once the last lease is gone, nobody may lead for well
    # over a TTL.
    wait_until(lambda: cluster.holder() is None, KILL_BOUND_S, what="the last lease is gone")
    deadline = time.monotonic() + 2 * TTL_S
    while time.monotonic() < deadline:
        assert cluster.holder() is None, _beat_logs(cluster)
        time.sleep(0.1)
    assert skewed.alive()
    assert "crawl_max_clock_skew" in skewed.log()
    cluster.spawn_beat()
    cluster.leader_proc()
    cluster.wait_runs(4, timeout_s=30)


def test_operator_cli(redis_cluster: tuple[Cluster, RedisServer]) -> None:
    cluster, _ = redis_cluster
    _, token = cluster.leader_proc()

    def crawl(*args: str) -> str:
        out = subprocess.run(celery_args("tests.system.beatapp", "crawl", *args),
                             env={**os.environ, **cluster.env}, cwd=str(ROOT),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    status = crawl("status")
    assert f"token {token}" in status and "replicas:" in status, status
    assert "clock offset +30" in status and "BLOCKED: not leading" in status, status
    assert "e0" in status
    crawl("pause", "e1")
    wait_until(lambda: SkipLog.from_record(cluster.store.get(keys.beat_skips("e1")))
               .totals.get("paused", 0) >= 2, 15, what="paused slots recorded")
    crawl("resume", "e1")
    crawl("trigger", "e0")
    wait_until(lambda: any(r["manual"] and r["entry"] == "e0" for r in cluster.runs()), 15,
               what="the triggered run")
    assert "PAUSED" not in crawl("status")
    # backfill: every slot of the window runs once, as a manual run with that slot
    base = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    crawl("backfill", "e1", "--start", base.isoformat(),
          "--end", (base + timedelta(seconds=2)).isoformat())
    want = {f"{base + timedelta(seconds=i):%Y-%m-%dT%H:%M:%SZ}" for i in range(3)}
    got = wait_until(lambda: (m := [r["slot"] for r in cluster.runs()
                                    if r["manual"] and r["entry"] == "e1"])
                     and want <= set(m) and m, 15, what="the backfilled runs")
    assert sorted(got) == sorted(want), got


def test_a_leader_whose_wall_clock_is_set_ahead_for_a_second_publishes_nothing_early(
    redis_cluster: tuple[Cluster, RedisServer], tmp_path: Path
) -> None:
    """The leader's wall clock is set 2 h ahead for about a second (libfaketime, offset read
    from a file at every call, monotonic clocks untouched), well inside one skew-check
    interval: no run is published ahead of the reference clock, the slots in between are not
    written off as skipped, and the entries keep running once the clock is back."""
    cluster, _ = redis_cluster
    lib = faketime_lib()
    if lib is None:
        missing_tool("libfaketime not installed (apt-get install faketime)")
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    stepped = cluster.spawn_beat(
        env={"FAKETIME_TIMESTAMP_FILE": str(offset), "FAKETIME_NO_CACHE": "1",
             "FAKETIME_DONT_FAKE_MONOTONIC": "1"},
        preload=lib, tag="stepped",
        launcher=[sys.executable, "-m", "tests.system.faketime_celery"])
    wait_until(lambda: stepped.alive() and "standing by" in stepped.log(), 30,
               what="the replica under libfaketime starts")
    cluster.faults += 2  # the stepped replica takes over, then hands over in the step
    for p in cluster.alive_beats():  # make it the leader: every healthy replica steps down
        if p is not stepped and "skewed" not in p.log_path.name:
            p.stop(grace_s=5)
    wait_until(lambda: cluster.leader_proc()[0] is stepped, KILL_BOUND_S,
               what="the replica under libfaketime leads")
    standby = cluster.spawn_beat()  # to take over
    wait_until(lambda: any(r.get("pid") == standby.pid for r in
                           cluster.store.scan(keys.beat_presence("")).values()), 30,
               what="the standby's presence")
    cluster.wait_runs(2)
    before = {e: SkipLog.from_record(cluster.store.get(keys.beat_skips(e))).totals
              for e in ENTRIES}
    offset.write_text("+2h\n")
    step_ends = time.monotonic() + 1.0
    while time.monotonic() < step_ends:  # the fault lasts one second
        assert stepped.alive(), stepped.log()[-3000:]
        time.sleep(0.05)
    offset.write_text("+0\n")
    cluster.wait_runs(4, timeout_s=30)
    real_now = datetime.now(UTC)
    early = [r for r in cluster.runs() if parse_slot(r["slot"]) > real_now]
    assert early == [], f"published ahead of the reference clock: {early[:3]}"
    for e in ENTRIES:
        after = SkipLog.from_record(cluster.store.get(keys.beat_skips(e))).totals
        grown = {k: v - before[e].get(k, 0) for k, v in after.items()
                 if v != before[e].get(k, 0)}
        # a leader change may write off a few seconds' slots, never two hours of them
        assert sum(grown.values()) <= 10, (e, grown)
    assert stepped.alive() and "wall clock was set by +7200" in stepped.log(), \
        stepped.log()[-3000:]


def test_every_slot_ran_once_or_was_recorded_skipped(
    redis_cluster: tuple[Cluster, RedisServer]
) -> None:
    cluster, _ = redis_cluster
    stats = cluster.check_ledger()
    print(f"redis ledger: {stats}")
    assert stats["runs"] >= 10


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if etcd_binary() is None:
        if os.environ.get("CRAWL_REQUIRE_ETCD") == "1" or os.environ.get("CI") == "true":
            pytest.fail("etcd binary not found")
        pytest.skip("etcd binary not found")
    logs = tmp_path_factory.mktemp("beat-etcd")
    etcd = EtcdServer().start()
    broker = RedisServer().start()
    cluster = Cluster(lease_url=etcd.url, broker=broker, logs=logs,
                      ns=f"bhe-{uuid.uuid4().hex[:6]}")
    try:
        cluster.spawn_worker()
        for _ in range(3):
            cluster.spawn_beat()
        yield cluster
    finally:
        cluster.stop()
        broker.cleanup()
        etcd.cleanup()


def test_kill9_of_the_leader_on_etcd(etcd_cluster: Cluster) -> None:
    cluster = etcd_cluster
    leader, token = cluster.leader_proc()
    cluster.wait_runs(3, timeout_s=30)
    cluster.faults += 1
    leader.kill9()
    took, _ = cluster.wait_new_leader(token, KILL_BOUND_S)
    print(f"kill -9 failover (etcd): {took:.2f}s")
    cluster.wait_runs(4)
    stats = cluster.check_ledger()
    print(f"etcd ledger: {stats}")
