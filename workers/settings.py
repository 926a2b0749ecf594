"""The crawler's configuration, read once from the environment.

Every value has a default that works on a laptop (a Redis on localhost); a malformed value is a
``ConfigError`` naming the variable, raised at import of ``workers.crawler`` so a worker or beat
refuses to start rather than crawling with half a configuration.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import redis

from celery_crawl.config import mask_url
from celery_crawl.durations import parse_duration
from celery_crawl.errors import ConfigError

__all__ = ["ANY_HOST", "DIRECT", "CrawlerSettings", "redis_client", "sentinel_master"]

#: The entry of ``CRAWL_PROXIES`` that means "no proxy".
DIRECT = "direct"
#: ``CRAWL_ALLOWED_HOSTS`` value that allows every host (the default).
ANY_HOST = "*"

_BROKER_SCHEMES = ("redis", "rediss", "amqp", "amqps", "pyamqp", "sentinel")
#: Redis behind Sentinel: ``redis+sentinel://s1:26379,s2:26379/<master>/<db>``.
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_MiB = 1024 * 1024
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


@dataclasses.dataclass(frozen=True)
class CrawlerSettings:
    """Validated crawler settings. Durations are float seconds (``*_s``).

    Attributes:
        redis_url: broker, and the Redis that holds politeness state (``REDIS_URL``).
        broker_url: ``CRAWL_BROKER_URL``, default ``redis_url`` (RabbitMQ works too).
        result_url: result backend (``CRAWL_RESULT_URL``); default the audited backend on
            ``redis_url`` (``crawlredis://``) when it is installed, else plain ``redis://``.
        lease_url: ``CRAWL_LEASE_URL``, else ``ETCD_URL`` (as ``etcd://``), else ``redis_url``.
        namespace: ``CRAWL_NAMESPACE``; prefixes every key the crawler writes.
        sink: SQLite file the pages are upserted into (``CRAWL_SINK``).
        proxies: rotation order for 403 answers (``CRAWL_PROXIES``, comma separated;
            ``direct`` means no proxy). Without the variable: ``("direct",)``.
        rate_per_s: per-domain fetches per second, shared by all workers (``CRAWL_RATE``).
        burst: token-bucket capacity per domain (``CRAWL_BURST``).
        domain_concurrency: in-flight fetches per domain across all workers
            (``CRAWL_DOMAIN_CONCURRENCY``).
        max_bytes: response bodies are read up to this size, then refused (``CRAWL_MAX_BYTES``).
        connect_timeout_s, read_timeout_s, write_timeout_s, pool_timeout_s: httpx timeouts.
        fetch_timeout_s: wall budget of one fetch including the body (a slow drip cannot hold a
            worker past it; ``CRAWL_FETCH_TIMEOUT``).
        max_redirects: redirects followed per fetch (``CRAWL_MAX_REDIRECTS``).
        max_retries: retries per page before it is recorded as failed (``CRAWL_MAX_RETRIES``).
        backoff_base_s, backoff_max_s: exponential backoff without ``Retry-After``.
        retry_after_max_s: a longer ``Retry-After`` is capped (and logged as capped).
        crawl_budget_s: deadline given to a crawl that arrives without one (``CRAWL_BUDGET``).
        max_items: fan-out cap per listing (``CRAWL_MAX_ITEMS``).
        schedule_paths: ``CRAWL_SCHEDULE_PATHS`` (``os.pathsep`` or comma separated globs).
        metrics_port: ``CRAWL_METRICS_PORT`` for this process, or None.
        metrics_addr: ``CRAWL_METRICS_ADDR``, the address it listens on (default 127.0.0.1;
            ``0.0.0.0`` in a container, so Prometheus in another container can scrape it).
        beat_lease_ttl_s, worker_lease_ttl_s: optional overrides (``CRAWL_BEAT_LEASE_TTL``,
            ``CRAWL_WORKER_LEASE_TTL``); None keeps celery-crawl's defaults.
        visibility_timeout_s: Redis broker ``visibility_timeout`` (``CRAWL_VISIBILITY_TIMEOUT``);
            None keeps kombu's (1 h). The worker plugin recovers a dead worker's tasks sooner.
        verify_delivery_s: ``crawl_beat_verify_delivery`` (``CRAWL_VERIFY_DELIVERY``, default
            30 s; 0 turns it off): every crawler worker runs the worker plugin, so the beat may
            publish again a run lost between the Redis broker and a worker.
        allowed_hosts: the only hosts a fetch (or a redirect it follows) may go to, lower case,
            IDNA names in their ``xn--`` form (``CRAWL_ALLOWED_HOSTS``, comma separated); None
            (the default, ``*``) allows every host.
    """

    redis_url: str
    broker_url: str
    result_url: str | None
    lease_url: str
    namespace: str
    sink: str
    proxies: tuple[str, ...]
    rate_per_s: float
    burst: int
    domain_concurrency: int
    max_bytes: int
    connect_timeout_s: float
    read_timeout_s: float
    write_timeout_s: float
    pool_timeout_s: float
    fetch_timeout_s: float
    max_redirects: int
    max_retries: int
    backoff_base_s: float
    backoff_max_s: float
    retry_after_max_s: float
    crawl_budget_s: float
    max_items: int
    schedule_paths: tuple[str, ...] | None
    metrics_port: int | None
    metrics_addr: str
    beat_lease_ttl_s: float | None
    worker_lease_ttl_s: float | None
    visibility_timeout_s: float | None
    allowed_hosts: tuple[str, ...] | None = None
    verify_delivery_s: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CrawlerSettings:
        """Read the settings from ``env`` (default ``os.environ``).

        Raises:
            ConfigError: naming the variable and what is wrong with its value.
        """
        e = os.environ if env is None else env
        redis_url = _url(e, "REDIS_URL", "redis://127.0.0.1:6379/0",
                         ("redis", "rediss", *_SENTINEL_SCHEMES))
        broker_url = _url(e, "CRAWL_BROKER_URL", _kombu_url(redis_url), _BROKER_SCHEMES)
        result_url = e.get("CRAWL_RESULT_URL") or None
        etcd_url = e.get("ETCD_URL") or None
        if etcd_url is not None:
            etcd_url = _etcd(etcd_url)
        lease_url = e.get("CRAWL_LEASE_URL") or etcd_url or redis_url
        _check_scheme("CRAWL_LEASE_URL", lease_url,
                      ("redis", "rediss", *_SENTINEL_SCHEMES, "etcd", "etcd+http", "etcd+https"))
        namespace = e.get("CRAWL_NAMESPACE", "crawler").strip()
        if not namespace or any(c in namespace for c in " \n{}:"):
            raise ConfigError(f"CRAWL_NAMESPACE: {namespace!r} must be a non-empty word")
        proxies = tuple(p.strip() for p in e.get("CRAWL_PROXIES", DIRECT).split(",") if p.strip())
        for proxy in proxies:
            if proxy != DIRECT:
                _check_scheme("CRAWL_PROXIES", proxy, ("http", "https", "socks5"))
        paths = e.get("CRAWL_SCHEDULE_PATHS")
        return cls(
            redis_url=redis_url,
            broker_url=broker_url,
            result_url=result_url,
            lease_url=lease_url,
            namespace=namespace,
            sink=e.get("CRAWL_SINK", "crawl-results.sqlite3"),
            proxies=proxies or (DIRECT,),
            rate_per_s=_positive(e, "CRAWL_RATE", 2.0),
            burst=int(_positive(e, "CRAWL_BURST", 2, integer=True)),
            domain_concurrency=int(_positive(e, "CRAWL_DOMAIN_CONCURRENCY", 2, integer=True)),
            max_bytes=int(_positive(e, "CRAWL_MAX_BYTES", 2 * _MiB, integer=True)),
            connect_timeout_s=_seconds(e, "CRAWL_CONNECT_TIMEOUT", 5.0),
            read_timeout_s=_seconds(e, "CRAWL_READ_TIMEOUT", 10.0),
            write_timeout_s=_seconds(e, "CRAWL_WRITE_TIMEOUT", 10.0),
            pool_timeout_s=_seconds(e, "CRAWL_POOL_TIMEOUT", 5.0),
            fetch_timeout_s=_seconds(e, "CRAWL_FETCH_TIMEOUT", 30.0),
            max_redirects=int(_positive(e, "CRAWL_MAX_REDIRECTS", 5, integer=True, zero=True)),
            max_retries=int(_positive(e, "CRAWL_MAX_RETRIES", 5, integer=True, zero=True)),
            backoff_base_s=_seconds(e, "CRAWL_BACKOFF_BASE", 1.0),
            backoff_max_s=_seconds(e, "CRAWL_BACKOFF_MAX", 60.0),
            retry_after_max_s=_seconds(e, "CRAWL_RETRY_AFTER_MAX", 300.0),
            crawl_budget_s=_seconds(e, "CRAWL_BUDGET", 600.0),
            max_items=int(_positive(e, "CRAWL_MAX_ITEMS", 100, integer=True)),
            schedule_paths=tuple(
                p for chunk in paths.split(os.pathsep) for p in chunk.split(",") if p
            ) if paths else None,
            metrics_port=_port(e, "CRAWL_METRICS_PORT"),
            metrics_addr=_addr(e, "CRAWL_METRICS_ADDR", "127.0.0.1"),
            beat_lease_ttl_s=_optional_seconds(e, "CRAWL_BEAT_LEASE_TTL"),
            worker_lease_ttl_s=_optional_seconds(e, "CRAWL_WORKER_LEASE_TTL"),
            visibility_timeout_s=_optional_seconds(e, "CRAWL_VISIBILITY_TIMEOUT"),
            allowed_hosts=_hosts(e, "CRAWL_ALLOWED_HOSTS"),
            verify_delivery_s=_verify_seconds(e, "CRAWL_VERIFY_DELIVERY", 30.0),
        )

    def host_allowed(self, host: str) -> bool:
        """Whether ``CRAWL_ALLOWED_HOSTS`` lets a fetch go to ``host`` (exact name match:
        ``example.com`` does not allow ``www.example.com``)."""
        if self.allowed_hosts is None:
            return True
        name = _host_name(host)
        return name is not None and name in self.allowed_hosts

    def celery_conf(self, *, audited_backend: bool) -> dict[str, Any]:
        """Celery settings for the crawler app.

        Args:
            audited_backend: whether ``crawlredis://`` is installed; the default result backend
                is the audited one when it is, plain Redis otherwise.
        """
        result = self.result_url or (
            _with_scheme(self.redis_url, "crawl" + urlsplit(self.redis_url).scheme)
            if audited_backend else self.redis_url
        )
        conf: dict[str, Any] = {
            "broker_url": self.broker_url,
            "result_backend": result,
            "task_serializer": "json",
            "result_serializer": "json",
            "accept_content": ["json"],
            "task_default_queue": "crawl",
            "task_acks_late": True,
            "task_reject_on_worker_lost": True,
            "worker_prefetch_multiplier": 1,
            "result_expires": 86400,
            "result_extended": True,
            "broker_connection_retry_on_startup": True,
            "worker_cancel_long_running_tasks_on_connection_loss": True,
            "crawl_lease_url": self.lease_url,
            "crawl_namespace": self.namespace,
            # The crawler serves /metrics itself (workers.crawler), on CRAWL_METRICS_ADDR.
            "crawl_metrics_port": None,
            "crawl_beat_verify_delivery": self.verify_delivery_s,
        }
        if self.schedule_paths is not None:
            conf["crawl_schedule_paths"] = list(self.schedule_paths)
        if self.beat_lease_ttl_s is not None:
            conf["crawl_beat_lease_ttl"] = self.beat_lease_ttl_s
        if self.worker_lease_ttl_s is not None:
            conf["crawl_worker_lease_ttl"] = self.worker_lease_ttl_s
        if self.visibility_timeout_s is not None:
            # Sweep for abandoned messages often enough for a short visibility timeout to matter.
            conf["broker_transport_options"] = {
                "visibility_timeout": self.visibility_timeout_s,
                "unacked_restore_interval": max(1, int(self.visibility_timeout_s / 4)),
                "unacked_restore_throttle": 1,
            }
        master = sentinel_master(self.redis_url)
        if master is not None and self.broker_url.startswith("sentinel://"):
            # kombu's Sentinel transport finds the master by this name.
            conf["broker_transport_options"] = {
                **conf.get("broker_transport_options", {}), "master_name": master}
        return conf


def sentinel_master(url: str) -> str | None:
    """The master's name of a ``redis+sentinel://hosts/<master>/<db>`` URL, else None."""
    if url.split("://", 1)[0] not in _SENTINEL_SCHEMES:
        return None
    return urlsplit(url).path.strip("/").split("/")[0] or None


def _kombu_url(redis_url: str) -> str:
    """The broker URL for ``REDIS_URL``: itself, or kombu's ``sentinel://`` form (one URL per
    sentinel, ``;``-separated) for ``redis+sentinel://``."""
    scheme, _, rest = redis_url.partition("://")
    if scheme not in _SENTINEL_SCHEMES:
        return redis_url
    hosts, _, path = rest.partition("?")[0].partition("/")
    db = [*path.strip("/").split("/"), "0"][1] or "0"
    return ";".join(f"sentinel://{h}/{db}" for h in hosts.rpartition("@")[2].split(","))


def redis_client(url: str, **kwargs: Any) -> redis.Redis:
    """A client of ``url``: ``redis://``/``rediss://``, or the master the sentinels of a
    ``redis+sentinel://`` URL name (each new connection asks them)."""
    scheme = url.partition("://")[0]
    if scheme not in _SENTINEL_SCHEMES:
        return redis.Redis.from_url(url, **kwargs)
    from redis.sentinel import Sentinel

    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    master, _, db = parts.path.strip("/").partition("/")
    pairs = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        pairs.append((name, int(port or 26379)))
    password = userinfo.partition(":")[2] or None
    timeouts = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinel = Sentinel(pairs, sentinel_kwargs=timeouts, **kwargs)
    client: redis.Redis = sentinel.master_for(master, db=int(db or 0), password=password,
                                              ssl=scheme == "rediss+sentinel")
    return client


def _check_scheme(var: str, url: str, schemes: tuple[str, ...]) -> None:
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in schemes or not urlsplit(url).hostname:
        raise ConfigError(
            f"{var}: {mask_url(url)!r} is not a URL with scheme {' | '.join(schemes)}"
        )


def _url(env: Mapping[str, str], var: str, default: str, schemes: tuple[str, ...]) -> str:
    url = env.get(var) or default
    _check_scheme(var, url, schemes)
    return url


def _etcd(url: str) -> str:
    if url.startswith(("http://", "https://")):
        scheme, rest = url.split("://", 1)
        url = ("etcd+https://" if scheme == "https" else "etcd://") + rest
    _check_scheme("ETCD_URL", url, ("etcd", "etcd+http", "etcd+https"))
    return url.rstrip("/")


def _with_scheme(url: str, scheme: str) -> str:
    return scheme + "://" + url.split("://", 1)[1]


def _positive(env: Mapping[str, str], var: str, default: float, *, integer: bool = False,
              zero: bool = False) -> float:
    raw = env.get(var)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{var}: expected {kind}, got {raw!r}") from None
    if value < 0 or (value == 0 and not zero) or value != value:
        raise ConfigError(f"{var}: must be {'>= 0' if zero else '> 0'}, got {raw!r}")
    return value


def _seconds(env: Mapping[str, str], var: str, default: float) -> float:
    raw = env.get(var)
    if raw is None or raw == "":
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = parse_duration(raw, what=var)
    if seconds <= 0:
        raise ConfigError(f"{var}: must be positive, got {raw!r}")
    return seconds


def _verify_seconds(env: Mapping[str, str], var: str, default: float) -> float:
    raw = (env.get(var) or "").strip()
    if raw in ("0", "0s", "off"):
        return 0.0
    value = _seconds(env, var, default)
    if value < 1:
        raise ConfigError(f"{var}: {value:g}s is too short (0 = off, else at least 1s)")
    return value


def _optional_seconds(env: Mapping[str, str], var: str) -> float | None:
    return _seconds(env, var, 0.0) if env.get(var) else None


def _addr(env: Mapping[str, str], var: str, default: str) -> str:
    raw = (env.get(var) or default).strip()
    try:
        ipaddress.ip_address(raw)
    except ValueError:
        raise ConfigError(f"{var}: {raw!r} is not an IP address (e.g. 0.0.0.0)") from None
    return raw


def _hosts(env: Mapping[str, str], var: str) -> tuple[str, ...] | None:
    raw = env.get(var)
    if raw is None:
        return None
    entries = [h.strip() for h in raw.split(",") if h.strip()]
    hint = "give host names or IP addresses, comma separated (e.g. 127.0.0.1,localhost), or *"
    if not entries:
        # An allow-list that is set but empty is a mistake, not "no restriction".
        raise ConfigError(f"{var}: empty ({raw!r}); {hint}")
    if ANY_HOST in entries:
        if len(entries) > 1:
            raise ConfigError(f"{var}: {raw!r}: * allows every host and cannot be combined "
                              "with host names")
        return None
    hosts: list[str] = []
    for entry in entries:
        host = _host_name(entry)
        if host is None:
            raise ConfigError(f"{var}: {entry!r} is not a host name (no scheme, port, path or "
                              f"wildcard); {hint}")
        if host not in hosts:
            hosts.append(host)
    return tuple(hosts)


def _host_name(entry: str) -> str | None:
    """``entry`` as the host part of a URL is compared (lower case, ``xn--`` form), or None."""
    text = entry.lower()
    literal = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(literal))
    except ValueError:
        pass
    try:
        name = text.encode("idna").decode("ascii") if not text.isascii() else text
    except UnicodeError:
        return None
    name = name.rstrip(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return None
    return name


def _port(env: Mapping[str, str], var: str) -> int | None:
    raw = env.get(var)
    if not raw:
        return None
    if not raw.isdigit() or not 0 <= int(raw) <= 65535:
        raise ConfigError(f"{var}: {raw!r} is not a TCP port (0-65535)")
    return int(raw)
