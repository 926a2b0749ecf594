"""``AuditedRedisBackend``: Celery's Redis result backend with fencing and an audit stream.

Celery's ``RedisBackend`` guards only SUCCESS, with a GET and then a SET in two round trips: a
late STARTED or RETRY can overwrite a FAILURE, and a paused worker's stale result can overwrite a
newer one. Here every state write is one Lua script (``store.lua``) that decides, stores and
records in a single round trip:

* precedence: a ready state (SUCCESS, FAILURE, REVOKED) is never replaced by a non-ready one; a
  second ready write needs a higher claim token;
* fencing: a write carrying an older claim token than the stored one is refused, and a write
  without a token cannot overwrite a tokened result; with the Redis lease store on the same
  server (same host, port and db) the token must also have been issued
  (``token <= GET {namespace}:token``), otherwise only the order of tokens is enforced;
* ``SET`` with the result expiry and the ``PUBLISH`` that ``AsyncResult.get()`` waits on;
* ``XADD`` of an audit record (task, state, token, worker, digest, outcome, rollback) to the
  stream ``{namespace}:audit``, capped with ``MAXLEN ~ crawl_audit_maxlen``.

**Side paths of a refused run.** Celery's ``mark_as_done``/``mark_as_failure`` do more than
store: they count the task into its chord (``on_chord_part_return``), mark the rest of its chain
FAILURE (``_fail_chain``) and call its errbacks. When the ready write of a tokened run is refused
(a newer run of the task already wrote its result: this run is stale, fenced), none of these run
for it: the newer run's outcome is the one its chain and chord see. A run without a token and a
write that is not stored (``ignore_result``) keep Celery's behaviour.

The write is idempotent on (task, token, state, digest): a write retried after a lost reply
gets the first answer and adds no second record. The claim token is ``request.crawl_claim_token``
(set by the worker plugin); the worker is ``request.hostname``.

Results are JSON only, so that the stored value can be digested and inspected by
``celery crawl audit``: another ``result_serializer`` or ``result_compression`` is a
``ConfigError``, and a stored payload that is not JSON is refused with ``SerializationRefused``.

redis-py errors are translated at this backend's boundary (``ensure``, ``get``/``mget``/...,
``translate_errors``) into the ``StoreError`` tree, each naming the backend URL with the password
masked. A refusal that retrying cannot cure (credentials refused: ``AuthenticationError``,
``NOAUTH``, ``WRONGPASS``, a wrong number of ``AUTH`` arguments; a TLS certificate that is not
trusted or a client certificate the server refuses) is never retried: it is a
``StoreUnavailable`` at once. A ``NOPERM`` reply (the ACL user lacks a right) is a ``StoreError``,
also not retried. A connection that is refused, dropped or times out is retried per Celery's
``retry_policy`` and, when that gives up, is a ``StoreUnavailable`` (``StoreTimeout`` for a
timeout).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from importlib import resources
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any, Protocol
from urllib.parse import urlsplit

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError, TaskRevokedError
from kombu.exceptions import EncodeError
from kombu.utils.encoding import bytes_to_str
from redis import exceptions as redis_errors

from .. import _finishing as finishing
from .. import _issued as issued
from .._canvas import META_FIELD as CANVAS_FIELD
from .._canvas import canvas_key
from .._celery_compat import (
    call_task_errbacks,
    fail_chain,
    failure_expires,
    max_value_size,
    result_meta,
)
from ..config import CrawlConfig, mask_url
from ..errors import (
    ConfigError,
    FencedError,
    SerializationRefused,
    StoreDataError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from ..leases._lanes import Lanes
from ..leases.redis import token_counter_key

__all__ = [
    "GUARD_ATTR",
    "MARKED_ATTR",
    "MAX_TOKEN",
    "OUTCOMES",
    "REFUSED_ATTR",
    "AuditedRedisBackend",
    "FencedWrite",
    "WriteGuard",
    "audit_stream_key",
    "parse_token",
    "refusal_reason",
    "result_digest",
]

logger = logging.getLogger(__name__)

#: Outcomes recorded in the audit stream.
OUTCOMES = ("written", "refused-stale", "refused-regression", "refused-unissued",
            "refused-fenced", "forgotten")

_SCHEMES = {"crawlredis": "redis", "crawlrediss": "rediss", "cluster": "redis"}
_FENCE_PREFIX = "crawl-fence-"
_IDEM_PREFIX = "crawl-idem:"
_FORGOTTEN = "FORGOTTEN"
#: Request attribute set when this backend refused the request's ready write.
REFUSED_ATTR = "crawl_refused"
#: Request attribute an ``IdempotentTask`` run sets to have its SUCCESS write check that it
#: still owns its idempotency key (``WriteGuard``).
GUARD_ATTR = "crawl_idem_guard"
#: Request attribute naming the task id a run marked finished (``_finishing.mark``) itself.
MARKED_ATTR = "crawl_finish_marked"


#: The TLS options of ``redis_backend_use_ssl`` (Celery's, as for ``broker_use_ssl``) and of
#: ``sentinel_kwargs``, as redis-py names them.
TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path",
               "ssl_ca_data", "ssl_keyfile_password", "ssl_check_hostname", "ssl_password",
               "ssl_min_version", "ssl_ciphers")
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
              "none": ssl.CERT_NONE, "cert_required": ssl.CERT_REQUIRED,
              "cert_optional": ssl.CERT_OPTIONAL, "cert_none": ssl.CERT_NONE}


def check_tls_options(value: Any, setting: str, *, extra: tuple[str, ...] = (),
                      require_cert_reqs: bool = True) -> None:
    """Refuse a TLS setting Celery or redis-py would trip on later with a message naming
    neither it nor the option: ``value`` must be a dict (or None/empty) of known options
    (``TLS_OPTIONS`` and ``extra``) with ``ssl_cert_reqs`` one of required/optional/none (or
    the ``ssl`` module's constants), given when ``require_cert_reqs``; the files it names
    must be readable.

    Raises:
        ConfigError: naming ``setting`` and what is wrong.
    """
    if value is None or value == {}:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"{setting}: must be a dict of TLS options ({', '.join(TLS_OPTIONS[:4])}"
                          f"), got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in (*TLS_OPTIONS, *extra))
    if unknown:
        raise ConfigError(f"{setting}: unknown option(s) {', '.join(map(repr, unknown))} (known: "
                          f"{', '.join((*TLS_OPTIONS, *extra))})")
    reqs = value.get("ssl_cert_reqs")
    if reqs is None:
        if require_cert_reqs:
            raise ConfigError(f"{setting}: ssl_cert_reqs is required (required, optional or "
                              f"none; required verifies the server's certificate)")
    elif not (isinstance(reqs, ssl.VerifyMode) or str(reqs).lower() in _CERT_REQS):
        raise ConfigError(f"{setting}: ssl_cert_reqs must be required, optional or none (or "
                          f"ssl.CERT_*), got {reqs!r}")
    for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = value.get(key)
        if path and not os.access(str(path), os.R_OK):
            raise ConfigError(f"{setting}: {key} {str(path)!r} is not a readable file")


class WriteGuard(Protocol):
    """The ownership an ``IdempotentTask`` run's SUCCESS write must still have.

    A run that publishes nothing between its body and its result write (no callbacks, no
    chain) leaves its last ownership check to the write itself (``store.lua``, ``KEYS[4]``),
    which makes the check atomic with the write and saves the run a round trip of its own.
    """

    record_key: str
    run_id: str

    def fenced(self) -> BaseException:
        """Handle the refusal (roll this run's effects back): the exception it fails with."""


class FencedWrite(FencedError, EncodeError):
    """A run's SUCCESS write was refused because a newer run owns its idempotency key.

    Raised from ``mark_as_done``. Celery's tracer treats an ``EncodeError`` from there as the
    task's failure (FAILURE stored, ``on_failure``, errbacks), anything else as an internal
    error; the failure is stored as ``fenced``, the ``FencedError`` the run would have raised
    had it found the key gone before its write.
    """

    def __init__(self, fenced: BaseException) -> None:
        super().__init__(str(fenced))
        self.fenced = fenced

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.fenced,))


