"""Every key a Lua script touches is one it declared in KEYS (Redis Cluster routes a script by
its declared keys; an undeclared key works on a standalone server only by accident).

A real redis-server's ``MONITOR`` shows each ``EVALSHA`` with its declared keys, followed by the
commands the script ran; ``COMMAND GETKEYS`` names the keys of each. Every lease-store operation
that runs a script, and every backend script, is exercised, including the paths where a script
needs keys named by stored data (a claim taken over from a dead claimant, the reaper's pass, an
idempotency key owned by another task id).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery, states
from celery.app.task import Context

from celery_crawl.backends.ledger import KeyLedger
from celery_crawl.leases import open_store
from tests.servers import Monitor, RedisServer, running_redis, wait_until

_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


def undeclared(lines: list[str], probe: redis.Redis) -> list[str]:
    """``script-sha: command key`` for every key a script touched without declaring it."""
    out: list[str] = []
    declared: set[str] | None = None
    sha = ""
    for line in lines:
        args = [a.replace('\\"', '"') for a in _ARG.findall(line)]
        if not args:
            continue
        inside = re.search(r"\[\d+ lua\]", line) is not None
        if not inside:
            declared = None
            if args[0].upper() in ("EVALSHA", "EVAL"):
                sha = args[1][:8]
                declared = set(args[3:3 + int(args[2])])
            continue
        if declared is None:
            continue
        try:
            keys = [k.decode() if isinstance(k, bytes) else str(k)
                    for k in probe.command_getkeys(*args)]
        except redis.ResponseError:  # TIME, PUBLISH: no key arguments
            keys = []
        out.extend(f"{sha}: {args[0]} {k}" for k in keys if k not in declared)
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with running_redis() as srv:
        yield srv


def test_lease_store_scripts_touch_only_declared_keys(server: RedisServer) -> None:
    probe = server.client()
    mon = Monitor(server).start(probe)
    store = open_store(server.url, namespace=f"k{uuid.uuid4().hex[:6]}", timeout_s=5)
    try:
        dead = store.acquire("worker:dead", 0.5, "w-dead")
        assert dead is not None
        assert store.claim_many(dead, [("task:a", {"n": 1}), ("task:b", {"n": 2})]) != [None]
        wait_until(lambda: store.holder("worker:dead") is None, 10, what="the lease to expire")
        live = store.acquire("worker:live", 30, "w-live")
        assert live is not None
        live = store.renew(live)
        assert store.claim(live, "task:a", {"n": 3}) is not None  # taken over from a dead one
        assert store.claim(live, "task:c", {"n": 4}) is not None
        assert store.claimant("task:a") is not None
        assert {c.key for c in store.claims_of("worker:live")} == {"task:a", "task:c"}
        orphans = store.orphaned_claims()
        assert [c.key for c in orphans] == ["task:b"]
        assert store.drop_claim(orphans[0])
        assert store.unclaim(live, "task:c")
        store.put("rec", {"v": 1}, lease=live)
        store.put_many([("r1", {}), ("r2", {})], ttl_s=30)
        assert store.delete("r1", lease=live)
        store.push("q", {"n": 1})
        assert store.pop_all("q", lease=live) == [{"n": 1}]
        store.release(live)
    finally:
        store.close()
        mon.stop(probe)
    assert any("EVALSHA" in x for x in mon.lines)
    assert undeclared(mon.lines, probe) == []


def test_backend_scripts_touch_only_declared_keys(server: RedisServer) -> None:
    app = Celery(f"k{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False,
                 backend=f"crawlredis://127.0.0.1:{server.port}/0")
    ns = f"k{uuid.uuid4().hex[:6]}"
    app.conf.update(crawl_namespace=ns, redis_socket_timeout=5)
    store = open_store(server.url, namespace=ns, timeout_s=5)
    lease = store.acquire("worker:w", 30, "w")
    assert lease is not None
    token = store.claim(lease, "task:x", {})
    assert token is not None
    probe = server.client()
    mon = Monitor(server).start(probe)
    try:
        backend = app.backend
        assert backend.checks_token_issuance
        one, two = f"t1-{uuid.uuid4().hex[:6]}", f"t2-{uuid.uuid4().hex[:6]}"
        ledger = KeyLedger(backend, ns, "shared-key", 30.0)
        assert ledger.begin(one, str(token), "run-1").kind == "run"
        backend.store_result(one, 1, states.SUCCESS,
                             request=Context(crawl_claim_token=token, hostname="w"))
        assert ledger.begin(two, "", "run-2").kind == "finished"  # owned by another task id
        assert ledger.rollback_begin("run-1", str(token), final=False, failure="{}") == "go"
        ledger.rollback_end("run-1", str(token), final=False, status="done")
    finally:
        store.close()
        mon.stop(probe)
    assert undeclared(mon.lines, probe) == []
