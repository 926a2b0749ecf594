"""``AuditedSentinelBackend``: the audited Redis result backend on a master found through Sentinel.

Teams running Redis highly available point Celery's result backend at ``sentinel://`` with the
master's name in ``result_backend_transport_options``; this is the same for the audited backend,
with Celery's own ``SentinelBackend`` doing the finding (each new connection asks the
sentinels; a ``READONLY`` reply from a demoted master drops the connection, and Celery's retry
policy sends the write again, to the new master). Every script, the fencing and the audit
stream are ``AuditedRedisBackend``'s.

Two URL forms (``result_backend``)::

    crawlredis+sentinel://[:password@]s1:26379,s2:26379,s3:26379/<master>/<db>
    crawlredis+sentinel://[:password@]s1:26379/<db>;sentinel://s2:26379/<db>;...
                                              (Celery's; master_name in the transport options)

(``crawlsentinel://`` is the same backend by its own name.) The first form is the lease store's
``redis+sentinel://`` grammar, so one URL serves both; its ``sentinel_password`` and
``sentinel_username`` options join the transport options' ``sentinel_kwargs``. TLS to the data
nodes is Celery's ``redis_backend_use_ssl`` and TLS to the sentinels the ``ssl`` and TLS options
of ``result_backend_transport_options["sentinel_kwargs"]``, as for Celery's ``SentinelBackend``;
a setting that is not a dict, names an unknown option or an unreadable file is a
``ConfigError`` naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import redis
import redis.sentinel
from celery.backends.redis import SentinelBackend

from .._urls import masked_url as mask_url
from ..errors import ConfigError
from ..leases._sentinel import is_sentinel_url, parse_sentinel_url
from .audited import TLS_OPTIONS, AuditedRedisBackend, check_tls_options

__all__ = ["AuditedSentinelBackend", "sentinel_identity"]

_SETTING = "result_backend"


def sentinel_identity(url: str) -> tuple[frozenset[tuple[str, int]], str, int] | None:
    """``(sentinel addresses, master name, db)`` of a ``redis+sentinel://`` URL (None for any
    other): two URLs reach the same data when the master and db match and a sentinel is
    shared."""
    if not is_sentinel_url(url):
        return None
    spec = parse_sentinel_url(url)
    return frozenset(_loopback(h, p) for h, p in spec.sentinels), spec.master, spec.db


def _loopback(host: str, port: int) -> tuple[str, int]:
    name = host.lower()
    return ("127.0.0.1" if name in ("localhost", "::1") else name), int(port)


class AuditedSentinelBackend(AuditedRedisBackend, SentinelBackend):
    """``AuditedRedisBackend`` on the master the sentinels name. Selected by
    ``crawlredis+sentinel://`` (or ``crawlsentinel://``).

    Raises:
        ConfigError: no master name (neither in the URL nor as ``master_name`` in
            ``result_backend_transport_options``), or two different ones.
    """

    #: The master's name from the URL (the lease store's form), else None.
    crawl_master: str | None = None
    #: The sentinels' connection arguments from the URL's options.
    crawl_sentinel_kwargs: dict[str, Any] = {}

    def _params_from_url(self, url: str, defaults: dict[str, Any]) -> dict[str, Any]:
        _checked_sentinel_kwargs(self._options().get("sentinel_kwargs"))  # at start-up
        scheme, sep, rest = url.partition("://")
        if scheme in ("crawlsentinel", "crawlredis+sentinel"):
            url = f"sentinel{sep}{rest}"
        if ";" in url or not _names_master(url):
            params: dict[str, Any] = super()._params_from_url(url, defaults)  # Celery's form
        else:
            spec = parse_sentinel_url(f"redis+{url}", setting=_SETTING)
            self.crawl_master = spec.master
            self.crawl_sentinel_kwargs = {k: v for k, v in spec.sentinel.items()
                                          if v is not None}
            params = {k: v for k, v in defaults.items() if k not in ("host", "port")}
            params["hosts"] = [{"host": h, "port": p} for h, p in spec.sentinels]
            params["db"] = spec.db
            for key in ("username", "password"):
                if spec.data.get(key) is not None:
                    params[key] = spec.data[key]
        self.crawl_master = self._master_name()
        return params

    def as_uri(self, include_password: bool = False) -> str:
        """The URL as configured, the password masked unless asked for (Celery's own
        ``SentinelBackend`` splits it at ``;`` and cannot parse the comma-separated form)."""
        url = str(self.url or "")
        return url if include_password else mask_url(url)

    def _options(self) -> dict[str, Any]:
        return dict(self.app.conf.get("result_backend_transport_options") or {})

    def _master_name(self) -> str:
        configured = self._options().get("master_name")
        if self.crawl_master is not None:
            if configured and configured != self.crawl_master:
                raise ConfigError(
                    f"{_SETTING}: the URL names master {self.crawl_master!r} but "
                    f"result_backend_transport_options' master_name is {configured!r}")
            return self.crawl_master
        if not configured:
            raise ConfigError(
                f"{_SETTING}: no master name; give it in the URL (.../<master>/<db>) or as "
                f"master_name in result_backend_transport_options")
        return str(configured)

    def _create_client(self, **params: Any) -> Any:
        """A client of the master the sentinels name, as Celery's ``SentinelBackend`` makes it
        (``min_other_sentinels`` and ``sentinel_kwargs`` from the transport options), the
        URL's sentinel options added."""
        options = self._options()
        hosts = params.pop("hosts")
        sentinel_kwargs = {**self.crawl_sentinel_kwargs,
                           **_checked_sentinel_kwargs(options.get("sentinel_kwargs"))}
        manager = redis.sentinel.Sentinel(
            [(h["host"], h["port"]) for h in hosts],
            min_other_sentinels=options.get("min_other_sentinels", 0),
            sentinel_kwargs=sentinel_kwargs or None, **params)
        credentials = {k: params[k] for k in ("username", "password") if k in params}
        return manager.master_for(self._master_name(), redis_class=redis.Redis, **credentials)

    def _lease_store_is_here(self) -> bool:
        """The lease store is here when it names the same master and db through a sentinel
        of this backend's (then the token counter it checks is the store's)."""
        lease = sentinel_identity(self.crawl_config.lease_url)
        if lease is None:
            return False
        hosts = frozenset(_loopback(str(h.get("host")), int(h.get("port") or 26379))
                          for h in self.connparams.get("hosts", ()))
        here = (self._master_name(), int(self.connparams.get("db") or 0))
        return (lease[1], lease[2]) == here and bool(lease[0] & hosts)


