"""AuditedRedisBackend against a real redis-server: precedence, fencing, audit, Celery features."""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_crawl._celery_compat import pool_connection
from celery_crawl.backends import AuditedRedisBackend
from celery_crawl.backends.audit import history, iter_records, verify
from celery_crawl.errors import ConfigError, SerializationRefused, StoreError, StoreUnavailable
from tests.clusters import RedisCluster3
from tests.servers import RedisServer, free_port, wait_until


def make_app(url: str, **conf: Any) -> Celery:
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker="memory://", backend=url, set_as_current=False)
    app.conf.update(crawl_namespace=f"ns{uuid.uuid4().hex[:8]}", redis_socket_timeout=5,
                    redis_socket_connect_timeout=5, **conf)
    return app


def req(token: int | None = None, worker: str = "w1", **extra: Any) -> Context:
    return Context(crawl_claim_token=token, hostname=worker, **extra)


@pytest.fixture(params=["standalone", "cluster"])
def backend(request: pytest.FixtureRequest) -> AuditedRedisBackend:
    """The backend on the session's Redis, and on a 3-master Redis Cluster (every key under the
    namespace's hash tag, on the master owning its slot)."""
    if request.param == "cluster":
        cluster: RedisCluster3 = request.getfixturevalue("redis_cluster")
        app = make_app(f"crawlredis+cluster://127.0.0.1:{cluster.nodes[0].port}/0")
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        app = make_app(f"crawlredis://127.0.0.1:{server.port}/0")
    b = app.backend
    assert isinstance(b, AuditedRedisBackend)
    # The lease store defaults to the backend's server: tokens up to 10**6 count as issued.
    b.client.set(b.token_counter_key, 10**6)
    return b


def outcomes(b: AuditedRedisBackend, task_id: str) -> list[tuple[str, str]]:
    return [(r.state, r.outcome) for r in history(b, task_id)]


def status(b: AuditedRedisBackend, task_id: str) -> str:
    return str(b.get_task_meta(task_id, cache=False)["status"])


def test_late_started_or_retry_after_a_ready_state_is_refused(backend) -> None:
    tid = str(uuid.uuid4())
    backend.store_result(tid, {"pid": 1}, states.STARTED, request=req(5))
    backend.store_result(tid, 42, states.SUCCESS, request=req(5))
    backend.store_result(tid, {"pid": 1}, states.STARTED, request=req(5))
    backend.store_result(tid, ValueError("x"), states.RETRY, request=req(6))
    assert backend.get_task_meta(tid, cache=False)["result"] == 42
    assert outcomes(backend, tid) == [
        ("STARTED", "written"), ("SUCCESS", "written"), ("STARTED", "refused-regression"),
        ("RETRY", "refused-regression")]
    tid2 = str(uuid.uuid4())
    backend.store_result(tid2, ValueError("boom"), states.FAILURE, request=req(None))
    backend.store_result(tid2, {"pid": 1}, states.STARTED, request=req(None))
    assert status(backend, tid2) == "FAILURE"  # stock Celery would have let STARTED through


def test_stale_token_after_a_newer_write_is_refused(backend) -> None:
    tid = str(uuid.uuid4())
    backend.store_result(tid, {"pid": 2}, states.STARTED, request=req(8, "new"))
    backend.store_result(tid, "stale", states.SUCCESS, request=req(7, "paused"))
    backend.store_result(tid, "untokened", states.SUCCESS, request=req(None, "legacy"))
    assert status(backend, tid) == "STARTED"
    backend.store_result(tid, "fresh", states.SUCCESS, request=req(8, "new"))
    backend.store_result(tid, "same-token-again", states.FAILURE, request=req(8, "new"))
    backend.store_result(tid, "newer", states.SUCCESS, request=req(9, "newer"))
    assert backend.get_task_meta(tid, cache=False)["result"] == "newer"
    assert [(r.token, r.worker, r.outcome) for r in history(backend, tid)] == [
        (8, "new", "written"), (7, "paused", "refused-stale"), (None, "legacy", "refused-stale"),
        (8, "new", "written"), (8, "new", "refused-stale"), (9, "newer", "written")]


