"""Redis lease store: every lease, claim and fenced write is one Lua script.

URL grammar::

    redis://[[user]:password@]host[:port][/db]
    rediss://[[user]:password@]host[:port][/db][?ssl_ca_certs=PATH&ssl_certfile=PATH
                                               &ssl_keyfile=PATH&ssl_cert_reqs=required|optional|none]
    redis+cluster://[[user]:password@]host[:port]      (rediss+cluster:// with the TLS options)
    redis+sentinel://[[user]:password@]s1[:26379][,s2[:26379]...]/<master>[/db][?sentinel_password=P]
                                                       (rediss+sentinel:// with the TLS options)

Any other query option is a ``ConfigError`` (a typo in a TLS option must not silently turn
verification off). Port defaults to 6379, db to 0 (a cluster has only db 0).

Physical layout, every key prefixed ``"{namespace}:"`` — on a Redis Cluster ``"{{namespace}}:"``,
a hash tag that puts all of a namespace's keys in one slot, so every script's keys share it:

* ``token`` — the fencing-token counter (string). A token is ``max(INCR, TIME in µs)`` and the
  counter is set to it, so tokens never go backwards when the counter does (missing or older
  after a restart or a failover to a lagging replica). The audited result backend relies on
  "token ``t`` was issued => ``t <= GET {namespace}:token``".
* ``lease:<name>`` — hash ``{holder, token}`` with a millisecond ``PEXPIRE``.
* ``claim:<key>`` — hash ``{lease, holder, ltoken, token, value}``, no TTL: a claim is alive
  exactly while ``lease:<lease>`` exists with the same holder and lease token (``ltoken``), so
  renewal touches only the lease key, and a lease re-taken later never revives old claims.
* ``claims-of:<lease>`` — set of claim keys bound to a lease; ``claim-leases`` — zset of lease
  names having claims (score: first claim token) — so ``claims_of`` and ``orphaned_claims``
  never scan the keyspace.
* ``rec:<key>`` — record hash ``{v: JSON, t: writer token}``; ``q:<queue>`` — list.
* channel ``lease-free`` — lease names published on release, for ``watch_free``.

Every key a script touches is declared in its KEYS. Where a script would need a key named by
stored data (the previous claimant's lease of a claim, the members of a claims-of set, the lease
names in the index), the keys are read first and passed in, and the script checks that what it
finds is what was passed (a key that changed in between is reported and the call retried, or is
left to the next reaper pass). ``redis+cluster://`` names one node of a Redis Cluster: the store
finds the master owning the namespace's slot (``CLUSTER SLOTS``) and talks to it alone, so
pipelines, ``WAIT``, ``SCAN`` and pub/sub behave as on a standalone server; a ``MOVED`` reply
(resharding, failover) drops that connection and the call fails as ``StoreUnavailable`` (callers
retry). A ``redis://`` URL pointing at a cluster node is refused (``UnsupportedSetup``).
``redis+sentinel://`` names the sentinels of a master: every call goes to the master they name,
and a call that failed before it could have been applied is sent again to the master they name
next, within ``crawl_store_timeout`` (:mod:`~celery_crawl.leases._sentinel`); the calls that
ride in another client's round trips are off (the master may move between them).

With ``redis_wait_replicas > 0`` every lease write (acquire, renew, claim, fenced put/delete/pop)
is pipelined with ``WAIT n timeout`` in the same round trip. When fewer replicas acknowledge,
``acquire`` returns None (the caller stays standby and retries; a retry by the same holder gets
the same token back) and ``renew`` raises ``LeaseLost`` (fail closed: a failover could lose the
renewal); claims and fenced writes log a warning and count it in ``unacked_writes``.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis as redis_lib
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from .._urls import endpoint, query_options, split_credentials
from .._urls import masked_url as mask_url
from ..errors import (
    ConfigError,
    CrawlError,
    LeaseLost,
    RecordChanged,
    StoreDataError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    UnsupportedSetup,
)
from ._driver import StoreDriver, decoded_items
from ._driver import dumps as _dumps
from ._driver import loads as _loads
from ._lanes import Lanes
from ._sentinel import SentinelLink, is_sentinel_url
from .base import Characteristic, Claim, Lease, Taken

__all__ = ["RedisLeaseStore", "is_cluster_url", "key_prefix", "parse_redis_url",
           "token_counter_key"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")

_CLAIM_BATCH = 1000
#: Attempts of a claim read whose claimants changed hands between the reads.
_READ_ATTEMPTS = 4
_PUT_BATCH = 500
_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
              "none": ssl.CERT_NONE}


def token_counter_key(namespace: str, *, cluster: bool = False) -> str:
    """Physical key of the namespace's fencing-token counter (``"{namespace}:token"``; on a
    Redis Cluster ``"{{namespace}}:token"``)."""
    return f"{key_prefix(namespace, cluster=cluster)}token"


def key_prefix(namespace: str, *, cluster: bool = False) -> str:
    """Prefix of every key of ``namespace``: ``"ns:"``, or ``"{ns}:"`` on a Redis Cluster (a hash
    tag: the namespace's keys share one slot, as each script's keys must). Standalone servers
    keep the untagged names, so existing deployments' keys stay where they are."""
    return f"{{{namespace}}}:" if cluster else f"{namespace}:"


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return url.split("://", 1)[0].endswith("+cluster")


def parse_redis_url(url: str) -> dict[str, Any]:
    """Connection keyword arguments for ``redis.Redis`` from a ``redis://``/``rediss://`` URL.

    Raises:
        ConfigError: on an unknown scheme, a bad port/db, or an unknown query option.
    """
    masked = mask_url(url)
    scheme, user, password, rest = split_credentials(url)
    cluster = scheme.endswith("+cluster")
    scheme = scheme.removesuffix("+cluster")
    if scheme not in ("redis", "rediss"):
        raise ConfigError(f"crawl_lease_url: {masked!r} is not a redis://, rediss://, "
                          f"redis+cluster:// or rediss+cluster:// URL")
    host, port = endpoint(rest, 6379, masked=masked, bad="bad host or port")
    parts = urlsplit(f"//{rest}")
    path = parts.path.strip("/") or "0"
    if not path.isdigit():
        raise ConfigError(f"crawl_lease_url: {masked!r}: database {path!r} is not a number")
    if cluster and int(path) != 0:
        raise ConfigError(f"crawl_lease_url: {masked!r}: a Redis Cluster has only database 0")
    kwargs: dict[str, Any] = {
        "host": host or "localhost",
        "port": port,
        "db": int(path),
        "username": user,
        "password": password,
    }

    def convert(name: str, value: str) -> Any:
        if name != "ssl_cert_reqs":
            return value
        if value.lower() not in _CERT_REQS:
            raise ConfigError(
                f"crawl_lease_url: {masked!r}: ssl_cert_reqs must be one of "
                f"{', '.join(_CERT_REQS)}, got {value!r}"
            )
        return _CERT_REQS[value.lower()]

    kwargs.update(query_options(parts.query, _SSL_OPTIONS, masked=masked,
                                secure=scheme == "rediss", needs="rediss://", convert=convert))
    if scheme == "rediss":
        kwargs["ssl"] = True
    return kwargs


