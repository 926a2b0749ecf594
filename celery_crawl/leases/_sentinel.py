"""The lease store's link to a Sentinel-managed Redis master: the URL grammar, the clients, and
the one rule for a failover.

Every call goes to the master Sentinel names (redis-py's ``SentinelConnectionPool``: each new
connection asks the sentinels first, a ``READONLY`` reply from a demoted master drops the
connection). On top of that, a call that failed *before anything could have been applied* — the
connection to the old master was refused, no sentinel names a master yet (failover under way),
or the old master, now a replica, answered ``READONLY`` (a replica refuses every write, so the
script wrote nothing) — asks the sentinels again and is sent once more to the master they name,
until ``crawl_store_timeout`` from the call's start is spent. A call that failed after it was
sent (the connection dropped while the reply was awaited) is not repeated: it may have been
applied, and its caller already handles a ``StoreUnavailable`` as a call with unknown outcome.

A replica is never written to: connections go only to the address the sentinels report as the
master (never the replicas'), and a write reaching a node that was demoted meanwhile is refused
by that node (``replica-read-only``, Redis's default).

Sentinel does not demote the old master at once: after ``SENTINEL FAILOVER``, or when a paused
master comes back, it keeps answering as a master (accepting writes that the new master never
gets) until a sentinel reconfigures it, seconds later. Connections made before the switch would
keep writing there, so the link asks the sentinels for the master's address again at most every
``recheck_s`` (one round trip to one sentinel, before a call), and at once before the next call
after a new connection found the master moved, and drops every connection of the store's
client open to another address: a store follows a switch within about a second, and a
connection opened before a pause of the master and idle through it (a batch lane) does not
write to it when it comes back.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs

import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from .._celery_compat import pool_connections, redis_socket
from .._urls import endpoint, split_credentials
from .._urls import masked_url as mask_url
from ..errors import ConfigError

__all__ = ["SENTINEL_SCHEMES", "SentinelLink", "SentinelSpec", "is_sentinel_url",
           "parse_sentinel_url"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", "sentinel_ssl")
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
              "none": ssl.CERT_NONE}
_YES = {"1": True, "true": True, "yes": True, "on": True,
        "0": False, "false": False, "no": False, "off": False}
#: redis-py's text for a ``READONLY`` reply on a Sentinel-managed master connection.
_DEMOTED = "previous master is now a slave"
#: Pause between two questions to the sentinels while none names a master.
_POLL_S = 0.05
#: Seconds between two checks of the master's address made before calls.
RECHECK_S = 0.5


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Sentinel-managed master (``redis+sentinel://``,
    ``rediss+sentinel://``)."""
    return url.split("://", 1)[0] in SENTINEL_SCHEMES


@dataclass(frozen=True)
class SentinelSpec:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    #: Connection arguments of the data nodes (credentials, TLS).
    data: dict[str, Any] = field(repr=False)
    #: Connection arguments of the sentinels (their own credentials, TLS).
    sentinel: dict[str, Any] = field(repr=False)


