"""``CRAWL_ALLOWED_HOSTS``: parsing, matching, and the fetcher's check, which does no I/O."""

from __future__ import annotations

import pytest

from celery_crawl.errors import ConfigError
from workers.http import HOST_NOT_ALLOWED, Fetcher, FetchError
from workers.settings import CrawlerSettings


def _hosts(value: str) -> tuple[str, ...] | None:
    return CrawlerSettings.from_env({"CRAWL_ALLOWED_HOSTS": value}).allowed_hosts


def test_default_and_star_allow_every_host() -> None:
    assert CrawlerSettings.from_env({}).allowed_hosts is None
    assert _hosts("*") is None and _hosts(" * ") is None
    settings = CrawlerSettings.from_env({})
    assert settings.host_allowed("www.newegg.com") and settings.host_allowed("127.0.0.1")


def test_names_are_normalised_and_matched_exactly() -> None:
    assert _hosts("127.0.0.1, LocalHost.,[::1],::1,bücher.de") == (
        "127.0.0.1", "localhost", "::1", "xn--bcher-kva.de")
    settings = CrawlerSettings.from_env({"CRAWL_ALLOWED_HOSTS": "example.com,::1"})
    assert settings.host_allowed("example.com") and settings.host_allowed("EXAMPLE.com.")
    assert settings.host_allowed("::1") and settings.host_allowed("0:0::1")
    assert not settings.host_allowed("www.example.com")
    assert not settings.host_allowed("example.com.evil.test")
    assert not settings.host_allowed("")


@pytest.mark.parametrize(("value", "message"), [
    ("", "CRAWL_ALLOWED_HOSTS: empty"),
    (" , ", "CRAWL_ALLOWED_HOSTS: empty"),
    ("*,localhost", "CRAWL_ALLOWED_HOSTS: .*cannot be combined"),
    ("127.0.0.1:8470", "CRAWL_ALLOWED_HOSTS: '127.0.0.1:8470' is not a host name"),
    ("http://localhost", "CRAWL_ALLOWED_HOSTS: 'http://localhost' is not a host name"),
    ("localhost/x", "CRAWL_ALLOWED_HOSTS: 'localhost/x' is not a host name"),
    ("*.example.com", "CRAWL_ALLOWED_HOSTS: '\\*.example.com' is not a host name"),
    ("a..b", "CRAWL_ALLOWED_HOSTS: 'a..b' is not a host name"),
    ("-a.example", "CRAWL_ALLOWED_HOSTS: '-a.example' is not a host name"),
    ("two words", "CRAWL_ALLOWED_HOSTS: 'two words' is not a host name"),
])
def test_bad_values_name_the_variable(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _hosts(value)


def test_check_host_refuses_without_io_and_the_error_is_not_retryable() -> None:
    fetcher = Fetcher(CrawlerSettings.from_env({"CRAWL_ALLOWED_HOSTS": "127.0.0.1,localhost"}))
    fetcher.check_host("http://127.0.0.1:8470/")
    fetcher.check_host("http://LOCALHOST:8470/x")
    for url, host in [("https://www.newegg.com/todays-deals", "www.newegg.com"),
                      ("http://127.0.0.1@blocked.invalid/", "blocked.invalid"),
                      ("http://127.0.0.2/", "127.0.0.2")]:
        with pytest.raises(FetchError) as err:
            fetcher.check_host(url)
        assert err.value.reason == HOST_NOT_ALLOWED and not err.value.retryable
        assert err.value.detail == f"host {host} is not in CRAWL_ALLOWED_HOSTS"
        assert str(err.value) == f"{url}: {HOST_NOT_ALLOWED} ({err.value.detail})"
    # check_host opens no client, so nothing can have been sent.
    assert fetcher._clients == {}
