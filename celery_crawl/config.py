"""Typed view of the ``crawl_*`` settings of a Celery app, validated once with clear errors."""

from __future__ import annotations

import dataclasses
import datetime as dt
import zoneinfo
from collections.abc import Mapping
from typing import Any

from ._urls import LEASE_SCHEMES, masked_url
from .durations import parse_duration
from .errors import ConfigError

__all__ = ["DEFAULTS", "LEASE_SCHEMES", "SCHEDULE_SOURCES", "CrawlConfig", "mask_url",
           "plain_redis_url", "schedule_sources"]

_REDIS_BACKEND_SCHEMES = {"redis": "redis", "rediss": "rediss", "crawlredis": "redis",
                          "crawlrediss": "rediss",
                          # crawlredis+cluster://: Celery hands the backend "cluster://..."
                          "cluster": "redis+cluster"}

#: Defaults, in one place (DESIGN.md "Settings").
DEFAULTS: dict[str, Any] = {
    "crawl_lease_url": None,
    "crawl_namespace": None,
    "crawl_beat_lease_ttl": 10.0,
    "crawl_worker_lease_ttl": 15.0,
    "crawl_reaper_interval": None,
    "crawl_max_clock_skew": 1.0,
    "crawl_schedule_paths": ["beat_schedules/*.toml"],
    "crawl_metrics_port": None,
    "crawl_metrics_addr": "127.0.0.1",
    "crawl_on_lease_loss": "cancel",
    "crawl_max_deliveries": 5,
    "crawl_done_ttl": None,
    "crawl_min_memory": None,
    "crawl_redis_wait_replicas": 0,
    "crawl_audit_maxlen": 1_000_000,
    "crawl_store_timeout": 2.0,
    "crawl_beat_verify_delivery": 0.0,
    "crawl_schedule_sources": ["files", "beat_schedule"],
    "crawl_beat_schedule_mismatch": "refuse",
}

#: Where the beat may take entries from (``crawl_schedule_sources``), in assembly order.
SCHEDULE_SOURCES = ("files", "beat_schedule", "django_celery_beat")

