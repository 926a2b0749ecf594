"""Lease-store contents written by someone else: garbage in a record, lease, claim, token or
queue key is reported as ``StoreDataError`` naming the key, and the same store object keeps
serving every other key (its connection is not poisoned, valid items are not lost).

Real redis-server (the session's private one); every test uses its own namespace.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from celery_crawl.errors import FencedError, StoreDataError, StoreError
from celery_crawl.leases import open_store
from tests.servers import RedisServer

TTL_S = 3.0

#: Bytes nobody but celery-crawl should have written: binary, invalid UTF-8, text that is not
#: JSON, JSON that is not an object, absurdly deep or large JSON.
garbage = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    st.sampled_from([b"\xff\xfe\xfa", b"\xc3\x28", b"[1,2]", b"null", b"42", b'"str"', b"NaN",
                     b"{", b"{\"a\":"]),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                 lambda inner: st.lists(inner, max_size=3), max_leaves=20)
    .map(lambda v: json.dumps(v).encode()),
)


def _is_json_object(raw: bytes | str) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, TypeError, RecursionError):
        return False


@pytest.fixture(scope="module")
def raw(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client()


@pytest.fixture(scope="module")
def ns() -> str:
    return f"hostile{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def store(redis_server: RedisServer, ns: str) -> Iterator[Any]:
    s = open_store(redis_server.url, namespace=ns, timeout_s=2.0)
    yield s
    s.close()


def _still_serving(store: Any) -> None:
    """The store answers correctly on unrelated keys after meeting garbage."""
    key = f"good/{uuid.uuid4().hex[:8]}"
    store.put(key, {"ok": True, "n": 1})
    assert store.get(key) == {"ok": True, "n": 1}
    lease = store.acquire(f"good-{uuid.uuid4().hex[:8]}", TTL_S, "good:1:x")
    assert lease is not None
    store.release(lease)


#: Every example costs round trips to a real server: no shrinking (a failure is reported with
#: the example as drawn), so a regression cannot blow the suite's time budget.
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]
_fuzz = settings(max_examples=50, phases=_NO_SHRINK,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# -- records -----------------------------------------------------------------------------------
#: Shapes worth trying every run, whatever hypothesis draws: deep nesting (RecursionError in
#: json), huge, invalid UTF-8.
HOSTILE_EXAMPLES = [b"[" * 100_000, b'{"k":' * 50_000 + b"1" + b"}" * 50_000,
                    b'{"v":"' + b"x" * 2_000_000, b"\xff\xfe\xfa"]


@_fuzz
@given(value=garbage)
@example(value=HOSTILE_EXAMPLES[0])
@example(value=HOSTILE_EXAMPLES[1])
@example(value=HOSTILE_EXAMPLES[2])
@example(value=HOSTILE_EXAMPLES[3])
def test_garbage_record_value(store: Any, raw: redis.Redis, ns: str, value: bytes | str) -> None:
    if _is_json_object(value):
        return
    raw.hset(f"{ns}:rec:victim", "v", value)
    with pytest.raises(StoreDataError) as info:
        store.get("victim")
    assert "victim" in str(info.value)
    with pytest.raises(StoreDataError):
        store.get_many(["other-missing", "victim"])
    _still_serving(store)


@pytest.mark.parametrize("kind", ["string", "list", "set", "zset", "hash-without-v"])
def test_record_key_of_wrong_type(store: Any, raw: redis.Redis, ns: str, kind: str) -> None:
    key = f"{ns}:rec:wrongtype-{kind}"
    raw.delete(key)
    {"string": lambda: raw.set(key, b"\xff junk"), "list": lambda: raw.rpush(key, b"junk"),
     "set": lambda: raw.sadd(key, b"junk"), "zset": lambda: raw.zadd(key, {b"junk": 1}),
     "hash-without-v": lambda: raw.hset(key, "x", b"junk")}[kind]()
    lease = store.acquire(f"writer-{kind}", TTL_S, "writer:1:x")
    assert lease is not None
    try:
        if kind == "hash-without-v":
            assert store.get(f"wrongtype-{kind}") is None
        else:
            with pytest.raises(StoreDataError) as info:
                store.get(f"wrongtype-{kind}")
            assert f"wrongtype-{kind}" in str(info.value)
            for op in (lambda: store.put(f"wrongtype-{kind}", {"a": 1}),
                       lambda: store.put(f"wrongtype-{kind}", {"a": 1}, lease=lease),
                       lambda: store.delete(f"wrongtype-{kind}", lease=lease)):
                with pytest.raises(StoreDataError):
                    op()
    finally:
        store.release(lease)
    _still_serving(store)


def test_scan_with_one_garbage_record(store: Any, raw: redis.Redis, ns: str) -> None:
    """A scan meeting garbage either skips it or names it; it never crashes with a foreign
    exception, and the other records stay readable one by one."""
    store.put("scanme/a", {"a": 1})
    store.put("scanme/c", {"c": 1})
    raw.hset(f"{ns}:rec:scanme/b", "v", b"\xff\xfe not json")
    try:
        found = store.scan("scanme/")
    except StoreDataError as exc:
        assert "scanme/b" in str(exc)
    else:
        assert found == {"scanme/a": {"a": 1}, "scanme/c": {"c": 1}}
    assert store.get("scanme/a") == {"a": 1}
    _still_serving(store)


@pytest.mark.parametrize("writer_token", [b"abc", b"", b"\xff", b"1e400", b"-inf", b"nan"])
def test_garbage_writer_token_on_record(store: Any, raw: redis.Redis, ns: str,
                                        writer_token: bytes) -> None:
    raw.hset(f"{ns}:rec:fenced-victim", mapping={"v": b"{}", "t": writer_token})
    lease = store.acquire("fence-writer", TTL_S, "writer:2:x")
    assert lease is not None
    try:
        # Refusing (as garbage, or as fenced) and overwriting are both clean; a script error
        # surfacing as a bare StoreError is not.
        try:
            store.put("fenced-victim", {"a": 1}, lease=lease)
        except (StoreDataError, FencedError) as exc:
            assert "fenced-victim" in str(exc)
        else:
            assert store.get("fenced-victim") == {"a": 1}
    finally:
        store.release(lease)
    _still_serving(store)


# -- leases and the token counter --------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    {"holder": b"someone", "token": b"not-a-number"},
    {"holder": b"\xff\xfe", "token": b"7"},
    {"holder": b"someone"},
    {"token": b"9"},
])
def test_garbage_lease(store: Any, raw: redis.Redis, ns: str, fields: dict[str, bytes]) -> None:
    name = f"forged-{uuid.uuid4().hex[:6]}"
    raw.hset(f"{ns}:lease:{name}", mapping=fields)
    raw.pexpire(f"{ns}:lease:{name}", 60_000)
    try:
        result = store.holder(name)
    except StoreDataError as exc:
        assert name in str(exc)
    else:
        assert result is None or (isinstance(result[0], str) and isinstance(result[1], int))
    # A lease naming a holder is never taken over, whatever else it contains; one without a
    # holder may be treated as free.
    try:
        taken = store.acquire(name, TTL_S, "me:1:x")
    except StoreDataError as exc:
        assert name in str(exc)
    else:
        assert taken is None or "holder" not in fields
        if taken is not None:
            store.release(taken)
    _still_serving(store)


def test_lease_key_of_wrong_type(store: Any, raw: redis.Redis, ns: str) -> None:
    raw.set(f"{ns}:lease:wrongtype", b"junk", px=60_000)
    for op in (lambda: store.holder("wrongtype"), lambda: store.acquire("wrongtype", TTL_S, "me")):
        with pytest.raises(StoreDataError):
            op()
    _still_serving(store)


@pytest.mark.parametrize("counter", [b"abc", b"\xff", b"1.5", b"99999999999999999999999"])
def test_garbage_token_counter(redis_server: RedisServer, counter: bytes) -> None:
    ns = f"tok{uuid.uuid4().hex[:6]}"
    redis_server.client().set(f"{ns}:token", counter)
    s = open_store(redis_server.url, namespace=ns, timeout_s=2.0)
    try:
        with pytest.raises(StoreDataError) as info:
            s.acquire("beat-leader", TTL_S, "me:1:x")
        assert "token" in str(info.value)
        s.put("unrelated", {"a": 1})
        assert s.get("unrelated") == {"a": 1}
    finally:
        s.close()


# -- claims ------------------------------------------------------------------------------------
claim_fields = st.fixed_dictionaries(
    {},
    optional={"lease": st.binary(max_size=20), "holder": st.binary(max_size=20),
              "token": st.one_of(st.binary(max_size=12), st.integers().map(str)),
              "value": garbage},
)


@_fuzz
@given(fields=claim_fields)
def test_garbage_claim(store: Any, raw: redis.Redis, ns: str, fields: dict[str, Any]) -> None:
    key = f"task:forged-{uuid.uuid4().hex[:6]}"
    if fields:
        raw.hset(f"{ns}:claim:{key}", mapping=fields)
    try:
        got = store.claimant(key)
    except StoreDataError as exc:
        assert key in str(exc)
    else:
        assert got is None or isinstance(got.token, int)
    # A live lease can always take over a claim whose "lease" is not alive.
    lease = store.acquire(f"taker-{uuid.uuid4().hex[:6]}", TTL_S, "taker:1:x")
    assert lease is not None
    try:
        token = store.claim(lease, key, {"queue": "crawl"})
        assert isinstance(token, int) and token > 0
        claim = store.claimant(key)
        assert claim is not None and claim.holder == "taker:1:x" and claim.alive
        assert store.unclaim(lease, key)
    finally:
        store.release(lease)
    _still_serving(store)


def test_garbage_orphan_does_not_block_the_reaper(store: Any, raw: redis.Redis, ns: str) -> None:
    """One forged claim in the orphan index must not stop recovery of the real orphans."""
    dead = store.acquire("dying-worker", TTL_S, "dying:1:x")
    assert dead is not None
    assert store.claim(dead, "task:real-orphan", {"queue": "crawl"}) is not None
    forged = f"{ns}:claim:task:forged-orphan"
    raw.hset(forged, mapping={"lease": "dying-worker", "holder": "dying:1:x",
                              "token": "NaN-garbage", "value": "\xff{"})
    raw.sadd(f"{ns}:claims-of:dying-worker", forged)
    store.release(dead)
    try:
        orphans = store.orphaned_claims()
    except StoreDataError as exc:
        assert "forged-orphan" in str(exc)
        pytest.fail(f"a single forged claim blocks every recovery: {exc}")
    keys = {c.key for c in orphans}
    assert "task:real-orphan" in keys
    for c in orphans:
        if c.key == "task:real-orphan":
            assert store.drop_claim(c)
    _still_serving(store)


# -- operator command queue --------------------------------------------------------------------
def test_garbage_command_does_not_lose_valid_commands(store: Any, raw: redis.Redis,
                                                      ns: str) -> None:
    queue = f"beat/commands-{uuid.uuid4().hex[:6]}"
    store.push(queue, {"op": "pause", "entry": "a"})
    raw.rpush(f"{ns}:q:{queue}", b"\xff not json", b"[1]")
    store.push(queue, {"op": "resume", "entry": "b"})
    got: list[dict[str, Any]] = []
    for _ in range(5):  # however the driver reports the garbage, the valid items survive
        try:
            batch = store.pop_all(queue)
        except StoreDataError as exc:
            assert queue in str(exc)
            continue
        if not batch:
            break
        got.extend(batch)
    assert got == [{"op": "pause", "entry": "a"}, {"op": "resume", "entry": "b"}]
    _still_serving(store)


def test_store_errors_are_only_crawl_errors(store: Any, raw: redis.Redis, ns: str) -> None:
    """Sweep every read over a namespace full of garbage: only StoreError subclasses escape."""
    for suffix in ("rec:sweep", "lease:sweep", "claim:task:sweep", "q:sweep"):
        raw.delete(f"{ns}:{suffix}")
        raw.set(f"{ns}:{suffix}", b"\x00\xff garbage")
    raw.sadd(f"{ns}:claims-of:sweep", f"{ns}:claim:task:sweep")
    raw.zadd(f"{ns}:claim-leases", {"sweep": 1})
    ops = [lambda: store.get("sweep"), lambda: store.holder("sweep"),
           lambda: store.lease_ttl_left("sweep"), lambda: store.claimant("task:sweep"),
           lambda: store.claims_of("sweep"), lambda: store.orphaned_claims(),
           lambda: store.pop_all("sweep"), lambda: store.scan("sw"),
           lambda: store.watch_free("sweep", 0.1)]
    for op in ops:
        with contextlib.suppress(StoreError):
            op()
    _still_serving(store)


# == etcd =======================================================================================
# Same hostile shapes against the etcd driver's physical layout (``{ns}:rec:<key>`` JSON,
# ``{ns}:rtok:<key>`` writer token, ``{ns}:lease:<name>``, ``{ns}:claim:<key>``,
# ``{ns}:claims-of:<lease>/<key>``, ``{ns}:claim-leases:<lease>``, ``{ns}:q:<queue>/<id>``).
@pytest.fixture(scope="module")
def etcd_raw(etcd_server: Any) -> Iterator[Any]:
    from celery_crawl.leases.etcd import python_etcd3

    client = python_etcd3().client("127.0.0.1", etcd_server.client_port, timeout=5)
    yield client
    client.close()


@pytest.fixture(scope="module")
def etcd_ns() -> str:
    return f"hostile{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def etcd_store(etcd_server: Any, etcd_ns: str) -> Iterator[Any]:
    s = open_store(etcd_server.url, namespace=etcd_ns, timeout_s=3.0)
    yield s
    s.close()


@settings(max_examples=30, phases=_NO_SHRINK,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=garbage)
@example(value=HOSTILE_EXAMPLES[0])
@example(value=HOSTILE_EXAMPLES[1])
@example(value=HOSTILE_EXAMPLES[3])
def test_etcd_garbage_record_value(etcd_store: Any, etcd_raw: Any, etcd_ns: str,
                                   value: bytes | str) -> None:
    if _is_json_object(value):
        return
    etcd_raw.put(f"{etcd_ns}:rec:victim", value)
    with pytest.raises(StoreDataError) as info:
        etcd_store.get("victim")
    assert "victim" in str(info.value)
    _still_serving(etcd_store)


@pytest.mark.parametrize("writer_token", [b"abc", b"", b"\xff", b"1e400", b"-1"])
def test_etcd_garbage_writer_token(etcd_store: Any, etcd_raw: Any, etcd_ns: str,
                                   writer_token: bytes) -> None:
    etcd_raw.put(f"{etcd_ns}:rec:fenced-victim", b"{}")
    etcd_raw.put(f"{etcd_ns}:rtok:fenced-victim", writer_token)
    lease = etcd_store.acquire(f"fence-writer-{uuid.uuid4().hex[:6]}", TTL_S, "writer:2:x")
    assert lease is not None
    try:
        try:
            etcd_store.put("fenced-victim", {"a": 1}, lease=lease)
        except (StoreDataError, FencedError) as exc:
            assert "fenced-victim" in str(exc)
        else:
            assert etcd_store.get("fenced-victim") == {"a": 1}
    finally:
        etcd_store.release(lease)
    _still_serving(etcd_store)


@pytest.mark.parametrize("raw_value", [b"\xff\xfe", b"[1]", b"{\"holder\": [1, 2]}", b"{}",
                                       b"[" * 100_000])
def test_etcd_garbage_lease(etcd_store: Any, etcd_raw: Any, etcd_ns: str,
                            raw_value: bytes) -> None:
    name = f"forged-{uuid.uuid4().hex[:6]}"
    etcd_raw.put(f"{etcd_ns}:lease:{name}", raw_value)
    try:
        got = etcd_store.holder(name)
    except StoreDataError as exc:
        assert name in str(exc)
    else:
        assert got is None or (isinstance(got[0], str) and isinstance(got[1], int))
    try:
        assert etcd_store.acquire(name, TTL_S, "me:1:x") is None
    except StoreDataError as exc:
        assert name in str(exc)
    _still_serving(etcd_store)


@settings(max_examples=25, phases=_NO_SHRINK,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(doc=garbage)
def test_etcd_garbage_claim(etcd_store: Any, etcd_raw: Any, etcd_ns: str,
                            doc: bytes | str) -> None:
    key = f"task:forged-{uuid.uuid4().hex[:6]}"
    etcd_raw.put(f"{etcd_ns}:claim:{key}", doc)
    try:
        got = etcd_store.claimant(key)
    except StoreDataError as exc:
        assert key in str(exc)
    else:
        assert got is None or (isinstance(got.token, int) and isinstance(got.value, Mapping))
    lease = etcd_store.acquire(f"taker-{uuid.uuid4().hex[:6]}", TTL_S, "taker:1:x")
    assert lease is not None
    try:
        token = etcd_store.claim(lease, key, {"queue": "crawl"})
        assert isinstance(token, int) and token > 0
        claim = etcd_store.claimant(key)
        assert claim is not None and claim.holder == "taker:1:x" and claim.alive
        assert etcd_store.unclaim(lease, key)
    finally:
        etcd_store.release(lease)
    _still_serving(etcd_store)


def test_etcd_garbage_key_names(etcd_store: Any, etcd_raw: Any, etcd_ns: str) -> None:
    """Key names that are not UTF-8 (or not ours) under the namespace: listing operations skip
    or name them; they never raise a foreign exception, and valid entries stay reachable."""
    etcd_store.put("names/ok", {"ok": 1})
    etcd_raw.put(f"{etcd_ns}:rec:names/".encode() + b"\xff\xfe", b"{}")
    etcd_raw.put(f"{etcd_ns}:claim-leases:".encode() + b"\xc3\x28", b"")
    etcd_raw.put(f"{etcd_ns}:claims-of:ghost/".encode() + b"\xff", b"")
    etcd_raw.put(f"{etcd_ns}:claim-leases:ghost", b"")
    for op in (lambda: etcd_store.scan("names/"), lambda: etcd_store.orphaned_claims(),
               lambda: etcd_store.claims_of("ghost")):
        with contextlib.suppress(StoreDataError):
            op()
    assert etcd_store.get("names/ok") == {"ok": 1}
    _still_serving(etcd_store)


def test_etcd_garbage_command_does_not_lose_valid_commands(etcd_store: Any, etcd_raw: Any,
                                                           etcd_ns: str) -> None:
    queue = f"beat/commands-{uuid.uuid4().hex[:6]}"
    etcd_store.push(queue, {"op": "pause", "entry": "a"})
    etcd_raw.put(f"{etcd_ns}:q:{queue}/0-forged", b"\xff not json")
    etcd_store.push(queue, {"op": "resume", "entry": "b"})
    got: list[dict[str, Any]] = []
    for _ in range(5):
        try:
            batch = etcd_store.pop_all(queue)
        except StoreDataError as exc:
            assert queue in str(exc)
            continue
        if not batch:
            break
        got.extend(batch)
    assert got == [{"op": "pause", "entry": "a"}, {"op": "resume", "entry": "b"}]
    _still_serving(etcd_store)
