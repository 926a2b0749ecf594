"""The Redis lease store behind Sentinel: one master, two replicas, three real sentinels.

Every call goes to the master the sentinels name; a failover is noticed on the next call (a
refused connection or a ``READONLY`` reply asks the sentinels again, within the store timeout),
counted in ``master_changes``, and no write reaches a replica. Tokens never go back across a
failover. ``crawl_redis_wait_replicas`` works unchanged (``WAIT`` on the master).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_crawl import keys, metrics
from celery_crawl.errors import ConfigError, LeaseLost, StoreError
from celery_crawl.leases import Lease, open_store
from celery_crawl.leases._sentinel import SentinelLink, parse_sentinel_url
from celery_crawl.leases.redis import RedisLeaseStore
from tests.sentinels import SentinelSet, running_sentinels
from tests.servers import wait_until

pytestmark = pytest.mark.slow

TTL_S = 3.0
NS = "sentinel"


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    with running_sentinels() as topology:
        yield topology


def _store(topology: SentinelSet, **kw: object) -> RedisLeaseStore:
    store = open_store(topology.url(), namespace=NS, timeout_s=2.0, **kw)  # type: ignore[arg-type]
    assert isinstance(store, RedisLeaseStore)
    return store


# -- the URL ---------------------------------------------------------------------------------------
def test_url_grammar() -> None:
    spec = parse_sentinel_url(
        "rediss+sentinel://u:p%40ss@s1,s2:26380,[::1]:26381/crawl/3?sentinel_password=sp"
        "&sentinel_ssl=yes&ssl_ca_certs=/ca.pem&ssl_cert_reqs=none")
    assert spec.sentinels == (("s1", 26379), ("s2", 26380), ("::1", 26381))
    assert (spec.master, spec.db) == ("crawl", 3)
    assert spec.data["username"] == "u" and spec.data["password"] == "p@ss"
    assert spec.data["ssl"] is True and spec.data["ssl_cert_reqs"] == 0
    assert spec.sentinel["password"] == "sp" and spec.sentinel["ssl_ca_certs"] == "/ca.pem"


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://s1:26379", "no master name"),
    ("redis+sentinel://s1:26379/crawl/x", "not a number"),
    ("redis+sentinel://s1:26379,/crawl", "empty sentinel"),
    ("redis+sentinel://s1:99999/crawl", "bad sentinel address"),
    ("redis+sentinel://s1/crawl?ssl_ca_certs=/x", "needs rediss"),
    ("redis+sentinel://s1/crawl?sentinel_ssl=yes", "needs rediss"),
    ("rediss+sentinel://s1/crawl?sentinel_ssl=maybe", "yes or no"),
    ("redis+sentinel://s1/crawl?sentinel_pasword=x", "unknown option"),
])
def test_bad_urls_name_the_setting(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"crawl_lease_url.*{why}"):
        open_store(url, namespace=NS)


def test_passwords_are_masked() -> None:
    store = open_store("redis+sentinel://:s3cret@127.0.0.1:1/crawl?sentinel_password=t0psecret",
                       namespace=NS, timeout_s=0.3)
    try:
        assert "s3cret" not in repr(store) and "t0psecret" not in repr(store)
        with pytest.raises(StoreError) as info:
            store.holder("x")
        assert "s3cret" not in str(info.value) and "t0psecret" not in str(info.value)
    finally:
        store.close()


# -- a running topology ------------------------------------------------------------------------
def test_calls_go_to_the_master_and_ride_nothing(sentinels: SentinelSet) -> None:
    master = sentinels.wait_settled()
    store = _store(sentinels)
    try:
        lease = store.acquire(keys.worker_lease("w"), TTL_S, "w")
        assert lease is not None
        assert store.claim(lease, keys.task_claim("t1"), {"q": "crawl"}) is not None
        assert sentinels.node(master).client().exists(f"{NS}:lease:{keys.worker_lease('w')}")
        assert store.sentinel_link is not None and store.sentinel_link.master == (
            "127.0.0.1", master)
        # The master may move between a broker's round trips: nothing rides in them.
        assert store.line_pool() is None
        assert not store.shares_server({"host": "127.0.0.1", "port": master, "db": 0})
        store.release(lease)
    finally:
        store.close()


def test_wait_replicas_through_sentinel(sentinels: SentinelSet) -> None:
    sentinels.wait_settled()
    store = _store(sentinels, redis_wait_replicas=2)
    try:
        lease = store.acquire(keys.BEAT_LEADER, TTL_S, "beat-a")
        assert lease is not None, "both replicas acknowledged through the master"
        lease = store.renew(lease)
        assert store.unacked_writes == 0
        store.release(lease)
    finally:
        store.close()


def _renew_through(store: RedisLeaseStore, lease: Lease, bound_s: float) -> tuple[Lease, float]:
    """Renew until it succeeds; (the renewed lease, seconds it took)."""
    t0 = time.monotonic()
    got = wait_until(lambda: store.renew(lease), bound_s, interval_s=0.05,
                     what="a renewal on the new master")
    return got, time.monotonic() - t0


def test_planned_failover_the_store_follows_the_switch(sentinels: SentinelSet) -> None:
    old = sentinels.wait_settled()
    store = _store(sentinels)
    try:
        lease = store.acquire(keys.BEAT_LEADER, TTL_S, "beat-a")
        assert lease is not None
        lease = store.renew(lease)  # a pooled connection to the master
        t0 = time.monotonic()
        sentinels.planned_failover()
        new = sentinels.wait_new_master(old)
        # The old master still answers as a master (Sentinel demotes it seconds later): the
        # store's recheck of the address moves the calls to the new master anyway.
        link = store.sentinel_link
        assert link is not None

        lost = False

        def moved() -> bool:
            nonlocal lease, lost
            try:
                lease = store.renew(lease)
            except LeaseLost:
                # Replication is asynchronous: the lease's last write may have reached only the
                # old master (docs/durability.md); it is taken again on the new one.
                lost = True
                again = store.acquire(keys.BEAT_LEADER, TTL_S, "beat-a")
                lease = again if again is not None else lease
            except StoreError:
                pass
            return link.master == ("127.0.0.1", new)

        wait_until(moved, 5, what="the store on the new master", interval_s=0.05)
        print(f"\nSENTINEL FAILOVER: store on the new master after {time.monotonic() - t0:.2f}s"
              + (" (the lease's last write was lost with the old master)" if lost else ""))
        lease = store.renew(lease)
        assert sentinels.node(new).client().exists(f"{NS}:lease:{keys.BEAT_LEADER}")
        assert store.sentinel_link is not None and store.sentinel_link.master_changes == 1
        nxt = store.acquire(keys.worker_lease("after"), TTL_S, "after")
        assert nxt is not None and nxt.token > lease.token, "tokens never go back"
        store.release(lease)
    finally:
        store.close()
    sentinels.wait_settled(timeout_s=60)


def test_demoted_master_readonly_moves_the_call(sentinels: SentinelSet) -> None:
    """A connection to a node demoted meanwhile: READONLY (nothing written), the sentinels
    asked again, the same call made on the master, within the store timeout."""
    old = sentinels.wait_settled()
    store = _store(sentinels)
    assert store.sentinel_link is not None
    store.sentinel_link.recheck_s = 3600  # only the READONLY reply can move this store
    metrics.watch_master_changes(store)
    counted = metrics.STORE_MASTER_CHANGES._value.get()
    try:
        lease = store.acquire(keys.BEAT_LEADER, TTL_S, "beat-b")
        assert lease is not None
        sentinels.planned_failover()
        new = sentinels.wait_new_master(old)
        # What Sentinel does to the old master eventually, done now.
        sentinels.node(old).client().execute_command("REPLICAOF", "127.0.0.1", str(new))
        wait_until(lambda: sentinels.node(old).client().info("replication")["role"] == "slave",
                   10, what="old master demoted")
        lease = store.renew(lease)  # one call: READONLY, then the new master
        assert store.sentinel_link.master == ("127.0.0.1", new)
        assert store.sentinel_link.master_changes == 1
        assert metrics.STORE_MASTER_CHANGES._value.get() == counted + 1
        assert sentinels.node(new).client().hget(f"{NS}:lease:{keys.BEAT_LEADER}",
                                                 "holder") == b"beat-b"
        store.release(lease)
    finally:
        store.close()
    sentinels.wait_settled(timeout_s=60)


def test_killed_master_the_store_fails_then_follows_the_new_one(sentinels: SentinelSet) -> None:
    old = sentinels.wait_settled()
    store = _store(sentinels)
    try:
        lease = store.acquire(keys.BEAT_LEADER, 10.0, "beat-a")
        assert lease is not None
        before = lease.token
        node = sentinels.kill_master()
        t0 = time.monotonic()
        # Until the sentinels agree it is down and promote a replica, calls fail (bounded).
        got = wait_until(lambda: _try_renew(store, lease), 30, interval_s=0.05,
                         what="a renewal after the master was killed")
        interruption = time.monotonic() - t0
        new = sentinels.master_port()
        assert new != old and store.sentinel_link is not None
        assert store.sentinel_link.master == ("127.0.0.1", new)
        assert store.sentinel_link.master_changes == 1
        print(f"\nkill -9 master: store calls failed for {interruption:.2f}s")
        assert interruption < 15
        w = store.acquire(keys.worker_lease("w2"), TTL_S, "w2")
        assert w is not None and w.token > before
        store.release(got)
        sentinels.restart_node(node)
    finally:
        store.close()
    sentinels.wait_settled()


def _try_renew(store: RedisLeaseStore, lease: Lease) -> Lease | None:
    t0 = time.monotonic()
    try:
        return store.renew(lease)
    except StoreError:
        assert time.monotonic() - t0 < 2 * 2.0 + 1, "a failing call is bounded by the timeout"
        return None


def test_link_unsent_classification() -> None:
    import redis
    from redis.sentinel import MasterNotFoundError

    assert SentinelLink.unsent(MasterNotFoundError("none"))
    assert SentinelLink.unsent(redis.ReadOnlyError("READONLY"))
    assert SentinelLink.unsent(redis.ConnectionError("The previous master is now a slave"))
    assert SentinelLink.unsent(redis.ConnectionError("Error 111 connecting to 127.0.0.1:1."))
    assert not SentinelLink.unsent(redis.ConnectionError("Connection closed by server."))
    assert not SentinelLink.unsent(redis.TimeoutError("Timeout reading from socket"))


def test_passwords_of_the_data_nodes_and_of_the_sentinels() -> None:
    """Data nodes with ``requirepass``, sentinels with their own password: the URL's password
    is the data nodes', ``sentinel_password`` the sentinels'; a wrong one is a clear error that
    names neither."""
    with running_sentinels(password="d4ta-pw", sentinel_password="s3nt-pw") as topology:
        hosts = topology.url().split("://", 1)[1]
        good = open_store(f"redis+sentinel://:d4ta-pw@{hosts}?sentinel_password=s3nt-pw",
                          namespace=NS, timeout_s=2.0)
        try:
            lease = good.acquire(keys.worker_lease("w"), TTL_S, "w")
            assert lease is not None
            good.release(lease)
            link = good.sentinel_link
            shown = f"{good.url} {good!r} {vars(good)!r} {vars(link)!r}"
            assert "d4ta-pw" not in shown and "s3nt-pw" not in shown
        finally:
            good.close()
        for url in (f"redis+sentinel://:d4ta-pw@{hosts}?sentinel_password=wrong",
                    f"redis+sentinel://:wrong@{hosts}?sentinel_password=s3nt-pw"):
            bad = open_store(url, namespace=NS, timeout_s=0.5)
            try:
                with pytest.raises(StoreError) as info:
                    bad.holder("x")
                text = str(info.value)
                assert "wrong" not in text and "d4ta-pw" not in text and "s3nt-pw" not in text
            finally:
                bad.close()


def test_paused_master_no_connection_of_the_store_stays_on_it() -> None:
    """SIGSTOP of the master past ``down-after-milliseconds``, SIGCONT after the failover: the
    old master answers as a master again until Sentinel demotes it (seconds later). A connection
    the store made to it before the pause and did not use during it (a batch lane: the worker
    sends no batch while its broker is paused too) must not carry a write there afterwards,
    even when the store learnt of the move from a new connection of its own rather than from
    its recheck of the address; and no call waits longer than the store timeout."""
    timeout_s = 1.0
    with running_sentinels(replicas=1) as topology:
        old = topology.wait_settled()
        store = open_store(topology.url(), namespace=NS, timeout_s=timeout_s)
        assert isinstance(store, RedisLeaseStore)
        link = store.sentinel_link
        assert link is not None
        # Only a move the store sees itself may trigger the check of its connections.
        link.recheck_s = 3600
        try:
            lease = store.acquire(keys.worker_lease("paused"), 30.0, "w")
            assert lease is not None
            # A batch: its lane's connection to the master stays open, idle.
            assert store.finish_claims(lease, [("c0", "r0", {"n": 0})], ttl_s=30) == [False]
            node = topology.master()
            topology.pause(node)
            slowest = 0.0

            def renewed() -> bool:
                nonlocal lease, slowest
                t0 = time.monotonic()
                try:
                    lease = store.renew(lease)
                    return link.master != ("127.0.0.1", old)
                except StoreError:
                    return False
                finally:
                    slowest = max(slowest, time.monotonic() - t0)

            wait_until(renewed, 30, interval_s=0.05, what="a renewal on the new master")
            new = link.master[1] if link.master else None
            assert new is not None and new != old
            topology.resume(node)
            # The old master answers again, as a master (Sentinel demotes it later).
            wait_until(lambda: node.client().ping(), 10, what="the old master answering")
            if node.client().info("replication")["role"] != "master":
                pytest.skip("the old master was demoted before the check (a slow machine)")
            t0 = time.monotonic()
            got = store.finish_claims(lease, [("c1", "r1", {"n": 1})], ttl_s=30)
            slowest = max(slowest, time.monotonic() - t0)
            assert got == [False]
            rec = f"{NS}:rec:r1"
            assert topology.node(new).client().exists(rec), "the batch reached the new master"
            assert not node.client().exists(rec), "a write reached the old master"
            assert slowest < timeout_s * 1.5 + 0.5, f"a call took {slowest:.2f}s"
        finally:
            store.close()


def test_the_broker_master_is_asked_as_kombu_asks(sentinels: SentinelSet) -> None:
    """``_broker.broker_master_address`` asks the broker URL's sentinels in kombu's order (the
    worker reconnects its consumer after a failover only once they name the new master: a
    sentinel that had not heard of it would send the consumer back to the old one)."""
    from celery import Celery

    from celery_crawl._broker import broker_master_address
    from tests.sentinels import MASTER

    old = sentinels.wait_settled()
    app = Celery("broker-master", broker=sentinels.broker_url())
    app.conf.broker_transport_options = {"master_name": MASTER}
    assert broker_master_address(app, timeout_s=1.0) == ("127.0.0.1", old)
    sentinels.planned_failover()
    new = sentinels.wait_new_master(old)
    wait_until(lambda: broker_master_address(app, timeout_s=1.0) == ("127.0.0.1", new), 10,
               what="the broker's sentinels naming the new master")
    other = Celery("not-sentinel", broker="redis://127.0.0.1:1/0")
    assert broker_master_address(other, timeout_s=0.2) is None
    sentinels.wait_settled(timeout_s=60)
