"""Redis lease store under TLS and ACL users: refusals are clear, bounded and masked, and the
store works under exactly the documented least-privilege ACL user.

Real redis-servers (tests/security/tlsservers.py): one speaking only TLS with client
certificates required, one plain-TCP; both with the ``default`` user switched off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from celery_crawl.errors import CrawlError, StoreError, StoreTimeout, StoreUnavailable
from celery_crawl.leases import open_store
from tests.security import recipes
from tests.security.exercise import exercise_store
from tests.security.leaks import assert_no_secret, assert_refused, exception_text
from tests.security.tlsservers import AclRedis, SecureRedis

TIMEOUT_S = 1.0
#: Store timeout where the test waits for it to expire (a silent peer, TLS to a plain port).
SILENT_TIMEOUT_S = 0.5
#: A refusal may cost a connect and a handshake, each bounded by the timeout; 3x headroom.
BOUND_S = 6 * TIMEOUT_S
ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
REFUSED = (StoreUnavailable, StoreTimeout)


def _connect(url: str, namespace: str = "sec", timeout_s: float = TIMEOUT_S) -> None:
    """Open the store and use it; every refusal must surface here as a CrawlError."""
    store = open_store(url, namespace=namespace, timeout_s=timeout_s)
    try:
        store.ping()
        lease = store.acquire(f"probe-{uuid.uuid4().hex[:6]}", 3.0, "probe:1:x")
        if lease is not None:
            store.release(lease)
    finally:
        store.close()


def _fresh_secret() -> str:
    # Made at run time: a literal would show up in traceback source lines and look leaked.
    return f"pw-{uuid.uuid4().hex}"


def documented_acl_rules(namespace: str) -> list[str]:
    """The ACL rules of the lease store's recipe in docs/security.md, for ``namespace``."""
    return recipes.documented_acl_rules("redis-acl", "crawler", namespace)


# -- TLS ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_user(tls_redis: SecureRedis) -> tuple[str, str]:
    return "crawler", tls_redis.add_user("crawler", ["~*", "&*", "+@all"])


def test_tls_with_client_certificate_and_password_works(
    tls_redis: SecureRedis, tls_user: tuple[str, str]
) -> None:
    _connect(tls_redis.url(*tls_user, **tls_redis.tls_query()))


def test_tls_store_url_and_repr_are_masked(
    tls_redis: SecureRedis, tls_user: tuple[str, str]
) -> None:
    store = open_store(tls_redis.url(*tls_user, **tls_redis.tls_query()), namespace="sec",
                       timeout_s=TIMEOUT_S)
    try:
        assert "crawler:***@" in store.url
        assert_no_secret(f"{store.url} {store!r} {vars(store)!r}"[:100_000], [tls_user[1]],
                         "the store's url/repr")
    finally:
        store.close()


@pytest.mark.parametrize("case", ["no-credentials", "wrong-password", "unknown-user"])
def test_tls_bad_credentials_refused(tls_redis: SecureRedis, tls_user: tuple[str, str],
                                     case: str, all_logs: pytest.LogCaptureFixture) -> None:
    wrong = _fresh_secret()
    user, password = {"no-credentials": (None, None), "wrong-password": ("crawler", wrong),
                      "unknown-user": ("nobody", wrong)}[case]
    url = tls_redis.url(user, password, **tls_redis.tls_query())
    assert_refused(lambda: _connect(url), url, secrets=[wrong, tls_user[1]], expect=REFUSED,
                   bound_s=BOUND_S)
    assert_no_secret(all_logs.text, [wrong, tls_user[1]], "the logs")


@pytest.mark.parametrize("case", ["untrusted-server", "rogue-client-cert", "no-client-cert",
                                  "expired-client-cert", "system-ca-only"])
