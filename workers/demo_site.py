"""A small local site that misbehaves on purpose, and a forward proxy in front of it.

``celery-crawl up`` and the tests crawl it; it answers over real HTTP on loopback:

=============================  ==============================================================
``/``                          home page linking to the listings and the difficult pages
``/listing/<name>?n=N``        a listing linking to ``/item/<name>/<i>`` for i in 1..N
                               (``&item_delay=S``: links ask the items to answer slowly;
                               ``&pages=P``: pages 1..P, each linking to the next)
``/item/<name>/<i>?delay=S``   an item page (optionally answering after S seconds)
``/limited/<key>?after=N``     429 with ``Retry-After`` (``&retry_after=S``, default 1) for the
                               first N hits of ``key`` (default 1), then 200
``/unavailable/<key>?after=N`` 503 without ``Retry-After`` for the first N hits, then 200
``/forbidden/<key>``           403 unless the request came through the proxy (its ``Via``)
``/slow?s=S``                  headers at once, then one byte every 0.5 s for S seconds
``/stall``                     headers, then nothing for a minute
``/reset``                     the connection is reset (RST) before any answer
``/huge?mb=N&cl=0``            an N MiB page, chunked (``cl=1``: with Content-Length)
``/binary``                    an ``image/png`` body
``/loop/<i>``                  redirects to ``/loop/<i+1>`` forever
``/hits``                      JSON: every request seen (path, start and end wall time, via)
=============================  ==============================================================

The proxy (``DemoProxy``) is a plain HTTP forward proxy: it takes absolute-form requests,
fetches the target and adds ``Via: 1.1 crawl-demo-proxy``.

Run both: ``python -m workers.demo_site --port 8000 --proxy-port 8001``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import signal
import socket
import struct
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["PROXY_VIA", "DemoProxy", "DemoSite", "main"]

#: What the proxy adds to ``Via``; ``/forbidden`` pages are served only when it is present.
PROXY_VIA = "1.1 crawl-demo-proxy"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client closing or resetting its keep-alive connection is normal, not an error.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Base:
    """Start/stop plumbing shared by the site and the proxy."""

    handler: type[BaseHTTPRequestHandler]

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = _Server((host, port), self.handler)
        self.server.owner = self  # type: ignore[attr-defined]
        self.host = host
        self.port = int(self.server.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> _Base:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        self.server.shutdown()
        self.server.server_close()


class _SiteHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "crawl-demo/0.1"

    def log_message(self, format: str, *args: Any) -> None:
        if getattr(self.server.owner, "verbose", False):  # type: ignore[attr-defined]
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def _send(self, status: int, body: bytes, ctype: str = "text/html; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _html(self, title: str, links: list[str] = (), status: int = 200,  # type: ignore[assignment]
              headers: dict[str, str] | None = None) -> None:
        items = "".join(f'<li><a href="{href}">{href}</a></li>' for href in links)
        body = (f"<!doctype html><html><head><title>{title}</title></head>"
                f"<body><h1>{title}</h1><ul>{items}</ul></body></html>").encode()
        self._send(status, body, headers=headers)

    def do_GET(self) -> None:
        site: DemoSite = self.server.owner  # type: ignore[attr-defined]
        parts = urlsplit(self.path)
        path = parts.path
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        via = PROXY_VIA in self.headers.get("Via", "")
        hit = site.record(path, via, self.headers.get("Accept-Language"))
        segs = [s for s in path.split("/") if s]
        try:
            self._route(site, segs, query, via)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            hit["end"] = time.time()

    def _route(self, site: DemoSite, segs: list[str], query: dict[str, str], via: bool) -> None:
        head = segs[0] if segs else ""
        if not segs:
            self._html("crawl demo", ["/listing/news?n=5", "/listing/shop?n=5", "/limited/home",
                                      "/forbidden/home", "/slow?s=1"])
        elif head == "listing" and len(segs) == 2:
            n = int(query.get("n", "5"))
            suffix = f"?delay={query['item_delay']}" if "item_delay" in query else ""
            page, pages = int(query.get("page", "1")), int(query.get("pages", "1"))
            links = [f"/item/{segs[1]}/{(page - 1) * n + i}{suffix}" for i in range(1, n + 1)]
            if page < pages:
                links.append(f"/listing/{segs[1]}?n={n}&pages={pages}&page={page + 1}")
            self._html(f"listing {segs[1]} page {page}", links)
        elif head == "item" and len(segs) == 3:
            delay = float(query.get("delay", "0"))
            if delay:
                time.sleep(delay)
            self._html(f"item {segs[1]} {segs[2]}")
        elif head == "limited" and len(segs) == 2:
            if site.count(f"limited/{segs[1]}") <= int(query.get("after", "1")):
                self._html("slow down", status=429,
                           headers={"Retry-After": query.get("retry_after", "1")})
            else:
                self._html(f"limited {segs[1]}")
        elif head == "unavailable" and len(segs) == 2:
            if site.count(f"unavailable/{segs[1]}") <= int(query.get("after", "1")):
                self._html("unavailable", status=503)
            else:
                self._html(f"available {segs[1]}")
        elif head == "forbidden" and len(segs) == 2:
            if via:
                self._html(f"welcome {segs[1]}")
            else:
                self._html("forbidden", status=403)
        elif head == "slow":
            self._drip(float(query.get("s", "5")))
        elif head == "stall":
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.flush()
            time.sleep(float(query.get("s", "60")))
            self.close_connection = True
        elif head == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
        elif head == "huge":
            self._huge(float(query.get("mb", "5")), query.get("cl", "0") == "1")
        elif head == "binary":
            self._send(200, b"\x89PNG\r\n\x1a\n" + bytes(1024), ctype="image/png")
        elif head == "loop" and len(segs) == 2:
            self.send_response(302)
            self.send_header("Location", f"/loop/{int(segs[1]) + 1}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif head == "hits":
            self._send(200, json.dumps(site.hits()).encode(), ctype="application/json")
        else:
            self._html("not found", status=404)

    def _drip(self, seconds: float) -> None:
        ticks = max(1, int(seconds / 0.5))
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(ticks))
        self.end_headers()
        for _ in range(ticks):
            self.wfile.write(b" ")
            self.wfile.flush()
            time.sleep(0.5)

    def _huge(self, mib: float, with_length: bool) -> None:
        total = int(mib * 1024 * 1024)
        chunk = (b"<p>" + b"x" * 1017 + b"</p>\n") * 64  # 64 KiB of "HTML"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        if with_length:
            self.send_header("Content-Length", str(total))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        while sent < total:
            part = chunk[: total - sent]
            if with_length:
                self.wfile.write(part)
            else:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            sent += len(part)
        if not with_length:
            self.wfile.write(b"0\r\n\r\n")


class DemoSite(_Base):
    """The site; ``hits()`` lists every request, for tests and the ``up`` summary."""

    handler = _SiteHandler

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False) -> None:
        super().__init__(host, port)
        self.verbose = verbose
        self._lock = threading.Lock()
        self._hits: list[dict[str, Any]] = []
        self._counts: Counter[str] = Counter()

    def record(self, path: str, via: bool, lang: str | None = None) -> dict[str, Any]:
        """Log one request; the handler sets the returned record's ``end`` when it is done."""
        hit: dict[str, Any] = {"path": path, "at": time.time(), "end": None, "via": via,
                               "lang": lang}
        with self._lock:
            self._hits.append(hit)
            self._counts["/".join(s for s in path.split("/") if s)] += 1
        return hit

    def count(self, key: str) -> int:
        """How many times the page ``key`` (path without slashes at the ends) was requested."""
        with self._lock:
            return self._counts[key]

    def hits(self, prefix: str = "") -> list[dict[str, Any]]:
        """Requests seen so far whose path starts with ``prefix``."""
        with self._lock:
            return [dict(h) for h in self._hits if h["path"].startswith(prefix)]


