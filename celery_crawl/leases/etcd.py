"""etcd v3 lease store on python-etcd3's generated gRPC stubs.

URL grammar::

    etcd://[user:password@]host[:port][,host2[:port2]...]
    etcd+http://...            (same as etcd://)
    etcd+https://[user:password@]host[:port][,...][?ca_cert=PATH&cert_cert=PATH&cert_key=PATH]

Port defaults to 2379. Several endpoints form one gRPC channel that fails over between them
(``pick_first``); host names are resolved once when the store is opened. Unknown query options
are a ``ConfigError``.

Physical layout (every key prefixed ``"{namespace}:"``):

* ``lease:<name>`` — JSON ``{"holder": ...}`` put under an etcd lease; the fencing token is the
  revision of the transaction that created it (its ``create_revision``). etcd revisions are the
  namespace's one monotonic token source, persisted by raft, so they never go backwards.
* ``claim:<key>`` — durable JSON ``{lease, holder, value}``; ``live:<key>`` — empty marker put
  under the claimant's etcd lease *in the same transaction*, so it dies with the lease: a claim is
  alive iff its ``live`` marker exists with the claim's revision. Renewal is one keepalive and
  touches no claim. The claim's token is the revision of that transaction (claims made in one
  batch share it; tokens are per key, so that is harmless).
* ``claims-of:<lease>/<key>`` and ``claim-leases:<lease>`` — durable indexes for ``claims_of`` and
  ``orphaned_claims`` (prefix ranges, never a whole-keyspace read).
* ``rec:<key>`` — JSON record; ``rtok:<key>`` — its writer token as a zero-padded decimal;
  ``q:<queue>/<uuid>`` — queue items ordered by create revision.

Limits that follow from etcd: TTLs are whole seconds (rounded up) with a floor of 2 s; a
transaction carries at most 128 operations, so batches are split; etcd has no clock
(``server_time()`` is None). Fenced writes are optimistic: the writer tokens are read, then one
transaction writes only if the lease is current and none of them changed (retried on a race).

Process rules: python-etcd3 0.12's generated code only imports with protobuf's pure-Python
implementation, so ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`` is set before the import; if
protobuf's C/upb implementation is already loaded the store refuses with a ``CrawlError``. gRPC
channels must not cross ``fork()``: open stores only in main processes (beat, worker main), never
in prefork children. gRPC's fork handlers are disabled (``GRPC_ENABLE_FORK_SUPPORT=0``) so worker
logs do not fill with "skipping fork() handlers".
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

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

__all__ = ["ETCD_MIN_TTL_S", "EtcdLeaseStore", "import_etcd3", "parse_etcd_url"]

#: etcd grants no lease shorter than about 1.5 s (3/2 election timeout); we require 2 s.
ETCD_MIN_TTL_S = 2
#: etcd's default ``--max-txn-ops``.
MAX_TXN_OPS = 128
_TLS_OPTIONS = ("ca_cert", "cert_cert", "cert_key")
_POLL_S = 0.1
_OCC_ATTEMPTS = 5

log = logging.getLogger(__name__)


def import_etcd3() -> Any:
    """Import python-etcd3's gRPC stubs with the process settings they need.

    Returns:
        The ``etcd3.etcdrpc`` module.

    Raises:
        CrawlError: protobuf's C/upb implementation is already loaded in this process.
    """
    if "etcd3.etcdrpc" in sys.modules:
        return sys.modules["etcd3.etcdrpc"]
    if "google.protobuf.internal.api_implementation" in sys.modules:
        from google.protobuf.internal import api_implementation

        kind = api_implementation.Type()
        if kind != "python":
            raise CrawlError(
                f"the etcd lease store needs protobuf's pure-Python implementation, but the "
                f"{kind!r} implementation is already loaded in this process; set "
                f"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in the environment before "
                f"starting it (or open the store before anything imports protobuf)"
            )
    os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    with warnings.catch_warnings():
        # The 0.12 generated code uses descriptor constructors protobuf deprecates.
        warnings.simplefilter("ignore", DeprecationWarning)
        import etcd3.etcdrpc as etcdrpc
    return etcdrpc


def parse_etcd_url(url: str) -> dict[str, Any]:
    """Endpoints, credentials and TLS files from an ``etcd://`` URL (grammar above).

    Raises:
        ConfigError: naming ``crawl_lease_url`` and what is wrong.
    """
    masked = mask_url(url)
    scheme, user, password, rest = split_credentials(url)
    if scheme not in ("etcd", "etcd+http", "etcd+https"):
        raise ConfigError(f"crawl_lease_url: {masked!r} is not an etcd:// URL")
    if (user is None) != (password is None) or (user is not None and not password):
        raise ConfigError(f"crawl_lease_url: {masked!r}: give both user and password")
    netloc_path, _, query = rest.partition("?")
    netloc = netloc_path.split("/", 1)[0]
    endpoints: list[tuple[str, int]] = []
    for part in netloc.split(","):
        try:
            parts = urlsplit(f"//{part}")
            port = parts.port or 2379
        except ValueError:
            raise ConfigError(f"crawl_lease_url: {masked!r}: bad endpoint {part!r}") from None
        if not parts.hostname:
            raise ConfigError(f"crawl_lease_url: {masked!r}: empty host in {part!r}")
        endpoints.append((parts.hostname, port))
    tls: dict[str, str] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in _TLS_OPTIONS:
            raise ConfigError(f"crawl_lease_url: {masked!r}: unknown option {name!r} "
                              f"(known: {', '.join(_TLS_OPTIONS)})")
        if scheme != "etcd+https":
            raise ConfigError(f"crawl_lease_url: {masked!r}: {name!r} needs etcd+https://")
        tls[name] = values[-1]
    if ("cert_cert" in tls) != ("cert_key" in tls):
        raise ConfigError(f"crawl_lease_url: {masked!r}: cert_cert and cert_key go together")
    return {"endpoints": endpoints, "user": user, "password": password,
            "secure": scheme == "etcd+https", "tls": tls}


def _prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    arr = bytearray(prefix)
    for i in range(len(arr) - 1, -1, -1):
        if arr[i] < 0xFF:
            arr[i] += 1
            return bytes(arr[: i + 1])
    return b"\0"


def _stored_token(raw: bytes, key: str) -> int:
    """A record's writer token; foreign data raises ``StoreDataError`` naming the record."""
    if not raw.isdigit() or len(raw) > 20:
        raise StoreDataError(f"record {key!r} has a writer token that is not a number "
                             f"({raw[:40]!r}): data celery-crawl did not write")
    return int(raw)


