"""Driver-specific behaviour the shared contract cannot state: Redis scripts, WAIT, eviction
and persistence checks, token re-seeding; etcd's TTL floor and fork rules; what memory://
shares and with whom, its clock and its lock's timeout; URL grammar of all three."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from celery_crawl.clock import Clock, RedisTimeReference
from celery_crawl.config import CrawlConfig
from celery_crawl.errors import (
    ConfigError,
    CrawlError,
    LeaseLost,
    StoreDataError,
    StoreTimeout,
    StoreUnavailable,
    UnsupportedSetup,
)
from celery_crawl.leases import Characteristic, make_holder, memory, open_store, require, store_for
from celery_crawl.leases.redis import RedisLeaseStore, parse_redis_url, token_counter_key
from tests.servers import EtcdServer, RedisServer, free_cluster_port, free_port

ROOT = Path(__file__).resolve().parents[2]


# -- Redis ------------------------------------------------------------------------------------
def test_token_counter_is_the_documented_key_and_reseeds_from_time(
        redis_server: RedisServer) -> None:
    store = open_store(redis_server.url, namespace="seed")
    try:
        lease = store.acquire("a", 5, "h")
        assert lease is not None
        raw = redis_server.client()
        assert int(raw.get(token_counter_key("seed"))) == lease.token
        assert token_counter_key("seed") == "seed:token"
        # A failover to a replica that never saw the counter: the counter is simply missing.
        raw.delete(token_counter_key("seed"))
        again = store.acquire("b", 5, "h")
        assert again is not None and again.token > lease.token
        assert abs(again.token / 1e6 - time.time()) < 60, "seeded from TIME in microseconds"
    finally:
        store.close()


def test_flushed_scripts_are_reloaded_transparently(redis_server: RedisServer) -> None:
    store = open_store(redis_server.url, namespace="noscript")
    try:
        lease = store.acquire("a", 5, "h")
        assert lease is not None
        redis_server.client().script_flush()
        assert store.renew(lease).token == lease.token
    finally:
        store.close()


def test_wait_replicas_without_replicas_fails_closed_in_one_round_trip(
        redis_server: RedisServer) -> None:
    plain = RedisLeaseStore(redis_server.url, namespace="wait")
    waiting = RedisLeaseStore(redis_server.url, namespace="wait", timeout_s=0.4,
                              redis_wait_replicas=1)
    try:
        assert waiting.acquire("a", 5, "h") is None, "unacknowledged acquire is not a lease"
        lease = plain.acquire("b", 5, "h")
        assert lease is not None
        waiting.holder("b")  # loads nothing; warms the pool
        before = waiting.round_trips
        with pytest.raises(LeaseLost, match="replicas"):
            waiting.renew(lease)
        assert waiting.round_trips - before == 1
        assert waiting.claim(lease, "task:1", {}) is not None
        assert waiting.unacked_writes == 1
    finally:
        plain.close()
        waiting.close()


def test_eviction_risk_and_persistence_are_read_from_info(fresh_redis_aof: RedisServer) -> None:
    store = open_store(fresh_redis_aof.url, namespace="info")
    try:
        assert store.eviction_risk() is None  # type: ignore[attr-defined]
        assert store.persistence() == {  # type: ignore[attr-defined]
            "aof_enabled": True, "rdb": False, "persistent": True}
        raw = fresh_redis_aof.client()
        raw.config_set("maxmemory", "100mb")
        raw.config_set("maxmemory-policy", "allkeys-lru")
        risk = store.eviction_risk()  # type: ignore[attr-defined]
        assert risk is not None and "allkeys-lru" in risk and "noeviction" in risk
    finally:
        store.close()


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://127.0.0.1:6390/2", {"host": "127.0.0.1", "port": 6390, "db": 2}),
    ("redis://u:p%40ss@h", {"host": "h", "port": 6379, "db": 0, "username": "u",
                            "password": "p@ss"}),
    ("rediss://h:6380/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none",
     {"ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": 0}),
])
def test_redis_url_grammar(url: str, expected: dict[str, object]) -> None:
    got = parse_redis_url(url)
    assert {k: got[k] for k in expected} == expected


@pytest.mark.parametrize("url", [
    "redis://h/notadb", "redis://h:99999/0", "redis://h/0?ssl_ca_certs=/x",
    "rediss://h/0?ssl_verify=yes", "rediss://h/0?ssl_cert_reqs=maybe", "etcd+https://h?cert=x",
    "etcd://h?ca_cert=/x", "etcd+https://h?cert_cert=/c", "etcd://u@h", "mysql://h",
    "memory://h:1", "memory://u:p@x", "memory://a?b=1", "memory://a/b",
])
def test_bad_urls_are_config_errors_naming_the_setting(url: str) -> None:
    with pytest.raises(ConfigError, match="crawl_lease_url"):
        open_store(url, namespace="x")


def test_password_never_appears_in_errors() -> None:
    store = open_store(f"redis://u:s3cret@127.0.0.1:{free_port()}/0", namespace="x",
                       timeout_s=0.5)
    try:
        with pytest.raises(CrawlError) as info:
            store.holder("a")
        assert "s3cret" not in str(info.value) and "***" in str(info.value)
    finally:
        store.close()


# -- etcd -------------------------------------------------------------------------------------
def test_etcd_ttl_floor_and_whole_seconds(etcd_server: EtcdServer) -> None:
    store = open_store(etcd_server.url, namespace="floor")
    try:
        with pytest.raises(ConfigError, match="floor of 2s"):
            store.acquire("a", 1.5, "h")
        lease = store.acquire("a", 2.2, "h")
        assert lease is not None and lease.ttl_s == 3.0
    finally:
        store.close()


def test_etcd_endpoint_list_fails_over_to_a_live_member(etcd_server: EtcdServer) -> None:
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{etcd_server.client_port}"
    store = open_store(url, namespace="multi", timeout_s=2.0)
    try:
        lease = store.acquire("a", 5, "h")
        assert lease is not None
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["etcd", "memory"])
def test_store_refuses_use_in_a_forked_child(kind: str, request: pytest.FixtureRequest) -> None:
    url = (request.getfixturevalue("etcd_server").url if kind == "etcd"
           else f"memory://fork-{uuid.uuid4().hex[:8]}")
    store = open_store(url, namespace="fork")
    try:
        store.holder("a")
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                store.holder("a")
            except UnsupportedSetup:
                os._exit(0)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.holder("a") is None, "the parent keeps working"
    finally:
        store.close()


def test_etcd_pipelined_claims_stop_like_sequential_ones_on_a_bad_value(
        etcd_server: EtcdServer) -> None:
    """claim_many sends its transactions pipelined; a value that is not JSON in the fourth
    batch of 120 leaves exactly the first three batches claimed, as one-by-one sending did."""
    store = open_store(etcd_server.url, namespace="pipe")
    try:
        lease = store.acquire("w", 10, "h")
        assert lease is not None
        items: list[tuple[str, dict[str, object]]] = [(f"task:{i}", {"i": i})
                                                       for i in range(600)]
        items[400] = ("task:400", {"bad": object()})
        with pytest.raises(StoreDataError, match="task:400"):
            store.claim_many(lease, items)
        claimed = {c.key for c in store.claims_of("w")}
        assert claimed == {f"task:{i}" for i in range(360)}
        assert all(store.claim_many(lease, [(f"more:{i}", {}) for i in range(500)]))
        store.release(lease)
    finally:
        store.close()


def test_etcd_keeps_grpc_fork_noise_out_of_logs(etcd_server: EtcdServer) -> None:
    code = (
        "import os, threading\n"
        "from celery_crawl.leases import open_store\n"
        f"s = open_store({etcd_server.url!r}, namespace='noise')\n"
        "stop = []\n"
        "def loop():\n"
        "    while not stop: s.holder('x')\n"
        "t = threading.Thread(target=loop); t.start()\n"
        "for _ in range(10):\n"
        "    pid = os.fork()\n"
        "    if pid == 0: os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "stop.append(1); t.join(); print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "OK", out.stderr
    assert "fork" not in out.stderr, out.stderr


def test_etcd_user_and_password(fresh_etcd: EtcdServer) -> None:
    ctl = ["etcdctl", f"--endpoints=127.0.0.1:{fresh_etcd.client_port}"]
    env = {**os.environ, "ETCDCTL_API": "3"}
    for args in (["user", "add", "root:s3cret"], ["auth", "enable"]):
        subprocess.run(ctl + args, check=True, capture_output=True, timeout=20, env=env)
    host = f"127.0.0.1:{fresh_etcd.client_port}"
    store = open_store(f"etcd://root:s3cret@{host}", namespace="auth")
    try:
        lease = store.acquire("a", 5, "h")
        assert lease is not None and store.renew(lease).token == lease.token
        store.put("r", {"ok": 1}, lease=lease)
        assert store.get("r") == {"ok": 1}
    finally:
        store.close()
    with pytest.raises(CrawlError) as info:
        open_store(f"etcd://root:wrong@{host}", namespace="auth", timeout_s=1.0)
    assert "wrong" not in str(info.value)
    anonymous = open_store(f"etcd://{host}", namespace="auth", timeout_s=1.0)
    try:
        with pytest.raises(CrawlError):
            anonymous.holder("a")
    finally:
        anonymous.close()


# -- clock references ---------------------------------------------------------------------------
def test_clock_calibrates_against_redis_and_knows_etcd_has_no_clock(
        redis_server: RedisServer, etcd_server: EtcdServer) -> None:
    reference = RedisTimeReference(redis_server.url, timeout_s=1.0)
    store = open_store(redis_server.url, namespace="clock")
    etcd = open_store(etcd_server.url, namespace="clock")
    try:
        for ref in (reference, store):
            clock = Clock(ref)
            offset = clock.calibrate(k=3)
            # Same machine, same clock: the offset is within the measurement's own uncertainty.
            assert offset is not None and clock.uncertainty_s is not None
            assert abs(offset) <= clock.uncertainty_s + 0.05
        assert Clock(etcd).calibrate() is None
        dead = RedisTimeReference(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
        assert dead.server_time() is None
        dead.close()
    finally:
        reference.close()
        store.close()
        etcd.close()


def test_store_for_config_and_required_characteristics(redis_server: RedisServer,
                                                       etcd_server: EtcdServer) -> None:
    config = CrawlConfig.from_mapping({"crawl_lease_url": redis_server.url,
                                       "crawl_namespace": "cfg", "crawl_done_ttl": "1h",
                                       "crawl_store_timeout": "750ms"})
    redis_store = store_for(config)
    etcd_store = open_store(etcd_server.url, namespace="cfg")
    try:
        assert isinstance(redis_store, RedisLeaseStore)
        assert (redis_store.namespace, redis_store.timeout_s) == ("cfg", 0.75)
        require(redis_store, Characteristic.MONOTONIC_TOKENS, Characteristic.HAS_CLOCK)
        with pytest.raises(UnsupportedSetup, match="linearizable"):
            require(redis_store, Characteristic.LINEARIZABLE)
        require(etcd_store, Characteristic.LINEARIZABLE, Characteristic.MONOTONIC_TOKENS)
        with pytest.raises(UnsupportedSetup, match="has-clock"):
            require(etcd_store, Characteristic.HAS_CLOCK)
    finally:
        redis_store.close()
        etcd_store.close()
    with pytest.raises(ConfigError, match="crawl_redis_wait_replicas"):
        open_store(etcd_server.url, namespace="cfg", redis_wait_replicas=1)
    holder = make_holder()
    host, pid, rand = holder.rsplit(":", 2)
    assert int(pid) == os.getpid() and len(rand) == 8 and host
    assert make_holder() != holder


def test_a_cluster_node_named_by_a_plain_redis_url_is_refused_with_a_clear_error() -> None:
    server = RedisServer(extra=["--cluster-enabled", "yes"], port=free_cluster_port()).start()
    try:
        store = open_store(server.url, namespace="cluster")
        with pytest.raises(UnsupportedSetup, match=r"Redis Cluster node; name it with redis\+cluster://"):
            store.acquire("a", 5, make_holder())
        store.close()
        with pytest.raises(ConfigError, match="only database 0"):
            open_store(f"redis+cluster://127.0.0.1:{server.port}/3", namespace="cluster")
    finally:
        server.cleanup()


def test_a_moved_slot_fails_one_call_then_the_store_and_backend_follow_it() -> None:
    """Resharding the namespace's slot to another master: the next call of each client gets
    MOVED, fails as StoreUnavailable, and the one after talks to the new master, data intact."""
    from celery import Celery, states
    from celery.app.task import Context

    from tests.clusters import running_redis_cluster

    with running_redis_cluster() as cluster:
        store = open_store(cluster.url, namespace="moving", timeout_s=5)
        app = Celery("moving", broker="memory://", set_as_current=False,
                     backend=f"crawlredis+cluster://127.0.0.1:{cluster.nodes[0].port}/0")
        app.conf.update(crawl_namespace="moving", redis_socket_timeout=5,
                        result_backend_transport_options={"retry_policy": {"max_retries": 0}})
        try:
            lease = store.acquire("leader", 30, "a")
            assert lease is not None
            token = store.claim(lease, "task:1", {"n": 1})
            assert token is not None
            app.backend.store_result("t1", 1, states.SUCCESS,
                                     request=Context(crawl_claim_token=token))
            old = cluster.owner("{moving}:token")
            new = cluster.move_slot_of("{moving}:token")
            assert new is not old
            with pytest.raises(StoreUnavailable, match="moved"):
                store.renew(lease)
            lease = store.renew(lease)
            assert store.claimant("task:1") is not None
            with pytest.raises(StoreUnavailable, match="moved"):
                app.backend.get_task_meta("t1", cache=False)
            assert app.backend.get_task_meta("t1", cache=False)["status"] == states.SUCCESS
        finally:
            store.close()
            app.backend.client.connection_pool.disconnect()


# -- memory:// --------------------------------------------------------------------------------
def test_memory_is_one_store_per_name_in_this_process_only() -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    first = open_store(f"memory://{name}", namespace="ns")
    second = open_store(f"memory://{name}", namespace="ns")
    other = open_store(f"memory://{name}-other", namespace="ns")
    try:
        lease = first.acquire("leader", 30, "a")
        assert lease is not None
        assert second.holder("leader") == ("a", lease.token), "same name: same store"
        assert second.acquire("leader", 30, "b") is None
        assert other.holder("leader") is None, "another name: another store"
        assert open_store(f"memory://{name}", namespace="ns2").holder("leader") is None
        child = subprocess.run(
            [sys.executable, "-c",
             "from celery_crawl.leases import open_store\n"
             f"print(open_store('memory://{name}', namespace='ns').holder('leader'))"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
        assert child.stdout.strip() == "None", "another process has a store of its own"
        require(first, Characteristic.MONOTONIC_TOKENS, Characteristic.LINEARIZABLE)
        with pytest.raises(UnsupportedSetup, match="multi-process"):
            require(first, Characteristic.MULTI_PROCESS)
        assert first.persistence()["persistent"] is False
    finally:
        for store in (first, second, other):
            store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        first.holder("leader")
    with pytest.raises(ConfigError, match="crawl_lease_url"):
        CrawlConfig.from_mapping({"crawl_lease_url": f"memory://{name}"})
    with pytest.raises(ConfigError, match="crawl_redis_wait_replicas"):
        open_store(f"memory://{name}", namespace="ns", redis_wait_replicas=1)


def test_memory_judges_expiry_on_its_injected_clock() -> None:
    now = [1000.0]
    name = f"clock-{uuid.uuid4().hex[:8]}"
    store = memory.MemoryLeaseStore(f"memory://{name}", namespace="ns", clock=lambda: now[0])
    lease = store.acquire("l", 3, "a")
    assert lease is not None
    assert lease.valid_until == pytest.approx(1000 + 3 * 0.99 - 0.05)
    assert store.claim(lease, "task:1", {}) is not None
    store.put("done/1", {}, ttl_s=2)
    now[0] += 2.5
    assert store.get("done/1") is None and store.holder("l") is not None
    now[0] += 1.0
    assert store.holder("l") is None
    orphan = store.claimant("task:1")
    assert orphan is not None and not orphan.alive
    with pytest.raises(LeaseLost):
        store.renew(lease)
    with pytest.raises(ConfigError, match="another clock"):
        memory.MemoryLeaseStore(f"memory://{name}", namespace="ns", clock=time.monotonic)


def test_memory_calls_wait_for_its_lock_no_longer_than_the_timeout() -> None:
    name = f"lock-{uuid.uuid4().hex[:8]}"
    store = open_store(f"memory://{name}", namespace="ns", timeout_s=0.3)
    space = memory._spaces[name]
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with space.cond:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        held.wait(5)
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout, match=r"0\.3s"):
            store.holder("x")
        assert time.monotonic() - t0 < 0.3 * 3
    finally:
        done.set()
        thread.join(10)
    assert store.holder("x") is None