def parse_sentinel_url(url: str, *, setting: str = "crawl_lease_url") -> SentinelSpec:
    """``redis+sentinel://[[user]:password@]s1[:26379][,s2[:26379]...]/<master>[/<db>][?opts]``.

    The credentials are the data nodes'; the sentinels' own are the options
    ``sentinel_username`` and ``sentinel_password``. ``rediss+sentinel://`` speaks TLS to the
    data nodes (options ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``)
    and, with ``sentinel_ssl=yes``, to the sentinels too, with the same files.

    Raises:
        ConfigError: naming ``setting``, the masked URL and what is wrong.
    """
    masked = mask_url(url)
    scheme, user, password, rest = split_credentials(url)
    if scheme not in SENTINEL_SCHEMES:
        raise ConfigError(f"{setting}: {masked!r} is not a redis+sentinel:// or "
                          f"rediss+sentinel:// URL")
    rest, _, query = rest.partition("?")
    hosts, _, path = rest.partition("/")
    sentinels: list[tuple[str, int]] = []
    for one in hosts.split(","):
        if not one:
            raise ConfigError(f"{setting}: {masked!r}: an empty sentinel address")
        host, port = endpoint(one, 26379, masked=masked, bad=f"bad sentinel address {one!r}")
        sentinels.append((host or "localhost", port))
    master, _, db_text = path.strip("/").partition("/")
    if not master:
        raise ConfigError(f"{setting}: {masked!r}: no master name (the path is "
                          f"/<master name>/<db>, as the sentinels' `sentinel monitor` names it)")
    db_text = db_text.strip("/") or "0"
    if not db_text.isdigit():
        raise ConfigError(f"{setting}: {masked!r}: database {db_text!r} is not a number")
    secure = scheme == "rediss+sentinel"
    options: dict[str, str] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in (*_SENTINEL_OPTIONS, *_SSL_OPTIONS):
            raise ConfigError(f"{setting}: {masked!r}: unknown option {name!r} (known: "
                              f"{', '.join((*_SENTINEL_OPTIONS, *_SSL_OPTIONS))})")
        if (name in _SSL_OPTIONS or name == "sentinel_ssl") and not secure:
            raise ConfigError(f"{setting}: {masked!r}: {name!r} needs rediss+sentinel://")
        options[name] = values[-1]
    data: dict[str, Any] = {"db": int(db_text), "username": user, "password": password}
    tls: dict[str, Any] = {}
    if secure:
        tls = {"ssl": True, **{k: v for k, v in options.items() if k in _SSL_OPTIONS}}
        if "ssl_cert_reqs" in tls:
            reqs = str(tls["ssl_cert_reqs"]).lower()
            if reqs not in _CERT_REQS:
                raise ConfigError(f"{setting}: {masked!r}: ssl_cert_reqs must be one of "
                                  f"{', '.join(_CERT_REQS)}, got {tls['ssl_cert_reqs']!r}")
            tls["ssl_cert_reqs"] = _CERT_REQS[reqs]
        data.update(tls)
    sentinel: dict[str, Any] = {"username": options.get("sentinel_username") or None,
                                "password": options.get("sentinel_password") or None}
    if "sentinel_ssl" in options:
        flag = _YES.get(options["sentinel_ssl"].lower())
        if flag is None:
            raise ConfigError(f"{setting}: {masked!r}: sentinel_ssl must be yes or no, got "
                              f"{options['sentinel_ssl']!r}")
        if flag:
            sentinel.update(tls)
    return SentinelSpec(tuple(sentinels), master, int(db_text), data, sentinel)


