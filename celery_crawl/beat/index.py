"""The entry index: which entries have a stored state, so promotion never scans the store.

A new leader needs the state of every entry it knows (read by key, in batches) and the names
of stored states whose entry is gone (to collect them). Finding the latter by scanning made
promotion O(keys in the whole Redis database): 3.3 s with 2 M unrelated records, and never
finishing with ~6 M. The index record ``keys.BEAT_INDEX`` lists every name that may have a
stored state: it is written (fenced) *before* any new state and shrunk only *after* the
states it drops are deleted, so it always covers what is stored. A store without an index
(written before it existed, or damaged) is scanned once, renewing the lease between pages,
and the index is written from what the scan found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from .. import keys
from ..errors import StoreDataError
from ..leases.base import Lease, LeaseStore

__all__ = ["READ_BATCH", "read_index", "read_states", "write_index"]

log = logging.getLogger("celery_crawl.beat")

#: States read per request during promotion (the lease is renewed between requests).
READ_BATCH = 1000


def read_index(store: LeaseStore, *, between: Callable[[], None]) -> tuple[set[str], bool]:
    """The names that may have a stored state, and whether they came from a scan (the index
    was missing or damaged and must be written)."""
    try:
        record = store.get(keys.BEAT_INDEX)
    except StoreDataError as exc:
        log.error("beat: %s; rebuilding the entry index from a scan", exc)
        record = None
    names = record.get("names") if record is not None else None
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return set(names), False
    if record is not None:
        log.error("beat: the entry index %r is not a list of names; rebuilding it from a scan",
                  keys.BEAT_INDEX)
    prefix = keys.beat_entry("")
    found = {k[len(prefix):] for k in store.scan(prefix, between=between)}
    log.warning("beat: entry index built from a scan of the store (%d entry states)",
                len(found))
    return found, True


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
        out.update(zip(batch, store.get_many([keys.beat_entry(n) for n in batch]),
                       strict=True))
    return out


def write_index(store: LeaseStore, names: Iterable[str], *, lease: Lease) -> None:
    """Write the index (fenced by the leader lease)."""
    store.put(keys.BEAT_INDEX, {"names": sorted(names)}, lease=lease)