def test_tls_untrusted_certificates_refused(tls_redis: SecureRedis, tls_user: tuple[str, str],
                                           case: str, all_logs: pytest.LogCaptureFixture) -> None:
    pki = tls_redis.pki
    assert pki is not None
    query = {
        "untrusted-server": tls_redis.tls_query(ca=pki.rogue_ca),
        "rogue-client-cert": tls_redis.tls_query(cert=pki.rogue_client_cert,
                                                 key=pki.rogue_client_key),
        "no-client-cert": tls_redis.tls_query(client_cert=False),
        "expired-client-cert": tls_redis.tls_query(cert=pki.expired_client_cert,
                                                   key=pki.expired_client_key),
        "system-ca-only": {},
    }[case]
    url = tls_redis.url(*tls_user, **query)
    assert_refused(lambda: _connect(url), url, secrets=[tls_user[1]], expect=REFUSED,
                   bound_s=BOUND_S)
    assert_no_secret(all_logs.text, [tls_user[1]], "the logs")


def test_server_certificate_for_another_host_refused(tls_redis: SecureRedis) -> None:
    """A certificate from the trusted CA but issued for another host name is a
    man-in-the-middle's certificate: the host name must be checked."""
    pki = tls_redis.pki
    assert pki is not None
    imposter = SecureRedis(pki, cert=pki.other_host_cert, key=pki.other_host_key)
    imposter.start()
    try:
        password = imposter.add_user("crawler", ["~*", "&*", "+@all"])
        url = imposter.url("crawler", password, **imposter.tls_query())
        assert_refused(lambda: _connect(url), url, secrets=[password], expect=REFUSED,
                       bound_s=BOUND_S)
    finally:
        imposter.cleanup()


def test_plain_tcp_to_tls_port_refused(tls_redis: SecureRedis,
                                       tls_user: tuple[str, str]) -> None:
    url = tls_redis.url(*tls_user).replace("rediss://", "redis://", 1)
    assert_refused(lambda: _connect(url), url, secrets=[tls_user[1]], expect=REFUSED,
                   bound_s=BOUND_S)


def test_missing_ca_file_is_a_clear_error(tls_redis: SecureRedis,
                                          tls_user: tuple[str, str]) -> None:
    missing = tls_redis.dir / "no-such-ca.pem"
    url = tls_redis.url(*tls_user, **tls_redis.tls_query(ca=missing))
    exc = assert_refused(lambda: _connect(url), url, secrets=[tls_user[1]], bound_s=BOUND_S)
    assert "no-such-ca.pem" in str(exc) or "No such file" in exception_text(exc)


def test_unknown_tls_option_is_refused_not_ignored(tls_redis: SecureRedis,
                                                   tls_user: tuple[str, str]) -> None:
    url = tls_redis.url(*tls_user, **tls_redis.tls_query(), ssl_ca_cert="typo.pem")
    with pytest.raises(CrawlError) as info:
        _connect(url)
    assert "ssl_ca_cert" in str(info.value)
    assert_no_secret(exception_text(info.value), [tls_user[1]], "the exception")


def test_tls_handshake_to_silent_peer_is_bounded(blackhole: int,
                                                 pki_url_query: dict[str, str]) -> None:
    password = _fresh_secret()
    url = f"rediss://crawler:{password}@127.0.0.1:{blackhole}/0"
    url += "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in pki_url_query.items())
    assert_refused(lambda: _connect(url, timeout_s=SILENT_TIMEOUT_S), url,
                   secrets=[password], expect=REFUSED, bound_s=BOUND_S)


@pytest.fixture
def pki_url_query(tls_redis: SecureRedis) -> dict[str, str]:
    return tls_redis.tls_query()


# -- ACL over plain TCP ------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["no-credentials", "wrong-password", "disabled-user",
                                  "password-only"])
