"""The leader's book of entry states: loaded at promotion, written back in fenced batches.

Every change of an entry's durable state (position, last run, pause override, skip log) is made
in memory and queued here; :meth:`StateBook.flush` writes the queue with the leader lease, after
the publishes it describes, so a deposed leader's writes are refused by the store. A failed
write holds further runs (``flush_failed``) until one succeeds: a run must not be published
while the record of the one before it is unwritten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from .. import keys, metrics
from ..errors import FencedError, NotLeader, StoreError
from ..leases.base import LeaseStore, Taken
from . import index
from .election import Election
from .slots import SkipRange
from .state import EntryState, SkipLog, format_slot

__all__ = ["FLUSH_EVERY", "StateBook"]

log = logging.getLogger("celery_crawl.beat")

#: State writes queued before a flush in the middle of a burst.
FLUSH_EVERY = 256


class StateBook:
    """Entry states and skip logs of the current term, and the writes not yet made.

    Args:
        store: the lease store.
        election: whose lease fences the writes.
        refused: called with a reason when the store refuses a write (another leader).
    """

    def __init__(self, store: LeaseStore, election: Election,
                 refused: Callable[[str], None]) -> None:
        self.store = store
        self.election = election
        self.refused = refused
        self.states: dict[str, EntryState] = {}
        self.skiplogs: dict[str, SkipLog] = {}
        #: store key -> record to write (skip logs)
        self.pending: dict[str, dict[str, Any]] = {}
        #: entries whose state record is to be written
        self.pending_states: set[str] = set()
        self.flush_failed = False

    def clear(self) -> int:
        """Forget the term (demotion); returns how many state writes were dropped."""
        dropped = len(self.pending_states)
        self.pending.clear()
        self.pending_states.clear()
        # The held-back writes are gone with the leadership; a next term starts from the store's
        # records and must not stay held back by this term's failed flush.
        self.flush_failed = False
        self.states.clear()
        self.skiplogs.clear()
        return dropped

    def load(self, entries: Mapping[str, Any], now: datetime, *, collect_garbage: bool,
             keep_alive: Callable[[], None]) -> list[str]:
        """Load every entry's durable state, start changed entries afresh and (when
        ``collect_garbage``) delete the state of removed ones; returns the fresh names.

        Raises:
            StoreError, LeaseError, FencedError: the store failed or the lease is gone.
        """
        lease = self.election.lease
        assert lease is not None
        idx = index.EntryIndex.load(self.store, between=keep_alive)
        stored = index.read_states(self.store, entries, between=keep_alive)
        self.states.clear()
        self.skiplogs.clear()
        fresh: list[str] = []
        for i, (name, entry) in enumerate(entries.items()):
            if i % 1000 == 999:
                keep_alive()
            key = keys.beat_entry(name)
            record = stored.get(name)
            st: EntryState | None = None
            if record is not None:
                try:
                    st = EntryState.from_record(record, key=key)
                except StoreError as exc:
                    log.error("beat: %s; starting entry %r afresh", exc, name)
            if st is None or st.fingerprint != entry.fingerprint:
                if st is not None:
                    log.warning("beat: entry %r changed definition; starting it afresh", name)
                # A fresh entry's position is "now": it runs from its next slot, no catch-up.
                st = EntryState(entry.fingerprint, last_slot=now,
                                paused=st.paused if st else None)
                fresh.append(name)
            self.states[name] = st
        removed = sorted(idx.names - entries.keys())
        if removed and collect_garbage:
            for i, name in enumerate(removed):
                if i % 100 == 99:
                    keep_alive()
                self.store.delete(keys.beat_entry(name), lease=lease)
                self.store.delete(keys.beat_skips(name), lease=lease)
            idx.discard(removed)  # deleted first, then dropped from the index
            log.warning("beat: garbage-collected the state of %d removed entries: %s",
                        len(removed), ", ".join(removed[:10]))
        elif removed:
            log.warning("beat: not garbage-collecting %d unknown entry states while schedule "
                        "files have errors", len(removed))
        idx.add(entries)
        # Before any new state is written, so the index always covers what is stored.
        idx.save(self.store, lease=lease, between=keep_alive)
        for i, name in enumerate(fresh):
            if i % 1000 == 999:
                keep_alive()
            self.queue(name)
        self.flush()
        return fresh

    def queue(self, name: str) -> None:
        """Queue the state record of ``name`` (flushed at once when the queue is long)."""
        self.pending_states.add(name)
        if len(self.pending_states) + len(self.pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self, *, ack: Taken | None = None) -> None:
        """Write queued records with the leader lease (after the publishes they record); with
        ``ack``, the commands they apply leave their queue in the same write."""
        if not self.pending_states and not self.pending and ack is None:
            self.flush_failed = False
            return
        lease = self.election.lease
        if lease is None:
            return
        items = [(keys.beat_entry(n), self._record(n)) for n in self.pending_states
                 if n in self.states]
        items += list(self.pending.items())
        try:
            if ack is not None:
                self.store.put_and_ack(items, ack, lease=lease)
            else:
                self.store.put_many(items, lease=lease)
        except (NotLeader, FencedError) as exc:
            self.refused(f"state write refused: {exc}")
            return
        except StoreError as exc:
            if not self.flush_failed:
                log.warning("beat: state write failed, holding further runs until it succeeds: "
                            "%s", exc)
            self.flush_failed = True
            return
        self.flush_failed = False
        self.pending_states.clear()
        self.pending.clear()

    def _record(self, name: str) -> dict[str, Any]:
        st = self.states[name]
        st.token = self.election.lease.token if self.election.lease else st.token
        return st.to_record()

    def skiplog(self, name: str) -> SkipLog:
        """The skip log of ``name``, read from the store the first time in a term."""
        log_ = self.skiplogs.get(name)
        if log_ is None:
            key = keys.beat_skips(name)
            try:
                log_ = SkipLog.from_record(self.store.get(key), key=key)
            except StoreError as exc:
                log.warning("beat: %s; starting a new skip log", exc)
                log_ = SkipLog()
            self.skiplogs[name] = log_
        return log_

    def record_skip(self, name: str, st: EntryState, skip: SkipRange) -> None:
        """Add ``skip`` to the entry's log and move its position past it."""
        log_ = self.skiplog(name)
        contiguous = bool(log_.ranges) and log_.ranges[-1].last == st.last_slot
        log_.add(skip, contiguous=contiguous)
        self.pending[keys.beat_skips(name)] = log_.to_record()
        metrics.BEAT_SKIPPED.labels(skip.reason).inc(skip.count)
        if st.last_slot is None or skip.last > st.last_slot:
            st.last_slot = skip.last
        log.info("beat: entry %r skipped %d slot(s) %s..%s: %s", name, skip.count,
                 format_slot(skip.first), format_slot(skip.last), skip.reason)

    def record_lost(self, name: str, slot: datetime) -> None:
        """A run the delivery check gave up on: on the skip log as ``lost``, position kept."""
        self.skiplog(name).add(SkipRange(slot, slot, 1, "lost"), contiguous=False)
        self.pending[keys.beat_skips(name)] = self.skiplog(name).to_record()
        metrics.BEAT_SKIPPED.labels("lost").inc()