def _pad(token: int) -> bytes:
    return f"{token:020d}".encode()


def _loads(raw: bytes, key: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StoreDataError(f"key {key!r} holds non-JSON data: {raw[:80]!r}") from exc
    if not isinstance(value, dict):
        raise StoreDataError(f"key {key!r} holds {type(value).__name__}, not a JSON object")
    return value


def _name(raw: bytes, strip: int) -> str | None:
    """A key name after its prefix, or None when it is not UTF-8 (not written by us)."""
    try:
        return raw[strip:].decode()
    except UnicodeDecodeError:
        return None


def _holder_of(raw: bytes, name: str) -> str:
    holder = _loads(raw, f"lease {name!r}").get("holder")
    if not isinstance(holder, str):
        raise StoreDataError(f"lease {name!r} names no holder (data celery-crawl did not write)")
    return holder


def _dumps(value: Mapping[str, Any], key: str) -> bytes:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise StoreDataError(f"value for {key!r} is not JSON-serializable: {exc}") from exc


class EtcdLeaseStore:
    """``LeaseStore`` on an etcd v3 cluster.

    Args:
        url: ``etcd://``/``etcd+https://`` URL (grammar in the module docstring).
        namespace: prefix of every key.
        timeout_s: deadline of every gRPC call.

    Attributes:
        round_trips: gRPC calls made so far.
    """

    characteristics = frozenset({Characteristic.MONOTONIC_TOKENS, Characteristic.LINEARIZABLE})

    def __init__(self, url: str, *, namespace: str, timeout_s: float = 2.0) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"crawl_store_timeout: must be positive, got {timeout_s}")
        self.url = mask_url(url)
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.round_trips = 0
        self._prefix = f"{namespace}:"
        self._pid = os.getpid()
        self._rpc = import_etcd3()
        import grpc

        self._grpc = grpc
        opts = parse_etcd_url(url)
        self._channel = self._open_channel(opts)
        self._kv = self._rpc.KVStub(self._channel)
        self._lease_stub = self._rpc.LeaseStub(self._channel)
        self._maint = self._rpc.MaintenanceStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._credentials = (opts["user"], opts["password"]) if opts["user"] else None
        self._authenticate()

    def _authenticate(self) -> None:
        """Get an auth token (etcd's simple tokens lapse after 5 idle minutes)."""
        if self._credentials is None:
            return
        user, password = self._credentials
        req = self._rpc.AuthenticateRequest(name=user, password=password)
        with self._translate("authenticate"):
            self.round_trips += 1
            resp = self._rpc.AuthStub(self._channel).Authenticate(req, timeout=self.timeout_s)
        self._metadata = (("token", resp.token),)

    def _open_channel(self, opts: dict[str, Any]) -> Any:
        grpc = self._grpc
        addrs: list[str] = []
        for host, port in opts["endpoints"]:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise StoreUnavailable(f"{self.url}: cannot resolve {host!r}: {exc}") from exc
            for family, *_, sockaddr in infos:
                ip = sockaddr[0]
                addr = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
                if addr not in addrs:
                    addrs.append(addr)
        target = "ipv4:" + ",".join(addrs) if all(not a.startswith("[") for a in addrs) \
            else "ipv6:" + ",".join(addrs)
        options: list[tuple[str, Any]] = [("grpc.enable_retries", 0)]
        if not opts["secure"]:
            return grpc.insecure_channel(target, options=options)
        tls = opts["tls"]
        try:
            def read(name: str) -> bytes | None:
                if name not in tls:
                    return None
                with open(tls[name], "rb") as fh:
                    return fh.read()

            creds = grpc.ssl_channel_credentials(read("ca_cert"), read("cert_key"),
                                                 read("cert_cert"))
        except OSError as exc:
            raise ConfigError(f"crawl_lease_url: {self.url}: cannot read a TLS file: {exc}") \
                from exc
        options.append(("grpc.ssl_target_name_override", opts["endpoints"][0][0]))
        return grpc.secure_channel(target, creds, options=options)

    # -- plumbing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _translate(self, what: str, timeout_s: float | None = None) -> Iterator[None]:
        """Map gRPC errors to the ``StoreError`` tree, naming the masked URL."""
        grpc = self._grpc
        if os.getpid() != self._pid:
            raise UnsupportedSetup(
                f"{self.url}: the etcd lease store was opened in process {self._pid} and used in "
                f"its forked child {os.getpid()}; gRPC channels do not survive fork(), so open "
                f"the store in the main process only (beat, worker main process)"
            )
        try:
            yield
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StoreTimeout(f"{self.url}: {what} did not answer within "
                                   f"{timeout_s or self.timeout_s:g}s") from exc
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED):
                raise StoreUnavailable(f"{self.url}: {what}: {detail}") from exc
            raise StoreError(f"{self.url}: {what}: {code}: {detail}") from exc
        except ValueError as exc:  # e.g. a closed channel
            raise StoreUnavailable(f"{self.url}: {what}: {exc}") from exc

    def _call(self, what: str, method: Any, request: Any) -> Any:
        try:
            with self._translate(what):
                self.round_trips += 1
                return method(request, timeout=self.timeout_s, metadata=self._metadata)
        except StoreUnavailable as exc:
            if self._credentials is None or "auth token" not in str(exc):
                raise
        self._authenticate()  # the token lapsed: once more with a fresh one
        with self._translate(what):
            self.round_trips += 1
            return method(request, timeout=self.timeout_s, metadata=self._metadata)

    def _k(self, kind: str, name: str) -> bytes:
        return f"{self._prefix}{kind}:{name}".encode()

    @staticmethod
    def _now() -> float:
        return time.clock_gettime(time.CLOCK_BOOTTIME)

    @staticmethod
    def whole_ttl(ttl_s: float, what: str = "ttl") -> int:
        """``ttl_s`` rounded up to whole seconds.

        Raises:
            ConfigError: below etcd's floor of 2 s.
        """
        if not ttl_s >= ETCD_MIN_TTL_S:
            raise ConfigError(f"{what}: etcd leases have a floor of {ETCD_MIN_TTL_S}s, "
                              f"got {ttl_s!r}s")
        return math.ceil(ttl_s - 1e-9)

    # request builders ------------------------------------------------------------------------
    def _cmp(self, key: bytes, target: str, op: str, value: Any) -> Any:
        c = self._rpc.Compare(key=key, result=getattr(self._rpc.Compare, op),
                              target=getattr(self._rpc.Compare, target))
        if target == "LEASE":
            c.lease = int(value)
        elif target == "CREATE":
            c.create_revision = int(value)
        elif target == "MOD":
            c.mod_revision = int(value)
        elif target == "VALUE":
            c.value = value
        return c

    def _put(self, key: bytes, value: bytes, lease: int = 0) -> Any:
        return self._rpc.RequestOp(request_put=self._rpc.PutRequest(key=key, value=value,
                                                                    lease=lease))

    def _get(self, key: bytes) -> Any:
        return self._rpc.RequestOp(request_range=self._rpc.RangeRequest(key=key))

    def _del(self, key: bytes) -> Any:
        return self._rpc.RequestOp(
            request_delete_range=self._rpc.DeleteRangeRequest(key=key))

    def _txn(self, what: str, compare: Sequence[Any], success: Sequence[Any] = (),
             failure: Sequence[Any] = ()) -> Any:
        req = self._rpc.TxnRequest(compare=list(compare), success=list(success),
                                   failure=list(failure))
        return self._call(what, self._kv.Txn, req)

    def _range(self, what: str, prefix: bytes, *, keys_only: bool = False,
               sort_create: bool = False, limit: int = 0) -> list[Any]:
        req = self._rpc.RangeRequest(key=prefix, range_end=_prefix_end(prefix),
                                     keys_only=keys_only, limit=limit)
        if sort_create:
            req.sort_target = self._rpc.RangeRequest.CREATE
            req.sort_order = self._rpc.RangeRequest.ASCEND
        return list(self._call(what, self._kv.Range, req).kvs)

    def _lease_current(self, lease: Lease) -> list[Any]:
        """Compares that hold iff ``lease`` is the current one (same etcd lease and token)."""
        key = self._k("lease", lease.name)
        return [self._cmp(key, "LEASE", "EQUAL", lease.handle or 0),
                self._cmp(key, "CREATE", "EQUAL", lease.token)]

    def _grant(self, ttl: int) -> tuple[int, int]:
        resp = self._call("lease grant", self._lease_stub.LeaseGrant,
                          self._rpc.LeaseGrantRequest(TTL=ttl))
        if resp.error:
            raise StoreError(f"{self.url}: lease grant refused: {resp.error}")
        return int(resp.ID), int(resp.TTL)

    def _revoke(self, lease_id: int) -> None:
        with contextlib.suppress(StoreError):
            try:
                self._call("lease revoke", self._lease_stub.LeaseRevoke,
                           self._rpc.LeaseRevokeRequest(ID=lease_id))
            except StoreError as exc:
                if "not found" not in str(exc):
                    raise

    def _keepalive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """One keepalive on its own stream (one round trip); the TTL etcd answered."""
        req = self._rpc.LeaseKeepAliveRequest(ID=lease_id)
        bound = self.timeout_s if timeout_s is None else max(0.001, min(timeout_s,
                                                                        self.timeout_s))
        with self._translate("lease keepalive", bound):
            self.round_trips += 1
            call = self._lease_stub.LeaseKeepAlive(iter([req]), timeout=bound,
                                                   metadata=self._metadata)
            try:
                for resp in call:
                    return int(resp.TTL)
            finally:
                call.cancel()  # one request, one reply: do not leave the stream open
        return 0

    # -- leases -----------------------------------------------------------------------------
    def acquire(self, name: str, ttl_s: float, holder: str) -> Lease | None:
        """Grant an etcd lease and create the lease key under it iff the key is absent."""
        ttl = self.whole_ttl(ttl_s)
        key = self._k("lease", name)
        t_send = self._now()
        lease_id, granted = self._grant(ttl)
        try:
            resp = self._txn("acquire", [self._cmp(key, "CREATE", "EQUAL", 0)],
                             [self._put(key, _dumps({"holder": holder}, name), lease_id)],
                             [self._get(key)])
        except BaseException:
            self._revoke(lease_id)
            raise
        if resp.succeeded:
            return Lease(name=name, holder=holder, token=int(resp.header.revision),
                         ttl_s=float(min(ttl, granted)),
                         valid_until=t_send + min(ttl, granted) * (1 - DRIFT) - MARGIN_S,
                         handle=lease_id)
        self._revoke(lease_id)
        kvs = resp.responses[0].response_range.kvs
        if not kvs or _holder_of(kvs[0].value, name) != holder:
            return None
        # Ours already (a retried acquire whose reply was lost): adopt it with a fresh
        # keepalive so the validity window is measured from now.
        existing = kvs[0]
        t_send = self._now()
        left = self._keepalive(int(existing.lease))
        if left <= 0:
            return None
        return Lease(name=name, holder=holder, token=int(existing.create_revision),
                     ttl_s=float(left), valid_until=t_send + left * (1 - DRIFT) - MARGIN_S,
                     handle=int(existing.lease))

    def renew(self, lease: Lease, *, timeout_s: float | None = None) -> Lease:
        """One keepalive; a TTL <= 0 in the reply means the lease is gone."""
        if lease.handle is None:
            raise LeaseLost(f"{self.url}: lease {lease.name!r} has no etcd lease id")
        t_send = self._now()
        left = self._keepalive(lease.handle, timeout_s)
        if left <= 0:
            raise LeaseLost(f"{self.url}: lease {lease.name!r} (token {lease.token}) expired")
        return Lease(name=lease.name, holder=lease.holder, token=lease.token,
                     ttl_s=lease.ttl_s, valid_until=t_send + left * (1 - DRIFT) - MARGIN_S,
                     handle=lease.handle)

    def release(self, lease: Lease) -> None:
        """Revoke the etcd lease: the lease key and every ``live`` claim marker go with it."""
        if lease.handle is not None:
            self._revoke(lease.handle)

    def holder(self, name: str) -> tuple[str, int] | None:
        """``(holder, token)`` of lease ``name``, or None when free."""
        kvs = self._call("holder", self._kv.Range,
                         self._rpc.RangeRequest(key=self._k("lease", name))).kvs
        if not kvs:
            return None
        return _holder_of(kvs[0].value, name), int(kvs[0].create_revision)

    def lease_ttl_left(self, name: str) -> float | None:
        """Seconds left on the etcd lease behind ``name``, None when free."""
        kvs = self._call("lease ttl", self._kv.Range,
                         self._rpc.RangeRequest(key=self._k("lease", name))).kvs
        if not kvs or not kvs[0].lease:
            return None
        resp = self._call("lease ttl", self._lease_stub.LeaseTimeToLive,
                          self._rpc.LeaseTimeToLiveRequest(ID=kvs[0].lease))
        return None if resp.TTL <= 0 else float(resp.TTL)

    # -- claims -----------------------------------------------------------------------------
    def claim(self, lease: Lease, key: str, value: Mapping[str, Any]) -> int | None:
        """Create claim ``key`` unless a live one exists (its marker died with its lease)."""
        return self.claim_many(lease, [(key, value)])[0]

    def claim_many(
        self, lease: Lease, items: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> list[int | None]:
        """One transaction per 120 claims: the lease must be current; each key is a nested
        transaction that creates the claim iff its ``live`` marker is absent. (etcd counts a
        nested transaction's operations against what its parent leaves of the 128.)"""
        out: list[int | None] = []
        seen: set[str] = set()
        batch_size = MAX_TXN_OPS - 8
        index_op = self._put(self._k("claim-leases", lease.name), b"")
        for start in range(0, len(items), batch_size):
            batch = items[start:start + batch_size]
            nested, slots = [], []
            for key, value in batch:
                if key in seen:  # a key twice in one call: the second is refused
                    slots.append(False)
                    continue
                seen.add(key)
                slots.append(True)
                live = self._k("live", key)
                doc = _dumps({"lease": lease.name, "holder": lease.holder,
                              "value": dict(value)}, key)
                nested.append(self._rpc.RequestOp(request_txn=self._rpc.TxnRequest(
                    compare=[self._cmp(live, "CREATE", "EQUAL", 0)],
                    success=[self._put(self._k("claim", key), doc),
                             self._put(live, b"", lease.handle or 0),
                             self._put(self._k("claims-of", f"{lease.name}/{key}"), b"")],
                )))
            if not nested:
                out.extend(None for _ in batch)
                continue
            resp = self._txn("claim", self._lease_current(lease), [index_op, *nested])
            if not resp.succeeded:
                raise LeaseLost(f"{self.url}: cannot claim under lease {lease.name!r}: it is "
                                f"gone or held by another holder")
            token = int(resp.header.revision)
            results = iter(resp.responses[1:])
            for ok in slots:
                if not ok:
                    out.append(None)
                    continue
                out.append(token if next(results).response_txn.succeeded else None)
        return out

    def claim_unless_changed(self, lease: Lease, key: str, value: Mapping[str, Any], *,
                             record: str, version: str) -> int | None:
        """``claim`` iff record ``record`` still has mod revision ``version``, in one
        transaction: the lease and the record are compared at the top level, the claim's
        ``live`` marker in a nested transaction; on failure the lease key and the record are read
        back to tell a lost lease from a changed record."""
        rec = self._k("rec", record)
        try:
            expected = int(version or 0)
        except ValueError as exc:
            raise RecordChanged(f"{self.url}: {record!r}: not a version of this store: "
                                f"{version!r}") from exc
        live = self._k("live", key)
        doc = _dumps({"lease": lease.name, "holder": lease.holder, "value": dict(value)}, key)
        nested = self._rpc.RequestOp(request_txn=self._rpc.TxnRequest(
            compare=[self._cmp(live, "CREATE", "EQUAL", 0)],
            success=[self._put(self._k("claim", key), doc),
                     self._put(live, b"", lease.handle or 0),
                     self._put(self._k("claims-of", f"{lease.name}/{key}"), b"")],
        ))
        resp = self._txn(
            "claim", [*self._lease_current(lease), self._cmp(rec, "MOD", "EQUAL", expected)],
            [self._put(self._k("claim-leases", lease.name), b""), nested],
            [self._get(self._k("lease", lease.name)), self._get(rec)])
        if not resp.succeeded:
            lkv = resp.responses[0].response_range.kvs
            if not lkv or lkv[0].lease != (lease.handle or 0) or (
                    lkv[0].create_revision != lease.token):
                raise LeaseLost(f"{self.url}: cannot claim under lease {lease.name!r}: it is "
                                f"gone or held by another holder")
            raise RecordChanged(f"{self.url}: claim of {key!r} refused: record {record!r} "
                                f"changed since it was read")
        if not resp.responses[1].response_txn.succeeded:
            return None
        return int(resp.header.revision)

    def get_many_versioned(self, keys: Sequence[str]) -> list[tuple[dict[str, Any] | None, str]]:
        """Records for ``keys``, each with its mod revision as its version."""
        out: list[tuple[dict[str, Any] | None, str]] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[start:start + MAX_TXN_OPS]
            resp = self._txn("get", [], [self._get(self._k("rec", k)) for k in batch])
            for key, rr in zip(batch, resp.responses, strict=True):
                kvs = rr.response_range.kvs
                out.append((_loads(kvs[0].value, key), str(kvs[0].mod_revision)) if kvs
                           else (None, ""))
        return out

    def _read_claims(self, keys: Sequence[str], *, strict: bool = True) -> list[Claim | None]:
        """Claims with liveness, ``claim`` and ``live`` read in one transaction per 64 keys.

        Foreign data raises ``StoreDataError`` naming the key when ``strict``, else it is logged
        and read as None, so one forged entry cannot stop the reaper's listing."""
        out: list[Claim | None] = []
        for start in range(0, len(keys), MAX_TXN_OPS // 2):
            batch = keys[start:start + MAX_TXN_OPS // 2]
            ops = []
            for key in batch:
                ops += [self._get(self._k("claim", key)), self._get(self._k("live", key))]
            resp = self._txn("read claims", [], ops)
            for i, key in enumerate(batch):
                ckv = resp.responses[2 * i].response_range.kvs
                lkv = resp.responses[2 * i + 1].response_range.kvs
                if not ckv:
                    out.append(None)
                    continue
                try:
                    out.append(self._claim_from(key, ckv[0], lkv))
                except StoreDataError as exc:
                    if strict:
                        raise StoreDataError(f"{self.url}: {exc}") from exc
                    log.warning("%s: skipping foreign data: %s", self.url, exc)
                    out.append(None)
        return out

    @staticmethod
    def _claim_from(key: str, ckv: Any, lkv: Sequence[Any]) -> Claim:
        doc = _loads(ckv.value, f"claim {key!r}")
        lease_name, holder, value = doc.get("lease"), doc.get("holder"), doc.get("value")
        if not (isinstance(lease_name, str) and isinstance(holder, str)
                and isinstance(value, dict)):
            raise StoreDataError(f"claim {key!r} is not a celery-crawl claim")
        token = int(ckv.mod_revision)
        alive = bool(lkv) and int(lkv[0].mod_revision) == token
        return Claim(key=key, lease_name=lease_name, holder=holder, token=token, value=value,
                     alive=alive)

    def claimant(self, key: str) -> Claim | None:
        """The current claim on ``key`` (alive or orphaned), or None."""
        return self._read_claims([key])[0]

    def unclaim(self, lease: Lease, key: str) -> bool:
        """Delete claim ``key`` if its live marker belongs to ``lease``'s etcd lease."""
        live = self._k("live", key)
        resp = self._txn("unclaim", [self._cmp(live, "LEASE", "EQUAL", lease.handle or 0),
                                     self._cmp(live, "CREATE", "GREATER", 0)],
                         [self._del(self._k("claim", key)), self._del(live),
                          self._del(self._k("claims-of", f"{lease.name}/{key}"))])
        return bool(resp.succeeded)

    def claims_of(self, lease_name: str) -> list[Claim]:
        """Every claim bound to ``lease_name``, from its index prefix."""
        prefix = self._k("claims-of", f"{lease_name}/")
        names = (_name(kv.key, len(prefix))
                 for kv in self._range("claims_of", prefix, keys_only=True))
        keys = [k for k in names if k is not None]
        return [c for c in self._read_claims(keys, strict=False)
                if c is not None and c.lease_name == lease_name]

    def orphaned_claims(self, limit: int = 1000) -> list[Claim]:
        """Claims whose lease is dead, oldest lease first (by index creation).

        A lease name whose lease lives costs one one-key range (its oldest index entry: only
        entries older than the current lease can belong to a dead predecessor of the same
        name); only the claims of dead leases are read.
        """
        index = self._k("claim-leases", "")
        indexed = [(_name(kv.key, len(index)), kv.create_revision)
                   for kv in self._range("orphans", index, keys_only=True)]
        names = sorted(((n, rev) for n, rev in indexed if n is not None),
                       key=lambda item: item[1])
        lease_prefix = self._k("lease", "")
        live = {_name(kv.key, len(lease_prefix)): int(kv.create_revision)
                for kv in self._range("orphans", lease_prefix, keys_only=True)}
        out: list[Claim] = []
        for name, _ in names:
            if len(out) >= limit:
                break
            prefix = self._k("claims-of", f"{name}/")
            if name in live:
                req = self._rpc.RangeRequest(key=prefix, range_end=_prefix_end(prefix),
                                             keys_only=True, limit=1,
                                             sort_target=self._rpc.RangeRequest.MOD,
                                             sort_order=self._rpc.RangeRequest.ASCEND)
                oldest = self._call("orphans", self._kv.Range, req).kvs
                if not oldest or oldest[0].mod_revision >= live[name]:
                    continue
            claims = self.claims_of(name)
            if not claims and name not in live:
                # Nothing left under a dead lease name: drop its stale index entries. Guarded by
                # the lease key's absence, because no claim can be added without a live lease.
                wipe = self._rpc.RequestOp(request_delete_range=self._rpc.DeleteRangeRequest(
                    key=prefix, range_end=_prefix_end(prefix)))
                self._txn("orphans", [self._cmp(self._k("lease", name), "CREATE", "EQUAL", 0)],
                          [wipe, self._del(self._k("claim-leases", name))])
                continue
            out.extend(c for c in claims if not c.alive)
        return out[:limit]

    def drop_claim(self, claim: Claim) -> bool:
        """Delete an orphaned claim if it still carries ``claim.token`` and is not alive."""
        ckey = self._k("claim", claim.key)
        live = self._k("live", claim.key)
        resp = self._txn("drop_claim", [self._cmp(ckey, "MOD", "EQUAL", claim.token),
                                        self._cmp(live, "MOD", "NOT_EQUAL", claim.token)],
                         [self._del(ckey),
                          self._del(self._k("claims-of", f"{claim.lease_name}/{claim.key}"))])
        return bool(resp.succeeded)

    # -- records ----------------------------------------------------------------------------
    def put(self, key: str, value: Mapping[str, Any], *, lease: Lease | None = None,
            ttl_s: float | None = None) -> None:
        """Write one record (fenced by ``lease`` when given)."""
        self.put_many([(key, value)], lease=lease, ttl_s=ttl_s)

    def put_many(self, items: Sequence[tuple[str, Mapping[str, Any]]], *,
                 lease: Lease | None = None, ttl_s: float | None = None) -> None:
        """Write records; each batch of up to 60 is one transaction (all-or-nothing)."""
        record_lease = 0
        if ttl_s is not None:
            if not ttl_s > 0:
                raise ConfigError(f"ttl_s: must be positive, got {ttl_s!r}")
            record_lease, _ = self._grant(max(ETCD_MIN_TTL_S, math.ceil(ttl_s)))
        size = (MAX_TXN_OPS - 2) // 2
        for start in range(0, len(items), size):
            batch = items[start:start + size]
            ops = []
            for key, value in batch:
                ops.append(self._put(self._k("rec", key), _dumps(value, key), record_lease))
                if lease is not None:  # the writer token expires with its record
                    ops.append(self._put(self._k("rtok", key), _pad(lease.token), record_lease))
            self._fenced_txn("put", [k for k, _ in batch], ops, lease)

    def _fenced_txn(self, what: str, keys: Sequence[str], ops: Sequence[Any],
                    lease: Lease | None, *, also: Sequence[Any] = ()) -> Any:
        """Run ``ops`` iff ``lease`` is current, no writer token of ``keys`` is newer and the
        compares ``also`` hold."""
        if lease is None:
            return self._txn(what, [], ops)
        for _ in range(_OCC_ATTEMPTS):
            read = self._txn(what, [], [self._get(self._k("rtok", k)) for k in keys])
            compare = [*self._lease_current(lease), *also]
            for key, rr in zip(keys, read.responses, strict=True):
                kvs = rr.response_range.kvs
                if kvs and _stored_token(kvs[0].value, key) > lease.token:
                    raise FencedError(f"{self.url}: write to {key!r} refused: it was written "
                                      f"with a newer token than {lease.token}")
                compare.append(self._cmp(self._k("rtok", key), "MOD", "EQUAL",
                                         kvs[0].mod_revision if kvs else 0))
            resp = self._txn(what, compare, ops)
            if resp.succeeded:
                return resp
            if self.holder(lease.name) != (lease.holder, lease.token):
                raise NotLeader(f"{self.url}: write to {(keys or ['?'])[0]!r} refused: lease "
                                f"{lease.name!r} (token {lease.token}) is not current")
            if also:
                return resp  # the caller tells which of its own compares failed
        raise StoreError(f"{self.url}: {what} of {keys[0]!r} kept racing with other writers")

    def get(self, key: str) -> dict[str, Any] | None:
        """A record, or None."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """Records for ``keys``; one transaction per 128 keys."""
        out: list[dict[str, Any] | None] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[start:start + MAX_TXN_OPS]
            resp = self._txn("get", [], [self._get(self._k("rec", k)) for k in batch])
            for key, rr in zip(batch, resp.responses, strict=True):
                kvs = rr.response_range.kvs
                out.append(_loads(kvs[0].value, key) if kvs else None)
        return out

    def scan(self, prefix: str, *, between: Callable[[], None] | None = None
             ) -> dict[str, dict[str, Any]]:
        """Every record whose key starts with ``prefix`` (one range request over that prefix
        only, so ``between`` is never needed)."""
        base = self._k("rec", "")
        out: dict[str, dict[str, Any]] = {}
        for kv in self._range("scan", self._k("rec", prefix)):
            key = _name(kv.key, len(base))
            try:
                if key is None:
                    raise StoreDataError(f"record name {kv.key[:80]!r} is not UTF-8")
                out[key] = _loads(kv.value, key)
            except StoreDataError as exc:
                log.warning("%s: scan skips foreign data: %s", self.url, exc)
        return out

    def delete(self, key: str, *, lease: Lease | None = None) -> bool:
        """Delete a record (fenced when ``lease`` is given); True if it existed."""
        ops = [self._del(self._k("rec", key)), self._del(self._k("rtok", key))]
        resp = self._fenced_txn("delete", [key], ops, lease)
        return bool(resp.responses[0].response_delete_range.deleted)

    # -- queues -----------------------------------------------------------------------------
    def push(self, queue: str, value: Mapping[str, Any]) -> None:
        """Append to a FIFO queue (ordered by create revision)."""
        self._txn("push", [], [self._put(self._k("q", f"{queue}/{uuid.uuid4().hex}"),
                                         _dumps(value, queue))])

    def pop_all(self, queue: str, *, lease: Lease | None = None,
                limit: int = 100) -> list[dict[str, Any]]:
        """Take up to ``limit`` items from the head atomically (fenced by ``lease``)."""
        limit = max(1, min(limit, MAX_TXN_OPS - 2))
        for _ in range(_OCC_ATTEMPTS):
            kvs = self._range("pop_all", self._k("q", f"{queue}/"), sort_create=True,
                              limit=limit)
            compare = self._lease_current(lease) if lease is not None else []
            compare += [self._cmp(kv.key, "MOD", "EQUAL", kv.mod_revision) for kv in kvs]
            resp = self._txn("pop_all", compare, [self._del(kv.key) for kv in kvs])
            if resp.succeeded:
                items = []
                for kv in kvs:  # foreign items are already off the queue: log, never block
                    try:
                        items.append(_loads(kv.value, f"queue {queue!r}"))
                    except StoreDataError as exc:
                        log.warning("%s: dropped foreign data: %s", self.url, exc)
                return items
            if lease is not None and self.holder(lease.name) != (lease.holder, lease.token):
                raise NotLeader(f"{self.url}: pop from {queue!r} refused: lease "
                                f"{lease.name!r} (token {lease.token}) is not current")
        raise StoreError(f"{self.url}: pop_all of {queue!r} kept racing with other consumers")

    def peek(self, queue: str, *, limit: int = 100) -> Taken:
        """Read up to ``limit`` items from the head of the queue, removing none."""
        limit = max(1, min(limit, MAX_TXN_OPS - 2))
        kvs = self._range("peek", self._k("q", f"{queue}/"), sort_create=True, limit=limit)
        items = []
        for kv in kvs:
            try:
                items.append(_loads(kv.value, f"queue {queue!r}"))
            except StoreDataError as exc:
                log.warning("%s: foreign data in a queue (removed with the rest): %s",
                            self.url, exc)
        return Taken(queue, tuple(items), tuple((kv.key, kv.mod_revision) for kv in kvs))

    def put_and_ack(self, items: Sequence[tuple[str, Mapping[str, Any]]], taken: Taken, *,
                    lease: Lease) -> None:
        """Write records and delete ``taken``'s queue keys in one fenced transaction, which
        also compares each queue key's mod revision (records beyond one transaction are
        written first, fenced, on their own)."""
        room = max(0, (MAX_TXN_OPS - 2 - len(taken.handle)) // 2)
        head, last = (items[:len(items) - room], items[len(items) - room:]) if room \
            else (items, [])
        if head:
            self.put_many(head, lease=lease)
        ops = []
        for key, value in last:
            ops.append(self._put(self._k("rec", key), _dumps(value, key)))
            ops.append(self._put(self._k("rtok", key), _pad(lease.token)))
        ops += [self._del(qkey) for qkey, _ in taken.handle]
        same = [self._cmp(qkey, "MOD", "EQUAL", rev) for qkey, rev in taken.handle]
        resp = self._fenced_txn("put_and_ack", [k for k, _ in last], ops, lease, also=same)
        if not resp.succeeded:
            raise StoreError(f"{self.url}: {taken.queue!r}: the head of the queue (or a record "
                             f"written with it) changed since it was read; nothing written")

    # -- misc -------------------------------------------------------------------------------
    def server_time(self) -> float | None:
        """etcd has no clock: None (calibrate against a Redis instead)."""
        return None

    def ping(self) -> float:
        """Round-trip time of a ``Status`` call in seconds."""
        t0 = self._now()
        self._call("ping", self._maint.Status, self._rpc.StatusRequest())
        return self._now() - t0

    def watch_free(self, name: str, timeout_s: float) -> bool:
        """Poll ``holder`` every 0.1 s until lease ``name`` is free or ``timeout_s`` passes.

        Polling (a cheap linearizable read) instead of a watch stream keeps gRPC's background
        threads out of the process, which matters because workers fork.
        """
        deadline = self._now() + max(0.0, timeout_s)
        while True:
            if self.holder(name) is None:
                return True
            left = deadline - self._now()
            if left <= 0:
                return False
            time.sleep(min(_POLL_S, left))

    def eviction_risk(self) -> str | None:
        """etcd never evicts keys: None."""
        return None

    def persistence(self) -> dict[str, Any]:
        """etcd persists every write through raft's WAL."""
        return {"aof_enabled": True, "rdb": True, "persistent": True}

    def close(self) -> None:
        """Close the gRPC channel."""
        with contextlib.suppress(Exception):
            self._channel.close()

    def __repr__(self) -> str:
        return f"EtcdLeaseStore({self.url!r}, namespace={self.namespace!r})"
