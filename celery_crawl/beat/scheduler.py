"""``LeasedScheduler``: a ``celery.beat.Scheduler`` where only the lease holder dispatches.

``celery -A proj beat -S celery_crawl.beat:LeasedScheduler``, any number of replicas. This class
is glue: leadership timing lives in :mod:`.election`, slot arithmetic in :mod:`.slots`, records
in :mod:`.state`, the message in :mod:`.publish`. Everything happens inside ``tick()`` and never
blocks longer than one store call: ``tick`` returns the time until the *earliest* of the next
due run, the next renewal (every ttl/3), the next standby poll (0.2 s), the next command poll
and the next schedule-file check, so the lease is renewed on time however far away the next run
is.

One tick as leader: renew if due; apply operator commands; pop every due entry off a heap
(never a scan of all entries), and for each run check the lease's local validity (a monotonic
compare), publish, and queue the state write; state writes are flushed in batches with the
leader lease (the store refuses them from an older token), after the publishes they describe.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.beat import Scheduler

from .. import keys, metrics, status
from ..clock import Clock, RedisTimeReference, monotonic
from ..config import CrawlConfig, plain_redis_url
from ..errors import (
    ConfigError,
    CrawlError,
    FencedError,
    LeaseError,
    LeaseLost,
    NotLeader,
    StoreError,
)
from ..leases import make_holder, store_for
from ..leases.base import Characteristic, LeaseStore, Taken
from ..schedules import DueHeap, check_duplicates_with_beat_schedule, load_schedule_files
from . import index
from .clockstep import Step, StepGuard
from .commands import MAX_BACKFILL, Command, parse_command
from .election import Action, Election
from .entries import BeatEntry, from_beat_schedule, from_spec
from .publish import Publisher
from .slots import SkipRange, blame, iter_slots, plan
from .state import EntryState, Sent, SkipLog, format_slot, parse_slot
from .verify import DeliveryCheck

__all__ = ["LeasedScheduler"]

log = logging.getLogger("celery_crawl.beat")

ROLE = "beat"
#: How often the leader reads the operator command queue.
COMMAND_POLL_S = 0.5
#: Commands applied and recorded together (one fenced write; etcd: one transaction).
COMMAND_BATCH = 20
#: How often schedule files are checked for changes (mtime poll).
RELOAD_POLL_S = 1.0
#: How often the wall clock is compared with the reference clock.
SKEW_CHECK_S = 10.0
#: How often the store's eviction policy is read again.
EVICTION_CHECK_S = 60.0
#: State writes queued before a flush in the middle of a burst.
FLUSH_EVERY = 256
#: Re-check of a run held back by ``buffer_one`` (capped by the entry's period).
BUFFER_RECHECK_S = 1.0
#: Presence records live this many TTLs after the last write.
PRESENCE_TTLS = 3
#: How often the leader runs the delivery check (``crawl_beat_verify_delivery``).
VERIFY_POLL_S = 1.0
#: A slot the store could not decide (previous run in flight?) is tried again this soon.
STORE_RETRY_S = 0.5


class LeasedScheduler(Scheduler):
    """Celery beat scheduler with a leader lease, fencing tokens and durable slot state.

    Settings are read from the app (``crawl_*``, see DESIGN.md); the schedule is
    ``beat_schedule`` plus the schedule files of ``crawl_schedule_paths``.
    """

    def __init__(self, app: Any, *args: Any, wall_clock: Callable[[], float] | None = None,
                 **kwargs: Any) -> None:
        self.config = CrawlConfig.from_app(app)
        #: the local wall clock (``time.time``; tests pass one they can set)
        self._wall_clock = wall_clock or time.time
        self.replica_id = make_holder()
        self.election = Election(self.config.beat_lease_ttl_s, clock=monotonic)
        self.entries: dict[str, BeatEntry] = {}
        self.states: dict[str, EntryState] = {}
        self._skiplogs: dict[str, SkipLog] = {}
        self._due = DueHeap()
        self._next_of: dict[str, datetime | None] = {}
        self._pending: dict[str, dict[str, Any]] = {}
        self._pending_states: set[str] = set()
        #: entry -> its oldest slot left undecided by a store error, retried on later ticks
        self._undecided: dict[str, datetime] = {}
        self._done_cache: dict[str, bool] = {}
        self._store: LeaseStore | None = None
        self._clock: Clock | None = None
        self._steps: StepGuard | None = None
        self._stepped = False  # the wall clock was set and is not measured again yet
        self._publisher = Publisher(app, self.config.namespace)
        self._file_sig: tuple[tuple[str, int, int], ...] | None = None
        self._file_entries: dict[str, BeatEntry] = {}
        self._file_errors: list[str] = []
        self._next_reload = 0.0
        self._next_commands = 0.0
        self._next_skew = 0.0
        self._next_eviction = 0.0
        self._skew_reason: str | None = None
        self._eviction_reason: str | None = None
        self._last_block_log = 0.0
        self._flush_failed = False
        self._closed = False
        self._verify: DeliveryCheck | None = None
        self._next_verify = 0.0
        self._started = format_slot(datetime.fromtimestamp(int(self._wall_clock()), UTC))
        super().__init__(app, *args, **kwargs)

    # -- Celery hooks -------------------------------------------------------------------------
    def setup_schedule(self) -> None:
        """Open the store, check it, start metrics and load the schedule (not when lazy)."""
        status.install(self.app, lambda: status.beat_process(self))
        try:
            metrics.start_metrics_server(self.config.metrics_port, addr=self.config.metrics_addr)
        except ConfigError as exc:  # a busy port must not take the scheduler down
            log.error("beat: metrics are off: %s", exc)
        self._store = store_for(self.config)
        self._clock = Clock(self._reference(), wall=self._wall_clock)
        self._steps = StepGuard(self._clock, self.config.max_clock_skew_s / 2)
        self._check_store_fitness()
        self._setup_verify()
        self._reload(force=True)
        log.info("beat replica %s standing by (lease %s, ttl %.1fs, %d entries)",
                 self.replica_id, self._store.url, self.config.beat_lease_ttl_s,
                 len(self.entries))

    def _setup_verify(self) -> None:
        after = self.config.beat_verify_delivery_s
        if not after:
            return
        from .._broker import broker_ops

        broker = broker_ops(self.app, timeout_s=self.config.store_timeout_s)
        if broker.kind != "redis":
            log.info("beat: crawl_beat_verify_delivery is off: it reads Redis broker queues "
                     "only (a broker that keeps unacked messages itself does not lose them)")
            return
        assert self._store is not None

        def queues_of(name: str) -> list[str]:
            entry = self.entries.get(name)
            return self._publisher.queue_names(entry) if entry is not None else []

        self._verify = DeliveryCheck(self._store, broker, after, queues_of,
                                     between=self._between_checks)
        log.info("beat: runs not seen at a worker %gs after publishing are looked for in the "
                 "broker and published again if lost", after)

    @property
    def info(self) -> str:
        store = self._store.url if self._store else self.config.lease_url
        return (f"    . leader lease -> {store} ttl={self.config.beat_lease_ttl_s:g}s "
                f"replica={self.replica_id}")

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One scheduler iteration; returns the seconds until something is due."""
        if self._closed or self._store is None:
            return 1.0
        now_m = monotonic()
        if now_m >= self._next_reload:
            self._next_reload = now_m + RELOAD_POLL_S
            self._reload()
        self._check_step()
        self._election_step()
        if self.election.is_leader and not self._stepped:
            self._leader_step()
        return self._sleep_s()

    def _now(self) -> datetime:
        """The reference clock's time (wall clock plus measured offset, see ``Clock.now``)."""
        if self._clock is None:
            return datetime.fromtimestamp(self._wall_clock(), UTC)
        return self._clock.now()

    def close(self) -> None:
        """Flush state, release the lease (a standby takes over at once), close the store."""
        if self._closed:
            return
        self._closed = True
        store, lease = self._store, self.election.lease
        try:
            if store is not None and lease is not None:
                if self.election.may_publish():
                    try:
                        self._flush()
                    except CrawlError as exc:
                        log.warning("beat: final state flush failed: %s", exc)
                try:
                    store.release(lease)
                    log.warning("beat replica %s released the leader lease (token %d)",
                                self.replica_id, lease.token)
                except CrawlError as exc:
                    log.warning("beat: releasing the lease failed (it expires in %.1fs): %s",
                                lease.ttl_s, exc)
            if store is not None:
                with contextlib.suppress(CrawlError):
                    store.delete(keys.beat_presence(self.replica_id))
        finally:
            self.election.demote()
            metrics.BEAT_IS_LEADER.set(0)
            if self._verify is not None:
                with contextlib.suppress(Exception):  # its broker connection only
                    self._verify.broker.close()
            if store is not None:
                store.close()
            super().close()

    # -- guards -------------------------------------------------------------------------------
    def _reference(self) -> Any:
        """The clock the skew guard compares with: the store's, else the broker/backend Redis."""
        assert self._store is not None
        if Characteristic.HAS_CLOCK in self._store.characteristics:
            return self._store
        for url in (self.app.conf.broker_url, self.app.conf.result_backend):
            redis_url = plain_redis_url(url)
            if redis_url is not None:
                return RedisTimeReference(redis_url, timeout_s=self.config.store_timeout_s)
        log.warning("beat: the lease store has no clock and neither the broker nor the result "
                    "backend is Redis: the clock-skew guard (crawl_max_clock_skew) is off")
        return None

    def _check_store_fitness(self) -> None:
        store = self._store
        eviction = getattr(store, "eviction_risk", None)
        if eviction is not None:
            try:
                risk = eviction()
            except StoreError as exc:
                log.warning("beat: cannot read the store's eviction policy: %s", exc)
                risk = None
            if risk and not self._eviction_reason:
                log.error("beat: refusing to lead: %s", risk)
            self._eviction_reason = f"refusing to lead: {risk}" if risk else None
        persistence = getattr(store, "persistence", None)
        if persistence is not None and self._next_eviction == 0.0:
            try:
                p = persistence()
                if not p.get("aof_enabled") and not p.get("rdb"):
                    log.warning("beat: the lease store %s has neither AOF nor RDB persistence: "
                                "slot state will not survive a restart of it (runs may repeat "
                                "or be missed after one)", self._store.url if self._store else "")
            except StoreError as exc:
                log.warning("beat: cannot read the store's persistence settings: %s", exc)
        self._next_eviction = monotonic() + EVICTION_CHECK_S
        self._apply_block()

    def _check_step(self) -> None:
        """Every tick: a wall clock set since the last calibration is measured again before
        anything is decided on it (see ``clockstep``)."""
        if self._steps is None:
            return
        verdict = self._steps.check(deadline=self._step_deadline())
        self._stepped = verdict is Step.UNKNOWN
        if verdict is Step.REMEASURED:
            assert self._clock is not None
            self._next_skew = monotonic() + SKEW_CHECK_S
            self._judge_skew(self._clock.offset_s)

    def _step_deadline(self) -> float:
        """When a multi-request step of the election (clock samples) must stop starting
        requests: half the leader's validity left, so the renewal after it is still in time."""
        if self.election.is_leader:
            return monotonic() + self.election.remaining_s() / 2
        return monotonic() + self.config.store_timeout_s

    def _check_skew(self) -> None:
        clock = self._clock
        if clock is None or clock.reference is None:
            return
        offset = clock.maybe_recalibrate(SKEW_CHECK_S, k=3, deadline=self._step_deadline())
        self._next_skew = monotonic() + SKEW_CHECK_S
        self._judge_skew(offset)

    def _judge_skew(self, offset: float | None) -> None:
        if offset is None:
            # Never measured: fail closed (a replica whose skew is unknown may be the skewed
            # one) and try again soon. A failed re-measurement keeps the last known offset.
            self._skew_reason = ("not leading: the wall clock could not be compared with the "
                                 "reference clock yet (crawl_max_clock_skew guard)")
            self._next_skew = monotonic() + 1.0
            self._apply_block()
            return
        if abs(offset) > self.config.max_clock_skew_s:
            self._skew_reason = (
                f"not leading: this replica's wall clock is {-offset:+.3f}s off the reference "
                f"clock, more than crawl_max_clock_skew={self.config.max_clock_skew_s:g}s")
        else:
            if self._skew_reason:
                log.warning("beat: wall clock back within %gs of the reference (offset %+.3fs)",
                            self.config.max_clock_skew_s, -offset)
            self._skew_reason = None
        self._apply_block()

    def _apply_block(self) -> None:
        reason = self._eviction_reason or self._skew_reason
        was_leader = self.election.is_leader
        lease = self.election.lease
        changed = reason != self.election.blocked_reason
        self.election.block(reason)
        if was_leader and not self.election.is_leader and lease is not None:
            # Step down cleanly so a healthy replica takes over at once, not after the TTL.
            with contextlib.suppress(CrawlError):
                assert self._store is not None
                self._store.release(lease)
        now = monotonic()
        if reason and (changed or now - self._last_block_log >= 30.0):
            self._last_block_log = now
            log.error("beat replica %s: %s", self.replica_id, reason)
        if was_leader and not self.election.is_leader:
            self._after_demotion(reason or "blocked")

    # -- election -----------------------------------------------------------------------------
    def _election_step(self) -> None:
        now = monotonic()
        if now >= self._next_skew:
            self._check_skew()
        if now >= self._next_eviction:
            self._check_store_fitness()
        action = self.election.action(now)
        if action is Action.RENEW:
            self._renew()
        elif action is Action.ACQUIRE and self._stepped:
            self.election.not_acquired()  # promotion would start fresh entries on a set clock
        elif action is Action.ACQUIRE:
            self._acquire()
        if self.election.presence_due():
            self._write_presence()

    def _acquire(self) -> None:
        assert self._store is not None
        try:
            lease = self._store.acquire(keys.BEAT_LEADER, self.config.beat_lease_ttl_s,
                                        self.replica_id)
        except StoreError as exc:
            log.debug("beat: acquire failed: %s", exc)
            lease = None
        if lease is None:
            self.election.not_acquired()
            return
        self.election.acquired(lease)
        metrics.BEAT_IS_LEADER.set(1)
        metrics.BEAT_FAILOVERS.inc()
        metrics.LEASE_TIME_LEFT.labels(ROLE).set(self.election.remaining_s())
        log.warning("beat replica %s is now the leader (token %d)", self.replica_id, lease.token)
        try:
            self._promote()
        except (StoreError, LeaseError, FencedError) as exc:
            log.error("beat: could not load slot state after taking the lease: %s", exc)
            self._demote(f"promotion failed: {exc}", release=True)
        self._write_presence()

    def _renew(self) -> None:
        assert self._store is not None and self.election.lease is not None
        try:
            lease = self._store.renew(self.election.lease)
        except LeaseLost as exc:
            metrics.LEASE_RENEWALS.labels(ROLE, "lost").inc()
            metrics.renewal_failed(ROLE, exc)
            metrics.lease_ended(ROLE, self.election.lease.valid_until, monotonic())
            self._demote(f"lease lost: {exc}")
            return
        except StoreError as exc:
            metrics.LEASE_RENEWALS.labels(ROLE, "error").inc()
            metrics.renewal_failed(ROLE, exc)
            until = self.election.lease.valid_until if self.election.lease else monotonic()
            if self.election.renew_failed():
                metrics.lease_ended(ROLE, until, monotonic())
                self._after_demotion(f"renewal failed until the lease ran out: {exc}")
            else:
                log.warning("beat: renewal failed, retrying (%.2fs of validity left): %s",
                            self.election.remaining_s(), exc)
            return
        self.election.renewed(lease)
        metrics.LEASE_RENEWALS.labels(ROLE, "ok").inc()
        metrics.LEASE_TIME_LEFT.labels(ROLE).set(self.election.remaining_s())

    def _demote(self, reason: str, *, release: bool = False) -> None:
        lease = self.election.lease
        self.election.demote()
        if release and lease is not None and self._store is not None:
            with contextlib.suppress(CrawlError):
                self._store.release(lease)
        self._after_demotion(reason)

    def _after_demotion(self, reason: str) -> None:
        metrics.BEAT_IS_LEADER.set(0)
        metrics.LEASE_TIME_LEFT.labels(ROLE).set(0)
        dropped = len(self._pending_states)
        self._pending.clear()
        self._pending_states.clear()
        # The held-back writes are gone with the leadership; a next term starts from the store's
        # records and must not stay held back by this term's failed flush.
        self._flush_failed = False
        self.states.clear()
        self._skiplogs.clear()
        self._due = DueHeap()
        self._next_of.clear()
        self._undecided.clear()
        log.error("beat replica %s stopped dispatching and is standing by: %s%s",
                  self.replica_id, reason,
                  f" ({dropped} unwritten entry states left to the next leader)"
                  if dropped else "")

    def _write_presence(self) -> None:
        assert self._store is not None
        clock = self._clock
        offset = clock.offset_s if clock is not None else None
        record = {
            "id": self.replica_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "role": self.election.role.value,
            "token": self.election.lease.token if self.election.lease else None,
            "clock_offset_s": None if offset is None else round(-offset, 6),
            "blocked": self.election.blocked_reason,
            "entries": len(self.entries),
            "started": self._started,
            "last_seen": format_slot(self._now()),
        }
        try:
            self._store.put(keys.beat_presence(self.replica_id), record,
                            ttl_s=PRESENCE_TTLS * self.config.beat_lease_ttl_s)
        except StoreError as exc:
            log.debug("beat: presence write failed: %s", exc)
        self.election.presence_written()

    # -- leadership: state ---------------------------------------------------------------------
    def _promote(self) -> None:
        """Load every entry's durable state, start changed entries afresh, GC removed ones and
        fill the due heap."""
        assert self._store is not None
        lease = self.election.lease
        assert lease is not None
        now = self._now()
        idx = index.EntryIndex.load(self._store, between=self._keep_alive)
        stored = index.read_states(self._store, self.entries, between=self._keep_alive)
        self.states.clear()
        self._skiplogs.clear()
        self._due = DueHeap()
        self._next_of.clear()
        self._undecided.clear()
        fresh: list[str] = []
        for i, (name, entry) in enumerate(self.entries.items()):
            if i % 1000 == 999:
                self._keep_alive()
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
        removed = sorted(idx.names - self.entries.keys())
        if removed and not self._file_errors:
            for i, name in enumerate(removed):
                if i % 100 == 99:
                    self._keep_alive()
                self._store.delete(keys.beat_entry(name), lease=lease)
                self._store.delete(keys.beat_skips(name), lease=lease)
            idx.discard(removed)  # deleted first, then dropped from the index
            log.warning("beat: garbage-collected the state of %d removed entries: %s",
                        len(removed), ", ".join(removed[:10]))
        elif removed:
            log.warning("beat: not garbage-collecting %d unknown entry states while schedule "
                        "files have errors", len(removed))
        idx.add(self.entries)
        # Before any new state is written, so the index always covers what is stored.
        idx.save(self._store, lease=lease, between=self._keep_alive)
        for i, name in enumerate(fresh):
            if i % 1000 == 999:
                self._keep_alive()
            self._queue_state(name)
        self._flush()
        for i, (name, st) in enumerate(self.states.items()):
            if i % 1000 == 999:
                self._keep_alive()
            self._schedule(name, st)
        log.info("beat: leading %d entries (%d fresh), next run %s", len(self.states),
                 len(fresh), self._describe_next())

    def _keep_alive(self) -> None:
        """Renew during long work (promotion, a delivery check reading a long queue) so the
        lease cannot lapse; raises ``LeaseLost`` to abort the work once it is gone."""
        if self.election.renew_due():
            self._renew()
        if not self.election.is_leader:
            raise LeaseLost("the lease was lost during a long step of the beat loop")

    def _between_checks(self) -> None:
        """Between the requests of a long delivery check (a queue read is O(backlog)): renew,
        and dispatch what came due meanwhile, so the schedule does not wait for the check."""
        self._keep_alive()
        peek = self._due.peek()
        if peek is not None and not self._stepped and peek[1] <= self._now():
            self._dispatch_due()
            self._keep_alive()

    def _schedule(self, name: str, st: EntryState) -> None:
        """Put ``name`` on the heap at the fire time of its next slot (or a buffer re-check)."""
        entry = self.entries.get(name)
        if entry is None:
            return
        nxt = self._next_of.get(name)
        if nxt is None or (st.last_slot is not None and nxt <= st.last_slot):
            nxt = entry.source.next_slot(st.last_slot or self._now())
        self._next_of[name] = nxt
        when = entry.fire_time(nxt) if nxt is not None else None
        if st.buffered_slot is not None:
            recheck = self._now() + timedelta(
                seconds=min(BUFFER_RECHECK_S, entry.period_s(st.buffered_slot)))
            when = recheck if when is None else min(when, recheck)
        if when is None:
            self._due.remove(name)
            return
        self._due.push(name, when)

    def _queue_state(self, name: str) -> None:
        self._pending_states.add(name)
        if len(self._pending_states) + len(self._pending) >= FLUSH_EVERY:
            self._flush()

    def _flush(self, *, ack: Taken | None = None) -> None:
        """Write queued state records with the leader lease (after the publishes they record);
        with ``ack``, the commands they apply leave their queue in the same write."""
        if not self._pending_states and not self._pending and ack is None:
            self._flush_failed = False
            return
        assert self._store is not None
        lease = self.election.lease
        if lease is None:
            return
        items = [(keys.beat_entry(n), self._state_record(n)) for n in self._pending_states
                 if n in self.states]
        items += list(self._pending.items())
        try:
            if ack is not None:
                self._store.put_and_ack(items, ack, lease=lease)
            else:
                self._store.put_many(items, lease=lease)
        except (NotLeader, FencedError) as exc:
            self._demote(f"state write refused: {exc}")
            return
        except StoreError as exc:
            if not self._flush_failed:
                log.warning("beat: state write failed, holding further runs until it succeeds: "
                            "%s", exc)
            self._flush_failed = True
            return
        self._flush_failed = False
        self._pending_states.clear()
        self._pending.clear()

    def _state_record(self, name: str) -> dict[str, Any]:
        st = self.states[name]
        st.token = self.election.lease.token if self.election.lease else st.token
        return st.to_record()

    def _skiplog(self, name: str) -> SkipLog:
        log_ = self._skiplogs.get(name)
        if log_ is None:
            assert self._store is not None
            key = keys.beat_skips(name)
            try:
                log_ = SkipLog.from_record(self._store.get(key), key=key)
            except StoreError as exc:
                log.warning("beat: %s; starting a new skip log", exc)
                log_ = SkipLog()
            self._skiplogs[name] = log_
        return log_

    def _record_skip(self, name: str, st: EntryState, skip: SkipRange) -> None:
        log_ = self._skiplog(name)
        contiguous = bool(log_.ranges) and log_.ranges[-1].last == st.last_slot
        log_.add(skip, contiguous=contiguous)
        self._pending[keys.beat_skips(name)] = log_.to_record()
        metrics.BEAT_SKIPPED.labels(skip.reason).inc(skip.count)
        if st.last_slot is None or skip.last > st.last_slot:
            st.last_slot = skip.last
        log.info("beat: entry %r skipped %d slot(s) %s..%s: %s", name, skip.count,
                 format_slot(skip.first), format_slot(skip.last), skip.reason)

    # -- leadership: dispatch ------------------------------------------------------------------
    def _leader_step(self) -> None:
        now_m = monotonic()
        if now_m >= self._next_commands:
            self._next_commands = now_m + COMMAND_POLL_S
            self._apply_commands()
        if self._flush_failed:
            self._flush()
            if self._flush_failed:
                return
        if self.election.is_leader:
            self._dispatch_due()
        if self._verify is not None and self.election.is_leader and now_m >= self._next_verify:
            self._next_verify = now_m + VERIFY_POLL_S
            self._check_deliveries()

    def _check_deliveries(self) -> None:
        assert self._verify is not None
        try:
            changed = self._verify.step(self.states, self._resend, self._give_up)
        except CrawlError as exc:
            log.warning("beat: delivery check failed, trying again: %s", exc)
            return
        for name in changed:
            self._queue_state(name)
        self._flush()

    def _resend(self, name: str, sent: Sent) -> bool:
        entry, lease = self.entries.get(name), self.election.lease
        if entry is None or lease is None or not self.election.may_publish():
            return False
        try:
            self._publisher.publish(entry, parse_slot(sent.slot), token=lease.token,
                                    remaining_s=self.election.remaining_s(),
                                    producer=self.producer, manual=sent.manual)
        except Exception as exc:  # kombu raises many types; the next check tries again
            log.error("beat: entry %r: publishing %s again failed: %s", name, sent.task_id, exc)
            return False
        return True

    def _give_up(self, name: str, sent: Sent) -> None:
        st = self.states.get(name)
        if st is None or sent.manual:
            return
        slot = parse_slot(sent.slot)
        self._skiplog(name).add(SkipRange(slot, slot, 1, "lost"), contiguous=False)
        self._pending[keys.beat_skips(name)] = self._skiplog(name).to_record()
        metrics.BEAT_SKIPPED.labels("lost").inc()

    def _dispatch_due(self) -> None:
        peek = self._due.peek()
        now = self._now()
        if peek is None or peek[1] > now:
            return
        due = self._due.pop_due(now)
        self._prefetch_done(name for name, _ in due)
        producer = self.producer
        election = self.election
        for i, (name, _when) in enumerate(due):
            if election.renew_due():
                self._renew()
            if not election.may_publish():
                if election.is_leader:  # validity ran out before a renewal: retry next tick
                    for rest, rest_when in due[i:]:
                        self._due.push(rest, rest_when)
                return
            self._run_entry(name, now, producer)
            if not election.is_leader:
                return
        self._done_cache.clear()
        self._flush()

    def _prefetch_done(self, names: Iterable[str]) -> None:
        """Read the done tombstones of every due entry's previous run in one round trip, so
        a burst does not pay one read per entry for the overlap decision."""
        ids = []
        for name in names:
            entry, st = self.entries.get(name), self.states.get(name)
            if entry is not None and st is not None and st.last_task_id \
                    and entry.overlap != "allow":
                ids.append(st.last_task_id)
        self._done_cache.clear()
        if not ids:
            return
        assert self._store is not None
        try:
            found = self._store.get_many([keys.done(i) for i in ids])
        except StoreError as exc:
            log.debug("beat: cannot prefetch done tombstones: %s", exc)
            return
        self._done_cache.update(zip(ids, (f is not None for f in found), strict=True))

    def _run_entry(self, name: str, now: datetime, producer: Any) -> None:
        entry = self.entries.get(name)
        st = self.states.get(name)
        if entry is None or st is None:
            return
        paused = st.paused if st.paused is not None else entry.paused
        checked: bool | None = None  # previous run in flight, asked once per entry per tick
        if st.buffered_slot is not None and not paused:
            checked = self._in_flight(entry, st, now)
            if checked is None:
                due = self._next_of.get(name)
                if due is not None and (due > now or (st.last_slot and due <= st.last_slot)):
                    due = None  # no slot of its own is due yet: only the buffered one waits
                self._retry_later(name, st, now, due)
                return
            if not checked:
                slot = st.buffered_slot
                st.buffered_slot = None
                self._publish(entry, st, slot, now, producer)
                checked = True
        expected = self._next_of.get(name)
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
        undecided = self._undecided.pop(name, None)
        if undecided is not None and undecided not in run:
            skipped = blame(skipped, undecided, "store_error", entry.source)
        for skip in skipped:
            self._record_skip(name, st, skip)
        batch_published = False  # catch-up runs published together are not checked
        for slot in run:
            if paused:
                self._record_skip(name, st, SkipRange(slot, slot, 1, "paused"))
                continue
            if checked is None and entry.overlap != "allow":
                checked = self._in_flight(entry, st, now)
                if checked is None:
                    self._retry_later(name, st, now, slot)
                    return
            if checked and entry.overlap != "allow" and not batch_published:
                if entry.overlap == "skip":
                    self._record_skip(name, st, SkipRange(slot, slot, 1, "overlap"))
                    continue
                if entry.overlap == "buffer_one":
                    if st.buffered_slot is None:
                        st.buffered_slot = slot
                        st.last_slot = slot
                    else:
                        self._record_skip(name, st, SkipRange(slot, slot, 1, "overlap_buffered"))
                    continue
                if entry.overlap == "cancel_other" and st.last_task_id:
                    self._revoke(st.last_task_id, name)
                    if st.last_run_slot is not None:  # its slot ends cancelled, on record
                        old = st.last_run_slot
                        self._record_skip(name, st, SkipRange(old, old, 1, "cancelled_by_overlap"))
            if not self.election.may_publish():
                # Validity ran out mid-entry: keep what was decided and retry the rest on the
                # next tick (after a renewal) or leave it to the next leader.
                self._queue_state(name)
                self._schedule(name, st)
                return
            self._publish(entry, st, slot, now, producer)
            batch_published = True
        if newest is not None and (st.last_slot is None or newest > st.last_slot):
            st.last_slot = newest
        self._next_of[name] = nxt
        self._queue_state(name)
        self._schedule(name, st)

    def _retry_later(self, name: str, st: EntryState, now: datetime,
                     slot: datetime | None) -> None:
        """The store could not tell whether the previous run is in flight: leave ``slot`` (and
        what follows it) undecided and try again shortly. It runs if the store answers while
        the catch-up policy still runs it; otherwise it is skipped as ``store_error``."""
        if slot is not None:
            self._undecided.setdefault(name, slot)
            self._next_of[name] = slot
        self._queue_state(name)
        self._due.push(name, now + timedelta(seconds=STORE_RETRY_S))

    def _in_flight(self, entry: BeatEntry, st: EntryState, now: datetime) -> bool | None:
        """Whether the entry's previous run may still be queued or running (None: the store
        could not tell; the caller decides later rather than guess).

        A claim on ``task:<id>`` (the worker plugin claims every task it receives) means it
        is running or about to be recovered; a ``done/<id>`` tombstone means it finished.
        With neither, the run is taken as still queued for at most its ``expires`` or one
        period from its slot, whichever is shorter (a plain worker leaves no trace, so this
        bounds the guess).
        """
        if not st.last_task_id or st.last_run_slot is None:
            return False
        assert self._store is not None
        try:
            done = self._done_cache.get(st.last_task_id)
            if done is None:
                done = self._store.get(keys.done(st.last_task_id)) is not None
            if done:
                return False
            if self._store.claimant(keys.task_claim(st.last_task_id)) is not None:
                return True
        except StoreError as exc:
            log.warning("beat: cannot read the state of %s (%s); deciding entry %r again in "
                        "%gs", st.last_task_id, exc, entry.name, STORE_RETRY_S)
            return None
        window = entry.period_s(st.last_run_slot)
        if entry.expires_s is not None:
            window = min(window, entry.expires_s)
        return now < st.last_run_slot + timedelta(seconds=window)

    def _revoke(self, task_id: str, name: str) -> None:
        try:
            self.app.control.revoke(task_id, terminate=True)
            log.warning("beat: entry %r: revoked the previous run %s (overlap=cancel_other)",
                        name, task_id)
        except Exception as exc:  # a broadcast failure must not stop the schedule
            log.error("beat: entry %r: revoking %s failed: %s", name, task_id, exc)

    def _publish(self, entry: BeatEntry, st: EntryState, slot: datetime, now: datetime,
                 producer: Any, *, manual: bool = False) -> str | None:
        lease = self.election.lease
        assert lease is not None
        try:
            task_id = self._publisher.publish(
                entry, slot, token=lease.token, remaining_s=self.election.remaining_s(),
                producer=producer, manual=manual)
        except Exception as exc:  # kombu raises many types; the run is recorded as skipped
            log.error("beat: entry %r slot %s: publish failed: %s", entry.name,
                      format_slot(slot), exc)
            if not manual:
                self._record_skip(entry.name, st, SkipRange(slot, slot, 1, "publish_failed"))
            return None
        st.run_count += 1
        if self._verify is not None:
            self._verify.track(st, task_id, format_slot(slot), manual)
        st.last_task_id = task_id
        st.last_run_slot = slot
        if not manual and (st.last_slot is None or slot > st.last_slot):
            st.last_slot = slot
        metrics.BEAT_DISPATCHED.inc()
        metrics.BEAT_DISPATCH_LAG.observe(max(0.0, time.time() - slot.timestamp()))
        return task_id

    # -- operator commands ---------------------------------------------------------------------
    def _apply_commands(self) -> None:
        """Read commands without taking them, apply them, then record their effect and take
        them off the queue in one fenced write: a leader deposed in between leaves them to
        the next one, which applies them again (pause/resume are idempotent; trigger and
        backfill publish the same task ids again, which the worker's claim deduplicates)."""
        assert self._store is not None
        if self.election.lease is None:
            return
        try:
            taken = self._store.peek(keys.BEAT_COMMANDS, limit=COMMAND_BATCH)
        except StoreError as exc:
            log.debug("beat: cannot read the command queue: %s", exc)
            return
        if not taken.handle:
            return
        for record in taken.items:
            try:
                cmd = parse_command(record)
            except ValueError as exc:
                log.error("beat: dropping a malformed command: %s", exc)
                continue
            self._apply(cmd)
            if not self.election.may_publish():
                return  # the effects so far are left unrecorded: the next leader redoes them
        self._flush(ack=taken)

    def _apply(self, cmd: Command) -> None:
        entry = self.entries.get(cmd.entry)
        st = self.states.get(cmd.entry)
        if entry is None or st is None:
            log.error("beat: %s %r: no such entry (known: %d entries)", cmd.op, cmd.entry,
                      len(self.entries))
            return
        log.warning("beat: applying %s %r from %s", cmd.op, cmd.entry, cmd.issued_by or "?")
        now = self._now()
        if cmd.op in ("pause", "resume"):
            st.paused = cmd.op == "pause"
            self._queue_state(cmd.entry)
            return
        if cmd.op == "trigger":
            # The instant it was issued, not applied: applied again by a next leader, it is
            # the same run (the same task id).
            slots: Iterable[datetime] = [cmd.issued_at or now.replace(microsecond=0)]
        else:
            assert cmd.start is not None and cmd.end is not None
            end = min(cmd.end, now)
            slots = list(iter_slots(entry.source, cmd.start - timedelta(microseconds=1), end,
                                    limit=MAX_BACKFILL))
            if len(slots) == MAX_BACKFILL:
                log.warning("beat: backfill %r capped at %d slots", cmd.entry, MAX_BACKFILL)
        producer = self.producer
        for slot in slots:
            if self.election.renew_due():  # a backfill publishes up to MAX_BACKFILL runs
                self._renew()
            if not self.election.may_publish():
                return
            self._publish(entry, st, slot, now, producer, manual=True)
        self._queue_state(cmd.entry)

    # -- schedule ------------------------------------------------------------------------------
    def _reload(self, *, force: bool = False) -> None:
        """Rebuild the entries when a schedule file changed (mtime poll). A file that fails to
        load keeps its previous entries; the reason is logged."""
        patterns = self.config.schedule_paths
        files = sorted({p for pat in patterns for p in glob.glob(pat, recursive=True)})
        sig_items = []
        for path in files:
            try:
                st = os.stat(path)
            except OSError:
                continue
            sig_items.append((path, st.st_mtime_ns, st.st_size))
        sig = tuple(sig_items)
        if not force and sig == self._file_sig:
            return
        self._file_sig = sig
        file_entries, _errors = self._load_files(patterns)
        entries: dict[str, BeatEntry] = {}
        for name, raw in (self.app.conf.beat_schedule or {}).items():
            try:
                entries[name] = from_beat_schedule(name, raw, self.app)
            except CrawlError as exc:
                log.error("beat: skipping beat_schedule entry %r: %s", name, exc)
        for name, entry in file_entries.items():
            if name not in entries:  # a duplicate was logged by _load_files
                entries[name] = entry
        changed = {n for n in entries.keys() | self.entries.keys()
                   if n not in entries or n not in self.entries
                   or entries[n].fingerprint != self.entries[n].fingerprint}
        self.entries = entries
        self._publisher.forget({n for n in changed if n not in entries})
        if changed and not force:
            log.warning("beat: schedule reloaded: %d entries, %d changed", len(entries),
                        len(changed))
            if self.election.is_leader:
                self._flush()
                try:
                    self._promote()
                except (StoreError, LeaseError, FencedError) as exc:
                    self._demote(f"reload failed: {exc}", release=True)

    def _load_files(self, patterns: tuple[str, ...]) -> tuple[dict[str, BeatEntry], list[str]]:
        result = load_schedule_files(list(patterns), base_dir=os.getcwd())
        dup_errors = check_duplicates_with_beat_schedule(result, self.app.conf.beat_schedule)
        bad_files: set[str] = set()
        errors: list[str] = []
        for err in result.errors:
            errors.append(str(err))
            bad_files.add(str(err.file or ""))
            log.error("beat: schedule file problem (that file keeps its previous schedule): %s",
                      err)
        for err in dup_errors:
            log.error("beat: %s", err)
        out: dict[str, BeatEntry] = {}
        for name, spec in result.entries.items():
            if spec.source in bad_files:
                continue
            try:
                out[name] = from_spec(spec)
            except (CrawlError, ValueError) as exc:
                errors.append(str(exc))
                log.error("beat: skipping schedule entry %r: %s", name, exc)
        for name, entry in self._file_entries.items():
            if entry.origin in bad_files and name not in out:
                out[name] = entry  # keep what that file defined before it broke
        self._file_entries = out
        self._file_errors = errors
        return out, errors

    # -- timing --------------------------------------------------------------------------------
    def _sleep_s(self) -> float:
        now_m = monotonic()
        s = min(float(self.max_interval), self.election.seconds_to_next_action(now_m),
                self._next_reload - now_m)
        if self.election.is_leader:
            s = min(s, self._next_commands - now_m)
            peek = self._due.peek()
            if peek is not None:
                s = min(s, (peek[1] - self._now()).total_seconds())
            if self._flush_failed:
                s = min(s, 0.2)
            if self._verify is not None:
                s = min(s, self._next_verify - now_m)
        return max(0.0, s)

    def _describe_next(self) -> str:
        peek = self._due.peek()
        if peek is None:
            return "none"
        return f"{peek[0]} at {format_slot(peek[1])}"
