"""The result backend and ``IdempotentTask`` under exactly the least-privilege Redis user that
docs/security.md documents.

A real worker (prefork, with the worker plugin) and a client app reach one redis-server with
three ACL users: the backend's (the recipe under test), the lease store's (its own recipe) and
the broker's. Everything the backend does in a fleet runs under its user; the server's ACL log
must then hold no refusal for it, and commands and keys outside the recipe must be refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chord, group

from celery_crawl.backends.audit import history, verify
from celery_crawl.errors import StoreError
from celery_crawl.tasks import ROLLED_BACK
from tests.procs import Proc, worker_args
from tests.security.leaks import assert_no_secret, exception_text
from tests.security.recipes import documented_acl_rules
from tests.security.tlsservers import AclRedis
from tests.servers import CLIENT_RESULT_OPTIONS, wait_until

pytestmark = pytest.mark.system

APP = "tests.security.backendapp"
TIMEOUT_S = 30  # the machine is small and shared
#: redis-py announces itself on connect (CLIENT SETINFO, Redis >= 7.2) and ignores a refusal;
#: it is not something the backend needs.
IGNORED_REFUSALS = {"client|setinfo"}


def _acl_log(admin: redis.Redis, user: str) -> list[dict[str, str]]:
    entries = admin.execute_command("ACL", "LOG")
    out = []
    for entry in entries:
        if isinstance(entry, list):  # RESP2 without a parser: a flat list of pairs
            entry = dict(zip(entry[::2], entry[1::2], strict=True))
        fields = {(k.decode() if isinstance(k, bytes) else str(k)):
                  (v.decode() if isinstance(v, bytes) else str(v)) for k, v in entry.items()}
        if fields.get("username") == user:
            out.append(fields)
    return out


@pytest.fixture(scope="module")
def deployment(acl_redis: AclRedis, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, Any]]:
    ns = f"secb{uuid.uuid4().hex[:6]}"
    user = f"results-{ns}"
    password = acl_redis.add_user(user, documented_acl_rules("redis-backend-acl", "results", ns))
    lease_user = f"crawler-{ns}"
    lease_password = acl_redis.add_user(lease_user,
                                        documented_acl_rules("redis-acl", "crawler", ns))
    broker_password = acl_redis.add_user(f"broker-{ns}", ["~*", "&*", "+@all"])
    env = {
        "CRAWL_SEC_BROKER": acl_redis.url(f"broker-{ns}", broker_password, db=0),
        "CRAWL_SEC_BACKEND": acl_redis.url(user, password).replace("redis://", "crawlredis://"),
        "CRAWL_SEC_LEASE": acl_redis.url(lease_user, lease_password),
        "CRAWL_SEC_NS": ns,
    }
    admin = acl_redis.admin()
    admin.execute_command("ACL", "LOG", "RESET")
    log = Path(tmp_path_factory.mktemp("backend-acl")) / "worker.log"
    proc = Proc(worker_args(APP, hostname=f"secb-{ns}@%h"), env=env, log_path=log)
    client = Celery("crawlsecb", broker=env["CRAWL_SEC_BROKER"],
                    backend=env["CRAWL_SEC_BACKEND"], set_as_current=False)
    client.conf.update(crawl_lease_url=env["CRAWL_SEC_LEASE"], crawl_namespace=ns,
                       task_serializer="json", result_serializer="json",
                       accept_content=["json"], result_expires=600, redis_socket_timeout=5,
                       broker_transport_options={"socket_timeout": 5},
                       result_backend_transport_options=CLIENT_RESULT_OPTIONS)
    try:
        wait_until(lambda: client.control.ping(timeout=0.5), 60, interval_s=0.3,
                   what=f"the worker to answer ping; log:\n{proc.log()[-3000:]}")
        yield {"client": client, "proc": proc, "user": user, "password": password, "ns": ns,
               "admin": admin, "redis": acl_redis}
    finally:
        proc.stop()
        client.close()


def test_results_and_idempotent_tasks_work_under_the_documented_user(
        deployment: dict[str, Any]) -> None:
    client: Celery = deployment["client"]
    backend = client.backend
    proc: Proc = deployment["proc"]

    plain = client.send_task("secb.add", (2, 3))
    assert plain.get(timeout=TIMEOUT_S) == 5, proc.log()[-3000:]
    written = [r for r in history(backend, plain.id) if r.outcome == "written"]
    assert [r.state for r in written] == ["STARTED", "SUCCESS"]
    # The worker plugin's claim token, checked against the lease store's counter (read only).
    assert written[-1].token is not None

    many = group(client.signature("secb.add", (i, i)) for i in range(3)).apply_async()
    assert many.get(timeout=TIMEOUT_S) == [0, 2, 4]
    many.save()
    restored = client.GroupResult.restore(many.id)
    assert restored is not None and [r.id for r in restored.results] == [r.id for r in many]
    joined = chord(client.signature("secb.add", (i, 1)) for i in range(3))(
        client.signature("secb.total"))
    assert joined.get(timeout=TIMEOUT_S) == 6

    # Idempotency: the second call with the same key replays the first run's result unrun.
    name = uuid.uuid4().hex[:8]
    first = client.send_task("secb.keyed", (name,)).get(timeout=TIMEOUT_S)
    again = client.send_task("secb.keyed", (name,))
    assert again.get(timeout=TIMEOUT_S) == first and first["by"] != again.id
    # A failure is rolled back once and replayed for the next call with its key.
    bad = uuid.uuid4().hex[:8]
    one = client.send_task("secb.keyed", (bad, True))
    with pytest.raises(KeyError, match="is broken"):
        one.get(timeout=TIMEOUT_S)
    two = client.send_task("secb.keyed", (bad, True))
    with pytest.raises(KeyError, match="is broken"):
        two.get(timeout=TIMEOUT_S)
    assert backend.get_task_meta(one.id, cache=False)["crawl_rollback"] == ROLLED_BACK
    assert backend.get_task_meta(two.id, cache=False)["crawl_rollback"] == ROLLED_BACK

    plain.forget()
    assert backend.get_task_meta(plain.id, cache=False)["status"] == "PENDING"
    report = verify(backend)
    assert report.clean, (report.missing, report.diverging)
    assert report.forgotten == 1 and report.ok >= 10

    # Nothing was refused on the way, not even where a refusal would be swallowed (the
    # heartbeat thread, redis-py's connect-time calls).
    refused = [e for e in _acl_log(deployment["admin"], deployment["user"])
               if e.get("object") not in IGNORED_REFUSALS]
    assert not refused, f"the recipe misses rights: {refused}\n{proc.log()[-3000:]}"
    assert "NOPERM" not in proc.log() and "permission" not in proc.log().lower()


def test_commands_and_keys_outside_the_recipe_are_refused(deployment: dict[str, Any]) -> None:
    backend = deployment["client"].backend
    user, password, ns = deployment["user"], deployment["password"], deployment["ns"]
    with pytest.raises(StoreError, match="permission denied") as info:
        backend.get("othertenant:celery-task-meta-x")  # another tenant's key
    text = str(info.value)
    assert f"{user}:***@127.0.0.1:{deployment['redis'].port}" in text, text
    assert_no_secret(exception_text(info.value), [password], "the refusal")
    with pytest.raises(redis.exceptions.NoPermissionError):
        backend.client.keys("*")  # a command outside the recipe
    assert any(e.get("object") == "othertenant:celery-task-meta-x"
               for e in _acl_log(deployment["admin"], user))
    admin = deployment["admin"]
    for command in (["FLUSHALL"], ["KEYS", "*"], ["CONFIG", "GET", "*"], ["SCAN", "0"],
                    ["SET", f"{ns}:token", "99999999"],  # forging a token issuance
                    ["HSET", f"{ns}:lease:beat", "holder", "x"],  # the lease store's keys
                    ["LPUSH", "celery", "forged"],  # the broker's queue
                    ["PUBLISH", "/0.celery.pidbox", "x"]):  # fleet control
        reply = admin.execute_command("ACL", "DRYRUN", user, *command)
        assert "no permissions" in str(reply), (command, reply)
