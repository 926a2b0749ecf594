"""Redis lease store: every lease, claim and fenced write is one Lua script.

URL grammar::

    redis://[[user]:password@]host[:port][/db]
    rediss://[[user]:password@]host[:port][/db][?ssl_ca_certs=PATH&ssl_certfile=PATH
                                               &ssl_keyfile=PATH&ssl_cert_reqs=required|optional|none]

Any other query option is a ``ConfigError`` (a typo in a TLS option must not silently turn
verification off). Port defaults to 6379, db to 0.

Physical layout, every key prefixed ``"{namespace}:"``:

* ``token`` — the fencing-token counter (string). Re-seeded from ``TIME`` in microseconds when
  missing, so tokens never go backwards after a restart without persistence or a failover. The
  audited result backend relies on "token ``t`` was issued iff ``t <= GET {namespace}:token``".
* ``lease:<name>`` — hash ``{holder, token}`` with a millisecond ``PEXPIRE``.
* ``claim:<key>`` — hash ``{lease, holder, ltoken, token, value}``, no TTL: a claim is alive
  exactly while ``lease:<lease>`` exists with the same holder and lease token (``ltoken``), so
  renewal touches only the lease key, and a lease re-taken later never revives old claims.
* ``claims-of:<lease>`` — set of claim keys bound to a lease; ``claim-leases`` — zset of lease
  names having claims (score: first claim token) — so ``claims_of`` and ``orphaned_claims``
  never scan the keyspace.
* ``rec:<key>`` — record hash ``{v: JSON, t: writer token}``; ``q:<queue>`` — list.
* channel ``lease-free`` — lease names published on release, for ``watch_free``.

Scripts read keys they derive from claim contents (the previous claimant's lease), so Redis
Cluster is not supported; use a standalone server or a Sentinel-managed primary.

With ``redis_wait_replicas > 0`` every lease write (acquire, renew, claim, fenced put/delete/pop)
is pipelined with ``WAIT n timeout`` in the same round trip. When fewer replicas acknowledge,
``acquire`` returns None (the caller stays standby and retries; a retry by the same holder gets
the same token back) and ``renew`` raises ``LeaseLost`` (fail closed: a failover could lose the
renewal); claims and fenced writes log a warning and count it in ``unacked_writes``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis as redis_lib
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry

from ..errors import (
    ConfigError,
    CrawlError,
    FencedError,
    LeaseLost,
    NotLeader,
    RecordChanged,
    StoreDataError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    UnsupportedSetup,
)
from ._urls import masked_url as mask_url
from ._urls import split_credentials
from .base import DRIFT, MARGIN_S, Characteristic, Claim, Lease, Taken

__all__ = ["RedisLeaseStore", "parse_redis_url", "token_counter_key"]

log = logging.getLogger(__name__)

_CLAIM_BATCH = 1000
_PUT_BATCH = 500
_POLL_S = 0.25
_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
              "none": ssl.CERT_NONE}


def token_counter_key(namespace: str) -> str:
    """Physical key of the namespace's fencing-token counter (``"{namespace}:token"``)."""
    return f"{namespace}:token"


def parse_redis_url(url: str) -> dict[str, Any]:
    """Connection keyword arguments for ``redis.Redis`` from a ``redis://``/``rediss://`` URL.

    Raises:
        ConfigError: on an unknown scheme, a bad port/db, or an unknown query option.
    """
    masked = mask_url(url)
    scheme, user, password, rest = split_credentials(url)
    if scheme not in ("redis", "rediss"):
        raise ConfigError(f"crawl_lease_url: {masked!r} is not a redis:// or rediss:// URL")
    try:
        parts = urlsplit(f"//{rest}")
        port = parts.port or 6379
    except ValueError:
        # The error text would quote URL parts; the masked URL says enough.
        raise ConfigError(f"crawl_lease_url: {masked!r}: bad host or port") from None
    path = parts.path.strip("/") or "0"
    if not path.isdigit():
        raise ConfigError(f"crawl_lease_url: {masked!r}: database {path!r} is not a number")
    kwargs: dict[str, Any] = {
        "host": parts.hostname or "localhost",
        "port": port,
        "db": int(path),
        "username": user,
        "password": password,
    }
    query = parse_qs(parts.query, keep_blank_values=True)
    for name, values in query.items():
        if name not in _SSL_OPTIONS:
            raise ConfigError(
                f"crawl_lease_url: {masked!r}: unknown option {name!r} "
                f"(known: {', '.join(_SSL_OPTIONS)})"
            )
        if scheme != "rediss":
            raise ConfigError(f"crawl_lease_url: {masked!r}: {name!r} needs rediss://")
        value = values[-1]
        if name == "ssl_cert_reqs":
            if value.lower() not in _CERT_REQS:
                raise ConfigError(
                    f"crawl_lease_url: {masked!r}: ssl_cert_reqs must be one of "
                    f"{', '.join(_CERT_REQS)}, got {value!r}"
                )
            kwargs[name] = _CERT_REQS[value.lower()]
        else:
            kwargs[name] = value
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
    scripts["claim_unless"] = _Script("claim_unless", "\n".join(
        (prelude, guard, (pkg / "claim.lua").read_text(encoding="utf-8"))))
    return scripts


