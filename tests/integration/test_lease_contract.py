"""The lease-store contract, one body per test, run against a real Redis, a real etcd and the
in-process ``memory://`` store.

The umbrella fixtures ``store`` (a shared server, a fresh namespace per test) and ``fresh`` (a
private server the test may restart, stop or freeze) are parametrized over every driver, and
over a Redis Cluster of three masters (``redis+cluster://``; the faults hit the master owning
the namespace's slot), so every statement below holds for each of them. ``memory://`` skips only
what needs a server process (contenders in other processes, freezing or stopping the server);
its restart is losing its contents, as a Redis without persistence does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_crawl.errors import (
    ConfigError,
    FencedError,
    LeaseLost,
    NotLeader,
    StoreDataError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from celery_crawl.leases import Lease, LeaseStore, StoreDiagnostics, memory, open_store
from tests.clusters import RedisCluster3, running_redis_cluster
from tests.sentinels import SentinelSet, redis_sentinels
from tests.servers import EtcdServer, RedisServer, free_port, wait_until


def _all_threads_stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is in state T (stopped) per /proc."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


class ClusterTarget:
    """A Redis Cluster seen as the one server a namespace lives on: its slot's master takes
    the faults (restart, stop, freeze); the URL names the cluster."""

    def __init__(self, cluster: RedisCluster3) -> None:
        self.cluster = cluster
        self.namespace = ""

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def owner(self) -> RedisServer:
        return self.cluster.owner(f"{{{self.namespace}}}:token")

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.owner.proc

    def restart(self) -> None:
        self.owner.restart()

    def stop(self) -> None:
        self.owner.stop()


class SentinelTarget:
    """A master behind three sentinels, seen as the one server: the URL names the sentinels."""

    def __init__(self, sentinels: SentinelSet) -> None:
        self.sentinels = sentinels

    @property
    def url(self) -> str:
        return self.sentinels.url()


class MemoryTarget:
    """A ``memory://`` name of its own, seen as a server: it restarts (empty, as a Redis without
    persistence), but it has no process to freeze or stop."""

    proc = None

    def __init__(self) -> None:
        self.name = f"contract-{uuid.uuid4().hex[:8]}"
        self.url = f"memory://{self.name}"

    def restart(self) -> None:
        memory.forget(self.name)

    def stop(self) -> None:
        raise AssertionError("memory:// has no server to stop")


#: Why a test cannot run on memory://.
NO_PROCESS = "memory:// lives in this process: no other process shares it, none to freeze or stop"

__all__ = ["redis_sentinels"]  # a session fixture of tests.sentinels used below

ROOT = Path(__file__).resolve().parents[2]
#: etcd's floor; Redis takes the same so one body fits both.
TTL_S = 3.0  # about 3 s: etcd rounds up to whole seconds and has a floor of 2 s
#: generous bound for "the server expired it" on a loaded 2-core machine (3x headroom)
EXPIRY_BOUND_S = 3 * (TTL_S + 1.0)


@dataclasses.dataclass
class Backend:
    """A real server behind a store, with the fault injections a test may apply."""

    kind: str
    server: RedisServer | EtcdServer | ClusterTarget | MemoryTarget | SentinelTarget
    opened: list[LeaseStore] = dataclasses.field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def persistent(self) -> bool:
        """Whether a restart keeps the data (etcd: always; the Redis fixtures run without)."""
        return self.kind == "etcd"

    def open(self, namespace: str | None = None, **kw: Any) -> LeaseStore:
        store = open_store(self.url, namespace=namespace or f"ns{uuid.uuid4().hex[:8]}", **kw)
        self.opened.append(store)
        if isinstance(self.server, ClusterTarget):
            self.server.namespace = store.namespace
        return store

    def restart(self) -> None:
        self.server.restart()

    def freeze(self) -> None:
        assert self.server.proc is not None
        pid = self.server.proc.pid
        os.kill(pid, signal.SIGSTOP)
        # kill() returns before every thread of the server has stopped (etcd runs many): a
        # request sent in between could still be answered. Wait until all of them are stopped.
        wait_until(lambda: _all_threads_stopped(pid), 5, interval_s=0.005,
                   what=f"every thread of pid {pid} stopped")

    def thaw(self) -> None:
        assert self.server.proc is not None
        os.kill(self.server.proc.pid, signal.SIGCONT)

    def write_garbage(self, store: LeaseStore, logical_key: str) -> None:
        """Put bytes celery-crawl never writes where a record lives."""
        physical = f"{store.namespace}:rec:{logical_key}"
        if isinstance(self.server, ClusterTarget):
            physical = f"{{{store.namespace}}}:rec:{logical_key}"
            self.server.owner.client().hset(physical, "v", b"\x80not json")
        elif isinstance(self.server, RedisServer):
            self.server.client().hset(physical, "v", b"\x80not json")
        elif isinstance(self.server, SentinelTarget):
            self.server.sentinels.master().client().hset(physical, "v", b"\x80not json")
        elif isinstance(self.server, MemoryTarget):  # a raw write, as a foreign client makes
            space = memory._spaces[self.server.name]
            with space.cond:
                space.records[(store.namespace, logical_key)] = memory._Record(
                    "\udc80not json", None, None, 0)
        else:
            subprocess.run(
                ["etcdctl", f"--endpoints=127.0.0.1:{self.server.client_port}", "put",
                 physical, "not json"], check=True, capture_output=True, timeout=10,
                env={**os.environ, "ETCDCTL_API": "3"})

    def close(self) -> None:
        for store in self.opened:
            store.close()


@pytest.fixture(params=["redis", "etcd", "redis-cluster", "memory", "redis-sentinel"])
def store_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The session's server of one kind; tests isolate themselves by namespace."""
    server: RedisServer | EtcdServer | ClusterTarget | MemoryTarget | SentinelTarget
    if request.param == "redis-cluster":
        server = ClusterTarget(request.getfixturevalue("redis_cluster"))
    elif request.param == "redis-sentinel":
        server = SentinelTarget(request.getfixturevalue("redis_sentinels"))
    elif request.param == "memory":
        server = MemoryTarget()
    else:
        server = request.getfixturevalue(f"{request.param}_server")
    backend = Backend(request.param, server)
    yield backend
    backend.close()


