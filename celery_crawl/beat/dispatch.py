"""What the leader publishes when: the due heap, catch-up plans and the overlap policies.

Every tick the leader pops the entries whose fire time has come off a heap (never a scan of
all entries) and decides each one's due slots: which run (:func:`.slots.plan`), which are
skipped and why, and, when the previous run may still be in flight, what its ``overlap``
policy does with the slot (one handler per :class:`~celery_crawl.schedules.policies.Overlap`).
Publishing itself is the caller's (``publish``): this module knows no Celery.

"In flight" is read from the store: a claim on ``task:<id>`` (the worker plugin claims every
task it receives) means running or about to be recovered; a ``done/<id>`` tombstone means
finished; with neither the run is taken as queued for at most its ``expires`` or one period. A
store error leaves the slot *undecided*: it is tried again shortly and runs if the store
answers while the catch-up policy still runs it, else it is skipped as ``store_error``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from .. import keys
from ..errors import StoreError
from ..leases.base import LeaseStore
from ..schedules.heap import DueHeap
from ..schedules.policies import Overlap
from .book import StateBook
from .election import Election
from .slots import SkipRange, blame, plan
from .state import EntryState, format_slot

__all__ = ["BUFFER_RECHECK_S", "STORE_RETRY_S", "Dispatcher"]

log = logging.getLogger("celery_crawl.beat")

#: Re-check of a run held back by ``buffer_one`` (capped by the entry's period).
BUFFER_RECHECK_S = 1.0
#: A slot the store could not decide (previous run in flight?) is tried again this soon.
STORE_RETRY_S = 0.5

#: ``publish(entry, state, slot, now, manual=...) -> task id or None`` (None: it failed and
#: the caller recorded why).
Publish = Callable[..., str | None]


class Dispatcher:
    """The due heap of the current term and the decisions for each due entry.

    Args:
        store: read for the previous run's claim and done tombstone.
        election: ``may_publish``/``renew_due`` before every publish.
        book: the term's entry states.
        now: the reference clock.
        renew: renews the lease (the caller's, with its metrics and demotion).
        publish: publishes one run and records it in the entry state.
        revoke: revokes a previous run (``overlap = "cancel_other"``).
    """

    def __init__(self, store: LeaseStore, election: Election, book: StateBook, *,
                 now: Callable[[], datetime], renew: Callable[[], None], publish: Publish,
                 revoke: Callable[[str, str], None]) -> None:
        self.store = store
        self.election = election
        self.book = book
        self.now = now
        self.renew = renew
        self.publish = publish
        self.revoke = revoke
        self.entries: Mapping[str, Any] = {}
        self.due = DueHeap()
        self.next_of: dict[str, datetime | None] = {}
        #: entry -> its oldest slot left undecided by a store error, retried on later ticks
        self.undecided: dict[str, datetime] = {}
        self._done_cache: dict[str, bool] = {}
        self._on_overlap: dict[Overlap, Callable[[str, EntryState, datetime], bool]] = {
            Overlap.SKIP: self._overlap_skip,
            Overlap.BUFFER_ONE: self._overlap_buffer_one,
            Overlap.CANCEL_OTHER: self._overlap_cancel_other,
            Overlap.ALLOW: self._overlap_allow,
        }

    def clear(self) -> None:
        """Forget the term (promotion starts afresh; demotion stops dispatching)."""
        self.due = DueHeap()
        self.next_of.clear()
        self.undecided.clear()

    def schedule_all(self, keep_alive: Callable[[], None]) -> None:
        for i, (name, st) in enumerate(self.book.states.items()):
            if i % 1000 == 999:
                keep_alive()
            self.schedule(name, st)

    def peek(self) -> tuple[str, datetime] | None:
        return self.due.peek()

    def describe_next(self) -> str:
        peek = self.due.peek()
        return "none" if peek is None else f"{peek[0]} at {format_slot(peek[1])}"

    def schedule(self, name: str, st: EntryState) -> None:
        """Put ``name`` on the heap at the fire time of its next slot (or a buffer re-check)."""
        entry = self.entries.get(name)
        if entry is None:
            return
        nxt = self.next_of.get(name)
        if nxt is None or (st.last_slot is not None and nxt <= st.last_slot):
            nxt = entry.source.next_slot(st.last_slot or self.now())
        self.next_of[name] = nxt
        when = entry.fire_time(nxt) if nxt is not None else None
        if st.buffered_slot is not None:
            recheck = self.now() + timedelta(
                seconds=min(BUFFER_RECHECK_S, entry.period_s(st.buffered_slot)))
            when = recheck if when is None else min(when, recheck)
        if when is None:
            self.due.remove(name)
            return
        self.due.push(name, when)

    def dispatch_due(self) -> None:
        """Decide and publish every entry whose fire time has come."""
        peek = self.due.peek()
        now = self.now()
        if peek is None or peek[1] > now:
            return
        due = self.due.pop_due(now)
        self._prefetch_done(name for name, _ in due)
        election = self.election
        for i, (name, _when) in enumerate(due):
            if election.renew_due():
                self.renew()
            if not election.may_publish():
                if election.is_leader:  # validity ran out before a renewal: retry next tick
                    for rest, rest_when in due[i:]:
                        self.due.push(rest, rest_when)
                return
            self._run_entry(name, now)
            if not election.is_leader:
                return
        self._done_cache.clear()
        self.book.flush()

    def _prefetch_done(self, names: Iterable[str]) -> None:
        """Read the done tombstones of every due entry's previous run in one round trip, so
        a burst does not pay one read per entry for the overlap decision."""
        ids = []
        for name in names:
            entry, st = self.entries.get(name), self.book.states.get(name)
            if entry is not None and st is not None and st.last_task_id \
                    and entry.overlap != Overlap.ALLOW:
                ids.append(st.last_task_id)
        self._done_cache.clear()
        if not ids:
            return
        try:
            found = self.store.get_many([keys.done(i) for i in ids])
        except StoreError as exc:
            log.debug("beat: cannot prefetch done tombstones: %s", exc)
            return
        self._done_cache.update(zip(ids, (f is not None for f in found), strict=True))

    def _run_entry(self, name: str, now: datetime) -> None:
        entry = self.entries.get(name)
        st = self.book.states.get(name)
        if entry is None or st is None:
            return
        paused = st.paused if st.paused is not None else entry.paused
        checked: bool | None = None  # previous run in flight, asked once per entry per tick
        if st.buffered_slot is not None and not paused:
            checked = self.in_flight(entry, st, now)
            if checked is None:
                due = self.next_of.get(name)
                if due is not None and (due > now or (st.last_slot and due <= st.last_slot)):
                    due = None  # no slot of its own is due yet: only the buffered one waits
                self._retry_later(name, st, now, due)
                return
            if not checked:
                slot = st.buffered_slot
                st.buffered_slot = None
                self.publish(entry, st, slot, now)
                checked = True
        expected = self.next_of.get(name)
        if (expected is not None and st.last_slot is not None and expected > st.last_slot
                and expected <= now
                and (now - expected).total_seconds() <= entry.catchup.grace_s):
            # The usual case: exactly the slot the heap was keyed on is due, on time.
            run: tuple[datetime, ...] = (expected,)
            skipped: tuple[SkipRange, ...] = ()
            newest: datetime | None = expected
            nxt = entry.source.next_slot(expected)
        else:
            p = plan(entry.source, st.last_slot, now, entry.catchup)
            run, skipped, newest, nxt = p.run, p.skipped, p.last_slot, p.next_slot
        undecided = self.undecided.pop(name, None)
        if undecided is not None and undecided not in run:
            skipped = blame(skipped, undecided, "store_error", entry.source)
        for skip in skipped:
            self.book.record_skip(name, st, skip)
        checks = entry.overlap != Overlap.ALLOW
        batch_published = False  # catch-up runs published together are not checked
        for slot in run:
            if paused:
                self.book.record_skip(name, st, SkipRange(slot, slot, 1, "paused"))
                continue
            if checked is None and checks:
                checked = self.in_flight(entry, st, now)
                if checked is None:
                    self._retry_later(name, st, now, slot)
                    return
            if checked and not batch_published \
                    and not self._on_overlap[entry.overlap](name, st, slot):
                continue
            if not self.election.may_publish():
                # Validity ran out mid-entry: keep what was decided and retry the rest on the
                # next tick (after a renewal) or leave it to the next leader.
                self.book.queue(name)
                self.schedule(name, st)
                return
            self.publish(entry, st, slot, now)
            batch_published = True
        if newest is not None and (st.last_slot is None or newest > st.last_slot):
            st.last_slot = newest
        self.next_of[name] = nxt
        self.book.queue(name)
        self.schedule(name, st)

    # -- overlap policies: the previous run is in flight; return whether to publish ``slot`` --
    def _overlap_allow(self, name: str, st: EntryState, slot: datetime) -> bool:
        return True

    def _overlap_skip(self, name: str, st: EntryState, slot: datetime) -> bool:
        self.book.record_skip(name, st, SkipRange(slot, slot, 1, "overlap"))
        return False

    def _overlap_buffer_one(self, name: str, st: EntryState, slot: datetime) -> bool:
        if st.buffered_slot is None:
            st.buffered_slot = slot
            st.last_slot = slot
        else:
            self.book.record_skip(name, st, SkipRange(slot, slot, 1, "overlap_buffered"))
        return False

    def _overlap_cancel_other(self, name: str, st: EntryState, slot: datetime) -> bool:
        if st.last_task_id:
            self.revoke(st.last_task_id, name)
            if st.last_run_slot is not None:  # its slot ends cancelled, on record
                old = st.last_run_slot
                self.book.record_skip(name, st, SkipRange(old, old, 1, "cancelled_by_overlap"))
        return True

    def _retry_later(self, name: str, st: EntryState, now: datetime,
                     slot: datetime | None) -> None:
        """The store could not tell whether the previous run is in flight: leave ``slot`` (and
        what follows it) undecided and try again shortly."""
        if slot is not None:
            self.undecided.setdefault(name, slot)
            self.next_of[name] = slot
        self.book.queue(name)
        self.due.push(name, now + timedelta(seconds=STORE_RETRY_S))

    def in_flight(self, entry: Any, st: EntryState, now: datetime) -> bool | None:
        """Whether the entry's previous run may still be queued or running (None: the store
        could not tell; the caller decides later rather than guess)."""
        if not st.last_task_id or st.last_run_slot is None:
            return False
        try:
            done = self._done_cache.get(st.last_task_id)
            if done is None:
                done = self.store.get(keys.done(st.last_task_id)) is not None
            if done:
                return False
            if self.store.claimant(keys.task_claim(st.last_task_id)) is not None:
                return True
        except StoreError as exc:
            log.warning("beat: cannot read the state of %s (%s); deciding entry %r again in "
                        "%gs", st.last_task_id, exc, entry.name, STORE_RETRY_S)
            return None
        window = entry.period_s(st.last_run_slot)
        if entry.expires_s is not None:
            window = min(window, entry.expires_s)
        return now < st.last_run_slot + timedelta(seconds=window)