class SentinelLink:
    """The sentinels of one store and its master client.

    Args:
        url: the store's URL (``parse_sentinel_url``).
        client_kwargs: ``redis.Redis`` arguments every connection shares (timeouts, decoding,
            no retries).
        timeout_s: the bound of one call, failover retries included.

    Attributes:
        master_changes: times a connection found the master at another address than the one
            before (each failover this process saw, counted once).
        on_master_change: called with the old and the new address at each such change (the
            metrics hook; None for none).
    """

    def __init__(self, url: str, client_kwargs: dict[str, Any], *, timeout_s: float) -> None:
        spec = parse_sentinel_url(url)
        self.url = mask_url(url)
        self.master_name = spec.master
        self.timeout_s = timeout_s
        self.master_changes = 0
        self.on_master_change: Callable[[tuple[str, int], tuple[str, int]], None] | None = None
        self._lock = threading.Lock()
        self.master: tuple[str, int] | None = None
        #: Seconds between two checks of the master's address (``recheck``).
        self.recheck_s = RECHECK_S
        self._checked = 0.0
        #: A connection found the master moved: the next recheck is due at once.
        self._sweep = False
        sentinel_kwargs = {
            **{k: v for k, v in spec.sentinel.items() if v is not None},
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
            "decode_responses": True, "protocol": 2,
            # No client retries (the default differs between redis-py releases): discovery
            # moves on to the next sentinel itself, each within the timeout.
            "retry": Retry(NoBackoff(), 0),
        }
        data = {**client_kwargs, **{k: v for k, v in spec.data.items() if k != "ssl"}}
        self._sentinel = Sentinel(list(spec.sentinels), sentinel_kwargs=sentinel_kwargs, **data)
        base = (SentinelManagedSSLConnection if spec.data.get("ssl")
                else SentinelManagedConnection)
        saw = self._saw

        class _Connection(base):  # type: ignore[valid-type,misc]
            """Reports the master address each new connection was made to."""

            def connect_to(self, address: Any) -> None:
                super().connect_to(address)
                saw((str(address[0]), int(address[1])))

        self._connection_class = _Connection
        self.client: redis_lib.Redis = self.master_for()

    def master_for(self, **overrides: Any) -> redis_lib.Redis:
        """A client of the current master (a pool of its own), with ``overrides`` of the
        connection arguments (e.g. a shorter timeout)."""
        client: redis_lib.Redis = self._sentinel.master_for(
            self.master_name, redis_class=redis_lib.Redis,
            connection_pool_class=SentinelConnectionPool,
            connection_class=self._connection_class, **overrides)
        return client

    def _saw(self, address: tuple[str, int]) -> None:
        with self._lock:
            before, self.master = self.master, address
            if before is None or before == address:
                return
            self.master_changes += 1
            # The next call's recheck looks at every connection now, whenever the last was:
            # this move was seen by one new connection, and the others may still be open to
            # the old master (a batch lane idle through a pause, for one).
            self._sweep = True
        log.warning("%s: master %r moved from %s:%s to %s:%s (failover)", self.url,
                    self.master_name, *before, *address)
        if self.on_master_change is not None:
            with contextlib.suppress(Exception):
                self.on_master_change(before, address)

    @staticmethod
    def unsent(exc: BaseException) -> bool:
        """Whether ``exc`` (a redis-py error, or a ``StoreError`` caused by one) shows the call
        could not have been applied: no master known, the connection to it not made, or a
        ``READONLY`` refusal from a demoted master."""
        seen: BaseException | None = exc
        for _ in range(4):
            if seen is None:
                return False
            if isinstance(seen, MasterNotFoundError | redis_lib.exceptions.ReadOnlyError):
                return True
            if isinstance(seen, redis_lib.exceptions.ConnectionError):
                text = str(seen)
                return _DEMOTED in text or "connecting to" in text
            seen = seen.__cause__
        return False

    def recheck(self) -> None:
        """Ask the sentinels where the master is, at most every ``recheck_s`` (at once after a
        connection found it moved); drop every connection of the store's client (pooled or
        taken) open to another address, so none writes to an old master again. A sentinel that
        does not answer leaves it to the calls' own errors."""
        now = time.monotonic()
        if not self._sweep and (now - self._checked < self.recheck_s or self.master is None):
            return
        swept, self._checked, self._sweep = self._sweep, now, False
        try:
            host, port = self._sentinel.discover_master(self.master_name)
        except (redis_lib.RedisError, OSError):
            self._sweep = swept
            return
        where = (str(host), int(port))
        for conn in pool_connections(self.client.connection_pool):
            # Compared with each connection's own address, not with the last one seen: a
            # connection made after the move already told ``_saw`` of it while one made
            # before it (idle through a pause, say) is still open to the old master, which
            # answers as a master until Sentinel demotes it.
            if redis_socket(conn) is not None and (
                    str(getattr(conn, "host", "")), int(getattr(conn, "port", 0) or 0)) != where:
                with contextlib.suppress(Exception):
                    conn.disconnect()

    def call(self, fn: Callable[[], _R], *, retry: Callable[[BaseException], bool],
             timeout_s: float | None = None) -> _R:
        """``fn()``, sent again while it fails with an error for which ``retry`` says so, until
        ``timeout_s`` (default the store's timeout) from now is spent (the sentinels are asked
        again before each new attempt: ``fn`` connects through them)."""
        bound = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        deadline = time.monotonic() + bound
        self.recheck()
        told = False
        while True:
            try:
                return fn()
            except Exception as exc:
                if not retry(exc) or time.monotonic() + _POLL_S >= deadline:
                    raise
                if not told:
                    told = True
                    log.info("%s; asking the sentinels for the master again", exc)
                # Until the sentinels agree the master is down they still name it: a pause, so
                # the bounded wait for the failover is a few questions, not a busy loop.
                time.sleep(_POLL_S)

    def close(self) -> None:
        """Close the master's and the sentinels' connections."""
        with contextlib.suppress(Exception):
            self.client.close()
        for each in self._sentinel.sentinels:
            with contextlib.suppress(Exception):
                each.close()
