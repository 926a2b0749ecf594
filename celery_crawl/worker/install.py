"""``install_worker(app, config)``: register the worker steps and the settings they rely on."""

from __future__ import annotations

import logging
from typing import Any

from ..config import CrawlConfig

__all__ = ["install_worker"]

logger = logging.getLogger(__name__)


def _user_set(app: Any, key: str) -> bool:
    """Whether the app's own configuration sets ``key`` (not Celery's default).

    Celery's settings are a chain of maps: the app's changes, then each configuration source
    (``config_from_object``, ...), then the defaults last. Reading one value loads a pending
    configuration first.
    """
    conf = app.conf
    conf.get(key)
    maps = getattr(conf, "maps", None)
    if maps and len(maps) > 1:
        return any(key in m for m in maps[:-1])
    return key in getattr(conf, "changes", {})


def _bound_redis_broker(app: Any, config: CrawlConfig) -> None:
    """A Redis broker's ``socket_timeout`` (kombu waits forever by default) defaults to
    ``crawl_store_timeout``: claims and ends riding in kombu's round trips are made on the
    consumer's loop with kombu's client, and a worker cut off from Redis inside one must get
    its loop back within the overlap bound (``ride_gate.py``). An app that sets it keeps it."""
    url = app.conf.get("broker_url") or ""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "redis+socket")):
        return
    options = dict(app.conf.get("broker_transport_options") or {})
    if "socket_timeout" in options:
        return
    options["socket_timeout"] = config.store_timeout_s
    app.conf["broker_transport_options"] = options


def install_worker(app: Any, config: CrawlConfig | None = None) -> CrawlConfig:
    """Register ``LeaseStep`` and ``ClaimStep`` on ``app`` and turn on what recovery needs.

    Unless the app set them itself: ``task_acks_late = True`` (a message is acked only when its
    task ended, so a dead worker's task can be redelivered), ``task_reject_on_worker_lost =
    True`` (a killed child's task is requeued, and counted towards ``crawl_max_deliveries``) and
    ``broker_heartbeat`` no longer than half the worker TTL (RabbitMQ then drops a frozen
    worker's connection, and requeues its messages, about as fast as its lease expires).

    Idempotent. Returns the validated configuration.

    Raises:
        ConfigError: naming a bad ``crawl_*`` setting.
    """
    from . import (
        control,  # noqa: F401 - registers the crawl_leases remote command
        handoffs,
    )
    from .steps import ClaimStep, LeaseStep

    handoffs.connect()

    config = config or CrawlConfig.from_app(app)
    worker_steps = app.steps["worker"]
    consumer_steps = app.steps["consumer"]
    if not any(getattr(s, "name", None) == LeaseStep.name for s in worker_steps):
        worker_steps.add(LeaseStep)
    if not any(getattr(s, "name", None) == ClaimStep.name for s in consumer_steps):
        consumer_steps.add(ClaimStep)
    heartbeat = max(1, int(config.worker_lease_ttl_s // 2))
    for key, value in (("task_acks_late", True), ("task_reject_on_worker_lost", True),
                       ("broker_heartbeat", heartbeat)):
        if not _user_set(app, key):
            app.conf[key] = value
    _bound_redis_broker(app, config)
    if _user_set(app, "broker_heartbeat"):
        current = app.conf.get("broker_heartbeat")
        if current and current > config.worker_lease_ttl_s:
            logger.warning(
                "celery-crawl: broker_heartbeat=%ss is longer than crawl_worker_lease_ttl=%ss: "
                "RabbitMQ keeps a frozen worker's messages that long after its lease expired",
                current, config.worker_lease_ttl_s)
    return config
