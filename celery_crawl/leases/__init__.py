"""Lease stores: ``open_store(url)`` picks the driver by URL scheme.

``redis://`` and ``rediss://`` open :class:`~celery_crawl.leases.redis.RedisLeaseStore`;
``etcd://``, ``etcd+http://`` and ``etcd+https://`` open
:class:`~celery_crawl.leases.etcd.EtcdLeaseStore` (imported lazily: it needs the optional ``etcd``
extra, grpcio and protobuf, which a Redis-only install does not have); ``memory://name`` opens
:class:`~celery_crawl.leases.memory.MemoryLeaseStore`, in-process, for tests and single-process
demos (``crawl_lease_url`` does not accept it: it is never a deployment's store). Each driver's
module docstring gives its URL grammar; the operations they share are written once in
:mod:`~celery_crawl.leases._driver`.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from typing import TYPE_CHECKING

from .._urls import LEASE_SCHEMES, REDIS_LEASE_SCHEMES
from .._urls import masked_url as mask_url
from ..errors import ConfigError
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
    "driver_class",
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


# A driver module is imported on first use (etcd's needs the optional extra). Stores are opened
# on several threads (the status page's server threads beside the main thread); two threads
# importing one driver module at once can meet importlib's deadlock guard and one of them gets
# the module half initialized. One lock makes the first import of each driver whole.
_DRIVER_IMPORT = threading.Lock()


def driver_class(url: str) -> type[LeaseStore]:
    """The store class ``url``'s scheme names, its module imported (once, under one lock).

    Raises:
        ConfigError: unknown scheme, or an etcd URL without the ``etcd`` extra installed.
    """
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme != "memory" and scheme not in LEASE_SCHEMES:
        raise ConfigError(
            f"crawl_lease_url: unknown scheme {scheme!r} in {mask_url(url)!r} "
            f"(use one of {', '.join(LEASE_SCHEMES)})"
        )
    with _DRIVER_IMPORT:
        if scheme == "memory":
            from .memory import MemoryLeaseStore

            return MemoryLeaseStore
        if scheme in REDIS_LEASE_SCHEMES:
            from .redis import RedisLeaseStore

            return RedisLeaseStore
        from .etcd import EtcdLeaseStore

        return EtcdLeaseStore


def open_store(url: str, *, namespace: str, timeout_s: float = 2.0,
               redis_wait_replicas: int = 0) -> LeaseStore:
    """Open the lease store ``url`` for ``namespace``.

    Args:
        url: ``redis://``, ``rediss://``, ``etcd://``, ``etcd+http://``, ``etcd+https://``, or
            ``memory://name`` (in this process only; see :mod:`~celery_crawl.leases.memory`).
        namespace: prefix of every key, so several apps can share one store.
        timeout_s: bound of every store call.
        redis_wait_replicas: Redis only; ``WAIT`` for this many replicas after lease writes.

    Raises:
        ConfigError: unknown scheme or a malformed URL (message names ``crawl_lease_url``), or
            an etcd URL without the ``etcd`` extra installed (the message names the extra).
    """
    cls = driver_class(url)
    scheme = url.split("://", 1)[0]
    if scheme in REDIS_LEASE_SCHEMES:
        return cls(url, namespace=namespace, timeout_s=timeout_s,  # type: ignore[call-arg]
                   redis_wait_replicas=redis_wait_replicas)
    if redis_wait_replicas:
        if scheme == "memory":
            raise ConfigError("crawl_redis_wait_replicas: only applies to a Redis lease store")
        raise ConfigError("crawl_redis_wait_replicas: only applies to a Redis lease store "
                          "(etcd writes are already replicated by raft)")
    return cls(url, namespace=namespace, timeout_s=timeout_s)  # type: ignore[call-arg]


def store_for(config: CrawlConfig) -> LeaseStore:
    """Open the lease store a validated ``CrawlConfig`` names."""
    return open_store(config.lease_url, namespace=config.namespace,
                      timeout_s=config.store_timeout_s,
                      redis_wait_replicas=config.redis_wait_replicas)
