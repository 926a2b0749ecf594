"""The crawler's parts without Celery: fetcher, politeness script, sink, settings, backoff.

Real servers only: the demo site on loopback and a private redis-server.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest

from celery_crawl.errors import ConfigError, FencedError
from tests.procs import ROOT
from tests.servers import RedisServer
from workers.crawler import backoff_s
from workers.demo_site import DemoProxy, DemoSite
from workers.http import Fetcher, FetchError, parse_retry_after
from workers.links import parse_page
from workers.politeness import Politeness, PolitenessBusy, domain_of
from workers.settings import CrawlerSettings
from workers.sink import PageRecord, Sink


@pytest.fixture(scope="module")
def site() -> Iterator[DemoSite]:
    s = DemoSite().start()
    yield s
    s.stop()


def _settings(**env: str) -> CrawlerSettings:
    return CrawlerSettings.from_env({"CRAWL_READ_TIMEOUT": "1", "CRAWL_FETCH_TIMEOUT": "2",
                                     "CRAWL_MAX_BYTES": "100000", **env})


@pytest.mark.parametrize(("path", "reason", "retryable"), [
    ("/stall?s=20", "timeout", True),
    ("/slow?s=10", "timeout", True),
    ("/reset", "network", True),
    ("/huge?mb=2", "too-large", False),
    ("/huge?mb=2&cl=1", "too-large", False),
    ("/binary", "content-type", False),
    ("/loop/0", "redirects", False),
    ("/nope", "status-404", False),
    ("/forbidden/x", "forbidden", True),
])
def test_fetch_failures_are_classified_and_bounded(site: DemoSite, path: str, reason: str,
                                                   retryable: bool) -> None:
    fetcher = Fetcher(_settings())
    started = time.monotonic()
    with pytest.raises(FetchError) as err:
        fetcher.fetch(site.url + path)
    assert (err.value.reason, err.value.retryable) == (reason, retryable)
    assert time.monotonic() - started < 2.0 * 3  # the 2 s fetch budget, with headroom
    fetcher.close()


def test_fetch_through_the_proxy_and_retry_after(site: DemoSite) -> None:
    proxy = DemoProxy().start()
    try:
        fetcher = Fetcher(_settings())
        page = fetcher.fetch(f"{site.url}/forbidden/p", proxy=proxy.url)
        assert page.status == 200 and page.proxy == proxy.url
        with pytest.raises(FetchError) as err:
            fetcher.fetch(f"{site.url}/limited/c?retry_after=7")
        assert err.value.retry_after_s == 7.0
        fetcher.close()
    finally:
        proxy.stop()


def test_retry_after_forms() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30), usegmt=True),
                             now=now) == 30.0
    assert parse_retry_after(format_datetime(now - timedelta(seconds=30), usegmt=True),
                             now=now) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    rng = random.Random(7)
    for retries in range(10):
        step = min(8.0, 0.5 * 2 ** retries)
        value = backoff_s(retries, base_s=0.5, max_s=8.0, rng=rng)
        assert step / 2 <= value <= step
    assert len({round(backoff_s(3, base_s=1, max_s=60, rng=rng), 6) for _ in range(20)}) > 1


def test_politeness_rate_is_shared_by_concurrent_callers(redis_server: RedisServer) -> None:
    limiters = [Politeness(redis_server.client(), namespace="comp-rate", rate_per_s=10, burst=2,
                           concurrency=0, slot_ttl_s=5) for _ in range(3)]
    stamps: list[float] = []
    lock = threading.Lock()

    def run(limiter: Politeness) -> None:
        for _ in range(6):
            limiter.acquire("example.com", budget_s=10)
            with lock:
                stamps.append(time.monotonic())

    threads = [threading.Thread(target=run, args=(lim,)) for lim in limiters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    stamps.sort()
    assert len(stamps) == 18
    # 18 tokens at 10/s with a burst of 2: at least 1.6 s from the first to the last.
    assert stamps[-1] - stamps[0] >= 1.6 - 0.05
    # Another domain is not slowed down by this one.
    assert limiters[0].try_acquire("other.example", "h")[0]


def test_politeness_concurrency_cap_and_expiry(redis_server: RedisServer) -> None:
    lim = Politeness(redis_server.client(), namespace="comp-cap", rate_per_s=1000, burst=100,
                     concurrency=2, slot_ttl_s=0.5)
    a = lim.acquire("d", budget_s=1)
    lim.acquire("d", budget_s=1)
    granted, _, reason = lim.try_acquire("d", "third")
    assert (granted, reason) == (False, "concurrency")
    lim.release(a)
    assert lim.try_acquire("d", "third")[0]
    # A holder that never releases (a killed worker) frees its slot after slot_ttl_s.
    slot = lim.acquire("d", budget_s=2)
    assert slot.waited_s > 0.1
    slow = Politeness(redis_server.client(), namespace="comp-slow", rate_per_s=0.1, burst=1,
                      concurrency=0, slot_ttl_s=1)
    slow.acquire("d", budget_s=0.2)
    with pytest.raises(PolitenessBusy, match="rate limit"):
        slow.acquire("d", budget_s=0.2)  # the next token is 10 s away: refuse, do not sleep
    assert domain_of("HTTP://Example.COM:8080/x") == "example.com:8080"


def test_sink_fences_older_tokens_and_counts_duplicate_runs(tmp_path: Path) -> None:
    sink = Sink(str(tmp_path / "s.sqlite3"))
    sink.upsert(PageRecord(url="u", outcome="ok", title="v1"), 5)
    sink.upsert(PageRecord(url="u", outcome="ok", title="v1 again"), 5)  # same run retrying
    with pytest.raises(FencedError, match="token 4 refused, the row holds token 5"):
        sink.upsert(PageRecord(url="u", outcome="ok", title="stale"), 4)
    sink.upsert(PageRecord(url="u", outcome="ok", title="v2"), 9)
    row = sink.page("u")
    assert row is not None and (row["title"], row["token"], row["writes"]) == ("v2", 9, 3)
    assert sink.record_run("e", "2026-01-01T00:00:00Z", "t1", 1)
    assert sink.record_run("e", "2026-01-01T00:00:00Z", "t1", 1)  # its own redelivery
    assert not sink.record_run("e", "2026-01-01T00:00:00Z", "t2", 2)
    summary = sink.summary()
    assert summary["runs"] == {"e": (1, 1)} and summary["refused_writes"] == 1
    with pytest.raises(ConfigError, match="CRAWL_SINK"):
        Sink(":memory:")


@pytest.mark.parametrize(("env", "message"), [
    ({"REDIS_URL": "http://x"}, "REDIS_URL"),
    ({"CRAWL_RATE": "fast"}, "CRAWL_RATE: expected a number"),
    ({"CRAWL_RATE": "0"}, "CRAWL_RATE: must be > 0"),
    ({"CRAWL_PROXIES": "direct,ftp://p"}, "CRAWL_PROXIES"),
    ({"CRAWL_READ_TIMEOUT": "soon"}, "CRAWL_READ_TIMEOUT"),
    ({"CRAWL_METRICS_PORT": "99999"}, "CRAWL_METRICS_PORT"),
    ({"CRAWL_METRICS_ADDR": "everywhere"}, "CRAWL_METRICS_ADDR"),
    ({"ETCD_URL": "zk://x:1"}, "ETCD_URL"),
    ({"CRAWL_NAMESPACE": "a b"}, "CRAWL_NAMESPACE"),
    ({"CRAWL_VERIFY_DELIVERY": "0.5"}, "CRAWL_VERIFY_DELIVERY: 0.5s is too short"),
    ({"CRAWL_VERIFY_DELIVERY": "-3"}, "CRAWL_VERIFY_DELIVERY: must be positive"),
])
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CrawlerSettings.from_env(env)


def test_settings_defaults_and_lease_url_choice() -> None:
    s = CrawlerSettings.from_env({"ETCD_URL": "http://etcd:2379/"})
    assert s.lease_url == "etcd://etcd:2379" and s.proxies == ("direct",)
    conf = s.celery_conf(audited_backend=True)
    assert conf["result_backend"] == "crawlredis://127.0.0.1:6379/0"
    assert conf["task_acks_late"] is True
    assert conf["crawl_beat_verify_delivery"] == 30.0
    off = CrawlerSettings.from_env({"CRAWL_VERIFY_DELIVERY": "0"})
    assert off.celery_conf(audited_backend=True)["crawl_beat_verify_delivery"] == 0.0


def test_links_are_absolute_same_host_and_unique() -> None:
    html = ('<title> A  page </title><a href="/a#x">1</a><a href="/a">2</a>'
            '<a href="http://other/b">3</a><a href="mailto:x@y">4</a><a href="c?q=1">5</a>')
    title, links = parse_page("http://h:1/dir/", html)
    assert title == "A page"
    assert links == ["http://h:1/a", "http://h:1/dir/c?q=1"]


def test_a_misconfigured_worker_stops_with_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import workers.crawler"], capture_output=True, text=True,
        timeout=60, cwd=str(tmp_path),
        env={**os.environ, "CRAWL_PROXIES": "direct,ftp://nope", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "workers.crawler: configuration error: CRAWL_PROXIES: 'ftp://nope' is not a URL with "
        "scheme http | https | socks5"]