def test_acl_bad_credentials_refused(acl_redis: AclRedis, case: str,
                                     all_logs: pytest.LogCaptureFixture) -> None:
    good = acl_redis.add_user("limited", ["~*", "+@all"])
    asleep = acl_redis.add_user("sleeper", ["~*", "+@all"])
    acl_redis.admin().execute_command("ACL", "SETUSER", "sleeper", "off")
    wrong = _fresh_secret()
    user, password = {"no-credentials": (None, None), "wrong-password": ("limited", wrong),
                      "disabled-user": ("sleeper", asleep),
                      "password-only": (None, wrong)}[case]
    url = acl_redis.url(user, password)
    assert_refused(lambda: _connect(url), url, secrets=[wrong, good, asleep], expect=REFUSED,
                   bound_s=BOUND_S)
    assert_no_secret(all_logs.text, [wrong, good, asleep], "the logs")


def test_tls_to_plain_port_is_bounded(acl_redis: AclRedis, pki_url_query: dict[str, str]) -> None:
    password = acl_redis.add_user("limited", ["~*", "+@all"])
    url = acl_redis.url("limited", password, **pki_url_query).replace("redis://", "rediss://", 1)
    assert_refused(lambda: _connect(url, timeout_s=SILENT_TIMEOUT_S), url,
                   secrets=[password], expect=REFUSED, bound_s=BOUND_S)


def test_plain_to_silent_peer_is_bounded(blackhole: int) -> None:
    password = _fresh_secret()
    url = f"redis://crawler:{password}@127.0.0.1:{blackhole}/0"
    assert_refused(lambda: _connect(url, timeout_s=SILENT_TIMEOUT_S), url,
                   secrets=[password], expect=REFUSED, bound_s=BOUND_S)


def test_password_with_reserved_characters_works_when_encoded(acl_redis: AclRedis) -> None:
    password = f"p@ss:w/rd#?%&=+ é{_fresh_secret()}"
    acl_redis.add_user("odd", ["~*", "&*", "+@all"], password=password)
    url = acl_redis.url("odd", password)  # percent-encodes the password
    _connect(url)
    store = open_store(url, namespace="sec", timeout_s=TIMEOUT_S)
    try:
        assert_no_secret(f"{store.url} {store!r}", [password], "the store's url/repr")
    finally:
        store.close()


# -- least privilege ---------------------------------------------------------------------------
@pytest.mark.parametrize("server_name", ["acl_redis", "tls_redis"])
def test_store_works_under_documented_least_privilege_user(
    request: pytest.FixtureRequest, server_name: str
) -> None:
    server = request.getfixturevalue(server_name)
    namespace = f"lp{uuid.uuid4().hex[:6]}"
    password = server.add_user(f"crawler-{namespace}", documented_acl_rules(namespace))
    query = server.tls_query() if server.tls else {}
    store = open_store(server.url(f"crawler-{namespace}", password, **query),
                       namespace=namespace, timeout_s=TIMEOUT_S * 2)
    try:
        exercise_store(store)
    finally:
        store.close()
    # The user really is confined: another tenant's keys are out of reach.
    denied = server.admin().execute_command("ACL", "DRYRUN", f"crawler-{namespace}", "GET",
                                            "othertenant:token")
    assert "no permissions" in str(denied)


def test_every_command_the_store_sends_is_in_the_recipe(acl_redis: AclRedis) -> None:
    """Guards the documented recipe: run every operation under a full-rights user and compare
    the server's command statistics with the documented grants."""
    namespace = f"cs{uuid.uuid4().hex[:6]}"
    password = acl_redis.add_user("counter", ["~*", "&*", "+@all"])
    store = open_store(acl_redis.url("counter", password), namespace=namespace,
                       timeout_s=TIMEOUT_S * 2)
    admin = acl_redis.admin()
    admin.ping()  # connect the admin now so its AUTH is counted before the reset
    admin.config_resetstat()
    try:
        exercise_store(store)
    finally:
        store.close()
    used = {name.removeprefix("cmdstat_") for name in admin.info("commandstats")}
    used -= {"auth", "config|resetstat", "client|setinfo", "config|get"}
    granted = {r[1:] for r in documented_acl_rules(namespace) if r.startswith("+")}
    assert used <= granted, f"commands used but not in the recipe: {sorted(used - granted)}"


