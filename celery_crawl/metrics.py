"""Prometheus metrics of this process, and the HTTP endpoint that serves them.

Metric names are part of the public contract (README "Metrics"). Labels never carry URLs,
passwords or task arguments. The same read-only server serves the pages other modules add
(``/status``, ``/status.json``: :mod:`celery_crawl.status`); every other path is ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Summary, make_wsgi_app

from .errors import ConfigError, LeaseLost, StoreTimeout

log = logging.getLogger("celery_crawl.metrics")

__all__ = [
    "BEAT_DISPATCHED",
    "BEAT_DISPATCH_LAG",
    "BEAT_FAILOVERS",
    "BEAT_IS_LEADER",
    "BEAT_RESENT",
    "BEAT_SCHEDULE_ENTRIES",
    "BEAT_SCHEDULE_INFO",
    "BEAT_SCHEDULE_MISMATCH",
    "BEAT_SKIPPED",
    "LEASE_HOLD_DEVIATION",
    "LEASE_LAST_HOLD_DEVIATION",
    "LEASE_RENEWALS",
    "LEASE_RENEWAL_FAILURES",
    "LEASE_TIME_LEFT",
    "STORE_MASTER_CHANGES",
    "WORKER_CLAIMS",
    "WORKER_DUPLICATES_PARKED",
    "WORKER_LEASE_LOSSES",
    "WORKER_PREEMPTION_LATENCY",
    "WORKER_RECOVERIES",
    "Response",
    "add_page",
    "lease_ended",
    "renewal_failed",
    "set_schedule",
    "start_at_zero",
    "start_metrics_server",
    "watch_master_changes",
]

LEASE_RENEWALS = Counter(
    "crawl_lease_renewals_total", "Lease renewals by lease role and result", ["role", "result"]
)
LEASE_RENEWAL_FAILURES = Counter(
    "crawl_lease_renewal_failures_total",
    "Failed lease renewals by lease role and cause (timeout: no answer in time; lease_lost: "
    "the store says another holder has it or it expired; refused: any other store error)",
    ["role", "cause"],
)
# A summary, not a histogram: the deviation is signed, and a histogram with negative buckets
# exposes no _sum (so no mean); the gauge keeps the latest one visible between losses.
LEASE_HOLD_DEVIATION = Summary(
    "crawl_lease_hold_deviation_seconds",
    "How long a lost lease was really held (its last renewal to the loss being noticed) minus "
    "its TTL, by lease role: negative when the store dropped it early, positive when noticed late",
    ["role"],
)
LEASE_LAST_HOLD_DEVIATION = Gauge(
    "crawl_lease_last_hold_deviation_seconds",
    "crawl_lease_hold_deviation_seconds of the latest lease loss of this process", ["role"],
)
LEASE_TIME_LEFT = Gauge(
    "crawl_lease_time_left_seconds", "Validity left on this process's lease", ["role"]
)
BEAT_IS_LEADER = Gauge("crawl_beat_leader", "1 while this beat replica holds the leader lease")
BEAT_FAILOVERS = Counter("crawl_beat_failovers_total", "Times this replica became leader")
BEAT_DISPATCHED = Counter("crawl_beat_dispatched_total", "Runs published by this leader")
BEAT_DISPATCH_LAG = Histogram(
    "crawl_beat_dispatch_lag_seconds", "Publish time minus nominal slot",
    # Edges on both sides of 50 ms, the dispatch-lag objective its alert tests (p99).
    buckets=(0.005, 0.01, 0.025, 0.04, 0.05, 0.06, 0.075, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
BEAT_RESENT = Counter("crawl_beat_resent_total",
                      "Runs published again after the delivery check found them nowhere")
BEAT_SKIPPED = Counter("crawl_beat_skipped_slots_total", "Slots not run, by reason", ["reason"])
BEAT_SCHEDULE_ENTRIES = Gauge("crawl_beat_schedule_entries",
                              "Entries of this beat replica's schedule")
BEAT_SCHEDULE_INFO = Gauge(
    "crawl_beat_schedule_info",
    "1 for the fingerprint of this beat replica's schedule (replicas running the same schedule "
    "show the same one)", ["fingerprint"])
BEAT_SCHEDULE_MISMATCH = Gauge(
    "crawl_beat_schedule_mismatch",
    "1 while this beat replica's schedule differs from the one the fleet runs (see "
    "crawl_beat_schedule_mismatch)")
WORKER_CLAIMS = Gauge("crawl_worker_claims", "Task claims held by this worker")
WORKER_RECOVERIES = Counter(
    "crawl_worker_recoveries_total", "Tasks of dead workers recovered by this reaper"
)
WORKER_DUPLICATES_PARKED = Counter(
    "crawl_worker_duplicates_total",
    "Deliveries of a task id whose run holds a live claim, by outcome: parked (a duplicate "
    "delivery waiting for that run), waiting (a retry or replacement waiting for its own "
    "previous run to end: not a duplicate), dropped (a duplicate of a finished run), run (a "
    "parked duplicate run here once the claim ended)", ["outcome"]
)
WORKER_LEASE_LOSSES = Counter("crawl_worker_lease_losses_total", "Worker lease losses")
STORE_MASTER_CHANGES = Counter(
    "crawl_store_master_changes_total",
    "Times this process found the lease store's Redis master at a new address (Sentinel)")
WORKER_PREEMPTION_LATENCY = Histogram(
    "crawl_worker_preemption_latency_seconds",
    "Time from a dead worker's estimated death (its lease's last renewal) to its task "
    "being handed to a pool elsewhere",
    buckets=(0.5, 1, 2, 5, 10, 15, 30, 60, 120),
)


#: Label values known in advance: their series exist from the start at 0, so a healthy fleet's
#: dashboard shows 0 rather than "No data" (and a rate() sees the first increment).
_KNOWN_LABELS: dict[str, tuple[tuple[Any, tuple[str, ...]], ...]] = {
    "beat": (
        (BEAT_SKIPPED, ("paused", "overlap", "overlap_buffered", "cancelled_by_overlap",
                        "outside_window", "missed", "superseded", "catchup_max",
                        "publish_failed", "lost")),
    ),
    "worker": (
        (WORKER_DUPLICATES_PARKED, ("parked", "waiting", "dropped", "run")),
    ),
}


def start_at_zero(role: str) -> None:
    """Create the series of ``role``'s (``beat`` or ``worker``) known label sets at 0."""
    for result in ("ok", "error", "lost"):
        LEASE_RENEWALS.labels(role, result)
    for cause in ("timeout", "lease_lost", "refused"):
        LEASE_RENEWAL_FAILURES.labels(role, cause)
    LEASE_TIME_LEFT.labels(role)
    LEASE_HOLD_DEVIATION.labels(role)  # count 0: no loss yet (the last-loss gauge waits for one)
    for metric, values in _KNOWN_LABELS.get(role, ()):
        for value in values:
            metric.labels(value)


