"""``CRAWL_ALLOWED_HOSTS`` against real servers on loopback: the fetcher, then a real worker.

The server below counts every connection it accepts and every request with its ``Host``, so a
refusal can be shown to have happened before any connection. ``localhost`` and ``127.0.0.1``
reach the same server; with only ``127.0.0.1`` allowed, a URL naming ``localhost`` would
connect if the check were missing, which is what makes it a test. ``blocked.invalid`` never
resolves, so its refusal must be the allow-list's, not a DNS error.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.servers import RedisServer, wait_until
from workers.demo_site import DemoProxy
from workers.http import HOST_NOT_ALLOWED, Fetcher, FetchError
from workers.settings import CrawlerSettings

from .crawler_support import client_app, crawler_env, rows, start_worker, wait_ready

pytestmark = pytest.mark.system


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        server: _CountingServer = self.server  # type: ignore[assignment]
        parts = urlsplit(self.path)
        with server.lock:
            server.requests.append((self.headers.get("Host", ""), parts.path))
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        segs = [s for s in parts.path.split("/") if s]
        if segs[:1] == ["to"]:  # /to?url=U: 302 to U
            self._send(302, b"", {"Location": query["url"]})
        elif segs[:1] == ["chain"] and len(segs) == 2:  # /chain/N: N hops, then ?end=U
            n = int(segs[1])
            target = f"/chain/{n - 1}?{parts.query}" if n > 0 else query.get("end", "/page")
            self._send(302, b"", {"Location": target})
        else:
            self._send(200, b"<html><head><title>local</title></head><body>ok</body></html>",
                       {"Content-Type": "text/html"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _CountingServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.connections = 0
        self.requests: list[tuple[str, str]] = []  # (Host header, path)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        # Called once for every accepted connection, before any request is read from it.
        with self.lock:
            self.connections += 1
        return True

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def seen(self) -> tuple[int, list[tuple[str, str]]]:
        with self.lock:
            return self.connections, list(self.requests)

    def reset(self) -> None:
        with self.lock:
            self.connections, self.requests = 0, []


@pytest.fixture(scope="module")
def server() -> Iterator[_CountingServer]:
    srv = _CountingServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def local(server: _CountingServer) -> Iterator[_CountingServer]:
    server.reset()
    yield server


def _fetcher(allowed: str, **env: str) -> Fetcher:
    return Fetcher(CrawlerSettings.from_env({"CRAWL_ALLOWED_HOSTS": allowed,
                                             "CRAWL_FETCH_TIMEOUT": "5", **env}))


def _refused(fetcher: Fetcher, url: str, proxy: str = "direct") -> FetchError:
    with pytest.raises(FetchError) as err:
        fetcher.fetch(url, proxy=proxy)
    assert err.value.reason == HOST_NOT_ALLOWED, err.value
    assert err.value.retryable is False and err.value.status is None
    return err.value


def test_a_disallowed_host_is_refused_without_any_connection(local: _CountingServer) -> None:
    fetcher = _fetcher("127.0.0.1")
    err = _refused(fetcher, "http://blocked.invalid/todays-deals")
    assert err.detail == "host blocked.invalid is not in CRAWL_ALLOWED_HOSTS"
    # localhost is the same server: refused all the same, and it saw no connection.
    err = _refused(fetcher, f"http://localhost:{local.port}/page")
    assert err.detail == "host localhost is not in CRAWL_ALLOWED_HOSTS"
    # The host checked is the target's, never the proxy's: an allowed proxy changes nothing.
    proxy = DemoProxy().start()
    try:
        _refused(fetcher, f"http://localhost:{local.port}/page", proxy=proxy.url)
        assert proxy.forwarded == 0
    finally:
        proxy.stop()
        fetcher.close()
    assert local.seen() == (0, [])


def test_a_redirect_to_a_disallowed_host_is_refused_at_the_hop(local: _CountingServer) -> None:
    fetcher = _fetcher("127.0.0.1")
    base = f"http://127.0.0.1:{local.port}"
    landing = f"http://localhost:{local.port}/landing"
    err = _refused(fetcher, f"{base}/to?url={landing}")
    assert err.url == f"{base}/to?url={landing}"
    assert err.detail == (f"redirect 1 to {landing}: host localhost is not in "
                          "CRAWL_ALLOWED_HOSTS")
    # The allowed server answered the redirect; its Location was never requested.
    connections, requests = local.seen()
    assert requests == [(f"127.0.0.1:{local.port}", "/to")] and connections == 1
    # Every hop is checked, not only the first: two allowed hops, then the refused one.
    local.reset()
    err = _refused(fetcher, f"{base}/chain/2?end=https://www.newegg.com/todays-deals")
    assert err.detail == ("redirect 3 to https://www.newegg.com/todays-deals: "
                          "host www.newegg.com is not in CRAWL_ALLOWED_HOSTS")
    assert [path for _, path in local.seen()[1]] == ["/chain/2", "/chain/1", "/chain/0"]
    fetcher.close()


def test_allowed_hosts_are_fetched_and_redirects_stay_bounded(local: _CountingServer) -> None:
    fetcher = _fetcher("127.0.0.1,localhost", CRAWL_MAX_REDIRECTS="3")
    base = f"http://127.0.0.1:{local.port}"
    page = fetcher.fetch(f"{base}/page")
    assert page.status == 200 and page.url == f"{base}/page" and b"ok" in page.body
    # Redirects between allowed hosts are followed; the page is the last hop's.
    page = fetcher.fetch(f"{base}/to?url=http://localhost:{local.port}/landing")
    assert page.url == f"http://localhost:{local.port}/landing"
    assert local.seen()[1][-1] == (f"localhost:{local.port}", "/landing")
    # The bound still holds when the hops are followed one by one: 1 request + 3 redirects.
    local.reset()
    with pytest.raises(FetchError) as err:
        fetcher.fetch(f"{base}/chain/10")
    assert (err.value.reason, err.value.retryable) == ("redirects", False)
    assert len(local.seen()[1]) == 4
    fetcher.close()
    # The default (*) refuses nothing.
    fetcher = Fetcher(CrawlerSettings.from_env({}))
    assert fetcher.fetch(f"http://localhost:{local.port}/page").status == 200
    fetcher.close()


def test_a_worker_records_a_refusal_once_and_never_retries_it(
        tmp_path: Path, redis_server: RedisServer, local: _CountingServer) -> None:
    env = crawler_env(redis_server, tmp_path, db=7, CRAWL_ALLOWED_HOSTS="127.0.0.1",
                      CRAWL_MAX_RETRIES="3")
    worker = start_worker("hosts", env, tmp_path)
    try:
        wait_ready(worker)
        app = client_app(env)
        base = f"http://127.0.0.1:{local.port}"
        refused = {
            "https://www.newegg.com/todays-deals": "host www.newegg.com is not",
            f"http://localhost:{local.port}/page": "host localhost is not",
            f"{base}/to?url=http://localhost:{local.port}/landing": "redirect 1 to ",
        }
        allowed = f"{base}/page"
        app.send_task("workers.crawler.crawl_listing", args=[next(iter(refused))],
                      kwargs={"max_pages": 5})
        for url in [*list(refused)[1:], allowed]:
            app.send_task("workers.crawler.crawl_item", args=[url])
        got = wait_until(lambda: (r := rows(tmp_path / "sink.sqlite3"))
                         and all(u in r for u in [*refused, allowed]) and r,
                         60, what="every URL recorded in the sink")
    finally:
        worker.stop(grace_s=15)
    assert got[allowed]["outcome"] == "ok"
    log = worker.log()
    for url, detail in refused.items():
        assert got[url]["outcome"] == f"failed:{HOST_NOT_ALLOWED}" and got[url]["status"] is None
        lines = [x for x in log.splitlines() if f"give up {url}: " in x]
        assert len(lines) == 1, log[-5000:]
        assert f"{HOST_NOT_ALLOWED}: " in lines[0] and detail in lines[0]
        assert "is not in CRAWL_ALLOWED_HOSTS (not retryable)" in lines[0]
        assert f"retry {url} " not in log
    # Only the allowed page and the allowed redirect reached the server, never localhost.
    requests = local.seen()[1]
    assert sorted(path for _, path in requests) == ["/page", "/to"]
    assert all(host == f"127.0.0.1:{local.port}" for host, _ in requests)