class RedisLeaseStore:
    """``LeaseStore`` on one Redis server (standalone or a Sentinel-managed primary).

    Args:
        url: ``redis://`` or ``rediss://`` URL (grammar in the module docstring).
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
    })

    def __init__(self, url: str, *, namespace: str, timeout_s: float = 2.0,
                 redis_wait_replicas: int = 0) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"crawl_store_timeout: must be positive, got {timeout_s}")
        if redis_wait_replicas < 0:
            raise ConfigError("crawl_redis_wait_replicas: must be >= 0")
        self.url = mask_url(url)
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.wait_replicas = int(redis_wait_replicas)
        self.round_trips = 0
        self.unacked_writes = 0
        self._prefix = f"{namespace}:"
        self._token_key = token_counter_key(namespace)
        self._index_key = f"{self._prefix}claim-leases"
        self._channel = f"{self._prefix}lease-free"
        self._scripts = _load_scripts()
        self._client = _client_factory(parse_redis_url(url))
        self._redis = self._client(self.timeout_s)

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
        if timeout_s is not None and timeout_s < self.timeout_s:
            bounded = self._client(max(0.001, timeout_s))
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
                pipe = self._redis.pipeline(transaction=False)
                for i in todo:
                    keys, args = calls[i]
                    pipe.evalsha(script.sha or "", len(keys), *keys, *args)
                if use_wait:
                    pipe.execute_command(
                        "WAIT", self.wait_replicas, max(1, int(self.timeout_s * 500)))
                self.round_trips += 1
                replies = pipe.execute(raise_on_error=False)
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

    def _load_all(self, client: redis_lib.Redis | None = None) -> None:
        """``SCRIPT LOAD`` every script in one round trip, so no later call pays for it."""
        pipe = (client or self._redis).pipeline(transaction=False)
        pipe.info("cluster")
        for script in self._scripts.values():
            pipe.script_load(script.source)
        self.round_trips += 1
        info, *shas = pipe.execute()
        if isinstance(info, dict) and str(info.get("cluster_enabled", 0)) == "1":
            raise UnsupportedSetup(
                f"{self.url}: Redis Cluster is not supported as a lease store (its scripts touch "
                f"keys of several slots); use a standalone server or a Sentinel-managed primary"
            )
        for script, sha in zip(self._scripts.values(), shas, strict=True):
            script.sha = str(sha)

    def _under_acked(self, acked: int | None) -> bool:
        return acked is not None and acked < self.wait_replicas

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        with self._translate(what):
            self.round_trips += 1
            return fn(*args)

    @staticmethod
    def _valid_until(t_send: float, ttl_s: float) -> float:
        return t_send + ttl_s * (1 - DRIFT) - MARGIN_S

    @staticmethod
    def _now() -> float:
        return time.clock_gettime(time.CLOCK_BOOTTIME)

    @staticmethod
    def _ttl_ms(ttl_s: float, what: str = "ttl") -> int:
        if not ttl_s > 0:
            raise ConfigError(f"{what}: must be positive, got {ttl_s!r}")
        return max(1, round(ttl_s * 1000))

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
    def claim(self, lease: Lease, key: str, value: Mapping[str, Any]) -> int | None:
        """Create claim ``key`` bound to ``lease`` if absent or its claimant's lease is dead."""
        return self.claim_many(lease, [(key, value)])[0]

    def claim_many(
        self, lease: Lease, items: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> list[int | None]:
        """``claim`` for many keys, up to 1000 per round trip."""
        out: list[int | None] = []
        for start in range(0, len(items), _CLAIM_BATCH):
            batch = items[start:start + _CLAIM_BATCH]
            keys = [self._k("lease", lease.name), self._token_key,
                    self._k("claims-of", lease.name), self._index_key,
                    *(self._k("claim", k) for k, _ in batch)]
            args = [lease.name, lease.holder, lease.token, self._prefix,
                    *(_dumps(v, k) for k, v in batch)]
            reply, acked = self._eval("claim", keys, args, wait=True)
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
        ``claim.lua``)."""
        guarded = [(record, version), *also]
        keys, args = self._claim_unless_args(lease, key, value, guarded)
        reply, acked = self._eval("claim_unless", keys, args, wait=True)
        code = int(reply[0])
        if code == -1:
            raise LeaseLost(f"{self.url}: cannot claim under lease {lease.name!r}: "
                            f"it is gone or held by another holder")
        if code == -2:
            changed = guarded[int(reply[1]) - 1][0]
            raise RecordChanged(f"{self.url}: claim of {key!r} refused: record {changed!r} "
                                f"changed since it was read")
        if self._under_acked(acked):
            self.unacked_writes += 1
            log.warning("%s: claim acknowledged by %s of %s replicas", self.url, acked,
                        self.wait_replicas)
        return int(reply[1]) or None

    def _claim_unless_args(self, lease: Lease, key: str, value: Mapping[str, Any],
                           guarded: Sequence[tuple[str, str]]) -> tuple[list[str], list[Any]]:
        keys = [self._k("lease", lease.name), self._token_key, self._k("claims-of", lease.name),
                self._index_key, self._k("claim", key),
                *(self._k("rec", r) for r, _ in guarded)]
        args = [lease.name, lease.holder, lease.token, self._prefix, _dumps(value, key),
                *(v for _, v in guarded), len(guarded)]
        return keys, args

    def claim_unless_changed_many(
        self, lease: Lease,
        items: Sequence[tuple[str, Mapping[str, Any], Sequence[tuple[str, str]]]],
    ) -> list[int | CrawlError | None]:
        """``claim_unless_changed`` for many claims, each ``(key, value, [(record, version),
        ...])`` its own atomic script, all in one round trip. Per item: the token, None (held
        by a live claim), or the error (``RecordChanged``, ``LeaseLost``, another
        ``StoreError``) that call would have raised."""
        calls = [self._claim_unless_args(lease, key, value, guarded)
                 for key, value, guarded in items]
        out: list[int | CrawlError | None] = []
        for (key, _, guarded), reply in zip(
                items, self._eval_batch("claim_unless", calls, wait=True), strict=True):
            if isinstance(reply, CrawlError):
                out.append(reply)
                continue
            code = int(reply[0])
            if code == -1:
                out.append(LeaseLost(f"{self.url}: cannot claim under lease {lease.name!r}: "
                                     f"it is gone or held by another holder"))
            elif code == -2:
                changed = guarded[int(reply[1]) - 1][0]
                out.append(RecordChanged(f"{self.url}: claim of {key!r} refused: record "
                                         f"{changed!r} changed since it was read"))
            else:
                out.append(int(reply[1]) or None)
        return out

    def finish_claims(self, lease: Lease,
                      items: Sequence[tuple[str, str, Mapping[str, Any]]], *,
                      ttl_s: float) -> list[bool | CrawlError]:
        """``finish_claim`` for many ``(claim key, record, value)``, each its own atomic script,
        all in one round trip. Per item: whether the claim was deleted, or the error."""
        ttl_ms = self._ttl_ms(ttl_s, "ttl_s")
        calls = [([self._k("rec", record), self._k("claim", key),
                   self._k("claims-of", lease.name), self._index_key],
                  [_dumps(value, record), ttl_ms, lease.name, lease.holder, lease.token])
                 for key, record, value in items]
        return [r if isinstance(r, CrawlError) else bool(r)
                for r in self._eval_batch("finish", calls)]

    def finish_claim(self, lease: Lease, key: str, record: str, value: Mapping[str, Any], *,
                     ttl_s: float) -> bool:
        """Write record ``record`` (unfenced, ``ttl_s``), then delete claim ``key`` if it is
        bound to ``lease``, in one script (``finish.lua``); True if the claim was deleted."""
        reply, _ = self._eval(
            "finish",
            [self._k("rec", record), self._k("claim", key), self._k("claims-of", lease.name),
             self._index_key],
            [_dumps(value, record), self._ttl_ms(ttl_s, "ttl_s"), lease.name, lease.holder,
             lease.token],
        )
        return bool(reply)

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

    def claimant(self, key: str) -> Claim | None:
        """The current claim on ``key`` (alive or orphaned), or None."""
        reply, _ = self._eval("read_claims", [self._k("claim", key)], [self._prefix, ""])
        claims = self._claims_from(reply, strict=True)
        return claims[0] if claims else None

    def unclaim(self, lease: Lease, key: str) -> bool:
        """Delete claim ``key`` if it is bound to ``lease``; True if deleted."""
        reply, _ = self._eval(
            "unclaim",
            [self._k("claim", key), self._k("claims-of", lease.name), self._index_key],
            [lease.name, lease.holder, "unclaim", lease.token, self._prefix],
        )
        return bool(reply)

    def claims_of(self, lease_name: str) -> list[Claim]:
        """Every claim bound to ``lease_name``, read from its index set (no keyspace scan)."""
        reply, _ = self._eval("read_claims", [],
                              [self._prefix, self._k("claims-of", lease_name)])
        return [c for c in self._claims_from(reply, strict=False) if c.lease_name == lease_name]

    def orphaned_claims(self, limit: int = 1000) -> list[Claim]:
        """Claims whose lease is dead, oldest lease first, from the index (no keyspace scan)."""
        reply, _ = self._eval("orphans", [self._index_key], [self._prefix, int(limit)])
        return self._claims_from(reply, strict=False)

    def drop_claim(self, claim: Claim) -> bool:
        """Delete an orphaned claim if it still carries ``claim.token``."""
        reply, _ = self._eval(
            "unclaim",
            [self._k("claim", claim.key), self._k("claims-of", claim.lease_name),
             self._index_key],
            [claim.lease_name, claim.holder, "drop", claim.token, self._prefix],
        )
        return bool(reply)

    # -- records ----------------------------------------------------------------------------
    def put(self, key: str, value: Mapping[str, Any], *, lease: Lease | None = None,
            ttl_s: float | None = None) -> None:
        """Write one record (fenced by ``lease`` when given)."""
        self.put_many([(key, value)], lease=lease, ttl_s=ttl_s)

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
            raise NotLeader(f"{self.url}: write to {key!r} refused: lease {lease.name!r} "
                            f"(token {lease.token}) is not current")
        if code == -2 and lease is not None:
            raise FencedError(f"{self.url}: write to {key!r} refused: it was written with a "
                              f"newer token than {lease.token}")
        if code == -3:
            raise StoreDataError(f"{self.url}: write to {key!r} refused: its stored writer "
                                 f"token is not a number (data celery-crawl did not write)")

    def get(self, key: str) -> dict[str, Any] | None:
        """A record, or None."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """Records for ``keys`` in one round trip."""
        return self._get_many(keys, strict=True)

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
        return _valid_items(reply[1:], queue, self.url)

    def peek(self, queue: str, *, limit: int = 100) -> Taken:
        """Read up to ``limit`` items from the head of the queue (``LRANGE``), removing none."""
        raw = self._call("peek", self._redis.lrange, self._k("q", queue), 0, int(limit) - 1)
        return Taken(queue, tuple(_valid_items(raw, queue, self.url)), tuple(raw))

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

    def ping(self) -> float:
        """Round-trip time of a ``PING`` in seconds."""
        t0 = self._now()
        self._call("ping", self._redis.ping)
        return self._now() - t0

    def watch_free(self, name: str, timeout_s: float) -> bool:
        """Wait for a release announcement of ``name``, polling ``holder`` every 0.25 s as a
        fallback (expiry publishes nothing). True once it is seen free."""
        deadline = self._now() + max(0.0, timeout_s)
        with self._translate("watch_free"):
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._channel)
                self.round_trips += 1
                while True:
                    if self.holder(name) is None:
                        return True
                    left = deadline - self._now()
                    if left <= 0:
                        return False
                    msg = pubsub.get_message(timeout=min(_POLL_S, left))
                    if msg is not None and msg.get("data") == name:
                        return True
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
        with contextlib.suppress(Exception):
            self._redis.close()

    def __repr__(self) -> str:
        return f"RedisLeaseStore({self.url!r}, namespace={self.namespace!r})"


def _client_factory(kwargs: dict[str, Any]) -> Callable[[float], redis_lib.Redis]:
    """Clients of one server with a given timeout; the connection arguments (credentials among
    them) live in the closure, out of the store's ``vars()`` and ``repr``."""

    def client(timeout_s: float) -> redis_lib.Redis:
        return redis_lib.Redis(
            **kwargs,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            decode_responses=True,
            # Foreign bytes must reach _loads (StoreDataError naming the key), not blow up in
            # the reply parser.
            encoding_errors="surrogateescape",
            protocol=2,
        )

    return client


def _dumps(value: Mapping[str, Any], key: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise StoreDataError(f"value for {key!r} is not JSON-serializable: {exc}") from exc


def _loads(raw: str, key: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StoreDataError(f"key {key!r} holds non-JSON data: {raw[:80]!r}") from exc
    if not isinstance(value, dict):
        raise StoreDataError(f"key {key!r} holds {type(value).__name__}, not a JSON object")
    return value


def _token(raw: Any, what: str) -> int:
    """A token read back from the store; foreign data raises ``StoreDataError``."""
    text = str(raw)
    if not text.isdigit() or len(text) > 19:
        raise StoreDataError(f"{what} holds {text[:40]!r}, not a fencing token")
    return int(text)


def _valid_items(raw_items: Sequence[Any], queue: str, url: str) -> list[dict[str, Any]]:
    """Decoded queue items; foreign ones are logged and dropped (they are already off the
    queue), so they can never hold back the valid commands behind them."""
    items = []
    for raw in raw_items:
        try:
            items.append(_loads(raw, f"queue {queue!r}"))
        except StoreDataError as exc:
            log.warning("%s: dropped foreign data: %s", url, exc)
    return items


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