def test_a_retried_write_is_audited_once(backend) -> None:
    tid = str(uuid.uuid4())
    backend.store_result(tid, {"n": 1}, states.SUCCESS, request=req(3))
    # What celery's retry loop does after a lost reply: the same write again (date_done differs).
    backend.store_result(tid, {"n": 1}, states.SUCCESS, request=req(3))
    backend.store_result(tid, "late", states.STARTED, request=req(3))
    backend.store_result(tid, "late", states.STARTED, request=req(3))
    assert outcomes(backend, tid) == [("SUCCESS", "written"), ("STARTED", "refused-regression")]


def test_token_must_have_been_issued_when_the_lease_store_shares_the_server(backend) -> None:
    assert backend.checks_token_issuance
    tid = str(uuid.uuid4())
    backend.store_result(tid, "forged", states.SUCCESS, request=req(10**6 + 1))
    assert status(backend, tid) == "PENDING"
    assert outcomes(backend, tid) == [("SUCCESS", "refused-unissued")]


def test_without_the_lease_store_only_token_order_is_enforced(redis_server) -> None:
    app = make_app(f"crawlredis://127.0.0.1:{redis_server.port}/0",
                   crawl_lease_url=f"redis://127.0.0.1:{redis_server.port}/5")
    b = app.backend
    assert not b.checks_token_issuance
    tid = str(uuid.uuid4())
    b.store_result(tid, "ok", states.SUCCESS, request=req(10**15))
    assert status(b, tid) == "SUCCESS"


def test_get_waits_on_publish_and_global_keyprefix_is_honoured(redis_server) -> None:
    app = make_app(f"crawlredis://127.0.0.1:{redis_server.port}/0",
                   result_backend_transport_options={"global_keyprefix": "pfx"})
    b = app.backend
    tid = str(uuid.uuid4())
    result = app.AsyncResult(tid)
    b.on_task_call(None, tid)  # subscribe, as apply_async does
    timer = threading.Timer(0.3, lambda: b.store_result(tid, [1, 2], states.SUCCESS,
                                                        request=req(None)))
    timer.start()
    try:
        assert result.get(timeout=10) == [1, 2]
    finally:
        timer.join()
    client = redis_server.client()
    assert client.exists(f"pfx_celery-task-meta-{tid}")
    assert client.exists(f"pfx_crawl-fence-{tid}")
    assert b.audit_key.startswith("pfx_")
    assert verify(b).clean


def test_result_extended_and_revoke(redis_server) -> None:
    app = make_app(f"crawlredis://127.0.0.1:{redis_server.port}/0", result_extended=True)
    b = app.backend
    tid = str(uuid.uuid4())
    b.store_result(tid, None, states.STARTED,
                   request=req(None, task="proj.crawl", args=["u"], kwargs={}, retries=0))
    meta = b.get_task_meta(tid, cache=False)
    assert meta["name"] == "proj.crawl" and meta["args"] == ["u"] and meta["worker"] == "w1"
    b.mark_as_revoked(tid, "terminated", request=req(None))
    b.store_result(tid, "late", states.SUCCESS, request=req(None))
    assert status(b, tid) == "REVOKED"
    assert [o for _, o in outcomes(b, tid)] == ["written", "written", "refused-stale"]


def test_forget_is_audited(backend) -> None:
    tid = str(uuid.uuid4())
    backend.store_result(tid, 1, states.SUCCESS, request=req(None))
    backend.forget(tid)
    assert outcomes(backend, tid)[-1] == ("FORGOTTEN", "forgotten")
    report = verify(backend)
    assert report.clean and report.forgotten >= 1


def test_verify_detects_an_altered_and_a_deleted_result(redis_server) -> None:
    app = make_app(f"crawlredis://127.0.0.1:{redis_server.port}/0")
    b = app.backend
    ids = [str(uuid.uuid4()) for _ in range(3)]
    for i, tid in enumerate(ids):
        b.store_result(tid, {"i": i, "text": "naïve ü", "f": 0.1}, states.SUCCESS,
                       request=req(None))
    assert verify(b).ok == 3
    client = redis_server.client()
    key = b.get_key_for_task(ids[0])
    client.set(key, client.get(key).replace(b'"i": 0', b'"i": 7'))
    client.delete(b.get_key_for_task(ids[1]))
    report = verify(b)
    assert [t for t, _ in report.diverging] == [ids[0]]
    assert [t for t, _ in report.missing] == [ids[1]]
    assert report.ok == 1 and not report.clean