_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailers", "transfer-encoding", "upgrade", "proxy-connection", "content-length"}


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "crawl-demo-proxy/0.1"

    def log_message(self, format: str, *args: Any) -> None:
        if getattr(self.server.owner, "verbose", False):  # type: ignore[attr-defined]
            sys.stderr.write("proxy %s\n" % (format % args))

    def do_GET(self) -> None:
        proxy: DemoProxy = self.server.owner  # type: ignore[attr-defined]
        target = urlsplit(self.path)
        if target.scheme != "http" or not target.hostname:
            self.send_error(400, "absolute http:// URL required (forward proxy)")
            return
        proxy.forwarded += 1
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Via"] = ", ".join(filter(None, [self.headers.get("Via"), PROXY_VIA]))
        conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=30)
        try:
            conn.request("GET", target.path + (f"?{target.query}" if target.query else ""),
                         headers=headers)
            upstream = conn.getresponse()
            body = upstream.read(64 * 1024 * 1024)
        except (OSError, http.client.HTTPException) as exc:
            self.send_error(502, f"upstream: {exc}")
            return
        finally:
            conn.close()
        self.send_response(upstream.status)
        for name, value in upstream.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Via", PROXY_VIA)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)


class DemoProxy(_Base):
    """A forward HTTP proxy (absolute-form GET only), counting what it forwarded."""

    handler = _ProxyHandler

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False) -> None:
        self.verbose = verbose
        self.forwarded = 0
        super().__init__(host, port)


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.demo_site``: serve the site (and the proxy) until SIGTERM/Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m workers.demo_site",
                                     description="Local demo site for the crawler.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--proxy-port", type=int, default=None,
                        help="also run the forward proxy on this port")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    try:
        site = DemoSite(args.host, args.port, verbose=args.verbose).start()
        proxy = (DemoProxy(args.host, args.proxy_port, verbose=args.verbose).start()
                 if args.proxy_port is not None else None)
    except OSError as exc:
        print(f"demo site: cannot listen on {args.host}: {exc}", file=sys.stderr)
        return 2
    print(f"demo site on {site.url}" + (f", forward proxy on {proxy.url}" if proxy else ""),
          flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    site.stop()
    if proxy is not None:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