_MIN_TTL_S = 0.5


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``, safe for logs and errors; never raises."""
    return masked_url(url)


@dataclasses.dataclass(frozen=True)
class CrawlConfig:
    """Validated ``crawl_*`` settings. Durations are float seconds (``*_s``)."""

    lease_url: str
    namespace: str
    beat_lease_ttl_s: float
    worker_lease_ttl_s: float
    reaper_interval_s: float
    max_clock_skew_s: float
    schedule_paths: tuple[str, ...]
    metrics_port: int | None
    metrics_addr: str
    on_lease_loss: str
    max_deliveries: int
    done_ttl_s: float
    min_memory_bytes: int | None
    redis_wait_replicas: int
    audit_maxlen: int
    store_timeout_s: float
    beat_verify_delivery_s: float = 0.0
    schedule_sources: tuple[str, ...] = ("files", "beat_schedule")
    beat_schedule_mismatch: str = "refuse"

    @classmethod
    def from_app(cls, app: Any) -> CrawlConfig:
        """Read and validate the settings of a Celery app.

        Raises:
            ConfigError: naming the setting and what is wrong.
        """
        conf = app.conf
        values = {k: conf.get(k, v) for k, v in DEFAULTS.items()}
        if values["crawl_lease_url"] is None:
            backend = conf.get("result_backend")
            values["crawl_lease_url"] = plain_redis_url(backend) or sentinel_lease_url(backend)
        if values["crawl_namespace"] is None:
            values["crawl_namespace"] = getattr(app, "main", None) or "celery_crawl"
        if values["crawl_done_ttl"] is None:
            expires = conf.get("result_expires")
            values["crawl_done_ttl"] = (
                expires.total_seconds() if hasattr(expires, "total_seconds") else expires
            ) or 86400.0
        _check_timezone(conf.get("timezone"))
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CrawlConfig:
        """Validate a mapping of ``crawl_*`` settings (missing ones take their defaults)."""
        v = {**DEFAULTS, **values}
        if v["crawl_namespace"] is None:
            v["crawl_namespace"] = "celery_crawl"
        if v["crawl_done_ttl"] is None:
            v["crawl_done_ttl"] = 86400.0
        unknown = sorted(k for k in values if k.startswith("crawl_") and k not in DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r} (known: {', '.join(DEFAULTS)})")
        url = v["crawl_lease_url"]
        if not isinstance(url, str) or not url:
            raise ConfigError(
                "crawl_lease_url: not set, and the result backend is not Redis; set it to "
                "redis://..., rediss://... or etcd://host:2379"
            )
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in LEASE_SCHEMES:
            raise ConfigError(
                f"crawl_lease_url: unknown scheme {scheme!r} in {mask_url(url)!r} "
                f"(use one of {', '.join(LEASE_SCHEMES)})"
            )
        namespace = v["crawl_namespace"]
        if not isinstance(namespace, str) or not namespace or any(c in namespace for c in " \n{}"):
            raise ConfigError(f"crawl_namespace: {namespace!r} must be a non-empty word")
        beat_ttl = _ttl("crawl_beat_lease_ttl", v["crawl_beat_lease_ttl"], scheme)
        worker_ttl = _ttl("crawl_worker_lease_ttl", v["crawl_worker_lease_ttl"], scheme)
        reaper = v["crawl_reaper_interval"]
        reaper_s = worker_ttl / 3 if reaper is None else _dur("crawl_reaper_interval", reaper)
        if reaper_s <= 0:
            raise ConfigError("crawl_reaper_interval: must be positive")
        skew = _dur("crawl_max_clock_skew", v["crawl_max_clock_skew"])
        paths = v["crawl_schedule_paths"]
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, list | tuple) or not all(isinstance(p, str) for p in paths):
            raise ConfigError("crawl_schedule_paths: must be a list of glob strings")
        port = v["crawl_metrics_port"]
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
        ):
            raise ConfigError(f"crawl_metrics_port: {port!r} is not a TCP port (0-65535) or None")
        addr = v["crawl_metrics_addr"]
        if not isinstance(addr, str) or not addr or any(c.isspace() for c in addr):
            raise ConfigError(f"crawl_metrics_addr: {addr!r} is not a listen address")
        on_loss = v["crawl_on_lease_loss"]
        if on_loss not in ("cancel", "continue"):
            raise ConfigError(f"crawl_on_lease_loss: {on_loss!r} must be 'cancel' or 'continue'")
        max_del = _int("crawl_max_deliveries", v["crawl_max_deliveries"], minimum=1)
        done_ttl = _dur("crawl_done_ttl", v["crawl_done_ttl"])
        min_mem = v["crawl_min_memory"]
        min_mem_b = None if min_mem is None else _bytes("crawl_min_memory", min_mem)
        replicas = _int("crawl_redis_wait_replicas", v["crawl_redis_wait_replicas"], minimum=0)
        maxlen = _int("crawl_audit_maxlen", v["crawl_audit_maxlen"], minimum=1)
        timeout = _dur("crawl_store_timeout", v["crawl_store_timeout"])
        if timeout <= 0:
            raise ConfigError("crawl_store_timeout: must be positive")
        for name, ttl in (("crawl_beat_lease_ttl", beat_ttl),
                          ("crawl_worker_lease_ttl", worker_ttl)):
            if timeout >= ttl:
                raise ConfigError(
                    f"crawl_store_timeout: {timeout:g}s is not shorter than {name} ({ttl:g}s): "
                    "one hung renewal would outlast the lease; lower the timeout or raise "
                    "the ttl")
        verify = _dur("crawl_beat_verify_delivery", v["crawl_beat_verify_delivery"])
        if 0 < verify < 1:
            raise ConfigError(
                f"crawl_beat_verify_delivery: {verify:g}s is too short (0 = off, else >= 1s): "
                "a run must have time to reach a worker before it is looked for")
        sources = schedule_sources(v["crawl_schedule_sources"])
        mismatch = v["crawl_beat_schedule_mismatch"]
        if mismatch not in ("refuse", "warn"):
            raise ConfigError(f"crawl_beat_schedule_mismatch: {mismatch!r} must be 'refuse' "
                              "or 'warn'")
        return cls(
            lease_url=url, namespace=namespace, beat_lease_ttl_s=beat_ttl,
            worker_lease_ttl_s=worker_ttl, reaper_interval_s=reaper_s, max_clock_skew_s=skew,
            schedule_paths=tuple(paths), metrics_port=port, metrics_addr=addr,
            on_lease_loss=on_loss,
            max_deliveries=max_del, done_ttl_s=done_ttl, min_memory_bytes=min_mem_b,
            redis_wait_replicas=replicas, audit_maxlen=maxlen, store_timeout_s=timeout,
            beat_verify_delivery_s=verify, schedule_sources=sources,
            beat_schedule_mismatch=mismatch,
        )


def schedule_sources(value: object) -> tuple[str, ...]:
    """``crawl_schedule_sources`` validated: a list of known source names, each once.

    Raises:
        ConfigError: naming the setting and the bad value.
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
        raise ConfigError(f"crawl_schedule_sources: {value!r} must be a list of source names "
                          f"({', '.join(SCHEDULE_SOURCES)})")
    for name in value:
        if name not in SCHEDULE_SOURCES:
            raise ConfigError(f"crawl_schedule_sources: unknown source {name!r} "
                              f"(known: {', '.join(SCHEDULE_SOURCES)})")
    if len(set(value)) != len(value):
        raise ConfigError(f"crawl_schedule_sources: {list(value)!r} names a source twice")
    return tuple(value)