def test_an_expired_result_is_normal(fresh_redis) -> None:
    app = make_app(f"crawlredis://127.0.0.1:{fresh_redis.port}/0", result_expires=1)
    b = app.backend
    tid = str(uuid.uuid4())
    b.store_result(tid, 1, states.SUCCESS, request=req(None))
    wait_until(lambda: not fresh_redis.client().exists(b.get_key_for_task(tid)), 10,
               what="result expiry")
    report = verify(b)
    assert report.clean and report.expired == 1


def test_json_only(redis_server) -> None:
    url = f"crawlredis://127.0.0.1:{redis_server.port}/0"
    with pytest.raises(ConfigError, match="result_serializer"):
        _ = make_app(url, result_serializer="pickle", result_accept_content=["pickle"]).backend
    with pytest.raises(ConfigError, match="result_compression"):
        _ = make_app(url, result_compression="zlib").backend
    app = make_app(url)
    tid = str(uuid.uuid4())
    payload = pickle.dumps({"status": "SUCCESS", "result": 1, "task_id": tid})
    redis_server.client().set(app.backend.get_key_for_task(tid), payload)
    with pytest.raises(SerializationRefused):
        app.backend.get_task_meta(tid, cache=False)


def test_class_plus_url_form(redis_server) -> None:
    app = make_app(f"celery_crawl.backends:AuditedRedisBackend+redis://127.0.0.1:"
                   f"{redis_server.port}/0")
    assert isinstance(app.backend, AuditedRedisBackend)
    tid = str(uuid.uuid4())
    app.backend.store_result(tid, "x", states.SUCCESS, request=req(None))
    assert app.AsyncResult(tid).get(timeout=5) == "x"


def test_crawlrediss_speaks_tls(tmp_path: Path) -> None:
    from tests.security.tlsservers import make_pki

    pki = make_pki(tmp_path / "pki")
    server = RedisServer(extra=[
        "--tls-port", str(tls_port := free_port()), "--tls-cert-file", str(pki.server_cert),
        "--tls-key-file", str(pki.server_key), "--tls-ca-cert-file", str(pki.ca),
        "--tls-auth-clients", "no"]).start()
    try:
        app = make_app(f"crawlrediss://127.0.0.1:{tls_port}/0?ssl_cert_reqs=required"
                       f"&ssl_ca_certs={pki.ca}")
        b = app.backend
        tid = str(uuid.uuid4())
        b.store_result(tid, "secret", states.SUCCESS, request=req(None))
        assert app.AsyncResult(tid).get(timeout=10) == "secret"
        conn = pool_connection(b.client.connection_pool)
        try:
            assert type(conn).__name__ == "SSLConnection"
        finally:
            b.client.connection_pool.release(conn)
        assert server.client().exists(b.get_key_for_task(tid))  # the plain port sees the data
        # An untrusted server certificate is not retried, even under Celery's default retry
        # policy (20 retries a second apart): a StoreUnavailable naming the masked URL, at once.
        secret = f"pw-{uuid.uuid4().hex}"
        untrusted = make_app(f"crawlrediss://crawler:{secret}@127.0.0.1:{tls_port}/0"
                             f"?ssl_cert_reqs=required&ssl_ca_certs={pki.rogue_ca}")
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            untrusted.backend.store_result(str(uuid.uuid4()), "x", states.SUCCESS,
                                           request=req(None))
        assert time.monotonic() - t0 < 5.0
        text = str(info.value)
        assert f"crawlrediss://crawler:***@127.0.0.1:{tls_port}/0" in text, text
        assert "TLS certificate not trusted (not retried)" in text, text
        assert "certificate verify failed" in text.lower(), text
        assert secret not in text and secret not in repr(info.value)
    finally:
        server.cleanup()


