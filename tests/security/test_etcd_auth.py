"""etcd lease store with TLS (client certificates required) and etcd authentication: refusals
are clear, bounded and masked; the store works under exactly the documented namespace role.

One real etcd member (tests/security/tlsservers.py) serves an https:// listener and a plain
http:// listener; auth is enabled with a ``root`` user.
"""

from __future__ import annotations

import re
import shlex
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from celery_crawl.errors import ConfigError, CrawlError, StoreError, StoreTimeout, StoreUnavailable
from celery_crawl.leases import open_store
from tests.security.exercise import exercise_store
from tests.security.leaks import assert_no_secret, assert_refused, exception_text
from tests.security.tlsservers import Pki, SecureEtcd

TIMEOUT_S = 1.0
#: Store timeout where the test waits for it to expire (a silent peer, TLS to a plain port).
SILENT_TIMEOUT_S = 0.5
BOUND_S = 6 * TIMEOUT_S
DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"
REFUSED = (StoreUnavailable, StoreTimeout)


def _fresh_secret() -> str:
    # Made at run time: a literal would show up in traceback source lines and look leaked.
    return f"pw-{uuid.uuid4().hex}"


def _connect(url: str, namespace: str = "sec", timeout_s: float = TIMEOUT_S) -> None:
    store = open_store(url, namespace=namespace, timeout_s=timeout_s)
    try:
        store.ping()
        lease = store.acquire(f"probe-{uuid.uuid4().hex[:6]}", 3.0, "probe:1:x")
        if lease is not None:
            store.release(lease)
        store.put(f"probe/{uuid.uuid4().hex[:6]}", {"ok": True})
    finally:
        store.close()


def make_documented_user(server: SecureEtcd, namespace: str) -> tuple[str, str]:
    """Run the etcd role recipe of docs/security.md for ``namespace``; returns the
    user's name and password."""
    text = DOCS.read_text(encoding="utf-8")
    block = re.search(r"<!-- etcd-role-begin -->\s*```\s*\n(.*?)\n```", text, re.S)
    assert block, "docs/security.md lost its etcd-role block"
    user, password = f"crawler-{namespace}", _fresh_secret()
    for line in block.group(1).splitlines():
        words = shlex.split(line)
        assert words[0] == "etcdctl", line
        words = [w.replace("crawl:", f"{namespace}:").replace("crawl-role", f"{user}-role")
                 .replace("crawler", user) for w in words[1:]]
        if words[:2] == ["user", "add"]:
            words[2] = f"{words[2]}:{password}"
        server.ctl_ok(*words)
    return user, password


@pytest.fixture(scope="module")
def etcd_user(secure_etcd: SecureEtcd) -> tuple[str, str]:
    """A user whose role covers the ``sec:`` namespace used by most tests here."""
    return make_documented_user(secure_etcd, "sec")


# -- working setups ----------------------------------------------------------------------------
def test_tls_with_client_certificate_and_password_works(secure_etcd: SecureEtcd,
                                                        etcd_user: tuple[str, str]) -> None:
    _connect(secure_etcd.url(*etcd_user))


def test_password_over_plain_listener_works(secure_etcd: SecureEtcd,
                                            etcd_user: tuple[str, str]) -> None:
    _connect(secure_etcd.url(*etcd_user, tls=False))


def test_store_url_and_repr_are_masked(secure_etcd: SecureEtcd,
                                       etcd_user: tuple[str, str]) -> None:
    store = open_store(secure_etcd.url(*etcd_user), namespace="sec", timeout_s=TIMEOUT_S)
    try:
        assert f"{etcd_user[0]}:***@" in store.url
        assert_no_secret(f"{store.url} {store!r}", [etcd_user[1]], "the store's url/repr")
    finally:
        store.close()


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
def test_store_works_under_documented_namespace_role(secure_etcd: SecureEtcd,
                                                     tls: bool) -> None:
    namespace = f"lp{uuid.uuid4().hex[:6]}"
    user, password = make_documented_user(secure_etcd, namespace)
    store = open_store(secure_etcd.url(user, password, tls=tls), namespace=namespace,
                       timeout_s=TIMEOUT_S * 3)
    try:
        exercise_store(store)
    finally:
        store.close()


def test_role_confines_the_user_to_its_namespace(secure_etcd: SecureEtcd,
                                                 etcd_user: tuple[str, str]) -> None:
    url = secure_etcd.url(*etcd_user)
    exc = assert_refused(lambda: _connect(url, namespace="someone-else"), url,
                         secrets=[etcd_user[1]], expect=StoreError, bound_s=BOUND_S)
    assert "permission" in str(exc).lower()


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
@pytest.mark.parametrize("case", ["no-credentials", "wrong-password", "unknown-user"])
def test_bad_credentials_refused(secure_etcd: SecureEtcd, etcd_user: tuple[str, str],
                                 case: str, tls: bool,
                                 all_logs: pytest.LogCaptureFixture) -> None:
    wrong = _fresh_secret()
    user, password = {"no-credentials": (None, None), "wrong-password": (etcd_user[0], wrong),
                      "unknown-user": ("nobody", wrong)}[case]
    url = secure_etcd.url(user, password, tls=tls)
    assert_refused(lambda: _connect(url), url, secrets=[wrong, etcd_user[1]], expect=StoreError,
                   bound_s=BOUND_S)
    assert_no_secret(all_logs.text, [wrong, etcd_user[1], secure_etcd.root_password],
                     "the logs")


@pytest.mark.parametrize("case", ["untrusted-server", "rogue-client-cert", "no-client-cert",
                                  "expired-client-cert", "no-ca"])