_schedule_shown: list[str] = []


def set_schedule(fingerprint: str, entries: int) -> None:
    """Show this replica's schedule: ``crawl_beat_schedule_info{fingerprint}`` and its size."""
    for old in _schedule_shown:
        if old != fingerprint:
            BEAT_SCHEDULE_INFO.remove(old)
    _schedule_shown[:] = [fingerprint]
    BEAT_SCHEDULE_INFO.labels(fingerprint).set(1)
    BEAT_SCHEDULE_ENTRIES.set(entries)


def renewal_failed(role: str, exc: BaseException) -> None:
    """Count one failed renewal under its cause (``crawl_lease_renewal_failures_total``)."""
    cause = ("lease_lost" if isinstance(exc, LeaseLost)
             else "timeout" if isinstance(exc, StoreTimeout | TimeoutError) else "refused")
    LEASE_RENEWAL_FAILURES.labels(role, cause).inc()


def lease_ended(role: str, valid_until: float, now: float) -> None:
    """Observe how a lost lease's real hold time (its last renewal to the loss being noticed,
    both on ``CLOCK_BOOTTIME``) deviated from its TTL: ``now - valid_until``. Negative: the store
    dropped it early (another holder, a store restart, a clock jump); positive: noticed late."""
    LEASE_HOLD_DEVIATION.labels(role).observe(now - valid_until)
    LEASE_LAST_HOLD_DEVIATION.labels(role).set(now - valid_until)