def test_connection_refused_is_retried_per_policy_then_a_masked_store_unavailable() -> None:
    port = free_port()  # nothing listens here
    secret = f"pw-{uuid.uuid4().hex}"
    app = make_app(f"crawlredis://crawler:{secret}@127.0.0.1:{port}/0",
                   crawl_lease_url=f"redis://127.0.0.1:{port}/0",
                   result_backend_transport_options={"retry_policy": {
                       "max_retries": 3, "interval_start": 0.2, "interval_step": 0,
                       "interval_max": 0.2}})
    b = app.backend
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        b.store_result(str(uuid.uuid4()), "x", states.SUCCESS, request=req(None))
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 5.0, f"3 retries 0.2 s apart took {elapsed:.2f}s"  # it was retried
    text = str(info.value)
    assert f"crawlredis://crawler:***@127.0.0.1:{port}/0" in text, text
    assert "Connection refused" in text and "not retried" not in text, text
    assert secret not in text
    # Still transient for result_backend_always_retry; reads fail the same clear way.
    assert b.exception_safe_to_retry(info.value)
    with pytest.raises(StoreUnavailable, match=r"crawler:\*\*\*@"):
        b.get_task_meta(str(uuid.uuid4()), cache=False)
    with pytest.raises(StoreUnavailable, match=r"crawler:\*\*\*@"):
        list(iter_records(b))


# -- precedence and fencing against a model ----------------------------------------------------
READY = {states.SUCCESS, states.FAILURE, states.REVOKED}
write_st = st.tuples(
    st.sampled_from([states.STARTED, states.RETRY, states.SUCCESS, states.FAILURE]),
    st.one_of(st.none(), st.integers(min_value=1, max_value=6)),
)


def _allowed(stored: tuple[str, int | None] | None, state: str, token: int | None) -> bool:
    if stored is None:
        return True
    cur_state, cur_token = stored
    if cur_token is not None and (token is None or token < cur_token):
        return False  # fencing: older or missing token against a tokened result
    if cur_state in READY:
        # precedence: never back to non-ready; a second ready write needs a higher token
        return state in READY and token is not None and (cur_token is None or token > cur_token)
    return True


@settings(max_examples=40)
@given(writes=st.lists(write_st, min_size=1, max_size=8))
def test_writes_follow_the_precedence_and_fencing_rules(redis_server, writes) -> None:
    app = make_app(f"crawlredis://127.0.0.1:{redis_server.port}/0",
                   crawl_lease_url=f"redis://127.0.0.1:{redis_server.port}/9")
    b = app.backend
    tid = str(uuid.uuid4())
    stored: tuple[str, int | None] | None = None
    for n, (state, token) in enumerate(writes):
        value: Any = ValueError(str(n)) if state in (states.FAILURE, states.RETRY) else n
        b.store_result(tid, value, state, request=req(token))
        if _allowed(stored, state, token):
            stored = (state, token)
        assert status(b, tid) == (stored[0] if stored else "PENDING")
    # Every attempt differs in value, so every one is audited, written or refused.
    assert sum(1 for r in iter_records(b) if r.task == tid) == len(writes)


def test_results_written_by_a_stock_backend_are_respected(redis_server) -> None:
    url = f"127.0.0.1:{redis_server.port}/0"
    stock = make_app(f"redis://{url}").backend
    ours = make_app(f"crawlredis://{url}").backend
    tid = str(uuid.uuid4())
    stock.store_result(tid, "stock", states.SUCCESS)
    ours.store_result(tid, None, states.STARTED, request=req(None))
    assert ours.get_task_meta(tid, cache=False)["result"] == "stock"
    assert outcomes(ours, tid) == [("STARTED", "refused-regression")]


def test_a_stock_ready_result_still_decides_untokened_and_non_ready_writes(redis_server) -> None:
    """store.lua reads a stock backend's result only where it decides the outcome: a tokened
    ready write replaces it, an untokened ready write and a tokened non-ready one do not."""
    url = f"127.0.0.1:{redis_server.port}/0"
    stock = make_app(f"redis://{url}").backend
    ours = make_app(f"crawlredis://{url}", crawl_lease_url=f"redis://{url}").backend
    ours.client.set(ours.token_counter_key, 10**6)
    tid = str(uuid.uuid4())
    stock.store_result(tid, "stock", states.SUCCESS)
    ours.store_result(tid, "untokened", states.SUCCESS, request=req(None))
    ours.store_result(tid, {"pid": 1}, states.STARTED, request=req(4))
    assert ours.get_task_meta(tid, cache=False)["result"] == "stock"
    ours.store_result(tid, "tokened", states.SUCCESS, request=req(4))
    assert ours.get_task_meta(tid, cache=False)["result"] == "tokened"
    assert outcomes(ours, tid) == [("SUCCESS", "refused-stale"), ("STARTED", "refused-regression"),
                                   ("SUCCESS", "written")]