def test_untrusted_certificates_refused(secure_etcd: SecureEtcd, etcd_user: tuple[str, str],
                                        case: str, all_logs: pytest.LogCaptureFixture) -> None:
    pki = secure_etcd.pki
    query = {
        "untrusted-server": {"ca_cert": str(pki.rogue_ca)},
        "rogue-client-cert": {"cert_cert": str(pki.rogue_client_cert),
                              "cert_key": str(pki.rogue_client_key)},
        "no-client-cert": {"cert_cert": "", "cert_key": ""},
        "expired-client-cert": {"cert_cert": str(pki.expired_client_cert),
                                "cert_key": str(pki.expired_client_key)},
        "no-ca": {"ca_cert": ""},
    }[case]
    url = secure_etcd.url(*etcd_user, **query)
    assert_refused(lambda: _connect(url), url, secrets=[etcd_user[1]], expect=REFUSED,
                   bound_s=BOUND_S)
    assert_no_secret(all_logs.text, [etcd_user[1]], "the logs")


def test_plain_to_tls_listener_is_bounded(secure_etcd: SecureEtcd,
                                          etcd_user: tuple[str, str]) -> None:
    url = f"etcd://{etcd_user[0]}:{etcd_user[1]}@127.0.0.1:{secure_etcd.https_port}"
    assert_refused(lambda: _connect(url, timeout_s=SILENT_TIMEOUT_S), url,
                   secrets=[etcd_user[1]], expect=REFUSED, bound_s=BOUND_S)


def test_tls_to_plain_listener_is_bounded(secure_etcd: SecureEtcd,
                                          etcd_user: tuple[str, str]) -> None:
    url = secure_etcd.url(*etcd_user).replace(str(secure_etcd.https_port),
                                              str(secure_etcd.http_port), 1)
    assert_refused(lambda: _connect(url, timeout_s=SILENT_TIMEOUT_S), url,
                   secrets=[etcd_user[1]], expect=REFUSED, bound_s=BOUND_S)


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
def test_silent_peer_is_bounded(blackhole: int, secure_etcd: SecureEtcd, tls: bool) -> None:
    password = _fresh_secret()
    if tls:
        pki = secure_etcd.pki
        url = (f"etcd+https://crawler:{password}@127.0.0.1:{blackhole}?ca_cert="
               f"{quote(str(pki.ca), safe='')}")
    else:
        url = f"etcd://crawler:{password}@127.0.0.1:{blackhole}"
    assert_refused(lambda: _connect(url, timeout_s=SILENT_TIMEOUT_S), url,
                   secrets=[password], expect=REFUSED, bound_s=BOUND_S)


def test_missing_tls_file_is_a_clear_error(secure_etcd: SecureEtcd,
                                           etcd_user: tuple[str, str]) -> None:
    url = secure_etcd.url(*etcd_user, ca_cert=str(secure_etcd.dir / "no-such-ca.pem"))
    with pytest.raises(CrawlError) as info:
        _connect(url)
    assert "no-such-ca.pem" in exception_text(info.value)
    assert_no_secret(exception_text(info.value), [etcd_user[1]], "the exception")


def test_unknown_tls_option_is_refused_not_ignored(secure_etcd: SecureEtcd,
                                                   etcd_user: tuple[str, str]) -> None:
    url = secure_etcd.url(*etcd_user, ca_certs="typo.pem")
    with pytest.raises(ConfigError) as info:
        _connect(url)
    assert "ca_certs" in str(info.value)
    assert_no_secret(exception_text(info.value), [etcd_user[1]], "the exception")


# -- authentication tokens ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_token_etcd(pki: Pki) -> Iterator[SecureEtcd]:
    """etcd whose auth tokens expire after 1 s without use (the default is 300 s)."""
    server = SecureEtcd(pki, auth_token_ttl_s=1)
    server.start()
    yield server
    server.cleanup()


def test_store_authenticates_again_when_its_token_expires(short_token_etcd: SecureEtcd) -> None:
    """etcd drops a ``simple`` auth token after ``--auth-token-ttl`` without use (300 s by
    default: a partition of five minutes). A long-lived beat or worker must authenticate
    again, not fail every call with "invalid auth token" until someone restarts it."""
    user, password = make_documented_user(short_token_etcd, "sec")
    store = open_store(short_token_etcd.url(user, password), namespace="sec",
                       timeout_s=TIMEOUT_S)
    witness = _raw_client(short_token_etcd, user, password)
    try:
        store.put("before-idle", {"n": 1})
        held = store.acquire("held", 30.0, "idle:1:x")
        assert held is not None
        witness.get("sec:witness")
        time.sleep(2.5)  # the fault: idleness past the token TTL (checked every second)
        with pytest.raises(Exception, match="auth token"):  # the fault really happened
            witness.get("sec:witness")
        # First after the idle: pipelined claim transactions, all sent with the lapsed token.
        assert all(store.claim_many(held, [(f"task:{i}", {}) for i in range(600)]))
        assert store.get("before-idle") == {"n": 1}
        lease = store.acquire("after-idle", 3.0, "idle:1:x")
        assert lease is not None
        store.renew(lease)
        store.release(lease)
        store.release(held)
    finally:
        store.close()
        witness.close()


def _raw_client(server: SecureEtcd, user: str, password: str) -> Any:
    """A python-etcd3 client that authenticates once and never again."""
    from celery_crawl.leases.etcd import python_etcd3

    return python_etcd3().client("127.0.0.1", server.https_port, ca_cert=str(server.pki.ca),
                        cert_key=str(server.pki.client_key),
                        cert_cert=str(server.pki.client_cert), user=user, password=password,
                        timeout=5)