@dataclasses.dataclass(frozen=True, slots=True)
class Response:
    """What a page added with :func:`add_page` answers."""

    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}
_pages: dict[str, Callable[[], Response]] = {}
_metrics_app = make_wsgi_app(REGISTRY)


def add_page(path: str, render: Callable[[], Response]) -> None:
    """Serve ``render()`` at ``path`` on this process's metrics server (replacing a page
    added there before); effective at once, whether the server runs already or starts later."""
    _pages[path] = render


def _respond(start_response: Callable[..., Any], resp: Response, head: bool) -> list[bytes]:
    start_response(f"{resp.status} {_REASONS.get(resp.status, 'Error')}", [
        ("Content-Type", resp.content_type), ("Content-Length", str(len(resp.body))),
        ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"), *resp.headers])
    return [] if head else [resp.body]


def _app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """Read-only: GET and HEAD only; registered pages by path, ``/metrics`` everywhere else."""
    method = environ.get("REQUEST_METHOD", "GET")
    if method not in ("GET", "HEAD"):
        resp = Response(405, "text/plain; charset=utf-8", b"read-only: GET or HEAD\n",
                        (("Allow", "GET, HEAD"),))
        return _respond(start_response, resp, False)
    render = _pages.get(environ.get("PATH_INFO") or "/")
    if render is None:
        body: Iterable[bytes] = _metrics_app({**environ, "REQUEST_METHOD": "GET"},
                                             start_response)
        return [] if method == "HEAD" else body
    try:
        resp = render()
    except Exception:
        log.exception("celery-crawl: rendering %s failed", environ.get("PATH_INFO"))
        resp = Response(500, "text/plain; charset=utf-8", b"internal error (see the log)\n")
    return _respond(start_response, resp, method == "HEAD")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Handler(WSGIRequestHandler):
    #: A client that connects and sends nothing must not hold a thread forever.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a scrape every few seconds)."""


_started: dict[int, bool] = {}
_lock = threading.Lock()


def start_metrics_server(port: int | None, *, addr: str = "127.0.0.1") -> int | None:
    """Serve ``/metrics`` on ``port`` once per process; returns the bound port.

    Raises:
        ConfigError: naming ``crawl_metrics_port`` when the port is busy (never a crash later).
    """
    if port is None:
        return None
    with _lock:
        if port in _started:
            return port
        try:
            server = _listen(addr, port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"crawl_metrics_port: port {port} on {addr} is already in use"
                ) from exc
            raise ConfigError(f"crawl_metrics_port: cannot listen on {addr}:{port}: {exc}") from exc
        bound = int(server.server_address[1])
        _started[port] = True
        return bound


def _listen(addr: str, port: int) -> WSGIServer:
    family = socket.AF_INET
    infos = socket.getaddrinfo(addr or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    if infos:
        family = infos[0][0]

    class Server(_Server):
        address_family = family

    server = make_server(addr, port, _app, Server, handler_class=_Handler)
    threading.Thread(target=server.serve_forever, name="crawl-metrics", daemon=True).start()
    return server


def watch_master_changes(store: object,
                         *also: Callable[[tuple[str, int], tuple[str, int]], None]) -> None:
    """Count the failovers a lease store behind Sentinel notices (its ``sentinel_link``) in
    ``crawl_store_master_changes_total``, then tell ``also`` (old and new address); nothing for
    any other store."""
    link = getattr(store, "sentinel_link", None)
    if link is None:
        return

    def changed(old: tuple[str, int], new: tuple[str, int]) -> None:
        STORE_MASTER_CHANGES.inc()
        for listener in also:
            listener(old, new)

    link.on_master_change = changed
