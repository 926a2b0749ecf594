"""Hostile message headers and payloads through the public task and backend APIs.

* ``crawl_claim_token`` of any type or value reaches ``AuditedRedisBackend.store_result`` through
  the request: it is used (an int), or ignored with a warning — never a crash; a forged higher
  token that the lease store on the same Redis never issued cannot overwrite a result.
* ``crawl_deadline`` of any type or value (on publish, through the ``before_task_publish`` hook,
  and in ``remaining()``) is used or ignored — never a crash of the publisher.
* A pickle payload planted where a result is read is refused with ``SerializationRefused``
  and never unpickled; the audit stream keeps no task arguments or results.

Real redis-server (the session's private one) as result backend, lease store and broker.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_crawl.backends import AuditedRedisBackend
from celery_crawl.errors import CrawlError, SerializationRefused
from celery_crawl.leases import open_store
from celery_crawl.tasks import IdempotentTask, deadline_headers, parse_deadline, remaining
from tests.servers import RedisServer

_fuzz = settings(max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                          HealthCheck.too_slow])

#: Values a forged or broken producer could put in a header (JSON can carry all of these; kombu's
#: JSON decoder also accepts NaN and Infinity).
hostile = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(),
    st.text(max_size=40), st.binary(max_size=20),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                         max_size=3),
    st.sampled_from(["7", " 7 ", "1_000", "1e5", "0x10", "-1", "\uff17", "Infinity", "NaN",
                     "9" * 5000, "2026-01-01T00:00:00Z", "9999-12-31T23:59:59+14:00",
                     "0001-01-01T00:00:00+01:00", "0001-01-01T00:00:00-14:00", "tomorrow",
                     "2026-13-45T99:99:99", "2026-01-01T00:00:00"]),
    st.sampled_from([1e300, -1e300, 2**63, -(2**63), 253402300800, -62135596801,
                     float("inf"), float("nan")]),
)


@pytest.fixture(scope="module")
def app(redis_server: RedisServer) -> Celery:
    ns = f"hdr{uuid.uuid4().hex[:8]}"
    app = Celery(f"sec{ns}", broker=redis_server.url_db(3),
                 backend=f"crawlredis://127.0.0.1:{redis_server.port}/0", set_as_current=False)
    app.conf.update(crawl_namespace=ns, crawl_lease_url=redis_server.url,
                    redis_socket_timeout=5, redis_socket_connect_timeout=5,
                    broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
                    task_serializer="json", accept_content=["json"])
    return app


@pytest.fixture(scope="module")
def backend(app: Celery) -> AuditedRedisBackend:
    b = app.backend
    assert isinstance(b, AuditedRedisBackend)
    assert b.checks_token_issuance, "lease store and backend share a server: issuance is checked"
    return b


@pytest.fixture(scope="module")
def issued_token(app: Celery, redis_server: RedisServer) -> Iterator[int]:
    """A claim token really issued by the Redis lease store on the backend's server."""
    store = open_store(redis_server.url, namespace=app.conf.crawl_namespace, timeout_s=2.0)
    lease = store.acquire("worker:sec", 30.0, "sec:1:x")
    assert lease is not None
    token = store.claim(lease, "task:sec", {"queue": "crawl"})
    assert token is not None
    yield token
    store.release(lease)
    store.close()


def _meta(backend: AuditedRedisBackend, task_id: str) -> dict[str, Any]:
    return dict(backend.get_task_meta(task_id, cache=False))


# -- claim tokens --------------------------------------------------------------------------------
@_fuzz
@given(token=hostile)
@example(token=float("inf"))
@example(token=2**200)
@example(token="9" * 5000)
def test_hostile_claim_token_never_crashes_a_result_write(backend: AuditedRedisBackend,
                                                          token: Any) -> None:
    task_id = str(uuid.uuid4())
    try:
        backend.store_result(task_id, {"ok": 1}, states.SUCCESS,
                             request=Context(crawl_claim_token=token, hostname="w1"))
    except CrawlError:
        return  # refusing it clearly is fine
    meta = _meta(backend, task_id)
    # Written (as untokened, or with a token that passed the issuance check) or refused.
    assert meta["status"] in (states.SUCCESS, states.PENDING)


def test_forged_higher_token_cannot_overwrite_a_result(backend: AuditedRedisBackend,
                                                       issued_token: int) -> None:
    task_id = str(uuid.uuid4())
    backend.store_result(task_id, "real", states.SUCCESS,
                         request=Context(crawl_claim_token=issued_token, hostname="w1"))
    for forged in (issued_token + 10**9, 2**62, str(2**62), 10**30):
        backend.store_result(task_id, "forged", states.SUCCESS,
                             request=Context(crawl_claim_token=forged, hostname="evil"))
        assert _meta(backend, task_id)["result"] == "real", f"forged token {forged} won"
    for untokened in (None, "garbage", True, [issued_token + 1]):
        backend.store_result(task_id, "untokened", states.SUCCESS,
                             request=Context(crawl_claim_token=untokened, hostname="evil"))
        assert _meta(backend, task_id)["result"] == "real", f"{untokened!r} overwrote"