class _Script:
    """A Lua script loaded once per connection pool, called by SHA with a NOSCRIPT fallback."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha: str | None = None


def _load_scripts() -> dict[str, _Script]:
    pkg = resources.files(__package__ or "celery_crawl.leases")
    prelude = (pkg / "_token.lua").read_text(encoding="utf-8")
    scripts = {}
    for name in ("acquire", "renew", "release", "claim", "read_claims", "orphans", "unclaim",
                 "put", "delete", "pop", "ack", "finish"):
        body = (pkg / f"{name}.lua").read_text(encoding="utf-8")
        scripts[name] = _Script(name, prelude + "\n" + body)
    guard = (pkg / "claim_guard.lua").read_text(encoding="utf-8")
    claim = (pkg / "claim.lua").read_text(encoding="utf-8")
    scripts["claim_unless"] = _Script("claim_unless", "\n".join((prelude, guard, claim)))
    # Riding (``claim_command``, ``finish_command``): the broker's own writes, then ours.
    scripts["ride_claim"] = _Script("ride_claim", "\n".join(
        (prelude, (pkg / "ride_append.lua").read_text(encoding="utf-8"), guard, claim)))
    scripts["ride_finish"] = _Script("ride_finish", "\n".join(
        (prelude, (pkg / "ride_ack.lua").read_text(encoding="utf-8"),
         (pkg / "finish.lua").read_text(encoding="utf-8"))))
    return scripts


class RedisLeaseStore(StoreDriver):
    """``LeaseStore`` on one Redis server (standalone or a Sentinel-managed primary).

    Args:
        url: ``redis://``, ``rediss://``, ``redis+cluster://`` or ``redis+sentinel://`` URL
            (grammar in the module docstring).
        namespace: prefix of every key.
        timeout_s: socket connect and read timeout of every call; no client-side retries, so a
            call fails within about this bound.
        redis_wait_replicas: pipeline ``WAIT n`` after lease writes (see the module docstring).

    Attributes:
        round_trips: network round trips made so far (one per pipeline execution).
        unacked_writes: claim/fenced writes fewer than ``redis_wait_replicas`` acknowledged.
    """

    characteristics = frozenset({
        Characteristic.MONOTONIC_TOKENS,
        Characteristic.HAS_CLOCK,
        Characteristic.TOKEN_ISSUANCE_CHECK,
        Characteristic.MULTI_PROCESS,
    })

    def __init__(self, url: str, *, namespace: str, timeout_s: float = 2.0,
                 redis_wait_replicas: int = 0) -> None:
        super().__init__(url, namespace=namespace, timeout_s=timeout_s)
        if redis_wait_replicas < 0:
            raise ConfigError("crawl_redis_wait_replicas: must be >= 0")
        self.wait_replicas = int(redis_wait_replicas)
        self.unacked_writes = 0
        self.cluster = is_cluster_url(url)
        self.sentinel = is_sentinel_url(url)
        self._prefix = key_prefix(namespace, cluster=self.cluster)
        self._token_key = token_counter_key(namespace, cluster=self.cluster)
        self._index_key = f"{self._prefix}claim-leases"
        self._channel = f"{self._prefix}lease-free"
        self._scripts = _load_scripts()
        kwargs: dict[str, Any] = dict(
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            decode_responses=True,
            # Foreign bytes must reach _loads (StoreDataError naming the key), not blow up in
            # the reply parser.
            encoding_errors="surrogateescape",
            protocol=2,
        )
        #: The sentinels and the master they name (``redis+sentinel://``), else None.
        self.sentinel_link: SentinelLink | None = None
        if self.sentinel:
            link = self.sentinel_link = SentinelLink(url, dict(kwargs), timeout_s=self.timeout_s)

            def connect(**where: Any) -> redis_lib.Redis:
                # Always the master the sentinels name, whatever ``where`` says.
                return link.master_for(**{k: v for k, v in where.items()
                                          if k not in ("host", "port", "path")})
        else:
            kwargs.update(parse_redis_url(url))

            def connect(**where: Any) -> redis_lib.Redis:
                # A closure, not a stored dict: the password must not show in vars(store).
                return redis_lib.Redis(**{**kwargs, **where})

        self._connect = connect
        self._seed_host = str(kwargs.get("host"))
        # Standalone: the URL's server. Cluster: the master owning the namespace's slot, found
        # on first use and again after a MOVED reply.
        # Sentinel: the client of the master the sentinels name.
        self._client: redis_lib.Redis | None = (
            None if self.cluster
            else self.sentinel_link.client if self.sentinel_link else connect())
        #: The connections of ``_pipelined``.
        self._lanes = Lanes()

    @property
    def _redis(self) -> redis_lib.Redis:
        if self._client is None:
            self._client = self._slot_owner()
        return self._client

    def _slot_owner(self) -> redis_lib.Redis:
        """A client of the cluster master serving the namespace's slot (``CLUSTER SLOTS`` asked
        of the URL's node), with the URL's credentials, TLS options and timeouts."""
        slot = key_slot(self._token_key.encode())
        seed = self._connect()
        try:
            with self._translate("CLUSTER SLOTS"):
                self.round_trips += 1
                ranges = seed.execute_command("CLUSTER", "SLOTS")
        finally:
            with contextlib.suppress(Exception):
                seed.close()
        for first, last, master, *_ in ranges or ():
            if int(first) <= slot <= int(last):
                return self._connect(host=str(master[0]) or self._seed_host, port=int(master[1]))
        raise StoreUnavailable(f"{self.url}: no cluster master serves slot {slot} of namespace "
                               f"{self.namespace!r} (CLUSTERDOWN?)")

    def _drop_node(self) -> None:
        """Forget the slot owner after a MOVED/ASK/CLUSTERDOWN reply; the next call asks again."""
        if self.cluster and self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                client.close()
            for each in self._scripts.values():
                each.sha = None

    # -- plumbing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _translate(self, what: str, timeout_s: float | None = None) -> Iterator[None]:
        """Map every redis-py error to the ``StoreError`` tree, naming the masked URL."""
        try:
            yield
        except redis_lib.exceptions.TimeoutError as exc:
            raise StoreTimeout(
                f"{self.url}: {what} did not answer within {timeout_s or self.timeout_s:g}s"
            ) from exc
        except redis_lib.exceptions.ConnectionError as exc:
            raise StoreUnavailable(f"{self.url}: {what}: {exc}") from exc
        except (AskError, ClusterDownError, TryAgainError) as exc:  # MovedError is an AskError
            self._drop_node()
            raise StoreUnavailable(f"{self.url}: {what}: the cluster moved the namespace's slot "
                                   f"or is down ({exc}); the next call finds its master") from exc
        except ResponseError as exc:
            if "CRAWLDATA" in str(exc):
                raise StoreDataError(f"{self.url}: {what}: {exc}") from exc
            if "WRONGTYPE" in str(exc):
                raise StoreDataError(
                    f"{self.url}: {what}: a key holds data celery-crawl did not write: {exc}"
                ) from exc
            raise StoreError(f"{self.url}: {what}: {exc}") from exc
        except redis_lib.exceptions.RedisError as exc:
            raise StoreError(f"{self.url}: {what}: {exc}") from exc
        except UnicodeError as exc:
            raise StoreDataError(f"{self.url}: {what}: a reply was not text: {exc}") from exc
        except OSError as exc:  # TLS files unreadable, socket errors outside redis-py's wrapping
            raise StoreUnavailable(f"{self.url}: {what}: {exc}") from exc

    def _k(self, kind: str, name: str) -> str:
        return f"{self._prefix}{kind}:{name}"

    def _eval(self, name: str, keys: Sequence[str], args: Sequence[Any], *,
              wait: bool = False, timeout_s: float | None = None) -> tuple[Any, int | None]:
        """Run script ``name`` in one round trip (plus ``WAIT`` when asked and configured).

        Returns the script's reply and the number of replicas that acknowledged (None when no
        ``WAIT`` was sent). Every script is loaded on first use, in one round trip; a NOSCRIPT
        reply (a restarted or failed-over server) reloads them and retries once.

        ``timeout_s`` below the store's timeout runs the call on a connection of its own with
        that bound (connect included), closed afterwards: the pooled connections keep theirs.
        """
        return self._on_master(lambda: self._eval_once(name, keys, args, wait=wait,
                                                       timeout_s=timeout_s), timeout_s)

    def _on_master(self, fn: Callable[[], _R], timeout_s: float | None = None) -> _R:
        """``fn()``; behind Sentinel, sent again to the master the sentinels name next while
        it fails before it could have been applied (``SentinelLink.call``), within
        ``timeout_s`` (default the store's timeout)."""
        link = self.sentinel_link
        if link is None:
            return fn()
        return link.call(fn, retry=link.unsent, timeout_s=timeout_s)

    def _eval_once(self, name: str, keys: Sequence[str], args: Sequence[Any], *,
                   wait: bool, timeout_s: float | None) -> tuple[Any, int | None]:
        if timeout_s is not None and timeout_s < self.timeout_s:
            bound = max(0.001, timeout_s)
            # The server the pooled client talks to (a cluster's slot owner), with its own bound.
            where = {k: v for k, v in self._redis.connection_pool.connection_kwargs.items()
                     if k in ("host", "port", "path")}
            bounded = self._connect(**where, socket_timeout=bound, socket_connect_timeout=bound)
            try:
                return self._eval_on(bounded, name, keys, args, wait=wait, timeout_s=timeout_s)
            finally:
                with contextlib.suppress(redis_lib.RedisError, OSError):
                    bounded.close()
        return self._eval_on(self._redis, name, keys, args, wait=wait, timeout_s=None)

    def _eval_on(self, client: redis_lib.Redis, name: str, keys: Sequence[str],
                 args: Sequence[Any], *, wait: bool,
                 timeout_s: float | None) -> tuple[Any, int | None]:
        script = self._scripts[name]
        use_wait = wait and self.wait_replicas > 0
        timeout = timeout_s or self.timeout_s
        with self._translate(name, timeout_s):
            for attempt in (0, 1):
                if script.sha is None:
                    self._load_all(client)
                pipe = client.pipeline(transaction=False)
                pipe.evalsha(script.sha or "", len(keys), *keys, *args)
                if use_wait:
                    # WAIT gets half the socket timeout, so its (possibly short) count arrives
                    # before the read times out and the call still ends within timeout_s.
                    pipe.execute_command(
                        "WAIT", self.wait_replicas, max(1, int(timeout * 500))
                    )
                self.round_trips += 1
                replies = pipe.execute(raise_on_error=False)
                first = replies[0]
                if isinstance(first, NoScriptError) and attempt == 0:
                    for each in self._scripts.values():  # a restart or failover flushed all
                        each.sha = None
                    continue
                if isinstance(first, Exception):
                    raise first
                acked = None
                if use_wait:
                    if isinstance(replies[1], Exception):
                        raise replies[1]
                    acked = int(replies[1])
                return first, acked
        raise AssertionError("unreachable")  # pragma: no cover

    def _eval_batch(self, name: str, calls: Sequence[tuple[Sequence[str], Sequence[Any]]], *,
                    wait: bool = False) -> list[Any]:
        """``_eval_batch_once``; behind Sentinel, again on the next master while the batch
        failed before any of it could have been applied."""
        return self._on_master(lambda: self._eval_batch_once(name, calls, wait=wait))

    def _eval_batch_once(self, name: str,
                         calls: Sequence[tuple[Sequence[str], Sequence[Any]]], *,
                         wait: bool = False) -> list[Any]:
        """Run script ``name`` once per ``(keys, args)`` in one pipelined round trip (plus
        ``WAIT`` when asked and configured); each call stays one atomic script. Replies in
        order; a call that failed has its error (translated) in its place. Calls refused with
        NOSCRIPT (a restarted server) are sent once more, alone, after a reload."""
        script = self._scripts[name]
        use_wait = wait and self.wait_replicas > 0
        out: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        acked: int | None = None
        with self._translate(name):
            for attempt in (0, 1):
                if script.sha is None:
                    self._load_all()
                commands: list[tuple[Any, ...]] = [
                    ("EVALSHA", script.sha or "", len(calls[i][0]), *calls[i][0], *calls[i][1])
                    for i in todo]
                if use_wait:
                    commands.append(
                        ("WAIT", self.wait_replicas, max(1, int(self.timeout_s * 500))))
                self.round_trips += 1
                replies = self._pipelined(commands)
                if use_wait:
                    last = replies.pop()
                    acked = None if isinstance(last, Exception) else int(last)
                retry = []
                for i, reply in zip(todo, replies, strict=True):
                    if isinstance(reply, NoScriptError) and attempt == 0:
                        retry.append(i)
                    else:
                        out[i] = reply
                if not retry:
                    break
                for each in self._scripts.values():  # a restart or failover flushed all
                    each.sha = None
                todo = retry
        if self._under_acked(acked) or (use_wait and acked is None):
            self.unacked_writes += 1
            log.warning("%s: batched writes acknowledged by %s of %s replicas", self.url,
                        acked, self.wait_replicas)
        for i, reply in enumerate(out):
            if isinstance(reply, Exception):
                try:
                    with self._translate(name):
                        raise reply
                except StoreError as exc:
                    out[i] = exc
        return out

    def _pipelined(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one round trip, as a non-transactional pipeline sends them; each
        reply in order, an error reply as its exception.

        On a connection of this store's own (``_lanes.Lanes``) instead of a pipeline object:
        the pipeline's checkout, bookkeeping and reset cost more Python than the batch's own
        packing and parsing, and the worker sends a batch for almost every task when its
        claims cannot ride in the broker's round trips. The error of a failed call goes to the
        caller's ``_translate``. The batch's commands have no reply
        callbacks (``EVALSHA``, ``WAIT``).
        """
        taken = self._lanes.take(self._redis)
        conn = taken[0]
        out: list[Any] = []
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            for _ in commands:
                try:
                    out.append(conn.read_response())
                except ResponseError as exc:  # read whole: the next reply follows
                    out.append(exc)
        except BaseException as exc:
            Lanes.give(taken, broken=True)
            if out and isinstance(exc, redis_lib.exceptions.ConnectionError):
                # Some calls were applied: the batch must not be sent again as unsent.
                raise redis_lib.exceptions.ConnectionError(
                    f"connection lost after {len(out)} of {len(commands)} replies: {exc}"
                ) from exc
            raise
        Lanes.give(taken)
        return out

    def _load_all(self, client: redis_lib.Redis | None = None) -> None:
        """``SCRIPT LOAD`` every script in one round trip, so no later call pays for it."""
        pipe = (client or self._redis).pipeline(transaction=False)
        pipe.info("cluster")
        for script in self._scripts.values():
            pipe.script_load(script.source)
        self.round_trips += 1
        info, *shas = pipe.execute()
        if (isinstance(info, dict) and str(info.get("cluster_enabled", 0)) == "1"
                and not self.cluster):
            raise UnsupportedSetup(
                f"{self.url}: this server is a Redis Cluster node; name it with "
                f"redis+cluster:// (or rediss+cluster://) so the store puts the namespace's keys "
                f"in one slot and talks to the master owning it"
            )
        for script, sha in zip(self._scripts.values(), shas, strict=True):
            script.sha = str(sha)

    def _under_acked(self, acked: int | None) -> bool:
        return acked is not None and acked < self.wait_replicas

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        def once() -> Any:
            with self._translate(what):
                self.round_trips += 1
                return fn(*args)

        return self._on_master(once)

    @staticmethod
    def _ttl_ms(ttl_s: float, what: str = "ttl") -> int:
        return max(1, round(StoreDriver._positive_ttl(ttl_s, what) * 1000))

    def _fence_args(self, lease: Lease | None) -> tuple[str, list[str]]:
        if lease is None:
            # Unfenced: the script ignores KEYS[1], but it must still lie inside the namespace
            # so an ACL key pattern ("~{namespace}:*") admits the call.
            return self._k("lease", ""), ["", ""]
        return self._k("lease", lease.name), [lease.holder, str(lease.token)]

    # -- leases -----------------------------------------------------------------------------
    def acquire(self, name: str, ttl_s: float, holder: str) -> Lease | None:
        """Take lease ``name`` if free (or already ours); None while another holder has it."""
        ttl_ms = self._ttl_ms(ttl_s)
        t_send = self._now()
        reply, acked = self._eval(
            "acquire", [self._k("lease", name), self._token_key], [holder, ttl_ms], wait=True
        )
        if not reply:
            return None
        if self._under_acked(acked):
            log.warning("%s: lease %r acquired but only %s of %s replicas acknowledged; "
                        "not leading until a retry is acknowledged", self.url, name, acked,
                        self.wait_replicas)
            return None
        return Lease(name=name, holder=holder, token=int(reply[0]), ttl_s=ttl_ms / 1000,
                     valid_until=self._valid_until(t_send, ttl_ms / 1000))

    def renew(self, lease: Lease, *, timeout_s: float | None = None) -> Lease:
        """Extend ``lease`` in one round trip (one script on the lease key only)."""
        ttl_ms = self._ttl_ms(lease.ttl_s)
        t_send = self._now()
        reply, acked = self._eval(
            "renew", [self._k("lease", lease.name)], [lease.holder, lease.token, ttl_ms],
            wait=True, timeout_s=timeout_s,
        )
        if reply != 1:
            raise LeaseLost(f"{self.url}: lease {lease.name!r} (token {lease.token}) is gone "
                            f"or held by another holder")
        if self._under_acked(acked):
            raise LeaseLost(f"{self.url}: renewal of {lease.name!r} acknowledged by {acked} of "
                            f"{self.wait_replicas} replicas; a failover could lose it")
        return Lease(name=lease.name, holder=lease.holder, token=lease.token, ttl_s=lease.ttl_s,
                     valid_until=self._valid_until(t_send, lease.ttl_s), handle=lease.handle)

    def release(self, lease: Lease) -> None:
        """Delete the lease if still ours and announce it on the release channel."""
        self._eval("release", [self._k("lease", lease.name)],
                   [lease.holder, lease.token, self._channel, lease.name])

    def holder(self, name: str) -> tuple[str, int] | None:
        """``(holder, token)`` of lease ``name``, or None when free."""
        got = self._call("holder", self._redis.hmget, self._k("lease", name), "holder", "token")
        if got[0] is None or got[1] is None:
            return None
        return got[0], _token(got[1], f"lease {name!r}")

    def lease_ttl_left(self, name: str) -> float | None:
        """Server-side seconds left on lease ``name``, None when free."""
        ms = self._call("lease_ttl_left", self._redis.pttl, self._k("lease", name))
        return None if ms is None or ms < 0 else ms / 1000

    # -- claims -----------------------------------------------------------------------------
    def claim_many(
        self, lease: Lease, items: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> list[int | None]:
        """``claim`` for many keys, up to 1000 per round trip (plus one when a key's previous
        claimant's lease keys must be declared: learnt from the first reply, which wrote
        nothing)."""
        out: list[int | None] = []
        for start in range(0, len(items), _CLAIM_BATCH):
            batch = items[start:start + _CLAIM_BATCH]
            previous: list[str] = []
            for _ in range(_READ_ATTEMPTS):
                keys = [self._k("lease", lease.name), self._token_key,
                        self._k("claims-of", lease.name), self._index_key,
                        *(self._k("claim", k) for k, _ in batch)]
                for name in previous:
                    keys += [self._k("lease", name), self._k("claims-of", name)]
                args = [lease.name, lease.holder, lease.token, self._prefix,
                        *(_dumps(v, k) for k, v in batch), *previous]
                reply, acked = self._eval("claim", keys, args, wait=True)
                if int(reply[0]) != -2:
                    break
                previous.extend(str(n) for n in reply[1:] if str(n) not in previous)
            else:
                raise StoreError(f"{self.url}: claims {[k for k, _ in batch][:3]} kept changing "
                                 f"hands while being claimed ({_READ_ATTEMPTS} attempts)")
            if int(reply[0]) == -1:
                raise LeaseLost(f"{self.url}: cannot claim under lease {lease.name!r}: "
                                f"it is gone or held by another holder")
            if self._under_acked(acked):
                self.unacked_writes += 1
                log.warning("%s: claims acknowledged by %s of %s replicas", self.url, acked,
                            self.wait_replicas)
            out.extend(int(t) or None for t in reply[1:])
        return out

    def claim_unless_changed(self, lease: Lease, key: str, value: Mapping[str, Any], *,
                             record: str, version: str,
                             also: Sequence[tuple[str, str]] = ()) -> int | None:
        """``claim`` iff record ``record`` still holds ``version`` (its JSON as read), and every
        ``(record, version)`` of ``also`` too, in one script (``claim_guard.lua`` +
        ``claim.lua``; plus one round trip when the previous claimant's lease keys must be
        declared, as for ``claim_many``)."""
        guarded = [(record, version), *also]
        previous: list[str] = []
        for _ in range(_READ_ATTEMPTS):
            keys, args = self._claim_unless_args(lease, key, value, guarded, previous)
            reply, acked = self._eval("claim_unless", keys, args, wait=True)
            if int(reply[0]) != -2:
                break
            previous.extend(str(n) for n in reply[1:] if str(n) not in previous)
        else:
            raise StoreError(f"{self.url}: claim {key!r} kept changing hands while being "
                             f"claimed ({_READ_ATTEMPTS} attempts)")
        got = self._claim_unless_outcome(lease, key, guarded, reply)
        if isinstance(got, CrawlError):
            raise got
        if self._under_acked(acked):
            self.unacked_writes += 1
            log.warning("%s: claim acknowledged by %s of %s replicas", self.url, acked,
                        self.wait_replicas)
        return got

    def _claim_unless_args(self, lease: Lease, key: str, value: Mapping[str, Any],
                           guarded: Sequence[tuple[str, str]],
                           previous: Sequence[str] = ()) -> tuple[list[str], list[Any]]:
        """The guard's records first (``claim_guard.lua`` takes them off), then ``claim.lua``'s
        own keys and arguments, previous claimants' lease keys included."""
        keys = [*(self._k("rec", r) for r, _ in guarded),
                self._k("lease", lease.name), self._token_key, self._k("claims-of", lease.name),
                self._index_key, self._k("claim", key)]
        for name in previous:
            keys += [self._k("lease", name), self._k("claims-of", name)]
        args = [len(guarded), *(v for _, v in guarded),
                lease.name, lease.holder, lease.token, self._prefix, _dumps(value, key),
                *previous]
        return keys, args

    def _claim_unless_outcome(self, lease: Lease, key: str, guarded: Sequence[tuple[str, str]],
                              reply: Sequence[Any]) -> int | CrawlError | None:
        code = int(reply[0])
        if code == -1:
            return LeaseLost(f"{self.url}: cannot claim under lease {lease.name!r}: "
                             f"it is gone or held by another holder")
        if code == -3:
            changed = guarded[int(reply[1]) - 1][0]
            return RecordChanged(f"{self.url}: claim of {key!r} refused: record {changed!r} "
                                 f"changed since it was read")
        return int(reply[1]) or None

    def claim_unless_changed_many(
        self, lease: Lease,
        items: Sequence[tuple[str, Mapping[str, Any], Sequence[tuple[str, str]]]],
    ) -> list[int | CrawlError | None]:
        """``claim_unless_changed`` for many claims, each ``(key, value, [(record, version),
        ...])`` its own atomic script, all in one round trip (a takeover of a dead claimant's
        key takes one more, for that item alone). Per item: the token, None (held by a live
        claim), or the error (``RecordChanged``, ``LeaseLost``, another ``StoreError``) that
        call would have raised."""
        calls = [self._claim_unless_args(lease, key, value, guarded)
                 for key, value, guarded in items]
        out: list[int | CrawlError | None] = []
        for (key, value, guarded), reply in zip(
                items, self._eval_batch("claim_unless", calls, wait=True), strict=True):
            if isinstance(reply, CrawlError):
                out.append(reply)
            elif int(reply[0]) == -2:
                # The key's previous claimant's lease keys were not declared: this item again,
                # with them (nothing was written).
                (record, version), *also = guarded
                try:
                    out.append(self.claim_unless_changed(lease, key, value, record=record,
                                                         version=version, also=also))
                except CrawlError as exc:
                    out.append(exc)
            else:
                out.append(self._claim_unless_outcome(lease, key, guarded, reply))
        return out

    def finish_claims(self, lease: Lease,
                      items: Sequence[tuple[str, str, Mapping[str, Any]]], *,
                      ttl_s: float,
                      tokens: Sequence[int | None] | None = None) -> list[bool | CrawlError]:
        """``finish_claim`` for many ``(claim key, record, value)``, each its own atomic script,
        all in one round trip. Per item: whether the claim was deleted, or the error."""
        ttl_ms = self._ttl_ms(ttl_s, "ttl_s")
        named = list(tokens) if tokens is not None else [None] * len(items)
        calls = [([self._k("rec", record), self._k("claim", key),
                   self._k("claims-of", lease.name), self._index_key],
                  [_dumps(value, record), ttl_ms, lease.name, lease.holder, lease.token,
                   _claim_token_arg(token)])
                 for (key, record, value), token in zip(items, named, strict=True)]
        return [r if isinstance(r, CrawlError) else bool(r)
                for r in self._eval_batch("finish", calls)]

    # -- script calls sent in another client's round trip ---------------------------------
    def shares_server(self, where: Mapping[str, Any]) -> bool:
        """Whether a redis-py client connecting to ``where`` (its ``host``, ``port``, ``db``,
        ``path``) reaches this store's server and database, so a script call can ride in that
        client's own round trips (``claim_command``, ``finish_command``). Never on a cluster
        nor behind Sentinel (the namespace's master may move), nor with
        ``redis_wait_replicas`` (the ``WAIT`` must follow the write on the same connection)."""
        if self.cluster or self.sentinel or self.wait_replicas > 0:
            return False
        mine = self._redis.connection_pool.connection_kwargs

        def spot(kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
            host = kwargs.get("host")
            host = "127.0.0.1" if host in ("localhost", "::1") else host
            return (host, int(kwargs.get("port") or 6379) if kwargs.get("path") is None
                    else None, int(kwargs.get("db") or 0), kwargs.get("path"))

        return spot(mine) == spot(where)

    def _sha(self, name: str) -> str:
        script = self._scripts[name]
        if script.sha is None:
            with self._translate("SCRIPT LOAD"):
                self._load_all()
        return script.sha or ""

    def _ridden(self, name: str, reply: Any) -> Any:
        """A ridden call's reply, its error translated (a NOSCRIPT reply makes the next call
        load the scripts again)."""
        if isinstance(reply, NoScriptError):
            for each in self._scripts.values():
                each.sha = None
        if isinstance(reply, Exception):
            try:
                with self._translate(name):
                    raise reply
            except CrawlError as exc:
                return exc
        return reply

    def line_pool(self) -> Any:
        """The redis-py connection pool a connection of the caller's own may be made from, to
        send this store's script calls without waiting (``claim_command``, ``finish_command``
        with no ``unacked``); None on a cluster or behind Sentinel (the master may move) or with
        ``redis_wait_replicas`` (the ``WAIT`` must follow the write on the same connection)."""
        if self.cluster or self.sentinel or self.wait_replicas > 0:
            return None
        return self._redis.connection_pool

    def claim_command(self, lease: Lease, key: str, value: Mapping[str, Any],
                      guarded: Sequence[tuple[str, str]],
                      unacked: tuple[Sequence[Any], Sequence[Any]] | None = None
                      ) -> tuple[tuple[Any, ...], Callable[[Any], int | CrawlError | None]]:
        """``claim_unless_changed`` as one script call for the caller to send (on a connection
        of ``line_pool``, or in another client's round trip to this server: ``shares_server``),
        and what its reply means: the token, None (held by a live claim), or the error.
        ``unacked``: the broker's keys and arguments of its unacked record of the delivery,
        written first (``ride_append.lua``). A reply that needs the previous claimant's lease
        keys declared is ``RecordChanged``: the caller decides that delivery by reading
        first."""
        keys, args = self._claim_unless_args(lease, key, value, guarded)
        name = "claim_unless" if unacked is None else "ride_claim"
        first_keys, first_args = unacked or ((), ())
        command = ("EVALSHA", self._sha(name), len(keys) + len(first_keys),
                   *first_keys, *keys, *first_args, *args)

        def outcome(reply: Any) -> int | CrawlError | None:
            got = self._ridden(name, reply)
            if isinstance(got, CrawlError):
                return got
            if int(got[0]) == -2:
                return RecordChanged(f"{self.url}: claim of {key!r} is held under another "
                                     f"lease; read it first")
            return self._claim_unless_outcome(lease, key, guarded, got)

        return command, outcome

    def finish_command(self, lease: Lease, key: str, record: str, value: Mapping[str, Any], *,
                       ttl_s: float, token: int | None = None,
                       unacked: tuple[Sequence[Any], Sequence[Any]] | None = None
                       ) -> tuple[tuple[Any, ...], Callable[[Any], CrawlError | None]]:
        """``finish_claim`` as one script call for the caller to send (as ``claim_command``),
        and what its reply means (None when recorded, else the error). ``unacked``: the
        broker's keys and arguments of its ack, made first (``ride_ack.lua``)."""
        name = "finish" if unacked is None else "ride_finish"
        first_keys, first_args = unacked or ((), ())
        command = ("EVALSHA", self._sha(name), 4 + len(first_keys), *first_keys,
                   self._k("rec", record), self._k("claim", key),
                   self._k("claims-of", lease.name), self._index_key, *first_args,
                   _dumps(value, record), self._ttl_ms(ttl_s, "ttl_s"), lease.name,
                   lease.holder, lease.token, _claim_token_arg(token))

        def outcome(reply: Any) -> CrawlError | None:
            got = self._ridden(name, reply)
            return got if isinstance(got, CrawlError) else None

        return command, outcome

    def _claims_from(self, flat: Sequence[Any], *, strict: bool) -> list[Claim]:
        """Claims from a script's flat reply. Foreign data raises ``StoreDataError`` naming the
        key when ``strict``; otherwise it is logged and skipped, so one forged entry cannot
        stop a listing (the reaper's recovery) of the real claims."""
        claims = []
        strip = len(self._prefix) + len("claim:")
        for i in range(0, len(flat), 6):
            ck, lease_name, holder, token, value, alive = flat[i:i + 6]
            key = ck[strip:]
            try:
                if int(alive) < 0:
                    raise StoreDataError(f"claim {key!r} is not a celery-crawl claim")
                claims.append(Claim(key=key, lease_name=lease_name, holder=holder,
                                    token=_token(token, f"claim {key!r}"),
                                    value=_loads(value, f"claim {key!r}"),
                                    alive=bool(int(alive))))
            except StoreDataError as exc:
                if strict:
                    raise StoreDataError(f"{self.url}: {exc}") from exc
                log.warning("%s: skipping foreign data: %s", self.url, exc)
        return claims

    def _read_claims(self, claim_keys: Sequence[str], leases: Sequence[str], *,
                     only_passed: bool) -> list[Any]:
        """``read_claims.lua`` with every lease key it reads declared: the claimants' lease
        names are learnt from a first reply when not known, then passed in (a claim re-taken
        in between names yet another lease: asked again, a few times at most)."""
        known = list(dict.fromkeys(leases))
        for _ in range(_READ_ATTEMPTS):
            keys = [*claim_keys, *(self._k("lease", n) for n in known)]
            reply, _ = self._eval("read_claims", keys,
                                  [self._prefix, len(claim_keys), "1" if only_passed else "0"])
            if int(reply[0]) == 1:
                return list(reply[1:])
            known.extend(n for n in reply[1:] if n not in known)
        raise StoreError(f"{self.url}: claims {list(claim_keys)[:3]} kept changing hands while "
                         f"being read ({_READ_ATTEMPTS} attempts)")

    def claimant(self, key: str) -> Claim | None:
        """The current claim on ``key`` (alive or orphaned), or None."""
        flat = self._read_claims([self._k("claim", key)], [], only_passed=False)
        claims = self._claims_from(flat, strict=True)
        return claims[0] if claims else None

    def unclaim(self, lease: Lease, key: str, *, token: int | None = None) -> bool:
        """Delete claim ``key`` if it is bound to ``lease`` (and carries ``token``, if given);
        True if deleted."""
        reply, _ = self._eval(
            "unclaim",
            [self._k("claim", key), self._k("claims-of", lease.name), self._index_key,
             self._k("lease", lease.name)],
            [lease.name, lease.holder, "unclaim", lease.token, _claim_token_arg(token)],
        )
        return bool(reply)

    def claims_of(self, lease_name: str) -> list[Claim]:
        """Every claim bound to ``lease_name``, read from its index set (no keyspace scan).

        Two steps, so the script's keys are declared: the set's members, then the claims
        with the lease key. A claim made in between is not listed (as if read just before it
        was made); one dropped in between is not either."""
        members = self._set_members([self._k("claims-of", lease_name)])[0]
        flat: list[Any] = []
        for start in range(0, len(members), _CLAIM_BATCH):
            flat.extend(self._read_claims(members[start:start + _CLAIM_BATCH], [lease_name],
                                          only_passed=True))
        return [c for c in self._claims_from(flat, strict=False) if c.lease_name == lease_name]

    def _set_members(self, sets: Sequence[str]) -> list[list[str]]:
        """Members of each set in one round trip; a key that is not a set reads as empty."""
        if not sets:
            return []
        with self._translate("SMEMBERS"):
            pipe = self._redis.pipeline(transaction=False)
            for s in sets:
                pipe.smembers(s)
            self.round_trips += 1
            replies = pipe.execute(raise_on_error=False)
        return [[] if isinstance(r, Exception) else sorted(str(m) for m in r) for r in replies]

    def orphaned_claims(self, limit: int = 1000) -> list[Claim]:
        """Claims whose lease is dead, oldest lease first, from the index (no keyspace scan).

        The index, the lease keys of its names and the claims-of sets of the names to scan are
        read first, then passed to ``orphans.lua``, which checks them again (every key it
        touches is declared)."""
        with self._translate("orphans"):
            pipe = self._redis.pipeline(transaction=False)
            pipe.zrange(self._index_key, 0, -1, withscores=True)
            self.round_trips += 1
            (index,) = pipe.execute(raise_on_error=False)
            if isinstance(index, Exception) or not index:
                return []  # foreign data under the index key: nothing to recover from it
            pipe = self._redis.pipeline(transaction=False)
            for name, _ in index:
                pipe.hget(self._k("lease", str(name)), "token")
            self.round_trips += 1
            tokens = pipe.execute(raise_on_error=False)
        scan = [(str(name), score) for (name, score), tok in zip(index, tokens, strict=True)
                if not (isinstance(tok, str) and tok.isdigit() and int(tok) <= score)]
        members = self._set_members([self._k("claims-of", n) for n, _ in scan])
        flat: list[Any] = []
        found = 0
        group_keys: list[str] = []
        group_args: list[Any] = []
        for i, ((name, score), ms) in enumerate(zip(scan, members, strict=True)):
            group_keys += [self._k("lease", name), self._k("claims-of", name), *ms]
            group_args += [name, repr(float(score)), len(ms)]
            if len(group_keys) >= _CLAIM_BATCH or i == len(scan) - 1:
                reply, _ = self._eval("orphans", [self._index_key, *group_keys],
                                      [int(limit) - found, *group_args])
                flat.extend(reply)
                found = len(flat) // 6
                group_keys, group_args = [], []
                if found >= limit:
                    break
        return self._claims_from(flat, strict=False)

    def drop_claim(self, claim: Claim) -> bool:
        """Delete an orphaned claim if it still carries ``claim.token``."""
        reply, _ = self._eval(
            "unclaim",
            [self._k("claim", claim.key), self._k("claims-of", claim.lease_name),
             self._index_key, self._k("lease", claim.lease_name)],
            [claim.lease_name, claim.holder, "drop", claim.token, ""],
        )
        return bool(reply)

    # -- records ----------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, Mapping[str, Any]]], *,
                 lease: Lease | None = None, ttl_s: float | None = None) -> None:
        """Write records atomically (one script per 500 records)."""
        ttl_ms = 0 if ttl_s is None else self._ttl_ms(ttl_s, "ttl_s")
        lease_key, fence = self._fence_args(lease)
        for start in range(0, len(items), _PUT_BATCH):
            batch = items[start:start + _PUT_BATCH]
            keys = [lease_key, *(self._k("rec", k) for k, _ in batch)]
            args = [*fence, ttl_ms, *(_dumps(v, k) for k, v in batch)]
            reply, acked = self._eval("put", keys, args, wait=lease is not None)
            self._check_fence(int(reply), lease, ", ".join(k for k, _ in batch))
            if self._under_acked(acked):
                self.unacked_writes += 1
                log.warning("%s: fenced write acknowledged by %s of %s replicas", self.url,
                            acked, self.wait_replicas)

    def _check_fence(self, code: int, lease: Lease | None, key: str) -> None:
        if code == -1 and lease is not None:
            raise self._not_leader(lease, f"write to {key!r}")
        if code == -2 and lease is not None:
            raise self._fenced(lease, key)
        if code == -3:
            raise StoreDataError(f"{self.url}: write to {key!r} refused: its stored writer "
                                 f"token is not a number (data celery-crawl did not write)")

    def get_many_versioned(self, keys: Sequence[str]) -> list[tuple[dict[str, Any] | None, str]]:
        """Records for ``keys`` in one round trip, each with its stored JSON as its version."""
        raws = self._raw_many(keys)
        out: list[tuple[dict[str, Any] | None, str]] = []
        for k, raw in zip(keys, raws, strict=True):
            if isinstance(raw, Exception):
                raise StoreDataError(f"{self.url}: record {k!r} is not a celery-crawl record: "
                                     f"{raw}")
            try:
                out.append((None, "") if raw is None else (_loads(raw, k), str(raw)))
            except StoreDataError as exc:
                raise StoreDataError(f"{self.url}: {exc}") from exc
        return out

    def _raw_many(self, keys: Sequence[str]) -> list[Any]:
        if not keys:
            return []
        with self._translate("get"):
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.hget(self._k("rec", k), "v")
            self.round_trips += 1
            return list(pipe.execute(raise_on_error=False))

    def _get_many(self, keys: Sequence[str], *, strict: bool) -> list[dict[str, Any] | None]:
        """Records for ``keys``; foreign data raises (``strict``) or reads as None, logged."""
        replies = self._raw_many(keys)
        out: list[dict[str, Any] | None] = []
        for k, raw in zip(keys, replies, strict=True):
            try:
                if isinstance(raw, Exception):
                    raise StoreDataError(f"record {k!r} is not a celery-crawl record: {raw}")
                out.append(None if raw is None else _loads(raw, k))
            except StoreDataError as exc:
                if strict:
                    raise StoreDataError(f"{self.url}: {exc}") from exc
                log.warning("%s: skipping foreign data: %s", self.url, exc)
                out.append(None)
        return out

    def scan(self, prefix: str, *, between: Callable[[], None] | None = None
             ) -> dict[str, dict[str, Any]]:
        """Every record whose key starts with ``prefix`` (SCAN over the whole key space, so
        O(keys in the database): ``between`` runs between its pages)."""
        pattern = self._k("rec", _glob_escape(prefix)) + "*"
        names: list[str] = []
        with self._translate("scan"):
            cursor = 0
            while True:
                if cursor and between is not None:
                    between()
                self.round_trips += 1
                cursor, batch = self._redis.scan(cursor=cursor, match=pattern, count=1000)
                names.extend(str(n) for n in batch)
                if int(cursor) == 0:
                    break
        strip = len(self._prefix) + len("rec:")
        logical = sorted({n[strip:] for n in names})
        values = self._get_many(logical, strict=False)
        return {k: v for k, v in zip(logical, values, strict=True) if v is not None}

    def delete(self, key: str, *, lease: Lease | None = None) -> bool:
        """Delete a record (fenced when ``lease`` is given); True if it existed."""
        lease_key, fence = self._fence_args(lease)
        reply, _ = self._eval("delete", [lease_key, self._k("rec", key)], fence,
                              wait=lease is not None)
        self._check_fence(int(reply), lease, key)
        return int(reply) == 1

    # -- queues -----------------------------------------------------------------------------
    def push(self, queue: str, value: Mapping[str, Any]) -> None:
        """Append to a FIFO queue."""
        self._call("push", self._redis.rpush, self._k("q", queue), _dumps(value, queue))

    def pop_all(self, queue: str, *, lease: Lease | None = None,
                limit: int = 100) -> list[dict[str, Any]]:
        """Take up to ``limit`` items from the head of the queue atomically."""
        lease_key, fence = self._fence_args(lease)
        reply, _ = self._eval("pop", [lease_key, self._k("q", queue)], [*fence, int(limit)],
                              wait=lease is not None)
        if int(reply[0]) == -1:
            self._check_fence(-1, lease, queue)
        return decoded_items(reply[1:], queue, url=self.url, log=log)

    def peek(self, queue: str, *, limit: int = 100) -> Taken:
        """Read up to ``limit`` items from the head of the queue (``LRANGE``), removing none."""
        raw = self._call("peek", self._redis.lrange, self._k("q", queue), 0, int(limit) - 1)
        return Taken(queue, tuple(decoded_items(raw, queue, url=self.url, log=log)), tuple(raw))

    def put_and_ack(self, items: Sequence[tuple[str, Mapping[str, Any]]], taken: Taken, *,
                    lease: Lease) -> None:
        """Write records and ``LTRIM`` ``taken`` off its queue in one fenced script (records
        beyond one script's batch are written first, fenced, on their own)."""
        lease_key, fence = self._fence_args(lease)
        head, last = items[:-_PUT_BATCH], items[-_PUT_BATCH:]
        if head:
            self.put_many(head, lease=lease)
        keys = [lease_key, self._k("q", taken.queue), *(self._k("rec", k) for k, _ in last)]
        args = [*fence, len(taken.handle), *taken.handle, *(_dumps(v, k) for k, v in last)]
        reply, acked = self._eval("ack", keys, args, wait=True)
        what = ", ".join(k for k, _ in last) or taken.queue
        if int(reply) == -4:
            raise StoreError(f"{self.url}: {taken.queue!r}: the head of the queue changed "
                             f"since it was read; nothing written")
        self._check_fence(int(reply), lease, what)
        if self._under_acked(acked):
            self.unacked_writes += 1
            log.warning("%s: fenced write acknowledged by %s of %s replicas", self.url,
                        acked, self.wait_replicas)

    # -- misc -------------------------------------------------------------------------------
    def server_time(self) -> float | None:
        """Redis ``TIME`` as UNIX seconds."""
        sec, usec = self._call("server_time", self._redis.time)
        return int(sec) + int(usec) / 1e6

    def _ping_once(self) -> None:
        """A ``PING``."""
        self._call("ping", self._redis.ping)

    @contextlib.contextmanager
    def _release_waiter(self, name: str) -> Iterator[Callable[[float], bool]]:
        """``watch_free`` wakes on the release announcement of ``name`` (``release.lua``
        publishes it on the namespace's channel); it still looks at ``holder`` between waits,
        because an expiry publishes nothing."""
        with self._translate("watch_free"):
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._channel)
                self.round_trips += 1

                def wait(seconds: float) -> bool:
                    msg = pubsub.get_message(timeout=seconds)
                    return msg is not None and msg.get("data") == name

                yield wait
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()

    def eviction_risk(self) -> str | None:
        """Why lease or slot keys could be evicted (``maxmemory`` with an evicting policy)."""
        info = self._call("INFO memory", self._redis.info, "memory")
        maxmemory = int(info.get("maxmemory", 0) or 0)
        policy = str(info.get("maxmemory_policy", "noeviction"))
        if maxmemory > 0 and policy != "noeviction":
            return (f"{self.url}: maxmemory is {maxmemory} bytes with maxmemory-policy {policy}; "
                    f"lease and slot keys could be evicted (set maxmemory-policy noeviction)")
        return None

    def persistence(self) -> dict[str, Any]:
        """``{"aof_enabled", "rdb", "persistent"}`` (``rdb`` None when ``CONFIG`` is
        disabled), for the beat's warning that tokens and slot state may not survive a restart."""
        info = self._call("INFO persistence", self._redis.info, "persistence")
        rdb: bool | None
        try:
            config = self._call("CONFIG GET save", self._redis.config_get, "save")
            rdb = bool((config or {}).get("save"))
        except StoreError:  # CONFIG is often renamed away on managed Redis
            rdb = None
        aof = bool(int(info.get("aof_enabled", 0) or 0))
        return {"aof_enabled": aof, "rdb": rdb, "persistent": aof or bool(rdb)}

    def close(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        if self.sentinel_link is not None:
            self.sentinel_link.close()


def _token(raw: Any, what: str) -> int:
    """A token read back from the store; foreign data raises ``StoreDataError``."""
    text = str(raw)
    if not text.isdigit() or len(text) > 19:
        raise StoreDataError(f"{what} holds {text[:40]!r}, not a fencing token")
    return int(text)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _claim_token_arg(token: int | None) -> str:
    """A claim token as the end and unclaim scripts compare it ('' names no claim)."""
    return "" if token is None else str(int(token))
