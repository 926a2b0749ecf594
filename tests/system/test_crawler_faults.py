"""Workers killed or frozen mid-crawl: no page lost, none written twice, no stale overwrite.

Recovery of a dead worker's tasks comes from the worker plugin's reaper when it is installed,
else from the Redis broker's visibility timeout (set short here); the sink's fencing works either
way, because every write carries the run's token and an older token is refused.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import RedisServer, wait_until
from workers.demo_site import DemoSite

from .crawler_support import client_app, crawler_env, events, rows, start_worker, wait_ready

pytestmark = pytest.mark.system


@pytest.fixture
def site() -> Iterator[DemoSite]:
    s = DemoSite().start()
    yield s
    s.stop()


def _env(redis: RedisServer, tmp: Path) -> dict[str, str]:
    return crawler_env(redis, tmp, CRAWL_RATE="50", CRAWL_BURST="10",
                       CRAWL_DOMAIN_CONCURRENCY="4", CRAWL_VISIBILITY_TIMEOUT="4")


def _assert_fenced_history(sink: Path, urls: list[str]) -> None:
    """Accepted writes per URL never go back in token order, and the row holds the newest."""
    got = rows(sink)
    for url in urls:
        accepted = [e["token"] for e in events(sink) if e["url"] == url and e["accepted"]]
        assert accepted, url
        assert accepted == sorted(accepted), (url, accepted)
        assert got[url]["token"] == accepted[-1]


def test_worker_killed_mid_crawl_loses_and_duplicates_nothing(
        fresh_redis: RedisServer, site: DemoSite, tmp_path: Path) -> None:
    env = _env(fresh_redis, tmp_path)
    victim = start_worker("victim", env, tmp_path, concurrency=1)
    survivor = None
    try:
        wait_ready(victim)
        listing = f"{site.url}/listing/k?n=5&item_delay=0.6"
        client_app(env).send_task("workers.crawler.crawl_listing", args=[listing])
        # Kill it while it is inside a fetch, after it has stored a few pages.
        wait_until(lambda: len(site.hits("/item/k/")) >= 2
                   and site.hits("/item/k/")[-1]["end"] is None, 30,
                   what="the victim inside its second fetch")
        in_flight = site.hits("/item/k/")[-1]["path"]
        victim.kill9()
        survivor = start_worker("survivor", env, tmp_path, concurrency=1)
        items = [f"{site.url}/item/k/{i}?delay=0.6" for i in range(1, 6)]
        sink = tmp_path / "sink.sqlite3"
        wait_until(lambda: all(rows(sink).get(u, {}).get("outcome") == "ok" for u in items),
                   60, what="every item page stored after the kill")
        got = rows(sink)
        assert sorted(got) == sorted([listing, *items])  # nothing lost, nothing extra
        # The page being fetched when the worker died was fetched again by the survivor.
        assert [h["path"] for h in site.hits("/item/k/")].count(in_flight) == 2
        _assert_fenced_history(sink, [listing, *items])
        # No duplicate upserts: one accepted write per URL, in the event log and in the row's
        # own count (the killed fetch never reached the sink; the re-run wrote once).
        for url in [listing, *items]:
            accepted = [e for e in events(sink) if e["url"] == url and e["accepted"]]
            assert len(accepted) == 1, (url, accepted)
            assert got[url]["writes"] == 1, (url, got[url])
    finally:
        victim.stop()
        if survivor is not None:
            survivor.stop()


def test_frozen_worker_cannot_overwrite_the_newer_result(
        fresh_redis: RedisServer, site: DemoSite, tmp_path: Path) -> None:
    env = _env(fresh_redis, tmp_path)
    frozen = start_worker("frozen", env, tmp_path, concurrency=1)
    other = None
    try:
        wait_ready(frozen)
        url = f"{site.url}/item/frz/1?delay=1.5"
        client_app(env).send_task("workers.crawler.crawl_item", args=[url])
        wait_until(lambda: site.hits("/item/frz/"), 30, what="the first fetch started")
        frozen.signal_group(signal.SIGSTOP)
        # Started only now: a worker idle in BRPOP while another is frozen could be handed
        # the message itself, and this test is about the hand-over from a frozen worker.
        other = start_worker("other", env, tmp_path, concurrency=1)
        sink = tmp_path / "sink.sqlite3"
        wait_until(lambda: rows(sink).get(url, {}).get("outcome") == "ok", 60,
                   what="the redelivered run stored the page")
        newer = rows(sink)[url]["token"]
        frozen.signal_group(signal.SIGCONT)
        # The stale run either gets cancelled by its worker or is refused by the sink; in
        # both cases the row keeps the newer run's token.
        wait_until(lambda: "stale write refused" in frozen.log() or
                   "worker lease lost" in frozen.log(), 30,
                   what="the stale run refused or cancelled")
        assert rows(sink)[url]["token"] == newer
        assert len(rows(sink)) == 1
        _assert_fenced_history(sink, [url])
        assert len(site.hits("/item/frz/")) == 2
    finally:
        frozen.stop()
        if other is not None:
            other.stop()
