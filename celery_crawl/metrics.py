"""Prometheus metrics of this process, and the HTTP endpoint that serves them.

Metric names are part of the public contract (README "Metrics"). Labels never carry URLs,
passwords or task arguments.
"""

from __future__ import annotations

import errno
import threading

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from .errors import ConfigError

__all__ = [
    "BEAT_DISPATCHED",
    "BEAT_DISPATCH_LAG",
    "BEAT_FAILOVERS",
    "BEAT_IS_LEADER",
    "BEAT_RESENT",
    "BEAT_SKIPPED",
    "LEASE_RENEWALS",
    "LEASE_TIME_LEFT",
    "WORKER_CLAIMS",
    "WORKER_DUPLICATES_PARKED",
    "WORKER_LEASE_LOSSES",
    "WORKER_PREEMPTION_LATENCY",
    "WORKER_RECOVERIES",
    "start_metrics_server",
]

LEASE_RENEWALS = Counter(
    "crawl_lease_renewals_total", "Lease renewals by lease role and result", ["role", "result"]
)
LEASE_TIME_LEFT = Gauge(
    "crawl_lease_time_left_seconds", "Validity left on this process's lease", ["role"]
)
BEAT_IS_LEADER = Gauge("crawl_beat_leader", "1 while this beat replica holds the leader lease")
BEAT_FAILOVERS = Counter("crawl_beat_failovers_total", "Times this replica became leader")
BEAT_DISPATCHED = Counter("crawl_beat_dispatched_total", "Runs published by this leader")
BEAT_DISPATCH_LAG = Histogram(
    "crawl_beat_dispatch_lag_seconds", "Publish time minus nominal slot",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
BEAT_RESENT = Counter("crawl_beat_resent_total",
                      "Runs published again after the delivery check found them nowhere")
BEAT_SKIPPED = Counter("crawl_beat_skipped_slots_total", "Slots not run, by reason", ["reason"])
WORKER_CLAIMS = Gauge("crawl_worker_claims", "Task claims held by this worker")
WORKER_RECOVERIES = Counter(
    "crawl_worker_recoveries_total", "Tasks of dead workers recovered by this reaper"
)
WORKER_DUPLICATES_PARKED = Counter(
    "crawl_worker_duplicates_total", "Deliveries parked or dropped as duplicates", ["outcome"]
)
WORKER_LEASE_LOSSES = Counter("crawl_worker_lease_losses_total", "Worker lease losses")
WORKER_PREEMPTION_LATENCY = Histogram(
    "crawl_worker_preemption_latency_seconds",
    "Time from a dead worker's estimated death (its lease's last renewal) to its task "
    "being handed to a pool elsewhere",
    buckets=(0.5, 1, 2, 5, 10, 15, 30, 60, 120),
)

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
            server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"crawl_metrics_port: port {port} on {addr} is already in use"
                ) from exc
            raise ConfigError(f"crawl_metrics_port: cannot listen on {addr}:{port}: {exc}") from exc
        bound = int(server.server_address[1])
        _started[port] = True
        return bound
