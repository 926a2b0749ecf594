"""In-process lease store, for tests and single-process demos: never for production.

URL grammar::

    memory://[name]

Every store opened on the same ``name`` in one process shares one set of leases, claims,
records and queues (namespaces keep apps apart, as on a server), so a beat core and a worker core
driven in one test see each other's leases without a server. Nothing is shared with another
process and nothing survives the process: a second process opening ``memory://name`` gets an
empty store of its own, and the store refuses use in a forked child (it would act on a copy).
The store says so in its characteristics (no ``MULTI_PROCESS``), so a caller that needs other
processes to see its leases can refuse it (``require``).

Expiry is judged on one clock per ``name``: ``CLOCK_BOOTTIME`` by default, or the ``clock``
passed when the name is first opened, so a test can move time by hand and see leases, claims and
records expire at once. Every operation runs under one lock (so it is atomic, as a Lua script or
an etcd transaction is) whose wait is bounded by the store's timeout. Tokens come from one
counter per name, seeded from the wall clock in microseconds as Redis's is, so they increase
strictly and a restarted process does not issue tokens below its predecessor's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..errors import (
    ConfigError,
    CrawlError,
    LeaseLost,
    RecordChanged,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from ._driver import StoreDriver, boottime, decoded_items, dumps, loads
from .base import Characteristic, Claim, Lease, Taken

__all__ = ["MemoryLeaseStore", "forget"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.-]*")
#: Longest wait of ``watch_free`` between looks at the lease (expiry announces nothing).
_POLL_S = 0.05


@dataclasses.dataclass(slots=True)
class _Lease:
    holder: str
    token: int
    expires_at: float


@dataclasses.dataclass(slots=True)
class _Claim:
    lease_name: str
    holder: str
    ltoken: int  # the token of the lease it is bound to
    token: int
    value: str


@dataclasses.dataclass(slots=True)
class _Record:
    value: str
    writer: int | None  # the token of the last fenced write
    expires_at: float | None
    revision: int


class _Space:
    """Everything one ``memory://name`` holds, keyed by ``(namespace, name)``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.cond = threading.Condition()
        #: versions of records and order of queue items; never reset, so no version read
        #: before a ``clear`` matches a record written after it
        self.revisions = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        """Empty, token counter included (what a restart without persistence leaves)."""
        self.leases: dict[tuple[str, str], _Lease] = {}
        self.claims: dict[tuple[str, str], _Claim] = {}
        self.records: dict[tuple[str, str], _Record] = {}
        self.queues: dict[tuple[str, str], collections.deque[tuple[int, str]]] = {}
        self.last_token = 0

    def next_token(self) -> int:
        self.last_token = max(self.last_token + 1, time.time_ns() // 1000)
        return self.last_token


_spaces: dict[str, _Space] = {}
_spaces_lock = threading.Lock()


def _space(name: str, clock: Callable[[], float] | None) -> _Space:
    with _spaces_lock:
        space = _spaces.get(name)
        if space is None:
            space = _spaces[name] = _Space(clock or boottime)
        elif clock is not None and clock is not space.clock:
            raise ConfigError(f"crawl_lease_url: memory://{name} is already open on another "
                              f"clock; give each test clock its own name")
        return space


def forget(name: str) -> None:
    """Drop everything ``memory://name`` holds in this process, token counter included, as a
    server restarting without persistence does; stores open on it see it empty. Its clock is
    kept."""
    with _spaces_lock:
        space = _spaces.get(name)
    if space is not None:
        with space.cond:
            space.clear()
            space.cond.notify_all()


def parse_memory_url(url: str) -> str:
    """The store name of a ``memory://`` URL.

    Raises:
        ConfigError: naming ``crawl_lease_url``: another scheme, or more than a name.
    """
    scheme, sep, name = url.partition("://")
    if scheme != "memory" or not sep:
        raise ConfigError(f"crawl_lease_url: {url!r} is not a memory:// URL")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"crawl_lease_url: {url!r}: a memory:// URL holds only a name "
                          f"(letters, digits, '_', '.', '-'): no host, credentials or options")
    return name


