"""What every lease driver shares, written once, so the drivers hold only their primitives.

A driver subclasses :class:`StoreDriver` and gets the public operations that are the same
everywhere: one-record ``put``/``get``/``claim``/``claim_unless_changed``/``finish_claim`` on
top of the batched calls (a driver whose single call is cheaper or differs overrides it),
``get_many`` from ``get_many_versioned``, ``watch_free`` around ``holder`` and a bounded wait,
``ping`` around one cheap request, the masked URL, the ``crawl_store_timeout`` check, the fork
guard and the ``repr``. The module functions are the one JSON codec (so a value reads back the
same from every store, and foreign data raises ``StoreDataError`` naming the key), the validity
formula ``valid_until = t_send + ttl * (1 - DRIFT) - MARGIN_S`` and the handling of foreign
queue items.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .._urls import masked_url
from ..errors import (
    ConfigError,
    CrawlError,
    FencedError,
    LeaseLost,
    NotLeader,
    StoreDataError,
    UnsupportedSetup,
)
from .base import DRIFT, MARGIN_S, Characteristic, Lease

_R = TypeVar("_R")

__all__ = ["StoreDriver", "boottime", "decoded_items", "dumps", "loads", "valid_until"]

#: One encoder for every value (``json.dumps`` with options builds a new one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def dumps(value: Mapping[str, Any], key: str) -> str:
    """The stored form of a record: compact, keys sorted (so equal values are equal text).

    Raises:
        StoreDataError: the value is not JSON-serializable (naming ``key``).
    """
    try:
        return _ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise StoreDataError(f"value for {key!r} is not JSON-serializable: {exc}") from exc


def loads(raw: str | bytes, key: str) -> dict[str, Any]:
    """A stored record read back.

    Raises:
        StoreDataError: naming ``key``, when it holds anything but a JSON object (data
            celery-crawl did not write).
    """
    try:
        value = json.loads(raw)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StoreDataError(f"key {key!r} holds non-JSON data: {raw[:80]!r}") from exc
    if not isinstance(value, dict):
        raise StoreDataError(f"key {key!r} holds {type(value).__name__}, not a JSON object")
    return value


def decoded_items(raw_items: Sequence[str | bytes], queue: str, *, url: str,
                  log: logging.Logger, note: str = "dropped foreign data") -> list[dict[str, Any]]:
    """Queue items decoded; a foreign one is logged (``note``) and left out, so it can never
    hold back the valid commands behind it."""
    items = []
    for raw in raw_items:
        try:
            items.append(loads(raw, f"queue {queue!r}"))
        except StoreDataError as exc:
            log.warning("%s: %s: %s", url, note, exc)
    return items


def boottime() -> float:
    """``CLOCK_BOOTTIME`` seconds: the clock lease validity is judged on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def valid_until(t_send: float, ttl_s: float) -> float:
    """Until when a client may act on a lease the store granted ``ttl_s`` for, measured from
    ``t_send`` taken *before* the request: the server's clock may run up to ``DRIFT`` faster,
    and ``MARGIN_S`` covers the time between judging validity and acting on it."""
    return t_send + ttl_s * (1 - DRIFT) - MARGIN_S