def test_a_ready_write_marks_its_task_finished_unless_its_run_did(backend, monkeypatch) -> None:
    from celery_crawl import _finishing as finishing
    from celery_crawl.backends.audited import MARKED_ATTR

    marked: list[str] = []
    monkeypatch.setattr(finishing, "mark", marked.append)
    t1, t2, t3, t4 = (str(uuid.uuid4()) for _ in range(4))
    backend.store_result(t1, 1, states.SUCCESS, request=req(None))
    backend.store_result(t2, 1, states.SUCCESS, request=req(None, **{MARKED_ATTR: t2}))
    backend.store_result(t3, ValueError("x"), states.FAILURE,
                         request=req(None, **{MARKED_ATTR: "another task"}))
    backend.store_result(t4, {"pid": 1}, states.STARTED, request=req(None))
    assert marked == [t1, t3]


class _Interrupted(BaseException):
    """What a soft time limit raises inside a read: not an Exception."""


def test_script_calls_reuse_a_connection_and_recover_from_every_failure(backend) -> None:
    """The backend's own connections (``_round_trip``): reused from call to call; a connection
    the server closed is reconnected by redis-py's retry; one whose read was interrupted is
    disconnected, so no later call reads the interrupted call's reply."""
    def write(token: int) -> str:
        tid = str(uuid.uuid4())
        backend.store_result(tid, token, states.SUCCESS, request=req(token))
        return str(backend.get_task_meta(tid, cache=False)["result"])

    assert write(11) == "11"
    clients = len(backend.client.client_list())
    assert [write(12 + i) for i in range(5)] == [str(12 + i) for i in range(5)]
    assert len(backend.client.client_list()) == clients  # no connection per call
    backend.client.client_kill_filter(_type="normal", skipme=True)  # the server drops ours
    assert write(20) == "20"
    assert backend._lanes._free is not None
    (conn,) = backend._lanes._free[2]
    read = conn.read_response

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise _Interrupted()

    conn.read_response = interrupted
    with pytest.raises(_Interrupted):
        write(21)
    conn.read_response = read
    assert conn._sock is None  # disconnected: the unread reply went with the socket
    assert write(22) == "22"


def test_a_forked_child_writes_on_connections_of_its_own(redis_server) -> None:
    import os

    app = make_app(f"crawlredis://127.0.0.1:{redis_server.port}/0")
    b = app.backend
    parent_tid, child_tid = str(uuid.uuid4()), str(uuid.uuid4())
    b.store_result(parent_tid, "before", states.STARTED, request=req(None))
    parent_conn = b._lanes._free[2][0]
    pid = os.fork()
    if pid == 0:  # the child: a write must not use (and so not garble) the parent's socket
        code = 1
        try:
            b.store_result(child_tid, "child", states.SUCCESS, request=req(None))
            code = 0 if b._lanes._free[2] and b._lanes._free[2][0] is not parent_conn else 2
        finally:
            os._exit(code)
    _, status_ = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status_) == 0
    b.store_result(parent_tid, "after", states.SUCCESS, request=req(None))
    assert b._lanes._free[2] == [parent_conn]
    assert b.get_task_meta(parent_tid, cache=False)["result"] == "after"
    assert b.get_task_meta(child_tid, cache=False)["result"] == "child"


def test_ensure_retries_a_first_failed_attempt_per_policy(redis_server) -> None:
    """``ensure`` makes its first attempt outside Celery's retry loop; a connection error
    there is the loop's first failure: retried per policy, or given up when the policy allows
    no retry."""
    import redis as redis_lib

    def flaky(failures: int) -> tuple[list[int], Any]:
        calls: list[int] = []

        def fun(x: int) -> int:
            calls.append(x)
            if len(calls) <= failures:
                raise redis_lib.ConnectionError("dropped")
            return x * 2
        return calls, fun

    b = make_app(f"crawlredis://127.0.0.1:{redis_server.port}/0").backend
    calls, fun = flaky(2)
    assert b.ensure(fun, (21,), interval_start=0, interval_step=0, interval_max=0) == 42
    assert calls == [21, 21, 21]
    calls, fun = flaky(1)
    with pytest.raises(StoreUnavailable, match="dropped"):
        b.ensure(fun, (1,), max_retries=0)
    assert calls == [1]
    calls, fun = flaky(100)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        b.ensure(fun, (1,), max_retries=None, timeout=0.5, interval_start=0.1,
                 interval_step=0, interval_max=0.1)
    assert time.monotonic() - t0 < 3.0  # the policy's timeout still ends the retries
    assert 2 <= len(calls) <= 10


