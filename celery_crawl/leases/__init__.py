"""Lease stores: ``open_store(url)`` picks the driver by URL scheme.

``redis://`` and ``rediss://`` open :class:`~celery_crawl.leases.redis.RedisLeaseStore`;
``etcd://``, ``etcd+http://`` and ``etcd+https://`` open
:class:`~celery_crawl.leases.etcd.EtcdLeaseStore` (imported lazily, because importing etcd3 sets
process-wide protobuf and gRPC options). Each driver's module docstring gives its URL grammar.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import TYPE_CHECKING

from ..config import LEASE_SCHEMES
from ..errors import ConfigError
from ._urls import masked_url as mask_url
from .base import (
    DRIFT,
    MARGIN_S,
    Characteristic,
    Claim,
    Lease,
    LeaseStore,
    StoreDiagnostics,
    require,
)

if TYPE_CHECKING:
    from ..config import CrawlConfig

__all__ = [
    "DRIFT",
    "MARGIN_S",
    "Characteristic",
    "Claim",
    "Lease",
    "LeaseStore",
    "StoreDiagnostics",
    "make_holder",
    "open_store",
    "require",
    "store_for",
]


def make_holder() -> str:
    """A holder id unique per process start: ``hostname:pid:random``.

    The random part makes a restarted process (even one that got the same pid, e.g. in a
    container) a different holder, so it never adopts its predecessor's claims.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def open_store(url: str, *, namespace: str, timeout_s: float = 2.0,
               redis_wait_replicas: int = 0) -> LeaseStore:
    """Open the lease store ``url`` for ``namespace``.

    Args:
        url: ``redis://``, ``rediss://``, ``etcd://``, ``etcd+http://`` or ``etcd+https://``.
        namespace: prefix of every key, so several apps can share one store.
        timeout_s: bound of every store call.
        redis_wait_replicas: Redis only; ``WAIT`` for this many replicas after lease writes.

    Raises:
        ConfigError: unknown scheme or a malformed URL (message names ``crawl_lease_url``).
        CrawlError: the etcd client library cannot be imported in this process.
    """
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in LEASE_SCHEMES:
        raise ConfigError(
            f"crawl_lease_url: unknown scheme {scheme!r} in {mask_url(url)!r} "
            f"(use one of {', '.join(LEASE_SCHEMES)})"
        )
    if scheme in ("redis", "rediss"):
        from .redis import RedisLeaseStore

        return RedisLeaseStore(url, namespace=namespace, timeout_s=timeout_s,
                               redis_wait_replicas=redis_wait_replicas)
    if redis_wait_replicas:
        raise ConfigError("crawl_redis_wait_replicas: only applies to a Redis lease store "
                          "(etcd writes are already replicated by raft)")
    from .etcd import EtcdLeaseStore

    return EtcdLeaseStore(url, namespace=namespace, timeout_s=timeout_s)


def store_for(config: CrawlConfig) -> LeaseStore:
    """Open the lease store a validated ``CrawlConfig`` names."""
    return open_store(config.lease_url, namespace=config.namespace,
                      timeout_s=config.store_timeout_s,
                      redis_wait_replicas=config.redis_wait_replicas)
