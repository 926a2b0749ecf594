"""The crawler's metrics: HTTP status codes and failures per site, proxy latency and health,
queue length per queue and priority.

Fetches run in prefork pool children, but only the worker's main process serves ``/metrics``,
and a child's own ``prometheus_client`` counters die with it. So a child counts into one Redis
hash per worker (``<namespace>:crawler-metrics:<worker>``; one pipelined round trip per fetch,
expiring a day after the last write) and the main process exports that hash when scraped
(:class:`CrawlerCollector`), together with the queue lengths it reads from the broker then.

Labels stay bounded: ``site`` is the schedule entry (``crawl_entry`` header, inherited by every
child task) or, without one, the URL's domain when ``CRAWL_ALLOWED_HOSTS`` lists it, else
``other``; at most :data:`MAX_SITES` sites are exported (the rest is summed into ``other``).
``proxy`` is ``direct`` or ``proxy-<n>`` (its position in ``CRAWL_PROXIES``: a proxy URL can
carry a password). Nothing carries a URL.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from .politeness import domain_of
from .settings import DIRECT

__all__ = ["LATENCY_BUCKETS", "MAX_SITES", "CrawlerCollector", "Recorder", "proxy_label",
           "site_label"]

logger = logging.getLogger(__name__)

#: Seconds; the upper edges of ``crawler_proxy_latency_seconds`` (then +Inf).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Sites exported per worker; beyond it (a producer inventing entry names) they count as other.
MAX_SITES = 200
#: Fetches per proxy the health ratio looks back over.
HEALTH_WINDOW = 50
#: Reasons a fetch counts against its proxy's health (no answer, blocked, overloaded).
UNHEALTHY = frozenset({"timeout", "network", "forbidden", "status-429", "status-407"})
_KEY_TTL_S = 86400
_LABEL = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_REASON = re.compile(r"[a-z0-9-]{1,32}")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def site_label(entry: Any, url: str, allowed_hosts: Sequence[str] | None) -> str:
    """The bounded ``site`` label of a fetch of ``url`` by a run of schedule entry ``entry``."""
    if isinstance(entry, str) and _LABEL.fullmatch(entry):
        return entry
    domain = domain_of(url)
    if allowed_hosts is not None and domain in allowed_hosts and _LABEL.fullmatch(domain):
        return domain
    return "other"


def proxy_label(proxies: Sequence[str], index: int) -> str:
    proxy = proxies[min(index, len(proxies) - 1)]
    return "direct" if proxy == DIRECT else f"proxy-{min(index, len(proxies) - 1) + 1}"


def metrics_key(namespace: str, worker: str) -> str:
    return f"{namespace}:crawler-metrics:{worker}"


def worker_id() -> str:
    """This worker's id, the same in its main process and pool children: the main process's
    pid (a prefork child's parent) unless set in ``CRAWL_WORKER_ID`` before the pool forks."""
    return os.environ.get("CRAWL_WORKER_ID") or str(os.getpid())


class Recorder:
    """Counts fetch outcomes into the worker's metrics hash (from any process of the worker)."""

    def __init__(self, client: redis.Redis, *, namespace: str, worker: str | None = None) -> None:
        self.client = client
        self.key = metrics_key(namespace, worker or worker_id())

    def fetched(self, *, site: str, proxy: str | None, status: int | None,
                reason: str | None, elapsed_s: float | None) -> None:
        """One fetch: its HTTP status (if any answer came), its failure reason (if it produced
        no page) and, when it went through a proxy, its latency and health.

        Never raises: metrics must not fail a crawl.
        """
        reason_l = (reason if reason is None or _REASON.fullmatch(reason) else "other")
        pipe = self.client.pipeline(transaction=False)
        if status is not None:
            code = str(status) if 100 <= status <= 599 else "other"
            pipe.hincrby(self.key, f"http|{site}|{code}", 1)
        if reason_l is not None:
            pipe.hincrby(self.key, f"fail|{site}|{reason_l}", 1)
        if proxy is not None and elapsed_s is not None:
            edge = next((i for i, b in enumerate(LATENCY_BUCKETS) if elapsed_s <= b),
                        len(LATENCY_BUCKETS))
            pipe.hincrby(self.key, f"lat|{proxy}|{edge}", 1)
            pipe.hincrbyfloat(self.key, f"latsum|{proxy}", max(0.0, elapsed_s))
        if proxy is not None:
            health = f"{self.key}:health:{proxy}"
            pipe.lpush(health, "0" if reason_l in UNHEALTHY else "1")
            pipe.ltrim(health, 0, HEALTH_WINDOW - 1)
            pipe.expire(health, _KEY_TTL_S)
        pipe.expire(self.key, _KEY_TTL_S)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            logger.debug("crawler metrics not recorded: %s", exc)


class CrawlerCollector(Collector):
    """Exports the worker's metrics hash and the broker's queue lengths at each scrape.

    Args:
        client: Redis holding the metrics hash.
        namespace: ``CRAWL_NAMESPACE``.
        queues: returns the queue names to measure (those the worker consumes).
        broker: a Redis client on the broker (None: the broker is not Redis; no queue lengths).
        priority_steps: kombu's Redis ``priority_steps`` (sub-queue per step).
        sep: kombu's Redis ``sep`` between a queue name and its priority.
    """

    def __init__(self, client: redis.Redis, *, namespace: str, queues: Any,
                 broker: redis.Redis | None, priority_steps: Sequence[int] = (0, 3, 6, 9),
                 sep: str = "\x06\x16", worker: str | None = None) -> None:
        self.client = client
        self.key = metrics_key(namespace, worker or worker_id())
        self.queues = queues
        self.broker = broker
        self.priority_steps = tuple(priority_steps)
        self.sep = sep

    def describe(self) -> list[Any]:
        return []  # collected on scrape only: never at registration

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("crawler_metrics_up",
                               "1 when the crawler's metrics hash could be read at this scrape")
        try:
            raw = {_text(k): _text(v) for k, v in self.client.hgetall(self.key).items()}
            proxies = sorted({f.split("|")[1] for f in raw if f.startswith("lat|")})
            health = {p: [_text(v) for v in self.client.lrange(f"{self.key}:health:{p}", 0, -1)]
                      for p in proxies}
        except redis.RedisError as exc:
            logger.warning("crawler metrics: cannot read %s: %s", self.key, exc)
            up.add_metric([], 0)
            yield up
        else:
            up.add_metric([], 1)
            yield up
            yield from self._from_hash(raw, health)
        yield from self._queues()

    def _from_hash(self, fields: dict[str, str],
                   health: dict[str, list[str]]) -> Iterator[Any]:
        http = CounterMetricFamily("crawler_http_responses", "HTTP responses by site and status",
                                   labels=["site", "code"])
        fail = CounterMetricFamily("crawler_fetch_failures",
                                   "Fetches that produced no page, by site and reason",
                                   labels=["site", "reason"])
        per: dict[str, dict[tuple[str, str], float]] = {"http": {}, "fail": {}}
        lat: dict[str, list[float]] = {}
        lat_sum: dict[str, float] = {}
        for field, value in fields.items():
            kind, *rest = field.split("|")
            try:
                number = float(value)
            except ValueError:
                continue
            if kind in per and len(rest) == 2:
                per[kind][(rest[0], rest[1])] = number
            elif kind == "lat" and len(rest) == 2 and rest[1].isdigit():
                buckets = lat.setdefault(rest[0], [0.0] * (len(LATENCY_BUCKETS) + 1))
                if int(rest[1]) < len(buckets):
                    buckets[int(rest[1])] = number
            elif kind == "latsum" and len(rest) == 1:
                lat_sum[rest[0]] = number
        totals: dict[str, float] = {}
        for counts in per.values():
            for (site, _), n in counts.items():
                totals[site] = totals.get(site, 0.0) + n
        kept = set(sorted(totals, key=lambda s: -totals[s])[:MAX_SITES])
        for kind, family in (("http", http), ("fail", fail)):
            folded: dict[tuple[str, str], float] = {}
            for (site, other), n in per[kind].items():
                label = (site if site in kept else "other", other)
                folded[label] = folded.get(label, 0.0) + n
            for labels, n in sorted(folded.items()):
                family.add_metric(list(labels), n)
            yield family
        latency = HistogramMetricFamily(
            "crawler_proxy_latency_seconds", "Fetch time through each proxy (direct included)",
            labels=["proxy"])
        ratio = GaugeMetricFamily(
            "crawler_proxy_health_ratio",
            f"Share of the last {HEALTH_WINDOW} fetches through each proxy that got an answer "
            "that was not a block (403/407/429), a timeout or a network error",
            labels=["proxy"])
        for proxy, buckets in sorted(lat.items()):
            cumulative, running = [], 0.0
            for edge, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), buckets, strict=True):
                running += n
                cumulative.append((edge, running))
            latency.add_metric([proxy], cumulative, lat_sum.get(proxy, 0.0))
            window = health.get(proxy) or []
            if window:
                ratio.add_metric([proxy], sum(v == "1" for v in window) / len(window))
        yield latency
        yield ratio

    def _queues(self) -> Iterator[Any]:
        if self.broker is None:
            return
        family = GaugeMetricFamily("crawler_queue_length",
                                   "Messages waiting in each queue, per priority sub-queue",
                                   labels=["queue", "priority"])
        try:
            names = sorted(self.queues())
            pipe = self.broker.pipeline(transaction=False)
            for name in names:
                for step in self.priority_steps:
                    pipe.llen(name if step == 0 else f"{name}{self.sep}{step}")
            lengths = iter(pipe.execute())
        except redis.RedisError as exc:
            logger.warning("crawler metrics: cannot read queue lengths: %s", exc)
            return
        for name in names:
            for step in self.priority_steps:
                family.add_metric([name, str(step)], float(next(lengths)))
        yield family
