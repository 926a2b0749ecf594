"""``LeasedScheduler``: a ``celery.beat.Scheduler`` where only the lease holder dispatches.

``celery -A proj beat -S celery_crawl.beat:LeasedScheduler``, any number of replicas. This class
is the Celery adapter; the decisions live in Celery-free modules: :mod:`.election` (leader state
machine), :mod:`.term` (the lease's store calls), :mod:`.guards` (store fitness, clock skew,
clock steps), :mod:`.book` (entry states and their fenced writes), :mod:`.dispatch` (due heap,
catch-up, overlap policies), :mod:`.commands` (operator commands), :mod:`.reload` (schedule-file
poll), :mod:`.verify` (delivery check); the schedule comes from :mod:`.assembly` and the message
from :mod:`.publish`.

Everything happens inside ``tick()`` and never blocks longer than one store call: ``tick``
returns the time until the *earliest* of the next due run, the next renewal (every ttl/3), the
next standby poll (0.2 s), the next command poll and the next schedule-file check, so the lease
is renewed on time however far away the next run is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery.beat import Scheduler

from .. import keys, metrics, status
from .._broker import sentinel_master
from .._celery_compat import warn_untested
from ..clock import Clock, RedisTimeReference, monotonic
from ..config import CrawlConfig, plain_redis_url
from ..errors import ConfigError, CrawlError, FencedError, LeaseError, StoreError
from ..leases import make_holder, store_for
from ..leases.base import Characteristic
from ..schedules.fingerprint import schedule_fingerprint
from ..schedules.root import schedule_base
from .assembly import assemble
from .book import StateBook
from .commands import CommandQueue
from .dispatch import Dispatcher
from .election import Election
from .entries import BeatEntry, zone_name, zoned
from .fleet import FleetSchedule
from .guards import Guards
from .publish import Publisher
from .reload import FileWatch, changed_names
from .slots import SkipRange
from .sources import row_source
from .state import EntryState, Sent, format_slot, parse_slot
from .term import Term
from .verify import DeliveryCheck

__all__ = ["LeasedScheduler"]

log = logging.getLogger("celery_crawl.beat")

#: How often the leader reads the operator command queue.
COMMAND_POLL_S = 0.5
#: How often schedule files are checked for changes (mtime poll).
RELOAD_POLL_S = 1.0
#: How often the leader runs the delivery check (``crawl_beat_verify_delivery``).
VERIFY_POLL_S = 1.0
#: How often a standby compares its schedule with the fleet's (see :mod:`.fleet`).
FLEET_POLL_S = 1.0
#: A standing schedule mismatch is logged again this often (``warn`` mode).
_MISMATCH_LOG_S = 60.0

#: The replica id the banner showed, per app: Celery builds the banner from a lazy scheduler
#: made just before the real one, which takes this id over so the banner names it truly.
_banner_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


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
        self.replica_id = self._replica_id(app, lazy=bool(kwargs.get("lazy")))
        self.election = Election(self.config.beat_lease_ttl_s, clock=monotonic)
        self.entries: dict[str, BeatEntry] = {}
        #: fingerprint of the whole schedule (``schedule_fingerprint`` of the entries)
        self.schedule_fingerprint = schedule_fingerprint({})
        self._fleet: FleetSchedule | None = None
        #: whether this term's schedule is the fleet's (adopted): only then is state collected
        self._adopted = False
        self._next_fleet = 0.0
        self._last_mismatch_log = -_MISMATCH_LOG_S
        self._files_ok = True
        self._watch = FileWatch(self.config.schedule_paths)
        #: django-celery-beat's rows (``crawl_schedule_sources``), read when their marker moves
        self._rows = row_source(app, self.config) \
            if "django_celery_beat" in self.config.schedule_sources else None
        self._rows_problem: str | None = None
        self._next_write_back = 0.0
        self._store: Any = None
        #: The lease store saw its Redis master move (Sentinel): the producer is made anew.
        self._broker_moved = False
        self._clock: Clock | None = None
        self._term: Term | None = None
        self._guards: Guards | None = None
        self._book: StateBook | None = None
        self._dispatch: Dispatcher | None = None
        self._commands: CommandQueue | None = None
        self._verify: DeliveryCheck | None = None
        self._publisher = Publisher(app, self.config.namespace)
        self._next_reload = self._next_commands = self._next_verify = 0.0
        self._closed = False
        self._started = format_slot(datetime.fromtimestamp(int(self._wall_clock()), UTC))
        super().__init__(app, *args, **kwargs)

    @staticmethod
    def _replica_id(app: Any, *, lazy: bool) -> str:
        if lazy:
            replica_id = _banner_ids[app] = make_holder()
            return replica_id
        return _banner_ids.pop(app, None) or make_holder()

    @property
    def states(self) -> dict[str, EntryState]:
        """The entry states of the current term (empty on a standby)."""
        return self._book.states if self._book is not None else {}

    # -- Celery hooks -------------------------------------------------------------------------
    def setup_schedule(self) -> None:
        """Open the store, check it, start metrics and load the schedule (not when lazy)."""
        status.install(self.app, lambda: status.beat_process(self))
        warn_untested("beat")
        try:
            metrics.start_metrics_server(self.config.metrics_port, addr=self.config.metrics_addr)
        except ConfigError as exc:  # a busy port must not take the scheduler down
            log.error("beat: metrics are off: %s", exc)
        store = self._store = store_for(self.config)
        metrics.watch_master_changes(store, self._master_moved)
        self._clock = Clock(self._reference(), wall=self._wall_clock)
        term = self._term = Term(store, self.election, ttl_s=self.config.beat_lease_ttl_s,
                                 replica_id=self.replica_id, promote=self._promote,
                                 demoted=self._after_demotion, presence=self._presence)
        self._guards = Guards(store, self._clock, self.election,
                              max_skew_s=self.config.max_clock_skew_s,
                              store_timeout_s=self.config.store_timeout_s,
                              demoted=term.ended, replica_id=self.replica_id)
        self._book = StateBook(store, self.election, refused=term.fenced_out)
        self._dispatch = Dispatcher(store, self.election, self._book, now=self._now,
                                    renew=term.renew, publish=self._publish,
                                    revoke=self._revoke)
        self._commands = CommandQueue(store, self.election, self._book,
                                      entries=lambda: self.entries, now=self._now,
                                      renew=term.renew, publish=self._publish)
        self._fleet = FleetSchedule(store, replica_id=self.replica_id,
                                    alive_s=self.config.beat_lease_ttl_s, now=self._now)
        metrics.start_at_zero("beat")
        self._guards.check_store()
        self._setup_verify()
        self._reload(force=True)
        log.info("beat: schedule paths %s resolve against %s",
                 ", ".join(self.config.schedule_paths) or "(none)",
                 schedule_base(self.app).describe())
        log.info("beat replica %s standing by (lease %s, ttl %.1fs, %d entries, schedule %s)",
                 self.replica_id, store.url, self.config.beat_lease_ttl_s, len(self.entries),
                 self.schedule_fingerprint)

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
        if self._closed or self._guards is None or self._term is None:
            return 1.0
        now_m = monotonic()
        if now_m >= self._next_reload:
            self._next_reload = now_m + RELOAD_POLL_S
            self._reload()
        self._guards.check_step()
        now_m = monotonic()
        self._guards.poll(now_m)
        if now_m >= self._next_fleet:
            self._next_fleet = now_m + FLEET_POLL_S
            self._check_fleet()
        # A set clock blocks promotion: it would start fresh entries on the wrong time.
        self._term.step(now_m, may_acquire=not self._guards.stepped)
        if self.election.is_leader and not self._guards.stepped:
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
                if self.election.may_publish() and self._book is not None:
                    try:
                        self._book.flush()
                    except CrawlError as exc:
                        log.warning("beat: final state flush failed: %s", exc)
                    self._write_back_rows()
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
            if self._rows is not None:
                self._rows.close()
            if store is not None:
                store.close()
            super().close()

    def _reference(self) -> Any:
        """The clock the skew guard compares with: the store's, else the broker/backend Redis."""
        if Characteristic.HAS_CLOCK in self._store.characteristics:
            return self._store
        for url in (self.app.conf.broker_url, self.app.conf.result_backend):
            redis_url = plain_redis_url(url)
            if redis_url is not None:
                return RedisTimeReference(redis_url, timeout_s=self.config.store_timeout_s)
        log.warning("beat: the lease store has no clock and neither the broker nor the result "
                    "backend is Redis: the clock-skew guard (crawl_max_clock_skew) is off")
        return None

    # -- leadership ----------------------------------------------------------------------------
    def _after_demotion(self, reason: str) -> None:
        dropped = self._book.clear() if self._book is not None else 0
        if self._rows is not None:
            self._rows.forget_runs()  # written back by the next leader's token, not ours
        if self._dispatch is not None:
            self._dispatch.clear()
        log.error("beat replica %s stopped dispatching and is standing by: %s%s",
                  self.replica_id, reason,
                  f" ({dropped} unwritten entry states left to the next leader)"
                  if dropped else "")

    def _presence(self) -> dict[str, Any]:
        offset = self._clock.offset_s if self._clock is not None else None
        return {
            "id": self.replica_id, "host": socket.gethostname(), "pid": os.getpid(),
            "role": self.election.role.value,
            "token": self.election.lease.token if self.election.lease else None,
            "clock_offset_s": None if offset is None else round(-offset, 6),
            "blocked": self.election.blocked_reason, "entries": len(self.entries),
            "schedule": self.schedule_fingerprint,
            "started": self._started, "last_seen": format_slot(self._now()),
        }

    def _check_fleet(self) -> None:
        """A standby compares its schedule with the fleet's: a mismatch blocks it from leading
        (``refuse``: a leader that had not adopted its schedule steps down) or is logged
        (``warn``); see :mod:`.fleet`."""
        assert self._fleet is not None and self._guards is not None
        if self.election.is_leader and self._adopted:
            metrics.BEAT_SCHEDULE_MISMATCH.set(0)
            return
        # A standby, or a leader running a schedule it did not adopt (an empty one that led
        # before any other replica was up): the latter steps down once the rule says so.
        reason = self._fleet.check(self.schedule_fingerprint, len(self.entries))
        fleet_fp = self._fleet.fingerprint
        metrics.BEAT_SCHEDULE_MISMATCH.set(
            1 if fleet_fp is not None and fleet_fp != self.schedule_fingerprint else 0)
        if reason is None and self.election.is_leader and self.entries:
            # Nobody holds the fleet's schedule any more: the term adopts its own now (and
            # collects what it dropped), as a new term would.
            self._repromote()
            return
        if self.config.beat_schedule_mismatch == "refuse":
            text = (None if reason is None else
                    f"refusing to lead: {reason} (crawl_beat_schedule_mismatch=refuse)")
            if text != self._guards.schedule_reason:
                if text is None:
                    log.warning("beat replica %s: its schedule %s may lead now (no live replica "
                                "holds the fleet's %s any more)", self.replica_id,
                                self.schedule_fingerprint, fleet_fp)
                self._guards.schedule_reason = text
                self._guards.apply()
            return
        now_m = monotonic()
        if reason is not None and now_m - self._last_mismatch_log >= _MISMATCH_LOG_S:
            self._last_mismatch_log = now_m
            log.warning("beat replica %s may lead although %s (crawl_beat_schedule_mismatch=warn:"
                        " it would run its own schedule without adopting it)",
                        self.replica_id, reason)

    def _adopt(self, *, reloaded: bool) -> bool:
        """Whether this term runs the fleet's schedule: adopted when it matches, when no live
        replica holds the fleet's any more, or when the leader reloaded its own files (an
        empty schedule is never adopted over one with entries). Records it in the store."""
        assert self._fleet is not None
        lease = self.election.lease
        assert lease is not None
        fp, n = self.schedule_fingerprint, len(self.entries)
        if reloaded:
            fleet = self._fleet.fleet
            reason = (None if n or not fleet or not fleet.get("entries")
                      else "the reloaded schedule is empty")
        else:
            assert self._term is not None
            reason = self._fleet.check(fp, n, fresh=True, between=self._term.keep_alive)
        if reason is None and n == 0 and self._fleet.fleet is None:
            reason = "an empty schedule is not recorded as the fleet's"
        if reason is not None:
            log.warning("beat replica %s leads without adopting its schedule %s as the "
                        "fleet's (stored state of entries it lacks is kept): %s",
                        self.replica_id, fp, reason)
            return False
        self._fleet.adopt(lease, fp, n)
        return True

    def _promote(self, *, reloaded: bool = False) -> None:
        """Load every entry's durable state and fill the due heap (see ``StateBook.load``)."""
        assert self._book is not None and self._dispatch is not None and self._term is not None
        self._dispatch.clear()
        self._dispatch.entries = self.entries
        self._adopted = self._adopt(reloaded=reloaded)
        metrics.BEAT_SCHEDULE_MISMATCH.set(0 if self._adopted else 1)
        # Stored state of an entry goes only when the fleet's schedule dropped the entry.
        fresh = self._book.load(self.entries, self._now(),
                                collect_garbage=self._files_ok and self._adopted,
                                keep_alive=self._term.keep_alive)
        self._dispatch.schedule_all(self._term.keep_alive)
        log.info("beat: leading %d entries (%d fresh), next run %s", len(self._book.states),
                 len(fresh), self._dispatch.describe_next())

    def _between_checks(self) -> None:
        """Between the requests of a long delivery check (a queue read is O(backlog)): renew,
        and dispatch what came due meanwhile, so the schedule does not wait for the check."""
        assert self._dispatch is not None and self._guards is not None and self._term is not None
        self._term.keep_alive()
        peek = self._dispatch.peek()
        if peek is not None and not self._guards.stepped and peek[1] <= self._now():
            self._dispatch.dispatch_due()
            self._term.keep_alive()

    def _leader_step(self) -> None:
        assert self._book is not None and self._dispatch is not None
        assert self._commands is not None
        now_m = monotonic()
        if now_m >= self._next_commands:
            self._next_commands = now_m + COMMAND_POLL_S
            self._commands.poll()
        if self._book.flush_failed:
            self._book.flush()
            if self._book.flush_failed:
                return
        if self.election.is_leader:
            self._dispatch.dispatch_due()
        if self._verify is not None and self.election.is_leader and now_m >= self._next_verify:
            self._next_verify = now_m + VERIFY_POLL_S
            self._check_deliveries()
        if self._rows is not None and self._rows.pending and now_m >= self._next_write_back:
            self._next_write_back = now_m + RELOAD_POLL_S
            self._write_back_rows()

    def _write_back_rows(self) -> None:
        """``last_run_at``/``total_run_count`` of django-celery-beat rows, fenced by the token."""
        lease = self.election.lease
        if self._rows is None or lease is None or not self.election.may_publish():
            return
        try:
            self._rows.write_back(lease.token)
        except FencedError as exc:
            log.error("beat: %s", exc)
        except CrawlError as exc:
            log.warning("beat: writing runs back to django-celery-beat failed, trying again: "
                        "%s", exc)

    def _check_deliveries(self) -> None:
        assert self._verify is not None and self._book is not None
        try:
            changed = self._verify.step(self._book.states, self._resend, self._give_up)
        except CrawlError as exc:
            log.warning("beat: delivery check failed, trying again: %s", exc)
            return
        for name in changed:
            self._book.queue(name)
        self._book.flush()

    def _master_moved(self, _old: tuple[str, int], _new: tuple[str, int]) -> None:
        # Called on whichever thread made the store call: the producer is replaced on the next
        # publish, on the scheduler's own thread.
        self._broker_moved = True

    def _producer(self) -> Any:
        """The producer to publish with: made anew after the lease store saw its Redis master
        move when the broker is behind the same Sentinel master (kombu would publish to the old
        master, which drops what it got when Sentinel demotes it)."""
        if self._broker_moved:
            self._broker_moved = False
            link = getattr(self._store, "sentinel_link", None)
            if link is not None and sentinel_master(self.app) == link.master_name:
                log.warning("beat: the Redis master %r moved: making the broker connection anew "
                            "through Sentinel", link.master_name)
                # Celery's Scheduler caches both (kombu cached_property, in the instance dict).
                self.__dict__.pop("producer", None)
                conn = self.__dict__.pop("connection", None)
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.collect()
        return self.producer

    def _resend(self, name: str, sent: Sent) -> bool:
        entry, lease = self.entries.get(name), self.election.lease
        if entry is None or lease is None or not self.election.may_publish():
            return False
        try:
            self._publisher.publish(entry, parse_slot(sent.slot), token=lease.token,
                                    remaining_s=self.election.remaining_s(),
                                    producer=self._producer(), manual=sent.manual)
        except Exception as exc:  # kombu raises many types; the next check tries again
            log.error("beat: entry %r: publishing %s again failed: %s", name, sent.task_id, exc)
            return False
        return True

    def _give_up(self, name: str, sent: Sent) -> None:
        if self._book is not None and name in self._book.states and not sent.manual:
            self._book.record_lost(name, parse_slot(sent.slot))

    def _revoke(self, task_id: str, name: str) -> None:
        try:
            self.app.control.revoke(task_id, terminate=True)
            log.warning("beat: entry %r: revoked the previous run %s (overlap=cancel_other)",
                        name, task_id)
        except Exception as exc:  # a broadcast failure must not stop the schedule
            log.error("beat: entry %r: revoking %s failed: %s", name, task_id, exc)

    def _publish(self, entry: BeatEntry, st: EntryState, slot: datetime, now: datetime, *,
                 manual: bool = False) -> str | None:
        """Publish one run and record it in ``st``; a failed publish is recorded as skipped."""
        lease = self.election.lease
        assert lease is not None and self._book is not None
        try:
            task_id = self._publisher.publish(
                entry, slot, token=lease.token, remaining_s=self.election.remaining_s(),
                producer=self._producer(), manual=manual)
        except Exception as exc:  # kombu raises many types; the run is recorded as skipped
            log.error("beat: entry %r slot %s: publish failed: %s", entry.name,
                      format_slot(slot), exc)
            if not manual:
                self._book.record_skip(entry.name, st, SkipRange(slot, slot, 1, "publish_failed"))
            return None
        st.run_count += 1
        if self._verify is not None:
            self._verify.track(st, task_id, format_slot(slot), manual)
        st.last_task_id = task_id
        st.last_run_slot = slot
        if self._rows is not None:
            self._rows.ran(entry, now)
        if not manual and (st.last_slot is None or slot > st.last_slot):
            st.last_slot = slot
        metrics.BEAT_DISPATCHED.inc()
        metrics.BEAT_DISPATCH_LAG.observe(max(0.0, time.time() - slot.timestamp()))
        log.info("beat: published %s slot %s = %s in %s as %s, token %d%s", entry.name,
                 format_slot(slot), zoned(entry, slot), zone_name(entry), task_id, lease.token,
                 " (manual)" if manual else "")
        return task_id

    # -- schedule ------------------------------------------------------------------------------
    def _reload(self, *, force: bool = False) -> None:
        """Assemble the schedule again when a schedule file changed. A file that fails to load
        keeps its previous entries; the reason is logged."""
        files_changed = self._watch.changed(force=force)
        if not self._poll_rows() and not files_changed:
            return
        schedule = assemble(self.app, paths=self.config.schedule_paths,
                            base_dir=str(schedule_base(self.app).path), previous=self.entries,
                            rows=self._rows)
        for name, exc in schedule.beat_schedule_errors.items():
            log.error("beat: skipping beat_schedule entry %r: %s", name, exc)
        for err in schedule.file_errors:
            log.error("beat: schedule file problem (that file keeps its previous schedule): %s",
                      err)
        for err in schedule.duplicates:
            log.error("beat: %s", err)
        for name, error in schedule.entry_errors.items():
            log.error("beat: skipping schedule entry %r: %s", name, error)
        for line in schedule.source_errors:
            if self._rows is None or line not in self._rows.errors.values():  # logged there
                log.error("beat: %s", line)
        changed = changed_names(self.entries, schedule.entries)
        self.entries, self._files_ok = schedule.entries, schedule.files_ok
        self.schedule_fingerprint = schedule_fingerprint(
            {name: entry.fingerprint for name, entry in self.entries.items()})
        metrics.set_schedule(self.schedule_fingerprint, len(self.entries))
        if self._dispatch is not None:
            self._dispatch.entries = self.entries
        self._publisher.forget({n for n in changed if n not in self.entries})
        if changed and not force:
            log.warning("beat: schedule reloaded: %d entries, %d changed", len(self.entries),
                        len(changed))
            if self.election.is_leader:
                self._repromote(reloaded=True)

    def _repromote(self, *, reloaded: bool = False) -> None:
        """Load the term again (a reloaded schedule, or one to adopt now); a store or lease
        failure ends the term."""
        if self._book is None:
            return
        self._book.flush()
        try:
            self._promote(reloaded=reloaded)
        except (StoreError, LeaseError, FencedError) as exc:
            assert self._term is not None
            self._term.demote(f"{'reload' if reloaded else 'adoption'} failed: {exc}",
                              release=True)

    def _poll_rows(self) -> bool:
        """Whether django-celery-beat's rows changed; a failing database keeps the last good
        rows (the beat goes on running them) and is polled again."""
        if self._rows is None:
            return False
        try:
            changed = self._rows.poll()
        except CrawlError as exc:
            if str(exc) != self._rows_problem:
                log.error("beat: django-celery-beat rows not read (the last good rows are kept, "
                          "trying again): %s", exc)
            self._rows_problem = str(exc)
            return False
        if self._rows_problem is not None:
            log.warning("beat: django-celery-beat rows read again")
            self._rows_problem = None
        return changed

    def _sleep_s(self) -> float:
        now_m = monotonic()
        s = min(float(self.max_interval), self.election.seconds_to_next_action(now_m),
                self._next_reload - now_m)
        if self.election.is_leader and self._dispatch is not None and self._book is not None:
            s = min(s, self._next_commands - now_m)
            peek = self._dispatch.peek()
            if peek is not None:
                s = min(s, (peek[1] - self._now()).total_seconds())
            if self._book.flush_failed:
                s = min(s, 0.2)
            if self._verify is not None:
                s = min(s, self._next_verify - now_m)
        return max(0.0, s)
