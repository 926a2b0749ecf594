"""One httpx client per process, with every timeout explicit and a bounded, expiring pool.

Why per process and created after fork: a client's connection pool holds sockets; a pool
inherited through ``fork()`` shares them with the parent and its siblings, and a pool that keeps
idle connections longer than the server does hands out dead ones (the "rotten pool" incident).
So ``workers.crawler`` opens the client on ``worker_process_init`` (each prefork child) and closes
it on ``worker_process_shutdown``; ``process_fetcher()`` also re-creates it when it notices a
fork it was not told about. Idle connections expire after ``keepalive_expiry`` (shorter than
common server idle timeouts), and the pool is bounded so a slow site cannot take every socket.

``Fetcher.fetch`` classifies every outcome once: a ``Page`` for an accepted 2xx body, or a
``FetchError`` saying whether a retry can help and, for 429/503, the server's ``Retry-After``.

``CRAWL_ALLOWED_HOSTS`` is enforced here, before any I/O: the target host of the request and of
every redirect is checked (the host the client would connect to, not a proxy's), and redirects
are followed one hop at a time so that a refused ``Location`` is never requested.
"""

from __future__ import annotations

import dataclasses
import email.utils
import os
import threading
import time
from datetime import UTC, datetime

import httpx

from celery_crawl.errors import CrawlError

from .settings import DIRECT, CrawlerSettings

__all__ = [
    "ACCEPTED_CONTENT_TYPES",
    "HOST_NOT_ALLOWED",
    "FetchError",
    "Fetcher",
    "Page",
    "close_process_fetcher",
    "open_process_fetcher",
    "parse_retry_after",
    "process_fetcher",
]

#: Bodies of other types are not read at all (an image or archive is not a page).
ACCEPTED_CONTENT_TYPES = frozenset({"text/html", "application/xhtml+xml", "text/plain"})
_USER_AGENT = "celery-crawl-demo/0.1 (+https://github.com/celery-crawl)"
#: ``FetchError.reason`` of a URL (or redirect) whose host ``CRAWL_ALLOWED_HOSTS`` refuses.
HOST_NOT_ALLOWED = "host-not-allowed"


class FetchError(CrawlError):
    """A fetch that produced no page.

    Attributes:
        url: the requested URL.
        reason: short machine-readable reason (``timeout``, ``network``, ``status-429``,
            ``forbidden``, ``too-large``, ``content-type``, ``redirects``, ``status-404``,
            ``host-not-allowed``, ...).
        detail: the human-readable part (e.g. ``host www.example.com is not in
            CRAWL_ALLOWED_HOSTS``), or "".
        retryable: whether trying again (later, or through another proxy) can help.
        status: the HTTP status when one was received.
        retry_after_s: the server's ``Retry-After`` in seconds, when it sent one.
    """

    def __init__(self, url: str, reason: str, detail: str = "", *, retryable: bool,
                 status: int | None = None, retry_after_s: float | None = None) -> None:
        self.url = url
        self.reason = reason
        self.detail = detail
        self.retryable = retryable
        self.status = status
        self.retry_after_s = retry_after_s
        super().__init__(f"{url}: {reason}" + (f" ({detail})" if detail else ""))