_SENTINEL_KWARGS = 'result_backend_transport_options["sentinel_kwargs"]'


def _checked_sentinel_kwargs(value: Any) -> dict[str, Any]:
    """The transport options' ``sentinel_kwargs`` (the sentinels' connection arguments, as
    Celery's ``SentinelBackend`` takes them: credentials, timeouts, ``ssl`` and the TLS options
    of ``redis_backend_use_ssl``), refused with a ``ConfigError`` naming the setting when not a
    dict of ``redis.Redis`` arguments or with bad TLS options."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_SENTINEL_KWARGS}: must be a dict of the sentinels' connection "
                          f"arguments, got {type(value).__name__}")
    accepted = set(inspect.signature(redis.Redis.__init__).parameters) - {"self"}
    unknown = sorted(str(k) for k in value if k not in accepted)
    if unknown:
        raise ConfigError(f"{_SENTINEL_KWARGS}: unknown argument(s) "
                          f"{', '.join(map(repr, unknown))} (redis.Redis arguments: username, "
                          f"password, ssl, {', '.join(TLS_OPTIONS[:4])}, socket_timeout, ...)")
    tls = {k: v for k, v in value.items() if k in TLS_OPTIONS}
    if tls and not value.get("ssl"):
        raise ConfigError(f"{_SENTINEL_KWARGS}: {', '.join(sorted(tls))} given without "
                          f"ssl=True (TLS to the sentinels)")
    check_tls_options(tls, _SENTINEL_KWARGS, require_cert_reqs=False)
    return dict(value)


def _names_master(url: str) -> bool:
    """Whether a ``sentinel://`` URL's path starts with a master name (not only a db)."""
    path = url.partition("://")[2].partition("?")[0].partition("/")[2]
    first = path.strip("/").partition("/")[0]
    return bool(first) and not first.isdigit()
