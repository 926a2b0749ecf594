"""Store URLs with hostile passwords: masking never raises and never shows any part of the
password, whether the password is percent-encoded (as it should be) or typed raw with ``#``,
``/``, ``?`` or ``@`` in it (a common mistake that breaks URL parsing), or passed as a query
option. Opening such a URL fails, if it fails, with a ``CrawlError`` that hides it too.
"""

from __future__ import annotations

import socket
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_crawl.config import CrawlConfig, mask_url
from celery_crawl.errors import ConfigError, CrawlError
from celery_crawl.leases import open_store
from tests.security.leaks import exception_text

HEAD, TAIL = "Zq7", "7qZ"  # ends of every generated password; neither may survive masking

schemes = st.sampled_from(["redis", "rediss", "etcd", "etcd+http", "etcd+https", "crawlredis",
                           "crawlrediss"])
users = st.sampled_from(["", "crawler", "team-a", "u%40x"])
cores = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
encodings = st.sampled_from(["encoded", "raw"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CLOSED = _closed_port()
hosts = st.sampled_from([f"127.0.0.1:{CLOSED}", "localhost", f"[::1]:{CLOSED}",
                         f"127.0.0.1:{CLOSED},127.0.0.1:{CLOSED}", "127.0.0.1:99999",
                         "127.0.0.1:port"])


def _url(scheme: str, user: str, password: str, host: str, encoding: str) -> str:
    secret = quote(password, safe="") if encoding == "encoded" else password
    path = "/0" if "redis" in scheme else ""
    return f"{scheme}://{user}:{secret}@{host}{path}"


def _assert_hidden(text: str, password: str) -> None:
    for form in {password, quote(password, safe="")}:
        assert form not in text, f"password leaked: {text!r}"
    assert HEAD not in text and TAIL not in text, f"part of the password leaked: {text!r}"


_fuzz = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])


@_fuzz
@given(scheme=schemes, user=users, core=cores, host=hosts, encoding=encodings)
@example(scheme="redis", user="u", core="#", host=f"127.0.0.1:{CLOSED}", encoding="raw")
@example(scheme="redis", user="u", core="/", host=f"127.0.0.1:{CLOSED}", encoding="raw")
@example(scheme="etcd", user="u", core="", host=f"127.0.0.1:{CLOSED},127.0.0.1:{CLOSED}",
         encoding="encoded")
def test_mask_url_hides_every_part_of_the_password(scheme: str, user: str, core: str,
                                                   host: str, encoding: str) -> None:
    password = HEAD + core + TAIL
    masked = mask_url(_url(scheme, user, password, host, encoding))
    _assert_hidden(masked, password)


@pytest.mark.parametrize("option", ["password"])
def test_mask_url_hides_a_password_given_as_query_option(option: str) -> None:
    password = HEAD + "secret" + TAIL
    masked = mask_url(f"redis://127.0.0.1:{CLOSED}/0?{option}={password}&ssl_cert_reqs=none")
    _assert_hidden(masked, password)


def test_mask_url_keeps_ipv6_brackets() -> None:
    assert mask_url("redis://u:secret@[::1]:6380/0") == "redis://u:***@[::1]:6380/0"


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(scheme=schemes.filter(lambda s: not s.startswith("crawl")), user=users, core=cores,
       host=hosts, encoding=encodings)
@example(scheme="etcd", user="u", core="x", host=f"127.0.0.1:{CLOSED},127.0.0.1:{CLOSED}",
         encoding="encoded")
@example(scheme="redis", user="u", core="x", host="127.0.0.1:99999", encoding="encoded")
def test_opening_a_hostile_url_fails_cleanly(scheme: str, user: str, core: str, host: str,
                                             encoding: str) -> None:
    """Nothing listens on these addresses: opening and pinging fails with a CrawlError that
    hides the password, never with a foreign exception."""
    password = HEAD + core + TAIL
    url = _url(scheme, user, password, host, encoding)
    try:
        store = open_store(url, namespace="sec", timeout_s=0.5)
        try:
            store.ping()
        finally:
            store.close()
    except CrawlError as exc:
        _assert_hidden(exception_text(exc), password)
    else:
        pytest.fail(f"pinging a closed port succeeded: {mask_url(url)}")


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(scheme=schemes, user=users, core=cores, host=hosts, encoding=encodings)
def test_config_validation_hides_the_password(scheme: str, user: str, core: str, host: str,
                                              encoding: str) -> None:
    password = HEAD + core + TAIL
    url = _url(scheme, user, password, host, encoding).replace("crawl", "", 1)
    try:
        CrawlConfig.from_mapping({"crawl_lease_url": url, "crawl_namespace": "sec"})
    except ConfigError as exc:
        _assert_hidden(exception_text(exc), password)


@given(url=st.text(max_size=200))
@settings(max_examples=300)
def test_mask_url_never_raises(url: str) -> None:
    assert isinstance(mask_url(url), str)