@pytest.fixture
def store(store_backend: Backend) -> LeaseStore:
    return store_backend.open()


@pytest.fixture(params=["redis", "etcd", "redis-cluster", "memory"])
def fresh(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A private server of one kind, to restart, stop or freeze."""
    if request.param == "memory":
        backend = Backend(request.param, MemoryTarget())
        yield backend
        backend.close()
        return
    if request.param == "redis-cluster":
        with running_redis_cluster() as cluster:
            backend = Backend(request.param, ClusterTarget(cluster))
            yield backend
            with contextlib.suppress(ProcessLookupError, AssertionError):
                backend.thaw()
            backend.close()
        return
    server = request.getfixturevalue("fresh_redis" if request.param == "redis" else "fresh_etcd")
    backend = Backend(request.param, server)
    yield backend
    with contextlib.suppress(ProcessLookupError, AssertionError):
        backend.thaw()
    backend.close()


def _now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _expire(store: LeaseStore, name: str) -> None:
    wait_until(lambda: store.holder(name) is None, EXPIRY_BOUND_S, interval_s=0.1,
               what=f"lease {name!r} to expire on {store.url}")


def _raises_within(bound_s: float, exc: type[BaseException], fn: Callable[[], object]) -> float:
    t0 = _now()
    with pytest.raises(exc):
        fn()
    elapsed = _now() - t0
    assert elapsed < bound_s, f"{fn} took {elapsed:.2f}s, bound {bound_s}s"
    return elapsed


# -- mutual exclusion ---------------------------------------------------------------------------
def test_contenders_never_hold_overlapping_validity_windows(
        store_backend: Backend, tmp_path: Path) -> None:
    if store_backend.kind == "memory":
        pytest.skip(NO_PROCESS)
    namespace = f"race{uuid.uuid4().hex[:8]}"
    log = tmp_path / "holdings.jsonl"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integration.leases_racer", store_backend.url,
             namespace, str(log), "4", "3" if i == 0 else "0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        for i in range(4)
    ]
    try:
        for proc in procs:
            _out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err.decode()
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    holdings = [json.loads(line) for line in log.read_text().splitlines()]
    assert len({h["holder"] for h in holdings}) >= 2, "no contention happened"
    assert len(holdings) >= 6, f"only {len(holdings)} holdings in 4 s"
    holdings.sort(key=lambda h: h["start"])
    for before, after in itertools.pairwise(holdings):
        assert before["end"] <= after["start"], f"overlapping validity: {before} and {after}"
        assert after["token"] > before["token"], f"token went backwards: {before} -> {after}"


# -- tokens ----------------------------------------------------------------------------------
def test_tokens_strictly_increase_across_release_expiry_and_restart(fresh: Backend) -> None:
    store = fresh.open(namespace="tokens")
    tokens = []
    a = store.acquire("t", TTL_S, "a")
    assert a is not None
    tokens.append(a.token)
    store.release(a)
    b = store.acquire("t", TTL_S, "b")
    assert b is not None
    tokens.append(b.token)
    claim_token = store.claim(b, "task:1", {"n": 1})
    assert claim_token is not None
    tokens.append(claim_token)
    _expire(store, "t")  # not released: the server expires it
    c = store.acquire("t", TTL_S, "c")
    assert c is not None
    tokens.append(c.token)
    fresh.restart()  # the Redis fixture runs without persistence: the counter is gone
    d = wait_until(lambda: store.acquire("t2", TTL_S, "d"), 15, interval_s=0.1,
                   what="acquire after restart")
    tokens.append(d.token)
    assert tokens == sorted(set(tokens)), tokens


# -- renew / release -------------------------------------------------------------------------
def test_renew_after_expiry_raises_lease_lost(store: LeaseStore) -> None:
    lease = store.acquire("r", TTL_S, "a")
    assert lease is not None
    renewed = store.renew(lease)
    assert renewed.token == lease.token and renewed.valid_until >= lease.valid_until
    _expire(store, "r")
    with pytest.raises(LeaseLost):
        store.renew(renewed)


def test_release_by_non_holder_is_a_noop_and_expired_release_does_not_raise(
        store: LeaseStore) -> None:
    lease = store.acquire("rel", TTL_S, "a")
    assert lease is not None
    assert store.acquire("rel", TTL_S, "b") is None
    impostor = Lease(name="rel", holder="b", token=lease.token, ttl_s=TTL_S,
                     valid_until=lease.valid_until, handle=None)
    store.release(impostor)
    assert store.holder("rel") == ("a", lease.token)
    store.release(lease)
    assert store.holder("rel") is None
    store.release(lease)  # already released: still no error


def test_acquire_is_idempotent_for_its_holder_and_validity_is_client_side(
        store: LeaseStore) -> None:
    t0 = _now()
    lease = store.acquire("idem", TTL_S, "a")
    assert lease is not None
    assert t0 < lease.valid_until < t0 + TTL_S
    again = store.acquire("idem", TTL_S, "a")  # e.g. a retry after a lost reply
    assert again is not None and again.token == lease.token
    left = store.lease_ttl_left("idem")
    assert left is not None and 0 < left <= TTL_S + 1
    assert store.lease_ttl_left("nobody") is None


# -- claims ----------------------------------------------------------------------------------
def test_claims_refused_while_lease_lives_and_granted_with_higher_token_once_dead(
        store: LeaseStore) -> None:
    a = store.acquire("worker:a", TTL_S, "a")
    b = store.acquire("worker:b", 30, "b")
    assert a is not None and b is not None
    first = store.claim(a, "task:x", {"tag": 1})
    assert first is not None and first > a.token
    assert store.claim(a, "task:x", {"tag": 2}) is None  # our own live claim
    assert store.claim(b, "task:x", {"tag": 3}) is None  # another's live claim
    seen = store.claimant("task:x")
    assert seen is not None and seen.alive and seen.token == first
    assert (seen.lease_name, seen.holder, dict(seen.value)) == ("worker:a", "a", {"tag": 1})
    assert [c.key for c in store.claims_of("worker:a")] == ["task:x"]
    _expire(store, "worker:a")
    orphan = store.claimant("task:x")
    assert orphan is not None and not orphan.alive
    assert "task:x" in {c.key for c in store.orphaned_claims()}
    second = store.claim(b, "task:x", {"tag": 4})
    assert second is not None and second > first
    now = store.claimant("task:x")
    assert now is not None and now.alive and now.lease_name == "worker:b"
    assert not store.drop_claim(orphan), "a re-claimed key is no longer that orphan"
    assert store.unclaim(b, "task:x")
    assert store.claimant("task:x") is None
    with pytest.raises(LeaseLost):
        store.claim(a, "task:y", {})


def test_released_lease_orphans_its_claims_and_the_reaper_can_drop_them(
        store: LeaseStore) -> None:
    a = store.acquire("worker:gone", 30, "a")
    assert a is not None
    tokens = store.claim_many(a, [(f"task:{i}", {"i": i}) for i in range(5)])
    assert all(t is not None for t in tokens) and len(set(tokens)) <= 5
    assert store.claim_many(a, [("task:0", {}), ("task:new", {})])[0] is None
    store.release(a)
    orphans = store.orphaned_claims()
    assert {c.key for c in orphans} == {f"task:{i}" for i in range(5)} | {"task:new"}
    assert all(not c.alive and c.lease_name == "worker:gone" for c in orphans)
    assert len(store.orphaned_claims(limit=2)) == 2
    for claim in orphans:
        assert store.drop_claim(claim)
    assert store.orphaned_claims() == []
    assert store.claims_of("worker:gone") == []


def test_thousand_claims_and_renewal_is_one_round_trip(store: LeaseStore) -> None:
    lease = store.acquire("worker:big", 30, "big")
    assert lease is not None
    tokens = store.claim_many(lease, [(f"task:{i}", {"i": i}) for i in range(1000)])
    assert all(t is not None for t in tokens)
    assert isinstance(store, StoreDiagnostics)
    before = store.round_trips
    lease = store.renew(lease)
    assert store.round_trips - before == 1
    assert len(store.claims_of("worker:big")) == 1000
    assert store.orphaned_claims() == []


# -- restarts and outages --------------------------------------------------------------------
def test_holder_learns_on_next_renew_that_a_restart_lost_its_lease(fresh: Backend) -> None:
    store = fresh.open(namespace="restart")
    lease = store.acquire("leader", 30, "a")
    assert lease is not None
    fresh.restart()
    if fresh.persistent:
        renewed = wait_until(lambda: store.renew(lease), 15, interval_s=0.1,
                             what="renew after etcd restart")
        assert renewed.token == lease.token
    else:
        deadline = _now() + 15
        while True:  # the first call may meet a connection the restart closed
            try:
                store.renew(lease)
            except LeaseLost:
                break
            except StoreUnavailable:
                assert _now() < deadline, "store not back 15 s after its restart"
                time.sleep(0.1)
            else:
                raise AssertionError("renew succeeded on a restarted non-persistent store")


def test_unreachable_store_fails_within_its_timeout_never_hangs(fresh: Backend) -> None:
    if fresh.kind == "memory":
        pytest.skip(NO_PROCESS)
    store = fresh.open(namespace="outage", timeout_s=0.5)
    lease = store.acquire("leader", TTL_S, "a")
    assert lease is not None
    fresh.freeze()  # accepts nothing, answers nothing
    try:
        _raises_within(0.5 * 3 + 1.0, StoreTimeout, lambda: store.renew(lease))
        _raises_within(0.5 * 3 + 1.0, (StoreTimeout, StoreUnavailable),  # type: ignore[arg-type]
                       lambda: store.holder("leader"))
    finally:
        fresh.thaw()
    fresh.server.stop()
    _raises_within(0.5 * 3 + 1.0, StoreError, lambda: store.acquire("x", TTL_S, "b"))
    port = free_port()
    scheme = {"redis": "redis", "redis-cluster": "redis+cluster"}.get(fresh.kind, "etcd")
    dead = open_store(f"{scheme}://127.0.0.1:{port}", namespace="x", timeout_s=0.5)
    try:
        _raises_within(0.5 * 3 + 1.0, StoreUnavailable, lambda: dead.holder("x"))
    finally:
        dead.close()


# -- records, fencing, queues ----------------------------------------------------------------
def test_fenced_writes_refuse_older_tokens_and_non_current_leases(store: LeaseStore) -> None:
    old = store.acquire("lead-a", 30, "a")
    new = store.acquire("lead-b", 30, "b")
    assert old is not None and new is not None and new.token > old.token
    store.put("slot", {"by": "old"}, lease=old)
    store.put("slot", {"by": "new"}, lease=new)
    with pytest.raises(FencedError):
        store.put("slot", {"by": "old again"}, lease=old)
    with pytest.raises(FencedError):
        store.delete("slot", lease=old)
    assert store.get("slot") == {"by": "new"}
    store.release(new)
    with pytest.raises(NotLeader):
        store.put("slot", {"by": "demoted"}, lease=new)
    with pytest.raises(NotLeader):
        store.put_many([("a", {}), ("b", {})], lease=new)
    assert store.get_many(["a", "b", "slot"]) == [None, None, {"by": "new"}]
    with pytest.raises(NotLeader):
        store.pop_all("cmds", lease=new)


def test_records_and_queues(store_backend: Backend, store: LeaseStore) -> None:
    lead = store.acquire("lead", 30, "a")
    assert lead is not None
    store.put_many([("beat/entry/a", {"n": 1}), ("beat/entry/b", {"n": 2})], lease=lead)
    store.put("beat/other", {"n": 3})
    store.put("done/t1", {"ok": True}, ttl_s=TTL_S)
    assert store.scan("beat/entry/") == {"beat/entry/a": {"n": 1}, "beat/entry/b": {"n": 2}}
    assert store.get("done/t1") == {"ok": True}
    assert store.delete("beat/entry/a", lease=lead)
    assert not store.delete("beat/entry/a")
    assert store.get("beat/entry/a") is None
    wait_until(lambda: store.get("done/t1") is None, EXPIRY_BOUND_S, interval_s=0.1,
               what="record ttl")
    for n in range(5):
        store.push("cmds", {"n": n})
    assert store.pop_all("cmds", lease=lead, limit=2) == [{"n": 0}, {"n": 1}]
    assert store.pop_all("cmds") == [{"n": 2}, {"n": 3}, {"n": 4}]
    assert store.pop_all("cmds") == []
    store_backend.write_garbage(store, "junk")
    with pytest.raises(StoreDataError, match="junk"):
        store.get("junk")
    with pytest.raises(ConfigError):
        store.put("x", {}, ttl_s=-1)


def test_watch_free_sees_a_release_promptly(store: LeaseStore) -> None:
    lease = store.acquire("watched", 30, "a")
    assert lease is not None
    assert not store.watch_free("watched", 0.2)
    timer = threading.Timer(0.3, store.release, args=(lease,))
    timer.start()
    try:
        t0 = _now()
        assert store.watch_free("watched", 10)
        assert _now() - t0 < 3.0
    finally:
        timer.cancel()
        # The watch can see the release's write before the release has read its reply: the
        # call ends before the store is closed, or it fails in its thread during teardown.
        timer.join(10)


def test_misc_server_time_ping_and_durability(store_backend: Backend, store: LeaseStore) -> None:
    assert store.ping() < 2.0
    assert isinstance(store, StoreDiagnostics)
    server = store.server_time()
    if store_backend.kind.startswith("redis") or store_backend.kind == "memory":
        assert server is not None and abs(server - time.time()) < 5
        assert store.persistence()["persistent"] is False
    else:
        assert server is None
        assert store.persistence()["persistent"] is True
    assert store.eviction_risk() is None


def test_a_retaken_lease_name_does_not_revive_its_predecessors_claims(store: LeaseStore) -> None:
    first = store.acquire("reaper", 30, "same-holder")
    assert first is not None
    old_token = store.claim(first, "task:old", {})
    assert old_token is not None
    store.release(first)
    second = store.acquire("reaper", 30, "same-holder")  # same name and holder, new lease
    assert second is not None and second.token > first.token
    assert store.claim(second, "task:new", {}) is not None
    old = store.claimant("task:old")
    assert old is not None and not old.alive
    assert [c.key for c in store.orphaned_claims()] == ["task:old"]
    assert store.unclaim(second, "task:old") is False, "not bound to the current lease"
    assert store.drop_claim(old)
    assert store.orphaned_claims() == []
    assert [c.key for c in store.claims_of("reaper") if c.alive] == ["task:new"]