def result_digest(encoded_meta: str | bytes) -> str:
    """Digest of an encoded result meta *without* its ``date_done``.

    ``date_done`` is left out so that a write rebuilt by celery's retry loop (same task, token,
    state and value, a later ``date_done``) has the same digest and is recognised as a retry.
    """
    data = encoded_meta.encode() if isinstance(encoded_meta, str) else encoded_meta
    return hashlib.blake2b(data, digest_size=10).hexdigest()


def audit_stream_key(global_keyprefix: str, namespace: str) -> str:
    """Physical key of a namespace's audit stream."""
    return f"{global_keyprefix}{namespace}:audit"


def _script(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text()


def _token_counter_key(namespace: str, cluster: bool) -> str:
    return token_counter_key(namespace, cluster=cluster)


#: Claim tokens are compared in Lua, as doubles: beyond 2**53 they would lose precision.
MAX_TOKEN = 2**53 - 1


def parse_token(value: object) -> int | None:
    """A claim token from a header value: an int (or ASCII digits) in ``0..2**53-1``, else None.

    Anything else (floats, booleans, huge or negative numbers, other text) is not a token: the
    write is then untokened, which can never overwrite a tokened result.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        token = value
    elif isinstance(value, str | bytes) and 0 < len(value) <= 16:
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        if not (text.isascii() and text.isdigit()):
            return None
        token = int(text)
    else:
        return None
    return token if 0 <= token <= MAX_TOKEN else None


def _claim_token(request: Any) -> int | None:
    raw = getattr(request, "crawl_claim_token", None) if request is not None else None
    if raw is None:
        return None
    token = parse_token(raw)
    if token is None:
        logger.warning("ignoring malformed crawl_claim_token %.40r", raw)
    return token


_AUTH_ERRORS = (redis_errors.AuthenticationError,
                redis_errors.AuthenticationWrongNumberOfArgsError)
_AUTH_REPLIES = ("NOAUTH", "WRONGPASS")
#: Text of a TLS alert by which the server refused our client certificate.
_TLS_ALERTS = ("alert bad certificate", "alert certificate required", "alert unknown ca",
               "alert certificate unknown", "alert certificate expired",
               "alert certificate revoked", "alert access denied")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and, for a redis-py error, the error it wraps (redis-py reports TLS failures as
    the context). Only one level: further down is whatever the caller was handling (a task's
    own exception), which says nothing about the connection."""
    yield exc
    if isinstance(exc, redis_errors.RedisError):
        inner = exc.__cause__ or exc.__context__
        if inner is not None:
            yield inner


def refusal_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is a refusal that retrying cannot cure, or None when it may be transient.

    Returns:
        ``credentials refused``, ``permission denied``, ``TLS certificate not trusted``,
        ``TLS client certificate refused`` or ``TLS files unreadable``.
    """
    for err in _chain(exc):
        if isinstance(err, _AUTH_ERRORS):
            return "credentials refused"
        if isinstance(err, redis_errors.NoPermissionError):
            return "permission denied"
        if isinstance(err, redis_errors.ResponseError):
            text = str(err)
            if text.startswith(_AUTH_REPLIES):
                return "credentials refused"
            if text.startswith("NOPERM"):
                return "permission denied"
        if isinstance(err, ssl.SSLCertVerificationError):
            return "TLS certificate not trusted"
        if isinstance(err, ssl.SSLError):
            text = str(err).lower()
            if "certificate_verify_failed" in text:
                return "TLS certificate not trusted"
            if any(alert in text for alert in _TLS_ALERTS):
                return "TLS client certificate refused"
        if isinstance(err, FileNotFoundError | IsADirectoryError):
            return "TLS files unreadable"
        if isinstance(err, redis_errors.ConnectionError) and (
                "CERTIFICATE_VERIFY_FAILED" in str(err)):
            return "TLS certificate not trusted"
    return None


def _server_identity(host: object, port: object, db: object) -> tuple[str, int, int]:
    name = str(host or "localhost").lower()
    if name in ("localhost", "::1", "[::1]"):
        name = "127.0.0.1"
    return name, int(str(port or 6379)), int(str(db or 0).strip("/") or 0)


class AuditedRedisBackend(RedisBackend):
    """Redis result backend whose every state write is fenced, precedence-checked and audited.

    URL grammar (``result_backend``)::

        crawlredis://[user:password@]host[:port][/db]
        crawlrediss://[user:password@]host[:port][/db]?ssl_cert_reqs=required&ssl_ca_certs=...
        celery_crawl.backends:AuditedRedisBackend+redis://host:port/db   (or +rediss://)
        crawlredis+cluster://[user:password@]host[:port]   (one node of a Redis Cluster)

    On a Redis Cluster every key of the backend (results, group and chord keys, fence and
    idempotency records, the audit stream) starts with the hash tag ``{namespace}:`` — the lease
    store's tag — so every script's keys, and the token counter it checks, share one slot; the
    backend talks to the master owning that slot (found with ``CLUSTER SLOTS``; again after a
    ``MOVED`` reply, which fails that one call as ``StoreUnavailable``).

    ``crawlrediss`` is mapped to TLS explicitly: Celery switches TLS on only for ``rediss``.
    Everything else (groups, chords, ``result_extended``, ``global_keyprefix``, ``get()``,
    revoke, the connection retry policy) is Celery's own ``RedisBackend``.

    Raises:
        ConfigError: on a ``result_serializer`` other than ``json``, on ``result_compression``,
            or on invalid ``crawl_*`` settings.
    """

    #: Results are stored as plain JSON text, to be digested and read by ``celery crawl audit``.
    supports_result_compression = False

    def __new__(cls, *args: Any, **kwargs: Any) -> AuditedRedisBackend:
        """``crawlredis+sentinel://`` reaches this class as a ``sentinel://`` URL (Celery splits
        the scheme at its ``+``): that one is an ``AuditedSentinelBackend``."""
        if cls is AuditedRedisBackend and str(kwargs.get("url") or "").startswith("sentinel://"):
            from .sentinel import AuditedSentinelBackend

            cls = AuditedSentinelBackend
        made: AuditedRedisBackend = object.__new__(cls)
        return made

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs.get("app") or (args[0] if args else None)
        if app is not None:
            conf = app.conf
            serializer = kwargs.get("serializer") or conf.result_serializer
            if serializer != "json":
                raise ConfigError(
                    f"result_serializer: {serializer!r} is not supported by AuditedRedisBackend; "
                    "results are audited and digested as JSON, set result_serializer = 'json'"
                )
            if conf.get("result_compression"):
                raise ConfigError(
                    "result_compression: not supported by AuditedRedisBackend; results are "
                    "stored as JSON text so that `celery crawl audit` can read them"
                )
            check_tls_options(conf.get("redis_backend_use_ssl"), "redis_backend_use_ssl")
        super().__init__(*args, **kwargs)
        self.crawl_config = CrawlConfig.from_app(self.app)
        options = self.app.conf.get("result_backend_transport_options") or {}
        prefix = options.get("global_keyprefix") or ""
        if prefix and prefix[-1] not in ":_-.":
            prefix += "_"
        namespace = self.crawl_config.namespace
        if self.crawl_cluster:
            tag = f"{{{namespace}}}:"
            prefix = tag + prefix
            for attr in ("task_keyprefix", "group_keyprefix", "chord_keyprefix"):
                setattr(self, attr, self.key_t(tag) + getattr(self, attr))
        self.crawl_keyprefix: str = prefix
        self.audit_key: str = audit_stream_key(prefix, namespace)
        self.token_counter_key: str = _token_counter_key(namespace, self.crawl_cluster)
        self.checks_token_issuance: bool = self._lease_store_is_here()
        #: The highest value of the lease store's token counter read so far (it only grows).
        self._issued_floor = 0
        #: The connections of ``_round_trip`` (``leases._lanes``).
        self._lanes = Lanes()

    # -- URL ------------------------------------------------------------------------------------
    #: ``crawlredis+cluster://`` (Celery passes the URL on as ``cluster://``).
    crawl_cluster = False

    def _params_from_url(self, url: str, defaults: dict[str, Any]) -> dict[str, Any]:
        scheme, sep, rest = url.partition("://")
        if scheme == "cluster":
            configured = str(self.app.conf.get("result_backend") or "")
            if not configured.startswith("crawlredis+cluster://"):
                # Celery splits "X+cluster://" into a backend name and "cluster://": a TLS
                # scheme (crawlrediss+cluster) would arrive here as plain text.
                raise ConfigError(
                    f"result_backend: {mask_url(configured)!r}: only crawlredis+cluster:// "
                    "names a Redis Cluster (TLS to a cluster is not supported by the backend)")
            self.crawl_cluster = True
        mapped = _SCHEMES.get(scheme)
        if mapped is not None:
            url = f"{mapped}{sep}{rest}"
        params: dict[str, Any] = super()._params_from_url(url, defaults)
        return params

    def _create_client(self, **params: Any) -> Any:
        """Celery's client; on a cluster, of the master owning the namespace's slot."""
        if not self.crawl_cluster:
            return super()._create_client(**params)
        from redis.crc import key_slot

        slot = key_slot(self.token_counter_key.encode())
        seed = super()._create_client(**params)
        try:
            ranges = seed.execute_command("CLUSTER", "SLOTS")
        finally:
            seed.connection_pool.disconnect()
        for first, last, master, *_ in ranges or ():
            if int(first) <= slot <= int(last):
                host = bytes_to_str(master[0]) or params.get("host")
                return super()._create_client(**{**params, "host": host, "port": int(master[1])})
        raise redis_errors.ConnectionError(f"no cluster master serves slot {slot}")

    def _lease_store_is_here(self) -> bool:
        url = self.crawl_config.lease_url
        if self.crawl_cluster and url.startswith("redis+cluster://"):
            url = "redis://" + url.split("://", 1)[1]
        if not url.startswith(("redis://", "rediss://")):
            return False
        params = self.connparams
        if "host" not in params:  # unix socket: compare nothing, enforce order only
            return False
        try:
            parts = urlsplit(url)
            lease = _server_identity(parts.hostname, parts.port, parts.path or 0)
        except ValueError as exc:
            raise ConfigError(f"crawl_lease_url: cannot parse {mask_url(url)!r}: {exc}") from exc
        return lease == _server_identity(params.get("host"), params.get("port"), params.get("db"))

    # -- errors ---------------------------------------------------------------------------------
    @property
    def safe_url(self) -> str:
        """The backend's URL with the password masked, as errors name it."""
        if self.url:
            return mask_url(str(self.url))
        params = self.connparams
        if "path" in params:
            return f"unix://{params['path']}"
        return f"redis://{params.get('host')}:{params.get('port')}/{params.get('db') or 0}"

    def store_error(self, exc: BaseException, what: str = "") -> StoreError:
        """The ``StoreError`` for a redis-py (or socket) error ``exc``, naming the masked URL."""
        where = f"result backend {self.safe_url}" + (f": {what}" if what else "")
        redirected = isinstance(exc, redis_errors.AskError | redis_errors.ClusterDownError
                                | redis_errors.TryAgainError)  # MovedError is an AskError
        # redis-py before 6 answers a cluster node's CROSSSLOT to a plain client as a bare
        # ResponseError.
        cross_slot = isinstance(exc, redis_errors.ClusterCrossSlotError) or (
            isinstance(exc, redis_errors.ResponseError) and str(exc).startswith("CROSSSLOT"))
        if not self.crawl_cluster and (redirected or cross_slot):
            return StoreError(f"{where}: the server is a Redis Cluster node; name it with "
                              f"crawlredis+cluster:// ({exc})")
        if redirected:
            self.__dict__.pop("client", None)  # the next call finds the slot's master again
            return StoreUnavailable(f"{where}: the cluster moved the slot or is down: {exc}")
        reason = refusal_reason(exc)
        if reason == "permission denied":
            return StoreError(f"{where}: {reason}: {exc}")
        if reason is not None:
            detail = str(exc)
            inner = [str(e) for e in _chain(exc)][1:]
            if inner and inner[0] not in detail:  # redis-py's text drops the TLS reason
                detail = f"{detail} ({inner[0]})"
            return StoreUnavailable(f"{where}: {reason} (not retried): {detail}")
        if isinstance(exc, redis_errors.TimeoutError | socket.timeout):
            return StoreTimeout(f"{where}: no answer in time: {exc}")
        if isinstance(exc, redis_errors.ConnectionError | OSError):
            return StoreUnavailable(f"{where}: {exc}")
        if isinstance(exc, redis_errors.ResponseError) and str(exc).startswith("WRONGTYPE"):
            return StoreDataError(f"{where}: a key holds data celery-crawl did not write: {exc}")
        return StoreError(f"{where}: {exc}")

    @contextlib.contextmanager
    def translate_errors(self, what: str = "") -> Iterator[None]:
        """Raise every redis-py (or socket) error inside as a ``StoreError`` (``store_error``)."""
        try:
            yield
        except (redis_errors.RedisError, OSError) as exc:
            raise self.store_error(exc, what) from exc

    def ensure(self, fun: Callable[..., Any], args: Any, **policy: Any) -> Any:
        """Celery's ``ensure`` (retries per ``retry_policy``), except that a refusal is not retried.

        Raises:
            StoreUnavailable: credentials or TLS refused (at once, see ``refusal_reason``), or
                the server stayed unreachable through the retries.
            StoreTimeout: the server stayed silent through the retries.
            StoreError: any other Redis error (``NOPERM``: the ACL user lacks a right).
        """
        def attempt(*call_args: Any) -> Any:
            try:
                return fun(*call_args)
            except (redis_errors.RedisError, OSError) as exc:
                if refusal_reason(exc) is not None:
                    raise self.store_error(exc) from exc
                raise

        # The first attempt is made here, outside Celery's retry loop: almost every call
        # succeeds at once, and building the loop (policy dict, interval generator, errback)
        # cost more than the rest of the call's Python. A connection error hands the loop
        # that very failure as its first attempt's, so the retries, their pauses, their log
        # lines and a policy's ``timeout`` (counted from this attempt's start) are Celery's.
        started = time.monotonic()
        try:
            try:
                return attempt(*args)
            except self.connection_errors as exc:
                failed: list[BaseException] = [exc]

            def again(*call_args: Any) -> Any:
                if failed:
                    raise failed.pop()
                return attempt(*call_args)

            timeout = dict(self.retry_policy, **policy).get("timeout")
            if timeout:
                policy = {**policy, "timeout": max(
                    float(timeout) - (time.monotonic() - started), 1e-6)}
            return super().ensure(again, args, **policy)
        except (redis_errors.RedisError, OSError) as exc:
            raise self.store_error(exc) from exc

    def run_script(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """``EVALSHA`` of a script registered with ``register_script``, on the current client.

        What redis-py's ``Script.__call__`` does for a plain client (``EVALSHA``; on
        ``NOSCRIPT`` a ``SCRIPT LOAD`` and the call again), without its per-call imports,
        type checks and argument copies: it runs for every task, twice for an
        ``IdempotentTask``.
        """
        try:
            return self._round_trip(("EVALSHA", script.sha, len(keys), *keys, *args))
        except redis_errors.NoScriptError:
            script.sha = self.client.script_load(script.script)
            return self._round_trip(("EVALSHA", script.sha, len(keys), *keys, *args))

    def _round_trip(self, command: tuple[Any, ...]) -> Any:
        """One command on a connection of this backend's own (``_lanes``), else as redis-py's
        ``execute_command`` sends it.

        ``execute_command`` takes a connection from the client's pool and gives it back for
        every command, with the pool's lock, its bookkeeping and metrics, and a non-blocking
        read that checks the connection holds no leftover data: more Python than the rest of a
        script call. Here a connection, taken from the pool once, is used by one call at a time
        (a free list; a thread takes one, so threads never share a connection) and is
        disconnected on any failure but an error reply (read whole), so none is ever left with
        unread data. As in ``execute_command``, the connection's ``retry`` (redis-py's retries
        of a connection error or timeout, reconnecting in between) runs around the command,
        and an error it gives up on goes to ``ensure`` (Celery's retries).
        """
        client = self.client
        if client.connection is not None:  # a single-connection client: its own lock
            return client.execute_command(*command)
        taken = self._lanes.take(client)
        conn = taken[0]

        def send() -> Any:
            conn.send_command(*command)
            return conn.read_response()

        try:
            reply = conn.retry.call_with_retry(send, lambda _error: conn.disconnect())
        except redis_errors.ResponseError:
            Lanes.give(taken)
            raise
        except BaseException:
            # e.g. a soft time limit inside the read: the reply is unread.
            Lanes.give(taken, broken=True)
            raise
        Lanes.give(taken)
        callback = client.response_callbacks.get(command[0])
        return reply if callback is None else callback(reply)

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        """For ``result_backend_always_retry``: transient connection failures only."""
        if isinstance(exc, StoreUnavailable | StoreTimeout):
            cause = exc.__cause__
            return cause is not None and refusal_reason(cause) is None
        return bool(super().exception_safe_to_retry(exc)) and refusal_reason(exc) is None

    def get(self, key: Any) -> Any:
        """``GET``, errors translated."""
        with self.translate_errors("GET"):
            return self.client.get(key)

    def mget(self, keys: Any) -> Any:
        """``MGET``, errors translated."""
        with self.translate_errors("MGET"):
            return self.client.mget(keys)

    def delete(self, key: Any) -> None:
        """``DEL``, errors translated."""
        with self.translate_errors("DEL"):
            self.client.delete(key)

    def incr(self, key: Any) -> Any:
        """``INCR``, errors translated."""
        with self.translate_errors("INCR"):
            return self.client.incr(key)

    def expire(self, key: Any, value: Any) -> Any:
        """``EXPIRE``, errors translated."""
        with self.translate_errors("EXPIRE"):
            return self.client.expire(key, value)

    # -- keys -----------------------------------------------------------------------------------
    def fence_key(self, task_id: str) -> str:
        """Fence record of one task (stored token, state, digest, last attempt)."""
        return f"{self.crawl_keyprefix}{_FENCE_PREFIX}{task_id}"

    @property
    def fence_prefix(self) -> str:
        """Prefix of every fence record (the task id follows)."""
        return f"{self.crawl_keyprefix}{_FENCE_PREFIX}"

    def idempotency_key(self, namespace: str, key: str) -> str:
        """Record of one idempotency key (see ``celery_crawl.tasks``)."""
        return f"{self.crawl_keyprefix}{_IDEM_PREFIX}{namespace}:{key}"

    # -- scripts --------------------------------------------------------------------------------
    @cached_property
    def _store_script(self) -> Any:
        return self.client.register_script(_script("store.lua"))

    @cached_property
    def idem_begin_script(self) -> Any:
        """``idem_begin.lua`` registered on this backend's client."""
        return self.client.register_script(_script("idem_begin.lua"))

    @cached_property
    def idem_update_script(self) -> Any:
        """``idem_update.lua`` registered on this backend's client."""
        return self.client.register_script(_script("idem_update.lua"))

    # -- encoding -------------------------------------------------------------------------------
    def decode(self, payload: Any) -> Any:
        """Decode a stored JSON payload.

        Raises:
            SerializationRefused: the payload is not JSON (e.g. a pickle aimed at this backend).
        """
        if payload is None:
            return None
        raw = payload if isinstance(payload, bytes) else str(payload).encode()
        if raw[:1] == b"\x80" or raw.lstrip()[:1] not in (b"{", b"["):
            raise SerializationRefused(
                "AuditedRedisBackend: refused a stored payload that is not JSON "
                f"(starts with {raw[:8]!r}); only result_serializer='json' is accepted"
            )
        try:
            return super().decode(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SerializationRefused(
                f"AuditedRedisBackend: refused a stored payload that is not valid JSON: {exc}"
            ) from exc

    def _get_result_meta(self, result: Any, state: str, traceback: Any, request: Any,
                         format_date: bool = True, encode: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = super()._get_result_meta(
            result, state, traceback, request, format_date=format_date, encode=encode)
        token = _claim_token(request)
        if token is not None:
            meta["crawl_token"] = token
        rollback = getattr(request, "crawl_rollback", None) if request is not None else None
        if rollback:
            meta["crawl_rollback"] = rollback
        if request is not None and state in states.READY_STATES:
            # Which canvas this outcome went to: a later copy of the message from another
            # canvas gets it replayed (celery_crawl.worker.replay).
            canvas = canvas_key(lambda name: getattr(request, name, None))
            if canvas is not None:
                meta[CANVAS_FIELD] = canvas
        return meta

    def encode_meta(self, meta: dict[str, Any]) -> tuple[str, str]:
        """Encode a result meta; returns ``(stored value, digest)``.

        ``date_done`` is spliced in last, after the digest was taken over the rest, so one
        encoding serves both (see ``result_digest``).
        """
        body = dict(meta)
        date_done = body.pop("date_done", None)
        encoded = bytes_to_str(self.encode(body))
        digest = result_digest(encoded)
        if not encoded.endswith("}"):
            raise BackendStoreError("result meta did not encode to a JSON object")
        sep = ", " if len(encoded) > 2 else ""
        done = "null" if date_done is None else (
            _json_str(date_done) if type(date_done) is str else json.dumps(date_done))
        value = f'{encoded[:-1]}{sep}"date_done": {done}}}'
        return value, digest

    def stored_digest(self, value: bytes | str) -> str:
        """Digest of a stored result, computed as at write time (for ``audit verify``)."""
        meta = self.decode(value)
        if not isinstance(meta, dict):
            raise SerializationRefused("stored result is not a JSON object")
        meta.pop("date_done", None)
        return result_digest(bytes_to_str(self.encode(meta)))

    # -- writes ---------------------------------------------------------------------------------
    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        if state in states.READY_STATES:
            # The body has returned: a lease loss from here on must not kill this run (its
            # work is done); the worker plugin reads the mark (see _finishing.py). A run that
            # marked itself already (IdempotentTask, right after its body: MARKED_ATTR) is not
            # marked twice: a mark stays until its delivery ends.
            tid = bytes_to_str(task_id)
            if request is None or getattr(request, MARKED_ATTR, None) != tid:
                finishing.mark(tid)
        meta = result_meta(self, result, state, traceback, request)
        meta["task_id"] = bytes_to_str(task_id)
        value, digest = self.encode_meta(meta)
        if len(value) > max_value_size(self):
            raise BackendStoreError("value too large for Redis backend", state=state,
                                    task_id=task_id)
        token = _claim_token(request)
        worker = getattr(request, "hostname", None) if request is not None else None
        rollback = getattr(request, "crawl_rollback", None) if request is not None else None
        guard = (getattr(request, GUARD_ATTR, None)
                 if request is not None and state == states.SUCCESS else None)
        expires = failure_expires(self) if state == states.FAILURE else self.expires
        outcome = self.write_state(
            task_id, value, state, token=token, digest=digest, worker=worker or "",
            rollback=rollback or "", expires_s=int(expires or 0),
            guard=(guard.record_key, guard.run_id) if guard is not None else None,
            operator_revoke=bool(kwargs.get("crawl_operator_revoke")) and token is None)
        if outcome != "written":
            logger.warning("result of task %s (%s, token %s) %s", task_id, state, token, outcome)
            if request is not None and (token is not None or outcome == "refused-fenced") and (
                    state in states.READY_STATES):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(request, REFUSED_ATTR, outcome)
        return result

    @staticmethod
    def refused(request: Any) -> str | None:
        """The outcome that refused ``request``'s ready write (a stale run), or None."""
        outcome = getattr(request, REFUSED_ATTR, None) if request is not None else None
        return outcome if isinstance(outcome, str) else None

    def _stale(self, task_id: str, request: Any, what: str) -> bool:
        outcome = self.refused(request)
        if outcome is None:
            return False
        logger.warning("task %s: its result was %s (a newer run wrote first); not running "
                       "%s for this stale run", task_id, outcome, what)
        return True

    def mark_as_done(self, task_id: str, result: Any, request: Any = None,
                     store_result: bool = True, state: str = states.SUCCESS) -> None:
        """Celery's, except that a refused (stale) run is not counted into its chord, and
        that a run whose key was taken over fails (``FencedWrite``)."""
        if store_result and not (request is not None and request.ignore_result):
            self.store_result(task_id, result, state, request=request)
            guard = getattr(request, GUARD_ATTR, None) if request is not None else None
            if guard is not None:
                setattr(request, GUARD_ATTR, None)
                if self.refused(request) == "refused-fenced":
                    # The FAILURE write that follows is judged on its own.
                    setattr(request, REFUSED_ATTR, None)
                    raise FencedWrite(guard.fenced())
            if self._stale(task_id, request, "its chord part"):
                return
        if request and request.chord:
            self.on_chord_part_return(request, state, result)

    def mark_as_failure(self, task_id: str, exc: Any, traceback: Any = None,
                        request: Any = None, store_result: bool = True,
                        call_errbacks: bool = True, state: str = states.FAILURE) -> None:
        """Celery's, except that a refused (stale) run has no side effects: no chord part,
        no FAILURE of the rest of its chain, no errbacks."""
        if isinstance(exc, FencedWrite):
            exc = exc.fenced
        if store_result:
            self.store_result(task_id, exc, state, traceback=traceback, request=request)
            if self._stale(task_id, request, "its chord part, chain failure or errbacks"):
                return
        if request:
            if request.chord:
                self.on_chord_part_return(request, state, exc)
            fail_chain(self, getattr(request, "chain", None), exc, traceback,
                       store_result=store_result, state=state)
            if call_errbacks and request.errbacks:
                call_task_errbacks(self, request, exc, traceback)

    def mark_as_revoked(self, task_id: str, reason: str = "", request: Any = None,
                        store_result: bool = True, state: str = states.REVOKED) -> None:
        """Celery's, with three differences.

        A revoke from outside any run (no ``request``: the worker's ``revoke`` command, which
        Celery 5.7 records for a task that is not running) is an operator's, not a stale write:
        it may replace a state a run wrote with its claim token while no run is going
        (PENDING, RECEIVED, RETRY, REJECTED), and keeps that token, so the run that wrote it
        cannot overwrite the revoke; a run going (STARTED, a custom state) or a ready result is
        left alone, judged in the same script as the write. A refused (stale) run is not
        counted into its chord. A task that expired carrying a crawl deadline names the
        deadline in its reason.
        """
        deadline = getattr(request, "crawl_deadline", None) if request is not None else None
        if reason == "expired" and isinstance(deadline, str):
            reason = f"expired: its crawl deadline {deadline} passed before it started"
        exc = TaskRevokedError(reason)
        if store_result:
            self.store_result(task_id, exc, state, traceback=None, request=request,
                              crawl_operator_revoke=request is None)
            if self._stale(task_id, request, "its chord part"):
                return
        if request and request.chord:
            self.on_chord_part_return(request, state, exc)

    def write_state(self, task_id: str, value: str, state: str, *, token: int | None,
                    digest: str, worker: str = "", rollback: str = "",
                    expires_s: int = 0, guard: tuple[str, str] | None = None,
                    operator_revoke: bool = False) -> str:
        """Run the store script (one round trip, retried on connection errors).

        Returns:
            The audited outcome: ``written``, ``refused-stale``, ``refused-regression`` or
            ``refused-unissued``; ``refused-fenced`` when ``guard`` (an idempotency key's
            record, a run id) no longer holds: another run owns that key.

        Raises:
            StoreError: see ``ensure``.
        """
        keys = [bytes_to_str(self.get_key_for_task(task_id)), self.fence_key(task_id),
                self.audit_key]
        args = [value, state, "1" if state in states.READY_STATES else "0",
                "" if token is None else str(token), digest, expires_s,
                self.crawl_config.audit_maxlen, worker, rollback,
                "1" if self.checks_token_issuance else "0", task_id, self.token_counter_key]
        if guard is not None:
            keys.append(guard[0])
        args.append("1" if operator_revoke else "0")
        reply = self.ensure(self._run_store, (keys, args, guard[1] if guard else ""))
        return str(bytes_to_str(reply[0]))

    def _run_store(self, keys: list[str], args: list[Any], run_id: str = "") -> Any:
        token = args[3]
        if args[9] == "1" and token and not int(token) <= self._issued_floor:
            if issued.vouched():
                # A worker with the plugins: its requests' tokens are issued claims'
                # (``_issued.py``), so the counter is at least this token.
                self._issued_floor = int(token)
            else:
                # The script must not read the counter (an undeclared key; see store.lua): it
                # is read here first. Tokens at or below a counter value seen before need no
                # read.
                raw = self.client.get(args[11])
                if raw is not None and bytes_to_str(raw).isdigit():
                    self._issued_floor = max(self._issued_floor, int(bytes_to_str(raw)))
        # A new list: a retried call (``ensure``) gets the same ``args`` again.
        return self.run_script(self._store_script, keys,
                               [*args[:11], str(self._issued_floor), run_id, args[12]])

    def _forget(self, task_id: str) -> None:
        # Forgetting is recorded, so that `audit verify` expects the result to be gone.
        with self.translate_errors("forget"), self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.get_key_for_task(task_id), self.fence_key(task_id))
            pipe.xadd(self.audit_key, {
                "task": task_id, "state": _FORGOTTEN, "token": "", "worker": "", "digest": "",
                "outcome": "forgotten", "rollback": "",
            }, maxlen=self.crawl_config.audit_maxlen, approximate=True)
            pipe.execute()
