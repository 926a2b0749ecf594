"""Bounded growth of an etcd lease store: TTL'd records share leases by expiry bucket, and with
auto-compaction a small backend quota holds any number of task lifecycles.

Real etcd servers (private ones, with the flags under test); the lifecycles are the worker's
store calls: claim a batch, write each task's ``done/<id>`` tombstone (TTL'd), unclaim."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_crawl.errors import StoreError
from celery_crawl.leases import Lease, LeaseStore, open_store
from celery_crawl.leases._buckets import BUCKETS_PER_TTL, ExpiryBuckets
from celery_crawl.leases.etcd import import_etcdrpc, python_etcd3
from tests.servers import EtcdServer, etcd_binary

TTL_S = 3.0
#: Small enough that the control run (no compaction) fills it in a few seconds.
QUOTA = 3 * 1024 * 1024
BATCH = 100


def _now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.fixture
def servers() -> Iterator[list[EtcdServer]]:
    if etcd_binary() is None:
        pytest.skip("etcd binary not found (apt-get install etcd-server)")
    started: list[EtcdServer] = []
    yield started
    for server in started:
        server.cleanup()


def _start(servers: list[EtcdServer], *args: str) -> EtcdServer:
    server = EtcdServer(args).start()
    servers.append(server)
    return server


def _revision(store: Any) -> int:
    rpc = import_etcdrpc()
    return int(store._call("status", store._maint.Status, rpc.StatusRequest()).header.revision)


def _record_leases(client: Any, ns: str, keys: list[str]) -> set[int]:
    leases = set()
    for key in keys:
        value, meta = client.get(f"{ns}:rec:{key}")
        assert value is not None, f"record {key} is missing"
        leases.add(meta.lease_id)
    return leases


def test_ttl_records_share_a_bounded_number_of_leases_and_expire_on_time(
        servers: list[EtcdServer]) -> None:
    server = _start(servers)
    store: Any = open_store(server.url, namespace="bk", timeout_s=5.0)
    client = python_etcd3().client("127.0.0.1", server.client_port, timeout=5)
    try:
        written: list[tuple[str, float]] = []
        t_end = _now() + 1.5
        i = 0
        while _now() < t_end or i < 200:  # one write per task, as a worker's finish() does
            written.append((f"done/{i}", _now()))
            store.put(f"done/{i}", {"state": "SUCCESS"}, ttl_s=TTL_S)
            i += 1
        rev_written = _revision(store)
        leases = _record_leases(client, "bk", [k for k, _ in written])
        # Buckets of TTL/16 s (at least 1 s) that end within TTL + one bucket of the writes.
        span = written[-1][1] - written[0][1]
        width = ExpiryBuckets.width(TTL_S)
        assert len(leases) <= span / width + 2, (len(written), leases)
        assert store._buckets.live() <= BUCKETS_PER_TTL + 1
        # No record is gone before its TTL; each is gone within one bucket (+1 s rounding,
        # +1 s for the poll and etcd's expiry sweep) after it.
        gone: dict[str, float] = {}
        deadline = _now() + span + TTL_S + width + 10
        while len(gone) < len(written) and _now() < deadline:
            keys = [k for k, _ in written if k not in gone]
            t_read = _now()
            for key, rec in zip(keys, store.get_many(keys), strict=True):
                if rec is None:
                    gone[key] = t_read
            time.sleep(0.05)
        assert len(gone) == len(written), "some records never expired"
        for key, t_put in written:
            lived = gone[key] - t_put
            assert lived >= TTL_S - 0.05, f"{key} expired after {lived:.2f}s < {TTL_S}s"
            assert lived <= TTL_S + width + 2.0 + 1.0, f"{key} lived {lived:.2f}s"
        # Expiry cost one revision per lease, not one per record.
        assert _revision(store) - rev_written <= len(leases)
        # A bucket lease revoked behind the store's back: the next write takes a fresh one.
        lease_id = store._buckets.lease_for(60.0)
        client.revoke_lease(lease_id)
        store.put("after-revoke", {"ok": 1}, ttl_s=60.0)
        assert store.get("after-revoke") == {"ok": 1}
    finally:
        client.close()
        store.close()


def _lifecycles(store: LeaseStore, lease: Lease, start: int, count: int) -> int:
    """``count`` task lifecycles from task ``start``; every write checked as it is made."""
    for base in range(start, start + count, BATCH):
        keys = [f"task:{n}" for n in range(base, base + BATCH)]
        tokens = store.claim_many(lease, [(k, {"worker": "w", "queue": "celery",
                                               "deliveries": 1, "claimed_at": time.time()})
                                          for k in keys])
        assert all(tokens), f"claims refused at {base}"
        done = [(f"done/{n}", {"state": "SUCCESS", "token": tokens[i], "retries": 0,
                               "worker": "w", "at": time.time()})
                for i, n in enumerate(range(base, base + BATCH))]
        store.put_many(done, ttl_s=2.0)
        assert all(store.get_many([k for k, _ in done])), f"a tombstone is missing at {base}"
        for key in keys:
            assert store.unclaim(lease, key), f"{key} was not unclaimed"
    return start + count


def _wait_compacted_past(store: Any, revision: int, deadline_s: float) -> None:
    """Poll until etcd's compactor has passed ``revision`` (a read at it is refused).

    The test writes as fast as the machine allows, which on a fast machine is several times the
    quota per compaction period; waiting for the compactor once per chunk bounds the history kept
    to about two chunks, whatever the machine's speed."""
    rpc = import_etcdrpc()
    deadline = _now() + deadline_s
    while True:
        try:
            store._call("probe", store._kv.Range,
                        rpc.RangeRequest(key=b"q:probe", revision=revision))
        except StoreError as exc:
            if "compacted" in str(exc):
                return
            raise
        assert _now() < deadline, f"etcd did not compact past revision {revision} in {deadline_s}s"
        time.sleep(0.05)


