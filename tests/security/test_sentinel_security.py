"""Redis behind Sentinel with TLS and least-privilege ACL users (docs/security.md).

Real processes: one master, one replica and one sentinel (``tests.security.sentinelsecure``),
every ``default`` user off.

* TLS: the data nodes and the sentinel speak only TLS with client certificates; the audited
  result backend reaches them the Celery way (``redis_backend_use_ssl`` for the data nodes,
  ``result_backend_transport_options["sentinel_kwargs"]`` for the sentinel), the lease store by
  its ``rediss+sentinel://`` URL; a bad setting is a ``ConfigError`` naming it.
* ACL: every user is exactly the documented recipe (read from docs/security.md): the lease
  store's and the backend's users on the data nodes, Sentinel's and the replicas' users there,
  the clients' user on the sentinel. Every lease-store operation and a backend write run through
  the sentinel; a ``SENTINEL FAILOVER`` under those users is followed; a user lacking a
  permission is refused with a clear error.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from celery import Celery, states
from celery.app.task import Context

from celery_crawl import keys
from celery_crawl.backends import AuditedSentinelBackend
from celery_crawl.errors import ConfigError, StoreError
from celery_crawl.leases import open_store
from tests.security.exercise import exercise_store
from tests.security.leaks import assert_no_secret
from tests.security.recipes import documented_acl_rules
from tests.security.sentinelsecure import MASTER, SecureSentinel, secure_sentinel
from tests.security.tlsservers import Pki
from tests.servers import CLIENT_RESULT_OPTIONS, wait_until

pytestmark = pytest.mark.slow

TIMEOUT_S = 5.0
NS = "crawl"  # the recipes' namespace, unchanged


def _recipe(marker: str, user: str) -> list[str]:
    return documented_acl_rules(marker, user, NS)


def _tls(pki: Pki) -> dict[str, str]:
    return {"ssl_cert_reqs": "required", "ssl_ca_certs": str(pki.ca),
            "ssl_certfile": str(pki.client_cert), "ssl_keyfile": str(pki.client_key)}


def _backend_app(url: str, **conf: Any) -> Celery:
    app = Celery(f"s{uuid.uuid4().hex[:6]}", broker="memory://", backend=url,
                 set_as_current=False)
    options = {**CLIENT_RESULT_OPTIONS, **conf.pop("result_backend_transport_options", {})}
    app.conf.update(crawl_namespace=NS, redis_socket_timeout=TIMEOUT_S,
                    redis_socket_connect_timeout=TIMEOUT_S,
                    result_backend_transport_options=options, **conf)
    return app


def _write_and_read(app: Celery) -> None:
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, {"ok": 1}, states.SUCCESS,
                             request=Context(crawl_claim_token=None, hostname="w"))
    assert app.backend.get_task_meta(task_id)["result"] == {"ok": 1}


# -- TLS -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_sentinel(pki: Pki) -> Iterator[SecureSentinel]:
    with secure_sentinel(
            pki=pki, replicas=1, data_users={"app": ["~*", "&*", "+@all"]},
            sentinel_users={"app": ["+@all"]},
            sentinel_auth=("sentinel-node", _recipe("redis-sentinel-node-acl", "sentinel-node")),
            replica_auth=("replica", _recipe("redis-replica-acl", "replica"))) as topology:
        yield topology


def test_backend_tls_the_celery_way(tls_sentinel: SecureSentinel, pki: Pki) -> None:
    """``redis_backend_use_ssl`` for the data nodes, ``sentinel_kwargs`` for the sentinel."""
    pw = tls_sentinel.passwords["app"]
    url = f"crawlredis+sentinel://app:{pw}@127.0.0.1:{tls_sentinel.sentinel_port}/{MASTER}/0"
    sentinel_kwargs = {"ssl": True, **_tls(pki), "username": "app", "password": pw}
    # The lease store on the same nodes by its URL (TLS to both).
    query = urlencode({**_tls(pki), "sentinel_ssl": "yes", "sentinel_username": "app",
                       "sentinel_password": pw})
    lease_url = (f"rediss+sentinel://app:{pw}@127.0.0.1:{tls_sentinel.sentinel_port}/{MASTER}/0"
                 f"?{query}")
    app = _backend_app(url, redis_backend_use_ssl=_tls(pki), result_backend_transport_options={
        "sentinel_kwargs": sentinel_kwargs})
    assert isinstance(app.backend, AuditedSentinelBackend)
    _write_and_read(app)
    # Celery's own URL form, master_name in the transport options.
    celery_form = _backend_app(
        f"crawlredis+sentinel://app:{pw}@127.0.0.1:{tls_sentinel.sentinel_port}/0",
        redis_backend_use_ssl=_tls(pki), crawl_lease_url=lease_url,
        result_backend_transport_options={"master_name": MASTER,
                                          "sentinel_kwargs": sentinel_kwargs})
    assert celery_form.backend.checks_token_issuance
    _write_and_read(celery_form)
    store = open_store(lease_url, namespace=NS, timeout_s=TIMEOUT_S)
    try:
        lease = store.acquire(keys.worker_lease("tls"), 10.0, "w")
        assert lease is not None
        store.release(lease)
    finally:
        store.close()
    # Without TLS to the sentinel (or to the data nodes) nothing gets through.
    for bad in ({"redis_backend_use_ssl": _tls(pki)},
                {"result_backend_transport_options": {"sentinel_kwargs": sentinel_kwargs}}):
        plain = _backend_app(url, **bad)
        plain.conf.result_backend_transport_options = {
            **plain.conf.result_backend_transport_options,
            "retry_policy": {"max_retries": 0}}
        with pytest.raises(Exception) as info:  # Celery's or ours, by the path taken
            _write_and_read(plain)
        assert_no_secret(str(info.value), [pw], "the error")


@pytest.mark.parametrize(("conf", "why"), [
    ({"redis_backend_use_ssl": True}, r"redis_backend_use_ssl: must be a dict"),
    ({"redis_backend_use_ssl": {"ssl_cert_reqs": "required", "ssl_ca_cert": "/x"}},
     r"redis_backend_use_ssl: unknown option.*'ssl_ca_cert'"),
    ({"redis_backend_use_ssl": {"ssl_ca_certs": "{ca}"}},
     r"redis_backend_use_ssl: ssl_cert_reqs is required"),
    ({"redis_backend_use_ssl": {"ssl_cert_reqs": "always"}},
     r"redis_backend_use_ssl: ssl_cert_reqs must be"),
    ({"redis_backend_use_ssl": {"ssl_cert_reqs": "required", "ssl_ca_certs": "/no/such.pem"}},
     r"redis_backend_use_ssl: ssl_ca_certs '/no/such.pem' is not a readable file"),
    ({"result_backend_transport_options": {"sentinel_kwargs": "ssl"}},
     r'result_backend_transport_options\["sentinel_kwargs"\]: must be a dict'),
    ({"result_backend_transport_options": {"sentinel_kwargs": {"ssl": True, "ssl_ca": "/x"}}},
     r'result_backend_transport_options\["sentinel_kwargs"\]: unknown argument.*ssl_ca'),
    ({"result_backend_transport_options": {"sentinel_kwargs": {"ssl_ca_certs": "{ca}"}}},
     r'result_backend_transport_options\["sentinel_kwargs"\]: ssl_ca_certs given without ssl'),
])
def test_bad_tls_settings_name_the_setting(conf: dict[str, Any], why: str, pki: Pki) -> None:
    def fill(value: Any) -> Any:  # the CA's path for "{ca}"
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return str(pki.ca) if value == "{ca}" else value

    conf = fill(conf)
    for url in ("crawlredis+sentinel://127.0.0.1:26379/crawl/0", "crawlredis://127.0.0.1:6379/0"):
        if "result_backend_transport_options" in conf and "sentinel" not in url:
            continue
        with pytest.raises(ConfigError, match=why):
            _ = _backend_app(url, **conf).backend


# -- ACL -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def acl_sentinel() -> Iterator[SecureSentinel]:
    with secure_sentinel(
            pki=None, replicas=1,
            data_users={"crawler": _recipe("redis-acl", "crawler"),
                        "results": _recipe("redis-backend-acl", "results"),
                        # The lease store's recipe without EVALSHA: no script runs.
                        "noscripts": [r for r in _recipe("redis-acl", "crawler")
                                      if r != "+evalsha"]},
            sentinel_users={
                "crawl-sentinel": _recipe("redis-sentinel-client-acl", "crawl-sentinel"),
                "blind": ["-@all", "+ping"]},
            sentinel_auth=("sentinel-node", _recipe("redis-sentinel-node-acl", "sentinel-node")),
            replica_auth=("replica", _recipe("redis-replica-acl", "replica"))) as topology:
        yield topology


def _store_url(topology: SecureSentinel, user: str, sentinel_user: str = "crawl-sentinel",
               scheme: str = "redis+sentinel") -> str:
    return (f"{scheme}://{user}:{topology.passwords[user]}@127.0.0.1:{topology.sentinel_port}/"
            f"{MASTER}/0?sentinel_username={sentinel_user}"
            f"&sentinel_password={topology.passwords[sentinel_user]}")


def test_documented_users_run_the_store_and_the_backend(acl_sentinel: SecureSentinel) -> None:
    store = open_store(_store_url(acl_sentinel, "crawler"), namespace=NS, timeout_s=TIMEOUT_S)
    try:
        exercise_store(store)
        app = _backend_app(_store_url(acl_sentinel, "results", scheme="crawlredis+sentinel"),
                           crawl_lease_url=_store_url(acl_sentinel, "crawler"))
        assert app.backend.checks_token_issuance  # reads the store's counter, read only
        _write_and_read(app)
        # A failover under these users (Sentinel's REPLICAOF, CONFIG REWRITE, CLIENT KILL and
        # the replica's PSYNC): the store follows, the backend writes on the new master.
        lease = store.acquire(keys.BEAT_LEADER, 30.0, "beat")
        assert lease is not None
        old = acl_sentinel.master_port
        acl_sentinel.admin(acl_sentinel.sentinel_port).execute_command(
            "SENTINEL", "FAILOVER", MASTER)

        def moved() -> bool:
            nonlocal lease
            try:
                lease = store.renew(lease)
            except StoreError:
                return False
            link = store.sentinel_link  # type: ignore[attr-defined]
            return link.master is not None and link.master[1] != old

        wait_until(moved, 30, interval_s=0.1, what="the store on the new master")
        _write_and_read(app)
        store.release(lease)
    finally:
        store.close()
    logs = "\n".join(p.read_text(errors="replace")
                     for p in Path(acl_sentinel.base).glob("*/redis.log"))
    assert "NOPERM" not in logs and "-NOAUTH" not in logs, logs[-2000:]


def test_a_user_lacking_a_permission_gets_a_clear_error(acl_sentinel: SecureSentinel) -> None:
    secrets = list(acl_sentinel.passwords.values())
    # A data-node user without EVALSHA: the store's first script call is refused.
    store = open_store(_store_url(acl_sentinel, "noscripts"), namespace=NS, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(StoreError) as info:
            store.acquire(keys.worker_lease("refused"), 10.0, "w")
        text = str(info.value)
        assert "NOPERM" in text or "permission" in text.lower(), text
        assert "redis+sentinel://noscripts:***@" in text, text
        assert_no_secret(text, secrets, "the error")
    finally:
        store.close()
    # A sentinel user that may not ask where the master is: no master found, said clearly.
    store = open_store(_store_url(acl_sentinel, "crawler", sentinel_user="blind"),
                       namespace=NS, timeout_s=1.0)
    try:
        with pytest.raises(StoreError) as info:
            store.holder("x")
        text = str(info.value)
        assert "No master found" in text and "no permissions" in text, text
        assert "sentinel|masters" in text, text
        assert_no_secret(text, secrets, "the error")
    finally:
        store.close()
