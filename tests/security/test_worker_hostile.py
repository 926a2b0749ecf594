"""A real ``celery worker`` with every plugin, every URL carrying a password, fed forged and
hostile messages.

* A forged ``crawl_claim_token`` (also in a task-protocol-1 message) never reaches the task: it
  sees the token the lease store issued to this worker.
* Hostile ``crawl_deadline``/``crawl_slot``/``crawl_leader_token`` headers fail at most their own
  task; the worker keeps serving.
* No password appears in ``inspect stats``, ``inspect crawl_leases``, the Prometheus metrics
  and the status page the worker serves, or its log.
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.procs import Proc, worker_args
from tests.security.leaks import assert_no_secret
from tests.security.tlsservers import AclRedis
from tests.servers import CLIENT_RESULT_OPTIONS, free_port, wait_until

pytestmark = pytest.mark.system

APP = "tests.security.workerapp"
FORGED = 10**30
RESULT_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def fleet(acl_redis: AclRedis, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Any]]:
    """One worker process and a client app; both reach Redis only with a password."""
    password = acl_redis.add_user("fleet", ["~*", "&*", "+@all"])
    ns = f"secw{uuid.uuid4().hex[:6]}"
    env = {
        "CRAWL_SEC_BROKER": acl_redis.url("fleet", password, db=2),
        "CRAWL_SEC_BACKEND": acl_redis.url("fleet", password).replace("redis://",
                                                                       "crawlredis://"),
        "CRAWL_SEC_LEASE": acl_redis.url("fleet", password),
        "CRAWL_SEC_NS": ns,
        "CRAWL_SEC_METRICS_PORT": str(free_port()),
    }
    log = Path(tmp_path_factory.mktemp("worker")) / "worker.log"
    proc = Proc(worker_args(APP, hostname=f"sec-{ns}@%h"), env=env, log_path=log)
    client = Celery("crawlsecw", broker=env["CRAWL_SEC_BROKER"],
                    backend=env["CRAWL_SEC_BACKEND"], set_as_current=False)
    client.conf.update(crawl_lease_url=env["CRAWL_SEC_LEASE"], crawl_namespace=ns,
                       task_serializer="json", result_serializer="json",
                       accept_content=["json"], redis_socket_timeout=5,
                       broker_transport_options={"socket_timeout": 5},
                       result_backend_transport_options=CLIENT_RESULT_OPTIONS)
    try:
        wait_until(lambda: client.control.ping(timeout=0.5), 60, interval_s=0.3,
                   what=f"the worker to answer ping; log:\n{proc.log()[-3000:]}")
        yield {"client": client, "proc": proc, "password": password, "env": env, "ns": ns,
               "redis": acl_redis}
    finally:
        proc.stop()
        client.close()


def _issued_counter(fleet: dict[str, Any]) -> int:
    raw = fleet["redis"].admin().get(f"{fleet['ns']}:token")
    return int(raw)


def _echo(fleet: dict[str, Any], **options: Any) -> dict[str, Any]:
    result = fleet["client"].send_task("sec.echo", **options)
    return dict(result.get(timeout=RESULT_TIMEOUT_S))


def test_forged_claim_token_never_reaches_the_task(fleet: dict[str, Any]) -> None:
    seen = _echo(fleet, headers={"crawl_claim_token": FORGED, "crawl_slot": {"$gt": ""},
                                 "crawl_leader_token": "evil"})
    assert isinstance(seen["token"], int) and seen["token"] != FORGED, seen
    assert seen["token"] <= _issued_counter(fleet), f"not a token the store issued: {seen}"
    assert seen["claim"] == seen["token"]


def test_forged_claim_token_in_a_protocol_1_message(fleet: dict[str, Any]) -> None:
    """Task protocol 1 carries no task id in its headers; the forged token must still not
    reach the task (the step strips it, or the worker refuses the message)."""
    client: Celery = fleet["client"]
    old = client.conf.task_protocol
    client.conf.task_protocol = 1
    try:
        result = client.send_task("sec.echo", headers={"crawl_claim_token": FORGED})
    finally:
        client.conf.task_protocol = old
    try:
        seen = dict(result.get(timeout=10))
    except Exception:  # refused or not run: acceptable
        return
    assert seen["token"] != FORGED and seen["claim"] != FORGED, seen


def test_forged_claim_token_in_a_protocol_1_body(fleet: dict[str, Any]) -> None:
    """A hand-made protocol-1 message carrying the token in its body and its headers (Celery
    builds a protocol-1 request from both): neither reaches the task, whose writes the backend
    then trusts (``_issued.py``)."""
    client: Celery = fleet["client"]
    task_id = str(uuid.uuid4())
    body = {"task": "sec.echo", "id": task_id, "args": [], "kwargs": {},
            "crawl_claim_token": FORGED}
    with client.producer_or_acquire() as producer:
        producer.publish(body, exchange="", routing_key="celery", serializer="json",
                         headers={"crawl_claim_token": FORGED})
    try:
        seen = dict(client.AsyncResult(task_id).get(timeout=RESULT_TIMEOUT_S))
    except Exception:  # refused or not run: acceptable
        return
    assert seen["token"] != FORGED and seen["claim"] != FORGED, seen


@pytest.mark.parametrize("value", ["garbage", 1e300, "0001-01-01T00:00:00+01:00", [1, 2],
                                   {"$ne": None}, 2**70])
def test_hostile_deadline_fails_at_most_its_own_task(fleet: dict[str, Any], value: Any) -> None:
    result = fleet["client"].send_task("sec.deadline", headers={"crawl_deadline": value})
    try:
        left = result.get(timeout=RESULT_TIMEOUT_S)
    except Exception as exc:
        pytest.fail(f"a malformed crawl_deadline {value!r} failed the task with "
                    f"{type(exc).__name__}: {exc} (it should be ignored with a warning)")
    assert left is None or isinstance(left, float)
    assert _echo(fleet)["token"] is not None, "the worker stopped serving"


class _Boom:
    """Unpickling this creates a directory: proof that the worker unpickled a message."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def test_pickled_message_is_refused_without_leaving_a_claim(fleet: dict[str, Any],
                                                            tmp_path: Path) -> None:
    """A pickle-serialized task message aimed at the worker is not unpickled, not run, and
    leaves no claim behind; the worker keeps serving."""
    marker = tmp_path / "unpickled"
    evil = Celery("crawlsecw", broker=fleet["env"]["CRAWL_SEC_BROKER"], set_as_current=False)
    evil.conf.update(task_serializer="pickle", accept_content=["pickle", "json"],
                     broker_transport_options={"socket_timeout": 5})
    task_id = str(uuid.uuid4())
    try:
        evil.send_task("sec.echo", args=[_Boom(str(marker))], task_id=task_id)
    finally:
        evil.close()
    assert _echo(fleet)["token"] is not None, "the worker stopped serving"

    def claims() -> list[Any]:
        replies = fleet["client"].control.broadcast("crawl_leases", reply=True, timeout=3,
                                                    limit=1)
        return [c for reply in replies for body in reply.values()
                for c in (body.get("claimed") or []) if task_id in json.dumps(c, default=str)]

    wait_until(lambda: not claims(), 6, interval_s=0.3,
               what=f"the refused pickle message's claim to go (claims: {claims()})")
    assert not marker.exists(), "the worker unpickled a task message"


def test_no_password_in_inspect_stats_leases_metrics_or_log(fleet: dict[str, Any]) -> None:
    client: Celery = fleet["client"]
    _echo(fleet)  # something has run, so every metric has a sample
    inspect = client.control.inspect(timeout=3, limit=1)
    stats = inspect.stats()
    assert stats, "no reply to inspect stats"
    leases = client.control.broadcast("crawl_leases", reply=True, timeout=3, limit=1)
    assert leases, "no reply to crawl_leases"
    secret = [fleet["password"]]
    assert_no_secret(json.dumps(stats, default=str), secret, "inspect stats")
    assert_no_secret(json.dumps(leases, default=str), secret, "inspect crawl_leases")
    port = fleet["env"]["CRAWL_SEC_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    assert "crawl_" in body
    assert_no_secret(body, secret, "the worker's /metrics")
    for page in ("/status", "/status.json"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{page}", timeout=10) as resp:
            body = resp.read().decode()
        assert "Leader" in body or '"leader"' in body, body[:2000]  # gathered from the store
        assert_no_secret(body, secret, f"the worker's {page}")
    assert_no_secret(fleet["proc"].log(), secret, "the worker log")
