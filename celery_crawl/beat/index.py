"""The entry index: which entries have a stored state, so promotion never scans the store.

A new leader needs the state of every entry it knows (read by key, in batches) and the names
of stored states whose entry is gone (to collect them). Finding the latter by scanning made
promotion O(keys in the whole Redis database): 3.3 s with 2 M unrelated records, and never
finishing with ~6 M. The index lists every name that may have a stored state, in ``SHARDS``
records ``beat/index/<n>`` (a name's shard is fixed by its CRC-32; small records, so an index of
100 000 names stays far below etcd's request size limit, and a change rewrites only the shards
it touches). A shard is written (fenced) *before* any new state of its names and shrunk only
*after* the states it drops are deleted, so the index always covers what is stored.

The index is complete only when every shard exists: a store without one (written before the
index existed, or damaged) is scanned once, renewing the lease between pages, and every shard
is written from what the scan found.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable
from typing import Any

from .. import keys
from ..errors import StoreDataError
from ..leases.base import Lease, LeaseStore

__all__ = ["READ_BATCH", "SHARDS", "EntryIndex", "read_states"]

log = logging.getLogger("celery_crawl.beat")

#: States read per request during promotion (the lease is renewed between requests).
READ_BATCH = 1000
#: Index records; fixed, since a name's shard is derived from it.
SHARDS = 64


def _shard(name: str) -> int:
    return zlib.crc32(name.encode("utf-8", "surrogatepass")) % SHARDS


def _names(record: dict[str, Any] | None) -> set[str] | None:
    names = record.get("names") if record is not None else None
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return set(names)
    return None


class EntryIndex:
    """The names of stored entry states, by shard, with the shards changed since loading."""

    def __init__(self, shards: list[set[str]], *, dirty: Iterable[int] = ()) -> None:
        self._shards = shards
        self._dirty = set(dirty)

    @property
    def names(self) -> set[str]:
        return set().union(*self._shards)

    @classmethod
    def load(cls, store: LeaseStore, *, between: Callable[[], None]) -> EntryIndex:
        """Read every shard (one request); rebuild from a scan if any is missing or damaged."""
        try:
            records = store.get_many([keys.beat_index(i) for i in range(SHARDS)])
        except StoreDataError as exc:
            log.error("beat: %s; rebuilding the entry index from a scan", exc)
            records = [None] * SHARDS
        shards = [_names(r) for r in records]
        if all(s is not None for s in shards):
            return cls([s for s in shards if s is not None])
        if any(r is not None for r in records):
            log.error("beat: the entry index is damaged (%d of %d shards readable); rebuilding "
                      "it from a scan", sum(s is not None for s in shards), SHARDS)
        prefix = keys.beat_entry("")
        found = [k[len(prefix):] for k in store.scan(prefix, between=between)]
        log.warning("beat: entry index built from a scan of the store (%d entry states)",
                    len(found))
        index = cls([set() for _ in range(SHARDS)], dirty=range(SHARDS))
        index.add(found)
        return index

    def add(self, names: Iterable[str]) -> None:
        for name in names:
            shard = self._shards[_shard(name)]
            if name not in shard:
                shard.add(name)
                self._dirty.add(_shard(name))

    def discard(self, names: Iterable[str]) -> None:
        for name in names:
            shard = self._shards[_shard(name)]
            if name in shard:
                shard.discard(name)
                self._dirty.add(_shard(name))

    def save(self, store: LeaseStore, *, lease: Lease, between: Callable[[], None]) -> None:
        """Write the changed shards, one fenced write each (``between`` runs between them)."""
        for i, n in enumerate(sorted(self._dirty)):
            if i:
                between()
            store.put(keys.beat_index(n), {"names": sorted(self._shards[n])}, lease=lease)
        self._dirty.clear()


def read_states(store: LeaseStore, names: Iterable[str], *,
                between: Callable[[], None]) -> dict[str, dict[str, Any] | None]:
    """The stored state record of each name (None when absent), ``READ_BATCH`` per request;
    ``between`` runs between requests."""
    todo = list(names)
    out: dict[str, dict[str, Any] | None] = {}
    for start in range(0, len(todo), READ_BATCH):
        if start:
            between()
        batch = todo[start:start + READ_BATCH]
        try:
            out.update(zip(batch, store.get_many([keys.beat_entry(n) for n in batch]),
                           strict=True))
        except StoreDataError:
            # Foreign bytes under one entry's key must not stop the leader from running every
            # other entry (nor that one): read the batch key by key; garbage counts as absent,
            # so that entry starts afresh, as after a changed definition.
            for name in batch:
                try:
                    out[name] = store.get(keys.beat_entry(name))
                except StoreDataError as exc:
                    log.error("beat: the state of entry %r is unreadable and is started "
                              "afresh: %s", name, exc)
                    out[name] = None
    return out