@dataclasses.dataclass(frozen=True)
class Page:
    """An accepted response.

    Attributes:
        url: the final URL after redirects.
        status: HTTP status (2xx).
        content_type: media type without parameters.
        body: the body, at most ``max_bytes`` long.
        elapsed_s: time from sending the request to the end of the body.
        proxy: the proxy it came through, or ``"direct"``.
    """

    url: str
    status: int
    content_type: str
    body: bytes
    elapsed_s: float
    proxy: str

    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced; pages are not trusted)."""
        return self.body.decode("utf-8", errors="replace")


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date), or None.

    A date in the past means "now" (0 s); garbage is ignored rather than trusted.
    """
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class Fetcher:
    """HTTP GETs through per-proxy httpx clients that share one configuration.

    Not shared across ``fork()``; one instance per process (see ``process_fetcher``).
    """

    def __init__(self, settings: CrawlerSettings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self._clients: dict[str, httpx.Client] = {}
        self._lock = threading.Lock()

    def _client(self, proxy: str) -> httpx.Client:
        with self._lock:
            client = self._clients.get(proxy)
            if client is None:
                s = self.settings
                client = httpx.Client(
                    proxy=None if proxy == DIRECT else proxy,
                    trust_env=False,  # the proxy list is ours; no surprise HTTP(S)_PROXY
                    timeout=httpx.Timeout(connect=s.connect_timeout_s, read=s.read_timeout_s,
                                          write=s.write_timeout_s, pool=s.pool_timeout_s),
                    limits=httpx.Limits(max_connections=20, max_keepalive_connections=5,
                                        keepalive_expiry=5.0),
                    # Followed by fetch(), one hop at a time, each checked against
                    # CRAWL_ALLOWED_HOSTS before it is requested.
                    follow_redirects=False,
                    headers={"User-Agent": _USER_AGENT},
                )
                self._clients[proxy] = client
            return client

    def fetch(self, url: str, *, proxy: str = DIRECT, budget_s: float | None = None,
              headers: dict[str, str] | None = None) -> Page:
        """GET ``url`` and return the accepted page.

        Args:
            url: absolute http(s) URL.
            proxy: an entry of ``CRAWL_PROXIES``.
            budget_s: the caller's time left (its deadline); the fetch never runs past the
                smaller of it and ``CRAWL_FETCH_TIMEOUT``, body included.
            headers: extra request headers (e.g. ``Accept-Language``).

        Raises:
            FetchError: for every outcome that is not an accepted 2xx page.
        """
        s = self.settings
        budget = s.fetch_timeout_s if budget_s is None else min(budget_s, s.fetch_timeout_s)
        if budget <= 0:
            raise FetchError(url, "deadline", "no time left", retryable=False)
        started = time.monotonic()
        deadline = started + budget
        client = self._client(proxy)
        try:
            request = client.build_request("GET", url, headers=headers,
                                           timeout=self._timeout(budget))
            for hop in range(s.max_redirects + 1):
                self._check_host(url, request.url, hop)
                response = client.send(request, stream=True)
                try:
                    if response.next_request is None:
                        return self._accept(url, response, proxy, started, deadline)
                    request = response.next_request
                finally:
                    response.close()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FetchError(url, "timeout", "redirects slower than the fetch budget",
                                     retryable=True)
                request.extensions = {**request.extensions,
                                      "timeout": self._timeout(left).as_dict()}
            raise FetchError(url, "redirects", f"more than {s.max_redirects}", retryable=False)
        except httpx.TimeoutException as exc:
            raise FetchError(url, "timeout", type(exc).__name__, retryable=True) from exc
        except httpx.TransportError as exc:
            raise FetchError(url, "network", f"{type(exc).__name__}: {exc}",
                             retryable=True) from exc
        except httpx.InvalidURL as exc:
            raise FetchError(url, "bad-url", str(exc), retryable=False) from exc

    def check_host(self, url: str) -> None:
        """Refuse ``url`` when ``CRAWL_ALLOWED_HOSTS`` does not allow its host (no I/O).

        ``fetch`` does this itself; callers use it to refuse before waiting for anything else.

        Raises:
            FetchError: ``host-not-allowed`` (not retryable), or ``bad-url``.
        """
        try:
            target = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise FetchError(url, "bad-url", str(exc), retryable=False) from exc
        self._check_host(url, target, 0)

    def _check_host(self, url: str, target: httpx.URL, hop: int) -> None:
        # raw_host is what the client connects to: ASCII (xn--) names, IPv6 without brackets.
        host = target.raw_host.decode("ascii", errors="replace")
        if self.settings.host_allowed(host):
            return
        where = f"redirect {hop} to {target}: " if hop else ""
        raise FetchError(url, HOST_NOT_ALLOWED,
                         f"{where}host {host or '(none)'} is not in CRAWL_ALLOWED_HOSTS",
                         retryable=False)

    def _timeout(self, budget_s: float) -> httpx.Timeout:
        s = self.settings
        return httpx.Timeout(connect=min(s.connect_timeout_s, budget_s),
                             read=min(s.read_timeout_s, budget_s),
                             write=min(s.write_timeout_s, budget_s),
                             pool=min(s.pool_timeout_s, budget_s))

    def _accept(self, url: str, response: httpx.Response, proxy: str, started: float,
                deadline: float) -> Page:
        status = response.status_code
        if status in (429, 503):
            raise FetchError(url, f"status-{status}", retryable=True, status=status,
                             retry_after_s=parse_retry_after(response.headers.get("retry-after")))
        if status == 403:
            raise FetchError(url, "forbidden", f"via {proxy}", retryable=True, status=status)
        if status >= 500:
            raise FetchError(url, f"status-{status}", retryable=True, status=status)
        if not 200 <= status < 300:
            raise FetchError(url, f"status-{status}", retryable=False, status=status)
        content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type not in ACCEPTED_CONTENT_TYPES:
            raise FetchError(url, "content-type", content_type or "none", retryable=False,
                             status=status)
        cap = self.settings.max_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise FetchError(url, "too-large", f"Content-Length {declared} > {cap}",
                             retryable=False, status=status)
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > cap:
                # Stop reading here: the rest of an oversize body never reaches memory.
                raise FetchError(url, "too-large", f"more than {cap} bytes", retryable=False,
                                 status=status)
            if time.monotonic() > deadline:
                raise FetchError(url, "timeout", "body slower than the fetch budget",
                                 retryable=True, status=status)
        return Page(url=str(response.url), status=status, content_type=content_type,
                    body=bytes(body), elapsed_s=time.monotonic() - started, proxy=proxy)

    def close(self) -> None:
        """Close every client and its pooled connections."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


_process_fetcher: Fetcher | None = None


def open_process_fetcher(settings: CrawlerSettings) -> Fetcher:
    """Create this process's fetcher (called after fork, on ``worker_process_init``)."""
    global _process_fetcher
    if _process_fetcher is not None and _process_fetcher.pid == os.getpid():
        return _process_fetcher
    _process_fetcher = Fetcher(settings)
    return _process_fetcher


def process_fetcher(settings: CrawlerSettings) -> Fetcher:
    """This process's fetcher; a fetcher inherited through an unannounced fork is replaced."""
    fetcher = _process_fetcher
    if fetcher is None or fetcher.pid != os.getpid():
        return open_process_fetcher(settings)
    return fetcher


def close_process_fetcher() -> None:
    """Close this process's fetcher (``worker_process_shutdown`` and worker shutdown)."""
    global _process_fetcher
    fetcher, _process_fetcher = _process_fetcher, None
    if fetcher is not None and fetcher.pid == os.getpid():
        fetcher.close()