class StoreDriver:
    """Base of every lease store driver: the ``LeaseStore`` operations that are the same for
    all of them. A driver implements the batched primitives (``put_many``, ``get_many``,
    ``claim_many``, ...) and ``_ping_once``.

    Args:
        url: the store URL; kept only masked (``url``), safe to log.
        namespace: prefix of every key.
        timeout_s: bound of every store call.

    Raises:
        ConfigError: ``timeout_s`` is not positive (naming ``crawl_store_timeout``).
    """

    characteristics: frozenset[Characteristic] = frozenset()
    #: How the driver names itself in the fork guard's message.
    _kind = "lease"
    #: Why a store object must not be used in a forked child, or None when it may.
    _fork_reason: str | None = None
    #: Longest wait of ``watch_free`` between two looks at the lease.
    _watch_poll_s = 0.25

    def __init__(self, url: str, *, namespace: str, timeout_s: float = 2.0) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"crawl_store_timeout: must be positive, got {timeout_s}")
        self.url = masked_url(url)
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        #: network round trips made so far (benchmarks and tests assert one per renewal)
        self.round_trips = 0
        self._pid = os.getpid()

    # -- hooks ------------------------------------------------------------------------------
    def _ping_once(self) -> None:
        """One cheapest request to the store (raises ``StoreError`` subclasses)."""
        raise NotImplementedError

    def _refuse_forked_child(self) -> None:
        """Refuse use in a process forked after the store was opened, when the driver says so.

        Raises:
            UnsupportedSetup: naming both processes and why.
        """
        if self._fork_reason is not None and os.getpid() != self._pid:
            raise UnsupportedSetup(
                f"{self.url}: the {self._kind} lease store was opened in process {self._pid} and "
                f"used in its forked child {os.getpid()}; {self._fork_reason}, so open the store "
                f"in the main process only (beat, worker main process)"
            )

    # -- the errors every driver raises alike --------------------------------------------------
    def _not_leader(self, lease: Lease, refused: str) -> NotLeader:
        """A fenced call refused because ``lease`` is not current (``refused``: what was, e.g.
        ``"write to 'slot'"``)."""
        return NotLeader(f"{self.url}: {refused} refused: lease {lease.name!r} "
                         f"(token {lease.token}) is not current")

    def _fenced(self, lease: Lease, key: str) -> FencedError:
        """A fenced write refused because ``key`` was written with a newer token."""
        return FencedError(f"{self.url}: write to {key!r} refused: it was written with a newer "
                           f"token than {lease.token}")

    def _cannot_claim(self, lease: Lease) -> LeaseLost:
        """A claim refused because ``lease`` is not held."""
        return LeaseLost(f"{self.url}: cannot claim under lease {lease.name!r}: it is gone or "
                         f"held by another holder")

    # -- the operations written once ---------------------------------------------------------
    def _now(self) -> float:
        """The clock validity is judged on (a driver with an injected clock overrides it)."""
        return boottime()

    @staticmethod
    def _valid_until(t_send: float, ttl_s: float) -> float:
        return valid_until(t_send, ttl_s)

    @staticmethod
    def _positive_ttl(ttl_s: float, what: str = "ttl") -> float:
        """``ttl_s`` as float seconds, refused alike by every store before anything is sent.

        Raises:
            ConfigError: not positive, naming ``what``.
        """
        if not ttl_s > 0:
            raise ConfigError(f"{what}: must be positive, got {ttl_s!r}")
        return float(ttl_s)

    @staticmethod
    def _each(calls: Iterable[Callable[[], _R]],
              errors: tuple[type[CrawlError], ...]) -> list[_R | CrawlError]:
        """A batched call made of single calls, for a store without a cheaper batch: per call
        its result, or the error of ``errors`` it raised (as the batched contract reports
        them); any other error ends the batch."""
        out: list[_R | CrawlError] = []
        for call in calls:
            try:
                out.append(call())
            except errors as exc:
                out.append(exc)
        return out

    def claim(self, lease: Lease, key: str, value: Mapping[str, Any]) -> int | None:
        """Create claim ``key`` bound to ``lease`` if absent or its claimant's lease is dead."""
        return self.claim_many(lease, [(key, value)])[0]

    def claim_many(self, lease: Lease, items: Sequence[tuple[str, Mapping[str, Any]]]
                   ) -> list[int | None]:
        raise NotImplementedError

    def claim_unless_changed(self, lease: Lease, key: str, value: Mapping[str, Any], *,
                             record: str, version: str,
                             also: Sequence[tuple[str, str]] = ()) -> int | None:
        """``claim_unless_changed_many`` for one claim; its error (``RecordChanged``,
        ``LeaseLost``, ...) raised."""
        got = self.claim_unless_changed_many(lease, [(key, value, [(record, version), *also])])[0]
        if isinstance(got, CrawlError):
            raise got
        return got

    def claim_unless_changed_many(
        self, lease: Lease,
        items: Sequence[tuple[str, Mapping[str, Any], Sequence[tuple[str, str]]]],
    ) -> list[int | CrawlError | None]:
        raise NotImplementedError

    def finish_claim(self, lease: Lease, key: str, record: str, value: Mapping[str, Any], *,
                     ttl_s: float, token: int | None = None) -> bool:
        """``finish_claims`` for one claim; its error raised."""
        got = self.finish_claims(lease, [(key, record, value)], ttl_s=ttl_s, tokens=[token])[0]
        if isinstance(got, CrawlError):
            raise got
        return got

    def finish_claims(self, lease: Lease,
                      items: Sequence[tuple[str, str, Mapping[str, Any]]], *,
                      ttl_s: float,
                      tokens: Sequence[int | None] | None = None) -> list[bool | CrawlError]:
        raise NotImplementedError

    def put(self, key: str, value: Mapping[str, Any], *, lease: Lease | None = None,
            ttl_s: float | None = None) -> None:
        """Write one record (fenced by ``lease`` when given)."""
        self.put_many([(key, value)], lease=lease, ttl_s=ttl_s)

    def put_many(self, items: Sequence[tuple[str, Mapping[str, Any]]], *,
                 lease: Lease | None = None, ttl_s: float | None = None) -> None:
        raise NotImplementedError

    def get(self, key: str) -> dict[str, Any] | None:
        """A record, or None."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """Records for ``keys``: ``get_many_versioned`` without the versions (the same reads,
        so the same round trips and the same ``StoreDataError`` for foreign data)."""
        return [record for record, _ in self.get_many_versioned(keys)]

    def get_many_versioned(self, keys: Sequence[str]) -> list[tuple[dict[str, Any] | None, str]]:
        raise NotImplementedError

    def holder(self, name: str) -> tuple[str, int] | None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _release_waiter(self, name: str) -> Iterator[Callable[[float], bool]]:
        """A wait of at most the given seconds between ``watch_free``'s looks, True when it saw
        ``name`` released. This one sleeps; a store that announces releases wakes on them."""
        def wait(seconds: float) -> bool:
            time.sleep(seconds)
            return False

        yield wait

    def watch_free(self, name: str, timeout_s: float) -> bool:
        """Wait until lease ``name`` is seen free (True) or ``timeout_s`` has passed (False):
        ``holder`` looked at between waits of at most ``_watch_poll_s`` (an expiry is announced
        by no store, so looking is the fallback even where releases are announced)."""
        deadline = self._now() + max(0.0, timeout_s)
        with self._release_waiter(name) as wait:
            while True:
                if self.holder(name) is None:
                    return True
                left = deadline - self._now()
                if left <= 0:
                    return False
                if wait(min(self._watch_poll_s, left)):
                    return True

    def ping(self) -> float:
        """Round-trip time of the store's cheapest request, in seconds."""
        t0 = self._now()
        self._ping_once()
        return self._now() - t0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, namespace={self.namespace!r})"