def test_digest_survives_rich_json_values(backend) -> None:
    import datetime
    import decimal

    tid = str(uuid.uuid4())
    value = {"when": datetime.datetime(2026, 1, 31, 2, 15, tzinfo=datetime.UTC),
             "price": decimal.Decimal("19.90"), "id": uuid.UUID(int=7), "tags": ("a", "b"),
             "nested": [{"x": 1.5e-7, "y": None, "z": "中文"}]}
    backend.store_result(tid, value, states.SUCCESS, request=req(None))
    raw = backend.client.get(backend.get_key_for_task(tid))
    assert backend.stored_digest(raw) == history(backend, tid)[-1].digest


def test_a_cluster_needs_the_cluster_url_and_plain_text(redis_cluster: RedisCluster3) -> None:
    seed = redis_cluster.nodes[0]
    plain = make_app(f"crawlredis://127.0.0.1:{seed.port}/0").backend
    tid = next(t for t in (str(uuid.uuid4()) for _ in range(100))
               if redis_cluster.owner(plain.get_key_for_task(t).decode()) is not seed)
    with pytest.raises(StoreError, match=r"Redis Cluster node; name it with crawlredis\+cluster"):
        plain.store_result(tid, 1, states.SUCCESS, request=req())
    with pytest.raises(ConfigError, match=r"only crawlredis\+cluster:// names a Redis Cluster"):
        _ = make_app(f"crawlrediss+cluster://127.0.0.1:{seed.port}/0").backend


def test_an_operator_revoke_replaces_a_waiting_retry_but_not_a_run_going(backend) -> None:
    """Celery 5.7's ``revoke`` command records REVOKED without a request for a task that is not
    running. Over a run's tokened RETRY it is written and keeps that token (the run that wrote
    it cannot overwrite the revoke; a newer claim can, as a run that missed the revoke does on
    stock); over a run going (STARTED) or a ready result it is refused; a revoke inside a run
    without a token is judged as any untokened write."""
    tid = str(uuid.uuid4())
    backend.store_result(tid, ValueError("again"), states.RETRY, request=req(5))
    backend.mark_as_revoked(tid, reason="revoked")
    assert status(backend, tid) == "REVOKED"
    backend.store_result(tid, "late", states.SUCCESS, request=req(5))
    backend.store_result(tid, {"pid": 1}, states.STARTED, request=req(5))
    assert status(backend, tid) == "REVOKED"
    backend.store_result(tid, "newer", states.SUCCESS, request=req(6))
    assert status(backend, tid) == "SUCCESS"
    assert outcomes(backend, tid) == [
        ("RETRY", "written"), ("REVOKED", "written"), ("SUCCESS", "refused-stale"),
        ("STARTED", "refused-regression"), ("SUCCESS", "written")]
    assert [r.token for r in history(backend, tid)][:2] == [5, 5]

    going, done, inside = (str(uuid.uuid4()) for _ in range(3))
    backend.store_result(going, {"pid": 1}, states.STARTED, request=req(7))
    backend.store_result(done, 1, states.SUCCESS, request=req(8))
    backend.store_result(inside, ValueError("again"), states.RETRY, request=req(9))
    backend.mark_as_revoked(going, reason="revoked")
    backend.mark_as_revoked(done, reason="revoked")
    backend.mark_as_revoked(inside, reason="revoked", request=req(None))
    assert [status(backend, t) for t in (going, done, inside)] == ["STARTED", "SUCCESS", "RETRY"]
    assert [outcomes(backend, t)[-1] for t in (going, done, inside)] == [
        ("REVOKED", "refused-stale")] * 3


def test_an_expired_crawl_child_names_its_deadline(backend) -> None:
    tid = str(uuid.uuid4())
    deadline = "2026-01-01T00:00:00+00:00"
    backend.mark_as_revoked(tid, "expired", request=req(3, crawl_deadline=deadline))
    meta = backend.get_task_meta(tid, cache=False)
    assert meta["status"] == "REVOKED"
    assert deadline in str(backend.exception_to_python(meta["result"]))