def plain_redis_url(url: object) -> str | None:
    """``redis://``/``rediss://`` for a broker or result-backend URL on Redis (``crawlredis://``
    and ``Class+redis://`` included), else None: the default lease store, and the reference
    clock of the beat's skew guard when the lease store (etcd) has none."""
    if not isinstance(url, str) or "://" not in url:
        return None
    scheme, rest = url.split("://", 1)
    mapped = _REDIS_BACKEND_SCHEMES.get(scheme.rsplit("+", 1)[-1])
    return f"{mapped}://{rest}" if mapped else None


def sentinel_lease_url(url: object) -> str | None:
    """``redis+sentinel://`` for an audited result backend behind Sentinel whose URL is in the
    lease store's form (``crawlredis+sentinel://s1,s2,s3/<master>/<db>``, ``crawlsentinel://``),
    else None (Celery's ``;``-separated form names no master: set ``crawl_lease_url``)."""
    if not isinstance(url, str) or ";" in url:
        return None
    scheme, _, rest = url.partition("://")
    if scheme not in ("crawlredis+sentinel", "crawlsentinel"):
        return None
    first = rest.partition("?")[0].partition("/")[2].strip("/").partition("/")[0]
    return f"redis+sentinel://{rest}" if first and not first.isdigit() else None


def _check_timezone(tz: object) -> None:
    """Celery's ``timezone`` names the zone of its own schedules (``crontab``, ``solar``) that
    the beat plugin runs; an unknown name would only fail at the first due check."""
    if tz is None or isinstance(tz, dt.tzinfo):
        return
    if not isinstance(tz, str) or not tz:
        raise ConfigError(f"timezone: {tz!r} is not an IANA zone name")
    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigError(f"timezone: {tz!r} is not a known IANA zone ({exc})") from None


def _dur(name: str, value: object) -> float:
    return parse_duration(value, what=name)


def _ttl(name: str, value: object, scheme: str) -> float:
    ttl = _dur(name, value)
    if ttl < _MIN_TTL_S:
        raise ConfigError(f"{name}: {ttl}s is too short to renew every ttl/3 (minimum 0.5s)")
    if scheme.startswith("etcd") and ttl < 2:
        raise ConfigError(f"{name}: etcd leases have a floor of 2s, got {ttl}s")
    return ttl


def _int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")
    return value


_SIZE = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2,
         "mib": 1024**2, "g": 1024**3, "gb": 1024**3, "gib": 1024**3}


def _bytes(name: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        num = text.rstrip("abgikm ")
        unit = text[len(num):].strip()
        try:
            if unit in _SIZE and float(num) > 0:
                return int(float(num) * _SIZE[unit])
        except ValueError:
            pass
    raise ConfigError(f"{name}: {value!r} is not a size like 512MiB or 2GB")
