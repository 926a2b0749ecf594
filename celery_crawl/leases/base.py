"""The lease-store contract every driver implements.

A store keeps three kinds of things for one namespace:

* **leases** — named, exclusive, expiring; acquiring one yields a fencing token from the
  namespace's single monotonic token source (etcd: the revision; Redis: ``max(INCR, TIME in
  µs)`` on one counter, so tokens never go backwards when the counter does);
* **claims** — ``key -> value`` records bound to a lease; valid exactly while that lease lives,
  never refreshed one by one (renewing the lease is O(1) whatever the number of claims);
* **records** — small JSON-able values (slot state, presence, tombstones, command queues),
  optionally fenced by a lease (written only while that lease is current and its token is not
  older than the stored writer token) and optionally expiring.

Validity is judged on the client's ``CLOCK_BOOTTIME`` measured from *before* the request:
``valid_until = t_send + ttl * (1 - drift) - margin``. The server expires keys by its own clock;
clients never compare wall clocks.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import CrawlError

__all__ = [
    "DRIFT",
    "MARGIN_S",
    "Characteristic",
    "Claim",
    "Lease",
    "LeaseStore",
    "StoreDiagnostics",
    "Taken",
    "require",
]

#: Fraction of the TTL assumed lost to clock-rate differences between client and server.
DRIFT = 0.01
#: Fixed safety margin subtracted from every validity window (seconds).
MARGIN_S = 0.05


class Characteristic(enum.Enum):
    """What a driver guarantees; callers may demand one (``store.require(...)``)."""

    #: Fencing tokens never go backwards, even after the server restarts without persistence.
    MONOTONIC_TOKENS = "monotonic-tokens"
    #: Writes are linearizable across store failover (etcd: raft; Redis async replication: no).
    LINEARIZABLE = "linearizable"
    #: ``server_time()`` returns the store's clock.
    HAS_CLOCK = "has-clock"
    #: The store can tell whether a token was issued (Redis token counter on the same server).
    TOKEN_ISSUANCE_CHECK = "token-issuance-check"
    #: Other processes (other hosts, a restarted process) see the same leases: the store lives
    #: outside the caller (Redis, etcd; not ``memory://``).
    MULTI_PROCESS = "multi-process"


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """A held lease. Immutable: ``renew`` returns a new one with a later ``valid_until``.

    Attributes:
        name: logical lease name inside the namespace (``"beat-leader"``, ``"worker:<holder>"``).
        holder: unique per process start (``hostname:pid:random``).
        token: fencing token; strictly greater than every token issued before in the namespace.
        ttl_s: the TTL the store enforces (etcd: whole seconds).
        valid_until: ``CLOCK_BOOTTIME`` seconds until which this client may act on the lease.
        handle: driver-private handle (etcd lease id); opaque to callers.
    """

    name: str
    holder: str
    token: int
    ttl_s: float
    valid_until: float
    handle: int | None = None

    def remaining(self, now: float) -> float:
        """Seconds of validity left at monotonic ``now`` (negative once expired)."""
        return self.valid_until - now


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """A claim as read back from the store.

    Attributes:
        key: the claimed key (``"task:<id>"``).
        lease_name: name of the lease the claim is bound to.
        holder: holder of that lease when the claim was made.
        token: the claim's own fencing token.
        value: the JSON-able mapping stored with the claim.
        alive: whether the bound lease still lives (so the claim is valid).
    """

    key: str
    lease_name: str
    holder: str
    token: int
    value: Mapping[str, Any]
    alive: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Taken:
    """Items read from the head of a queue and not yet removed (``peek``).

    They leave the queue only with the write that records what they caused
    (``put_and_ack``), so a consumer deposed in between loses nothing: the next one reads
    them again.

    Attributes:
        queue: the queue's logical name.
        items: the items that are records, oldest first (foreign data is logged and left out,
            and removed with the rest).
        handle: driver-private identity of every item read (Redis: the raw values; etcd: key
            and mod revision), checked again when they are removed.
    """

    queue: str
    items: tuple[dict[str, Any], ...]
    handle: tuple[Any, ...]


@runtime_checkable
class LeaseStore(Protocol):
    """A lease store for one namespace. Every call has a timeout and raises only ``StoreError``
    subclasses (or ``LeaseLost`` where stated) — never a client library's exception.

    Main-process only: prefork children must not share a store object across ``fork()``.
    """

    url: str  #: the URL with the password masked, safe to log
    namespace: str
    characteristics: frozenset[Characteristic]

    # -- leases -----------------------------------------------------------------------------
    def acquire(self, name: str, ttl_s: float, holder: str) -> Lease | None:
        """Take lease ``name`` if free (non-blocking); None while another holder has it."""
        ...

    def renew(self, lease: Lease, *, timeout_s: float | None = None) -> Lease:
        """Extend ``lease`` in one round trip. Raises ``LeaseLost`` if gone or held by another.

        ``timeout_s`` bounds this call below the store's timeout (a holder passes the validity
        it has left: an answer later than that is useless, the lease is lost by then)."""
        ...

    def release(self, lease: Lease) -> None:
        """Give the lease up if still held by ``lease.holder``; never raises for an expired one.

        Releasing deletes the lease's claims' validity at once (they become orphaned)."""
        ...

    def holder(self, name: str) -> tuple[str, int] | None:
        """``(holder, token)`` of lease ``name``, or None when free."""
        ...

    def lease_ttl_left(self, name: str) -> float | None:
        """Server-side seconds left on lease ``name`` (for status displays), None when free."""
        ...

    # -- claims -----------------------------------------------------------------------------
    def claim(self, lease: Lease, key: str, value: Mapping[str, Any]) -> int | None:
        """Atomically create claim ``key`` bound to ``lease`` if absent, or if the previous
        claimant's lease is dead. Returns the claim's fresh token, or None while a live claim
        exists (held by any lease, including this one). Raises ``LeaseLost`` if ``lease`` is
        not held."""
        ...

    def claim_many(
        self, lease: Lease, items: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> list[int | None]:
        """``claim`` for many keys in as few round trips as the store allows."""
        ...

    def claim_unless_changed(self, lease: Lease, key: str, value: Mapping[str, Any], *,
                             record: str, version: str,
                             also: Sequence[tuple[str, str]] = ()) -> int | None:
        """``claim``, in the same atomic operation as a check that record ``record`` still has
        the ``version`` read by ``get_many_versioned`` (``""``: still absent), and every
        ``(record, version)`` of ``also`` too.

        The caller decides from the record (a worker: the task's done tombstone) and claims
        only if that decision still holds when the claim is made, so no writer of the record
        can slip in between. Raises ``RecordChanged`` when the record changed (nothing was
        written), ``LeaseLost`` if ``lease`` is not held."""
        ...

    def claimant(self, key: str) -> Claim | None:
        """The current claim on ``key`` (alive or orphaned), or None."""
        ...

    def claim_unless_changed_many(
        self, lease: Lease,
        items: Sequence[tuple[str, Mapping[str, Any], Sequence[tuple[str, str]]]],
    ) -> list[int | CrawlError | None]:
        """``claim_unless_changed`` for many ``(key, value, [(record, version), ...])`` (the
        first pair is ``record``/``version``, the rest ``also``), each as atomic as one call,
        in as few round trips as the store allows. Per item: the token, None, or the
        ``StoreError`` (``RecordChanged``, ``LeaseLost``, ...) that call would have raised."""
        ...

    def finish_claims(self, lease: Lease,
                      items: Sequence[tuple[str, str, Mapping[str, Any]]], *,
                      ttl_s: float,
                      tokens: Sequence[int | None] | None = None) -> list[bool | CrawlError]:
        """``finish_claim`` for many ``(claim key, record, value)``, each as atomic as one
        call, in as few round trips as the store allows (``tokens``: each item's claim token,
        as ``finish_claim``'s ``token``). Per item: deleted, or the error."""
        ...

    def finish_claim(self, lease: Lease, key: str, record: str, value: Mapping[str, Any], *,
                     ttl_s: float, token: int | None = None) -> bool:
        """The end of a claimed run in one atomic operation: write record ``record``
        (unfenced, expiring after ``ttl_s``), then delete claim ``key`` if it is bound to
        ``lease`` and (``token`` given) still is the claim with that token: a late end of an
        earlier run never deletes a later claim of the same lease. The record is written even
        when the claim is not ours. True if deleted."""
        ...

    def unclaim(self, lease: Lease, key: str, *, token: int | None = None) -> bool:
        """Delete claim ``key`` if it is bound to ``lease`` (same holder and lease) and
        (``token`` given) carries claim token ``token``; True if deleted. A worker always
        names the token: another claim of the key under the same lease is not its to drop."""
        ...

    def claims_of(self, lease_name: str) -> list[Claim]:
        """Every claim bound to lease ``lease_name`` (alive or not)."""
        ...

    def orphaned_claims(self, limit: int = 1000) -> list[Claim]:
        """Claims whose bound lease is dead, oldest lease first; for the reaper."""
        ...

    def drop_claim(self, claim: Claim) -> bool:
        """Delete an orphaned claim if it is still the same one (same token); True if deleted."""
        ...

    # -- records ----------------------------------------------------------------------------
    def put(
        self,
        key: str,
        value: Mapping[str, Any],
        *,
        lease: Lease | None = None,
        ttl_s: float | None = None,
    ) -> None:
        """Write a JSON record. With ``lease``: only while that lease is current, and only if
        the record's stored writer token is not greater than ``lease.token``; otherwise raises
        ``NotLeader`` (lease not current) or ``FencedError`` (older token). With ``ttl_s``: the
        record expires."""
        ...

    def put_many(
        self,
        items: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        lease: Lease | None = None,
        ttl_s: float | None = None,
    ) -> None:
        """``put`` for several records, atomically, in one round trip where possible."""
        ...

    def get(self, key: str) -> dict[str, Any] | None:
        """A record, or None. A key holding non-JSON raises ``StoreDataError`` naming the key."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """``get`` for several keys in one round trip."""
        ...

    def get_many_versioned(self, keys: Sequence[str]) -> list[tuple[dict[str, Any] | None, str]]:
        """``get_many``, each record with an opaque version for ``claim_unless_changed``
        (``""`` for an absent record)."""
        ...

    def scan(self, prefix: str, *, between: Callable[[], None] | None = None
             ) -> dict[str, dict[str, Any]]:
        """Every record whose key starts with ``prefix`` (keys returned without the namespace).

        ``between`` is called between the requests of a scan that takes several (Redis
        ``SCAN`` pages): a lease holder renews there, and may raise to abort the scan."""
        ...

    def delete(self, key: str, *, lease: Lease | None = None) -> bool:
        """Delete a record (fenced like ``put`` when ``lease`` is given); True if it existed."""
        ...

    # -- queues (operator commands) ---------------------------------------------------------
    def push(self, queue: str, value: Mapping[str, Any]) -> None:
        """Append to a FIFO queue."""
        ...

    def pop_all(self, queue: str, *, lease: Lease | None = None, limit: int = 100) -> list[
        dict[str, Any]
    ]:
        """Take up to ``limit`` items from the head of the queue, atomically (fenced by
        ``lease`` when given, so only the leader consumes)."""
        ...

    def peek(self, queue: str, *, limit: int = 100) -> Taken:
        """Read up to ``limit`` items from the head of the queue without removing them."""
        ...

    def put_and_ack(self, items: Sequence[tuple[str, Mapping[str, Any]]], taken: Taken, *,
                    lease: Lease) -> None:
        """Write records (fenced by ``lease``, persistent) and remove ``taken`` from the head
        of its queue, in one write: both or neither. Raises ``NotLeader``/``FencedError`` as
        ``put`` does, and ``StoreError`` if the head of the queue is no longer ``taken``."""
        ...

    # -- misc -------------------------------------------------------------------------------
    def server_time(self) -> float | None:
        """The store's wall clock in UNIX seconds, or None if the store has none (etcd)."""
        ...

    def ping(self) -> float:
        """Round-trip time in seconds; raises ``StoreUnavailable``/``StoreTimeout``."""
        ...

    def watch_free(self, name: str, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until lease ``name`` looks free (pub/sub or watch);
        True if it was seen free. Used by standbys to take over within a second."""
        ...

    def close(self) -> None:
        """Close connections; the store is unusable afterwards."""
        ...


@runtime_checkable
class StoreDiagnostics(Protocol):
    """Extras both drivers offer beside the contract: durability checks and call counting."""

    #: network round trips made so far (benchmarks and tests assert one per renewal)
    round_trips: int

    def eviction_risk(self) -> str | None:
        """Why lease or slot keys could be evicted by the server, or None (etcd: never)."""
        ...

    def persistence(self) -> dict[str, Any]:
        """``{"aof_enabled", "rdb", "persistent"}``: whether tokens and state survive a restart."""
        ...


def require(store: LeaseStore, *wanted: Characteristic) -> None:
    """Refuse a store that lacks a guarantee the caller depends on.

    Raises:
        UnsupportedSetup: naming the store (masked URL) and the missing characteristics.
    """
    from ..errors import UnsupportedSetup

    missing = [c.value for c in wanted if c not in store.characteristics]
    if missing:
        raise UnsupportedSetup(
            f"{store.url}: this lease store does not guarantee {', '.join(missing)}"
        )