class MemoryLeaseStore(StoreDriver):
    """``LeaseStore`` in this process's memory (see the module docstring for what it is not).

    Args:
        url: ``memory://[name]``.
        namespace: prefix of every key, as on a server.
        timeout_s: bound of the wait for the store's lock.
        clock: ``CLOCK_BOOTTIME``-like seconds judging expiry and validity, fixed for ``name``
            when it is first opened (tests pass a hand-moved clock).

    Attributes:
        round_trips: operations made so far (one per call, as a server round trip would be).
    """

    characteristics = frozenset({
        Characteristic.MONOTONIC_TOKENS,
        Characteristic.LINEARIZABLE,
        Characteristic.HAS_CLOCK,
    })
    _kind = "memory"
    _fork_reason = ("its state lives in this process's memory, and a child would act on a copy "
                    "no other process sees")

    def __init__(self, url: str, *, namespace: str, timeout_s: float = 2.0,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(url, namespace=namespace, timeout_s=timeout_s)
        self.name = parse_memory_url(url)
        self._space = _space(self.name, clock)
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------------
    def _now(self) -> float:
        return self._space.clock()

    @contextlib.contextmanager
    def _op(self, what: str, timeout_s: float | None = None) -> Iterator[_Space]:
        """The store's lock for one operation, waited for at most the timeout."""
        self._refuse_forked_child()
        if self._closed:
            raise StoreUnavailable(f"{self.url}: {what}: the store is closed")
        bound = self.timeout_s if timeout_s is None else max(0.001, min(timeout_s,
                                                                         self.timeout_s))
        space = self._space
        if not space.cond.acquire(timeout=bound):
            raise StoreTimeout(f"{self.url}: {what} did not answer within {bound:g}s")
        try:
            self.round_trips += 1
            yield space
        finally:
            space.cond.release()

    def _lease(self, space: _Space, name: str) -> _Lease | None:
        """The live lease ``name``; an expired one is dropped here."""
        key = (self.namespace, name)
        lease = space.leases.get(key)
        if lease is not None and space.clock() >= lease.expires_at:
            del space.leases[key]
            return None
        return lease

    def _current(self, space: _Space, lease: Lease) -> bool:
        cur = self._lease(space, lease.name)
        return cur is not None and (cur.holder, cur.token) == (lease.holder, lease.token)

    def _alive(self, space: _Space, claim: _Claim) -> bool:
        cur = self._lease(space, claim.lease_name)
        return cur is not None and (cur.holder, cur.token) == (claim.holder, claim.ltoken)

    def _record(self, space: _Space, key: str) -> _Record | None:
        rkey = (self.namespace, key)
        rec = space.records.get(rkey)
        if rec is not None and rec.expires_at is not None and space.clock() >= rec.expires_at:
            del space.records[rkey]
            return None
        return rec

    def _fence(self, space: _Space, lease: Lease | None, keys: Sequence[str]) -> None:
        """Refuse a write by a lease that is not current, or over a newer writer token."""
        if lease is None:
            return
        if not self._current(space, lease):
            raise self._not_leader(lease, f"write to {', '.join(keys) or '?'!r}")
        for key in keys:
            rec = self._record(space, key)
            if rec is not None and rec.writer is not None and rec.writer > lease.token:
                raise self._fenced(lease, key)

    def _write(self, space: _Space, key: str, value: str, lease: Lease | None,
               expires_at: float | None) -> None:
        old = self._record(space, key)
        writer = lease.token if lease is not None else (old.writer if old else None)
        space.records[(self.namespace, key)] = _Record(value, writer, expires_at,
                                                       next(space.revisions))

    def _public(self, key: str, claim: _Claim, alive: bool) -> Claim:
        return Claim(key=key, lease_name=claim.lease_name, holder=claim.holder,
                     token=claim.token, value=loads(claim.value, f"claim {key!r}"), alive=alive)

    # -- leases -----------------------------------------------------------------------------
    def acquire(self, name: str, ttl_s: float, holder: str) -> Lease | None:
        """Take lease ``name`` if free (or already ours); None while another holder has it."""
        ttl = self._positive_ttl(ttl_s)
        with self._op("acquire") as space:
            t_send = space.clock()
            cur = self._lease(space, name)
            if cur is not None and cur.holder != holder:
                return None
            if cur is None:
                cur = space.leases[(self.namespace, name)] = _Lease(holder, space.next_token(),
                                                                    0.0)
            cur.expires_at = t_send + ttl
            return Lease(name=name, holder=holder, token=cur.token, ttl_s=ttl,
                         valid_until=self._valid_until(t_send, ttl))

    def renew(self, lease: Lease, *, timeout_s: float | None = None) -> Lease:
        """Extend ``lease``; ``LeaseLost`` once it expired or another holder took it."""
        ttl = self._positive_ttl(lease.ttl_s)
        with self._op("renew", timeout_s) as space:
            t_send = space.clock()
            if not self._current(space, lease):
                raise LeaseLost(f"{self.url}: lease {lease.name!r} (token {lease.token}) is "
                                f"gone or held by another holder")
            space.leases[(self.namespace, lease.name)].expires_at = t_send + ttl
            return dataclasses.replace(lease, valid_until=self._valid_until(t_send, ttl))

    def release(self, lease: Lease) -> None:
        """Delete the lease if still ours, waking ``watch_free`` callers."""
        with self._op("release") as space:
            if self._current(space, lease):
                del space.leases[(self.namespace, lease.name)]
                space.cond.notify_all()

    def holder(self, name: str) -> tuple[str, int] | None:
        """``(holder, token)`` of lease ``name``, or None when free."""
        with self._op("holder") as space:
            cur = self._lease(space, name)
            return None if cur is None else (cur.holder, cur.token)

    def lease_ttl_left(self, name: str) -> float | None:
        """Seconds left on lease ``name`` by the store's clock, None when free."""
        with self._op("lease_ttl_left") as space:
            cur = self._lease(space, name)
            return None if cur is None else cur.expires_at - space.clock()

    # -- claims -----------------------------------------------------------------------------
    def claim_many(self, lease: Lease, items: Sequence[tuple[str, Mapping[str, Any]]]
                   ) -> list[int | None]:
        """``claim`` for every item in one atomic step (a key given twice: the second is
        refused, the first claim is live). No items: nothing asked, nothing checked."""
        values = [dumps(value, key) for key, value in items]
        if not values:
            return []
        with self._op("claim") as space:
            if not self._current(space, lease):
                raise self._cannot_claim(lease)
            return [self._claim_one(space, lease, key, value)
                    for (key, _), value in zip(items, values, strict=True)]

    def _claim_one(self, space: _Space, lease: Lease, key: str, value: str) -> int | None:
        prev = space.claims.get((self.namespace, key))
        if prev is not None and self._alive(space, prev):
            return None
        token = space.next_token()
        space.claims[(self.namespace, key)] = _Claim(lease.name, lease.holder, lease.token,
                                                     token, value)
        return token

    def _claim_guarded(self, space: _Space, lease: Lease, key: str, doc: str,
                       guarded: Sequence[tuple[str, str]]) -> int | None:
        if not self._current(space, lease):
            raise self._cannot_claim(lease)
        for record, version in guarded:
            rec = self._record(space, record)
            if (str(rec.revision) if rec is not None else "") != version:
                raise RecordChanged(f"{self.url}: claim of {key!r} refused: record {record!r} "
                                    f"changed since it was read")
        return self._claim_one(space, lease, key, doc)

    def claim_unless_changed_many(
        self, lease: Lease,
        items: Sequence[tuple[str, Mapping[str, Any], Sequence[tuple[str, str]]]],
    ) -> list[int | CrawlError | None]:
        """``claim_unless_changed`` for many claims, each decided on its own, in one step."""
        docs = [dumps(value, key) for key, value, _ in items]
        out: list[int | CrawlError | None] = []
        with self._op("claim") as space:
            for (key, _, guarded), doc in zip(items, docs, strict=True):
                try:
                    out.append(self._claim_guarded(space, lease, key, doc, guarded))
                except CrawlError as exc:
                    out.append(exc)
        return out

    def finish_claims(self, lease: Lease,
                      items: Sequence[tuple[str, str, Mapping[str, Any]]], *,
                      ttl_s: float,
                      tokens: Sequence[int | None] | None = None) -> list[bool | CrawlError]:
        """``finish_claim`` for many ``(claim key, record, value)``, in one step."""
        ttl = self._positive_ttl(ttl_s, "ttl_s")
        values = [dumps(value, record) for _, record, value in items]
        named = list(tokens) if tokens is not None else [None] * len(items)
        out: list[bool | CrawlError] = []
        with self._op("finish") as space:
            expires_at = space.clock() + ttl
            for (key, record, _), value, token in zip(items, values, named, strict=True):
                self._write(space, record, value, None, expires_at)
                claim = space.claims.get((self.namespace, key))
                ours = claim is not None and (claim.lease_name, claim.holder, claim.ltoken) == (
                    lease.name, lease.holder, lease.token) and (
                    token is None or claim.token == token)
                if ours:
                    del space.claims[(self.namespace, key)]
                out.append(ours)
        return out

    def claimant(self, key: str) -> Claim | None:
        """The current claim on ``key`` (alive or orphaned), or None."""
        with self._op("claimant") as space:
            claim = space.claims.get((self.namespace, key))
            return None if claim is None else self._public(key, claim, self._alive(space, claim))

    def unclaim(self, lease: Lease, key: str, *, token: int | None = None) -> bool:
        """Delete claim ``key`` if it is bound to ``lease`` (and carries ``token``, if given);
        True if deleted."""
        with self._op("unclaim") as space:
            claim = space.claims.get((self.namespace, key))
            if claim is None or (claim.lease_name, claim.holder, claim.ltoken) != (
                    lease.name, lease.holder, lease.token) or (
                    token is not None and claim.token != token):
                return False
            del space.claims[(self.namespace, key)]
            return True

    def _claims(self, space: _Space) -> Iterator[tuple[str, _Claim]]:
        for (namespace, key), claim in space.claims.items():
            if namespace == self.namespace:
                yield key, claim

    def claims_of(self, lease_name: str) -> list[Claim]:
        """Every claim bound to ``lease_name`` (alive or not), by key."""
        with self._op("claims_of") as space:
            return [self._public(key, c, self._alive(space, c))
                    for key, c in sorted(self._claims(space)) if c.lease_name == lease_name]

    def orphaned_claims(self, limit: int = 1000) -> list[Claim]:
        """Claims whose lease is dead, oldest lease first."""
        with self._op("orphans") as space:
            dead = sorted(((c.ltoken, key, c) for key, c in self._claims(space)
                           if not self._alive(space, c)), key=lambda row: row[:2])
            return [self._public(key, c, False) for _, key, c in dead[:max(0, limit)]]

    def drop_claim(self, claim: Claim) -> bool:
        """Delete an orphaned claim if it still carries ``claim.token``."""
        with self._op("drop_claim") as space:
            cur = space.claims.get((self.namespace, claim.key))
            if cur is None or cur.token != claim.token or self._alive(space, cur):
                return False
            del space.claims[(self.namespace, claim.key)]
            return True

    # -- records ----------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, Mapping[str, Any]]], *,
                 lease: Lease | None = None, ttl_s: float | None = None) -> None:
        """Write records atomically: every fence is checked before any write. No items: nothing
        asked, nothing checked."""
        ttl = None if ttl_s is None else self._positive_ttl(ttl_s, "ttl_s")
        values = [dumps(value, key) for key, value in items]
        if not values:
            return
        with self._op("put") as space:
            self._fence(space, lease, [key for key, _ in items])
            expires_at = None if ttl is None else space.clock() + ttl
            for (key, _), value in zip(items, values, strict=True):
                self._write(space, key, value, lease, expires_at)

    def get_many_versioned(self, keys: Sequence[str]) -> list[tuple[dict[str, Any] | None, str]]:
        """Records for ``keys``, each with its write's revision as its version."""
        with self._op("get") as space:
            recs = [self._record(space, key) for key in keys]
        return [(None, "") if rec is None else (loads(rec.value, key), str(rec.revision))
                for key, rec in zip(keys, recs, strict=True)]

    def scan(self, prefix: str, *, between: Callable[[], None] | None = None
             ) -> dict[str, dict[str, Any]]:
        """Every record whose key starts with ``prefix`` (one step: ``between`` is never
        called)."""
        with self._op("scan") as space:
            keys = sorted(key for namespace, key in list(space.records)
                          if namespace == self.namespace and key.startswith(prefix))
            found = {key: rec for key in keys if (rec := self._record(space, key)) is not None}
        return {key: loads(rec.value, key) for key, rec in found.items()}

    def delete(self, key: str, *, lease: Lease | None = None) -> bool:
        """Delete a record (fenced when ``lease`` is given); True if it existed."""
        with self._op("delete") as space:
            self._fence(space, lease, [key])
            if self._record(space, key) is None:
                return False
            del space.records[(self.namespace, key)]
            return True

    # -- queues -----------------------------------------------------------------------------
    def _queue(self, space: _Space, queue: str) -> collections.deque[tuple[int, str]]:
        return space.queues.setdefault((self.namespace, queue), collections.deque())

    def push(self, queue: str, value: Mapping[str, Any]) -> None:
        """Append to a FIFO queue."""
        raw = dumps(value, queue)
        with self._op("push") as space:
            self._queue(space, queue).append((next(space.revisions), raw))

    def pop_all(self, queue: str, *, lease: Lease | None = None,
                limit: int = 100) -> list[dict[str, Any]]:
        """Take up to ``limit`` items from the head of the queue atomically."""
        with self._op("pop") as space:
            if lease is not None and not self._current(space, lease):
                raise self._not_leader(lease, f"pop from {queue!r}")
            items = self._queue(space, queue)
            raws = [items.popleft()[1] for _ in range(min(max(0, limit), len(items)))]
        return decoded_items(raws, queue, url=self.url, log=log)

    def peek(self, queue: str, *, limit: int = 100) -> Taken:
        """Read up to ``limit`` items from the head of the queue, removing none."""
        with self._op("peek") as space:
            head = list(itertools.islice(self._queue(space, queue), max(0, limit)))
        items = decoded_items([raw for _, raw in head], queue, url=self.url, log=log)
        return Taken(queue, tuple(items), tuple(seq for seq, _ in head))

    def put_and_ack(self, items: Sequence[tuple[str, Mapping[str, Any]]], taken: Taken, *,
                    lease: Lease) -> None:
        """Write records (fenced, persistent) and remove ``taken`` from its queue's head, in
        one step: both or neither."""
        values = [dumps(value, key) for key, value in items]
        with self._op("put_and_ack") as space:
            self._fence(space, lease, [key for key, _ in items])
            queue = self._queue(space, taken.queue)
            head = tuple(seq for seq, _ in itertools.islice(queue, len(taken.handle)))
            if head != taken.handle:
                raise StoreError(f"{self.url}: {taken.queue!r}: the head of the queue changed "
                                 f"since it was read; nothing written")
            for (key, _), value in zip(items, values, strict=True):
                self._write(space, key, value, lease, None)
            for _ in taken.handle:
                queue.popleft()

    # -- misc -------------------------------------------------------------------------------
    def server_time(self) -> float | None:
        """This process's wall clock: the "server" is this process."""
        return time.time()

    def _ping_once(self) -> None:
        with self._op("ping"):
            pass

    def watch_free(self, name: str, timeout_s: float) -> bool:
        """Wait for lease ``name`` to be released (woken at once) or to expire (seen within
        0.05 s); True once it is seen free. The wait is real time, whatever the clock."""
        deadline = boottime() + max(0.0, timeout_s)
        with self._op("watch_free") as space:
            while True:
                if self._lease(space, name) is None:
                    return True
                left = deadline - boottime()
                if left <= 0:
                    return False
                space.cond.wait(min(_POLL_S, left))

    def eviction_risk(self) -> str | None:
        """Nothing is evicted: None."""
        return None

    def persistence(self) -> dict[str, Any]:
        """Nothing survives the process."""
        return {"aof_enabled": False, "rdb": False, "persistent": False}

    def close(self) -> None:
        """Make this store object unusable (the named store's contents stay for others)."""
        self._closed = True