def test_auto_compaction_keeps_a_small_quota_from_filling(servers: list[EtcdServer]) -> None:
    quota = f"--quota-backend-bytes={QUOTA}"
    # Control: the same quota without compaction refuses writes after `held` lifecycles.
    plain = _start(servers, quota)
    store = open_store(plain.url, namespace="q", timeout_s=5.0)
    lease = store.acquire("w", 30, "h")
    assert lease is not None
    held = 0
    with pytest.raises(StoreError, match="database space exceeded"):
        while held < 50_000:
            held = _lifecycles(store, lease, held, BATCH)
            if held % 2000 == 0:
                lease = store.renew(lease)
    store.close()
    plain.cleanup()
    servers.remove(plain)
    # With auto-compaction (docker-compose.yml's mode; a short retention so the test is short)
    # the same quota takes 2.5x as many lifecycles: no NOSPACE, no write lost.
    compacted = _start(servers, quota, "--auto-compaction-mode=periodic",
                       "--auto-compaction-retention=1s")
    store = open_store(compacted.url, namespace="q", timeout_s=5.0)
    lease = store.acquire("w", 30, "h")
    assert lease is not None
    target = (held * 5 // 2 // BATCH + 1) * BATCH
    chunk = max(BATCH, held // 4 // BATCH * BATCH)  # a quarter of what the quota holds
    done = 0
    while done < target:
        start = _revision(store)
        done = _lifecycles(store, lease, done, chunk)
        lease = store.renew(lease)
        _wait_compacted_past(store, start, deadline_s=15.0)
    assert store.claims_of("w") == []
    rpc = import_etcdrpc()
    alarms = store._call("alarms", store._maint.Alarm,  # type: ignore[attr-defined]
                         rpc.AlarmRequest(action=rpc.AlarmRequest.GET)).alarms
    assert list(alarms) == [], alarms
    store.release(lease)
    store.close()