def test_user_confined_to_another_namespace_gets_a_clear_error(acl_redis: AclRedis) -> None:
    password = acl_redis.add_user("elsewhere", documented_acl_rules("elsewhere"))
    url = acl_redis.url("elsewhere", password)
    exc = assert_refused(lambda: _connect(url, namespace="mine"), url, secrets=[password],
                         expect=StoreError, bound_s=BOUND_S)
    assert "permission" in str(exc).lower()


# -- the audited result backend ----------------------------------------------------------------
#: A refusal the backend must not retry: well under Celery's default retry policy (20 retries,
#: a second apart), with the default policy in force.
BACKEND_BOUND_S = 5.0


def _backend_app(url: str, lease_url: str, *, always_retry: bool = False) -> Any:
    from celery import Celery

    app = Celery("sec-backend", broker="memory://", backend=url, set_as_current=False)
    # No retry_policy: Celery's default, under which a retried refusal would take ~20 s.
    app.conf.update(crawl_namespace=f"b{uuid.uuid4().hex[:6]}", crawl_lease_url=lease_url,
                    redis_socket_timeout=2, redis_socket_connect_timeout=2,
                    result_backend_always_retry=always_retry)
    return app


def _store(app: Any, task_id: str | None = None) -> None:
    from celery import states
    from celery.app.task import Context

    app.backend.store_result(task_id or str(uuid.uuid4()), {"ok": 1}, states.SUCCESS,
                             request=Context(crawl_claim_token=None, hostname="w"))


def _assert_backend_refusal(attempt: Any, url: str, secrets: list[str], user: str | None,
                            reason: str) -> StoreUnavailable:
    exc = assert_refused(attempt, url, secrets=secrets, expect=StoreUnavailable,
                         bound_s=BACKEND_BOUND_S)
    assert isinstance(exc, StoreUnavailable)
    text = str(exc)
    assert text.startswith("result backend crawlredis"), text
    if user is not None:
        assert f"{user}:***@127.0.0.1:" in text, text
    assert reason in text and "not retried" in text, text
    return exc


@pytest.mark.parametrize("case", ["works", "wrong-password", "no-credentials", "untrusted-server"])
def test_audited_backend_over_tls_refusals_are_clear_fast_and_masked(
        tls_redis: SecureRedis, tls_user: tuple[str, str], case: str,
        all_logs: pytest.LogCaptureFixture) -> None:
    user, password = tls_user
    pki = tls_redis.pki
    assert pki is not None
    wrong = _fresh_secret()
    cred: tuple[str | None, str | None] = {
        "wrong-password": (user, wrong), "no-credentials": (None, None)}.get(case, tls_user)
    query = {"untrusted-server": tls_redis.tls_query(ca=pki.rogue_ca)}.get(
        case, tls_redis.tls_query())
    url = tls_redis.url(*cred, **query).replace("rediss://", "crawlrediss://", 1)
    app = _backend_app(url, tls_redis.url(user, password, **tls_redis.tls_query()))
    backend = app.backend
    assert_no_secret(f"{backend.as_uri()} {backend!r} {backend.safe_url}", [password, wrong],
                     "the backend's uri")
    if case == "works":
        task_id = str(uuid.uuid4())
        _store(app, task_id)
        assert app.AsyncResult(task_id).get(timeout=10) == {"ok": 1}
    else:
        reason = {"wrong-password": "credentials refused", "no-credentials": "credentials refused",
                  "untrusted-server": "TLS certificate not trusted"}[case]
        _assert_backend_refusal(lambda: _store(app), url, [password, wrong], cred[0], reason)
        # Reading is refused the same way, e.g. AsyncResult.get() subscribing for a result.
        _assert_backend_refusal(lambda: app.AsyncResult(str(uuid.uuid4())).get(timeout=5), url,
                                [password, wrong], cred[0], reason)
    assert_no_secret(all_logs.text, [password, wrong], "the logs")