def test_fence_record_written_by_someone_else(app: Celery, backend: AuditedRedisBackend,
                                              issued_token: int) -> None:
    """A garbage fence record (token, state) must not crash writes or the poison hook."""

    @app.task(base=IdempotentTask, name=f"sec.poisoned.{uuid.uuid4().hex[:6]}", shared=False)
    def job() -> str:
        return "done"

    for garbage in (b"not-a-number", b"\xff\xfe", b"1e999", b""):
        task_id = str(uuid.uuid4())
        backend.client.hset(backend.fence_key(task_id), mapping={"token": garbage,
                                                                 "state": b"\xff"})
        with contextlib.suppress(CrawlError):
            backend.store_result(task_id, "x", states.SUCCESS,
                                 request=Context(crawl_claim_token=issued_token, hostname="w"))
        with contextlib.suppress(CrawlError):
            job.crawl_on_poison(task_id, [], {}, "delivered too often", hostname="w")


# -- deadlines -----------------------------------------------------------------------------------
@_fuzz
@given(value=hostile)
@example(value=1e300)
@example(value=float("nan"))
@example(value="0001-01-01T00:00:00+01:00")
@example(value="9999-12-31T23:59:59-14:00")
def test_hostile_deadline_values(value: Any) -> None:
    """``parse_deadline`` returns an aware datetime or raises ``CrawlError``; ``remaining``
    on a request carrying the value as ``crawl_deadline`` answers a number or None."""
    try:
        parsed = parse_deadline(value)
    except CrawlError:
        pass
    else:
        assert parsed.tzinfo is not None
        deadline_headers(value)
    left = remaining(Context(crawl_deadline=value))
    assert left is None or isinstance(left, float)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow])
@given(value=hostile)
@example(value=1e300)
@example(value="0001-01-01T00:00:00+01:00")
def test_publishing_with_a_hostile_deadline_header(app: Celery, value: Any) -> None:
    """The deadline propagation hook runs on every publish of the process: a hostile header on
    one message must not make publishing fail (it is ignored, or the message is refused with a
    CrawlError)."""
    if isinstance(value, bytes) or (isinstance(value, float) and not math.isfinite(value)):
        value = repr(value)  # kombu's JSON cannot carry these; their text can
    with contextlib.suppress(CrawlError):
        app.send_task("sec.never.run", args=[1], headers={"crawl_deadline": value},
                      queue=f"sec-{uuid.uuid4().hex[:6]}")


# -- serialization -------------------------------------------------------------------------------
class _Boom:
    """Unpickling this creates a file: proof that a payload was unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickled_result_is_refused_and_never_unpickled(app: Celery, backend: AuditedRedisBackend,
                                                       tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / f"unpickled-{protocol}"
    task_id = str(uuid.uuid4())
    payload = pickle.dumps({"status": "SUCCESS", "result": _Boom(str(marker)),
                            "task_id": task_id}, protocol=protocol)
    backend.client.set(backend.get_key_for_task(task_id), payload)
    with pytest.raises(SerializationRefused):
        backend.get_task_meta(task_id, cache=False)
    with pytest.raises(SerializationRefused):
        app.AsyncResult(task_id).get(timeout=2)
    assert not marker.exists(), "a pickled result was unpickled"


def test_pickle_allowed_in_accept_content_still_refused(redis_server: RedisServer,
                                                        tmp_path: Path) -> None:
    app = Celery("sec-accept", broker="memory://", set_as_current=False,
                 backend=f"crawlredis://127.0.0.1:{redis_server.port}/0")
    app.conf.update(crawl_namespace=f"acc{uuid.uuid4().hex[:6]}", accept_content=["json", "pickle"],
                    result_accept_content=["pickle", "json"])
    backend = app.backend
    marker = tmp_path / "unpickled"
    task_id = str(uuid.uuid4())
    backend.client.set(backend.get_key_for_task(task_id),
                       pickle.dumps({"status": "SUCCESS", "result": _Boom(str(marker)),
                                     "task_id": task_id}))
    with pytest.raises(SerializationRefused):
        backend.get_task_meta(task_id, cache=False)
    assert not marker.exists()


def test_audit_stream_keeps_no_arguments_or_results(app: Celery, backend: AuditedRedisBackend,
                                                    issued_token: int) -> None:
    secret = f"tenant-secret-{uuid.uuid4().hex}"
    task_id = str(uuid.uuid4())
    backend.store_result(task_id, {"page": secret}, states.SUCCESS,
                         request=Context(crawl_claim_token=issued_token, hostname="w1",
                                         args=[secret], kwargs={"cookie": secret},
                                         task="sec.t"))
    records = backend.client.xrange(backend.audit_key)
    text = json.dumps([{k.decode(): v.decode(errors="replace") for k, v in fields.items()}
                       for _, fields in records])
    assert task_id in text
    assert secret not in text, "the audit stream stored task arguments or results"