def test_audited_backend_client_certificate_refused_by_the_server(
        tls_redis: SecureRedis, tls_user: tuple[str, str]) -> None:
    """Under TLS 1.3 the server checks the client certificate after the handshake: its alert
    ("certificate required") is a refusal, not retried; but the server may close the connection
    before our first write is through, and that looks like any dropped connection, retried per
    the policy (capped here). Either way: a StoreUnavailable naming the masked URL."""
    user, password = tls_user
    url = tls_redis.url(user, password, **tls_redis.tls_query(client_cert=False)).replace(
        "rediss://", "crawlrediss://", 1)
    app = _backend_app(url, tls_redis.url(user, password, **tls_redis.tls_query()))
    app.conf.result_backend_transport_options = {"retry_policy": {
        "max_retries": 3, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.1}}
    exc = assert_refused(lambda: _store(app), url, secrets=[password], expect=StoreUnavailable,
                         bound_s=BACKEND_BOUND_S)
    text = str(exc)
    assert f"{user}:***@127.0.0.1:" in text, text
    if "alert" in text.lower():
        assert "TLS client certificate refused (not retried)" in text, text


@pytest.mark.parametrize("always_retry", [False, True], ids=["default", "always-retry"])
@pytest.mark.parametrize("case", ["wrong-password", "no-credentials", "disabled-user"])
def test_audited_backend_acl_refusals_are_not_retried(acl_redis: AclRedis, case: str,
                                                      always_retry: bool,
                                                      all_logs: pytest.LogCaptureFixture) -> None:
    """Neither ``ensure()``'s retry policy nor ``result_backend_always_retry`` retries a refused
    password: it is a StoreUnavailable naming the masked URL, at once."""
    good = acl_redis.add_user("backend", ["~*", "&*", "+@all"])
    asleep = acl_redis.add_user("sleeper", ["~*", "&*", "+@all"])
    acl_redis.admin().execute_command("ACL", "SETUSER", "sleeper", "off")
    wrong = _fresh_secret()
    cred: tuple[str | None, str | None] = {
        "wrong-password": ("backend", wrong), "no-credentials": (None, None),
        "disabled-user": ("sleeper", asleep)}[case]
    url = acl_redis.url(*cred).replace("redis://", "crawlredis://", 1)
    app = _backend_app(url, acl_redis.url("backend", good), always_retry=always_retry)
    _assert_backend_refusal(lambda: _store(app), url, [good, wrong, asleep], cred[0],
                            "credentials refused")
    assert_no_secret(all_logs.text, [good, wrong, asleep], "the logs")


def test_audit_cli_names_the_masked_url_on_a_refused_password(acl_redis: AclRedis) -> None:
    good = acl_redis.add_user("auditor", ["~*", "&*", "+@all"])
    wrong = _fresh_secret()
    backend_url = acl_redis.url("auditor", wrong).replace("redis://", "crawlredis://", 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CRAWL_SEC_BACKEND": backend_url,
           "CRAWL_SEC_LEASE": acl_redis.url("auditor", good),
           "CRAWL_SEC_BROKER": acl_redis.url("auditor", good, db=1)}
    t0 = time.monotonic()
    done = subprocess.run([CELERY, "-A", "tests.security.cliapp", "crawl", "audit", "verify"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    assert f"auditor:***@127.0.0.1:{acl_redis.port}" in output, output
    assert "credentials refused" in output, output
    assert_no_secret(output, [good, wrong], "the audit CLI's output")
    # Process start-up included; a retried refusal would take ~20 s.
    assert elapsed < 20, f"audit verify took {elapsed:.1f}s to report a refused password"
