"""The schedule the fleet runs, and who may change it.

Replicas of one app can hold different schedules: one started where its schedule files are not
found holds none, and a rolling deploy holds two versions at once. Without a rule, whichever
replica wins an election runs its own schedule (and forgets the others' entries). The rule:

* the leader records the schedule it runs (``keys.BEAT_SCHEDULE``: fingerprint, entry count;
  written with its lease) once it *adopts* it: that record is the fleet's schedule;
* a replica whose schedule differs from the fleet's does not take the lead while a live replica
  (presence seen within a lease TTL) still holds the fleet's schedule; one with an empty
  schedule never leads a fleet whose schedule has entries, nor beside live replicas that have
  some (``crawl_beat_schedule_mismatch = "refuse"``, the default; ``"warn"`` lets it lead and
  only logs, and it then runs its schedule without adopting it);
* so a new schedule is rolled out by replacing the replicas: once no live replica holds the old
  fingerprint, the next leader adopts the new one; a leader that reloads its own files adopts
  what it reloaded (files edited in place are the operator's change);
* only an adopted schedule removes stored entry state: an entry's state is deleted when the
  fleet's schedule dropped the entry, never because one replica lacks it.

Celery-free: the scheduler calls :meth:`FleetSchedule.check` on a standby's poll and
:meth:`FleetSchedule.adopt` when it leads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .. import keys
from ..clock import monotonic
from ..errors import StoreDataError, StoreError
from ..leases.base import Lease, LeaseStore
from .state import format_slot, parse_slot

__all__ = ["MODES", "FleetSchedule", "Replica", "judge"]

log = logging.getLogger("celery_crawl.beat")

#: Values of ``crawl_beat_schedule_mismatch``.
MODES = ("refuse", "warn")
#: The presence records are read (a ``SCAN``: O(keys in the database)) at most once per this many
#: times the last read took, so a standby that waits never loads a crowded store.
_SCAN_SPACING = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class Replica:
    """What another replica's presence record says about its schedule."""

    id: str
    schedule: str | None
    entries: int


def judge(fingerprint: str, entries: int, fleet: dict[str, Any] | None,
          others: list[Replica]) -> str | None:
    """Why a replica holding ``fingerprint`` (``entries`` entries) must not lead, or None.

    Args:
        fleet: the fleet's schedule record (None: none was adopted yet).
        others: the other live replicas.
    """
    fleet_fp = str(fleet.get("fingerprint")) if fleet else None
    fleet_n = _int(fleet.get("entries")) if fleet else 0
    if entries == 0:
        if fleet is not None and fleet_n > 0:
            return (f"this replica's schedule is empty, the fleet's schedule {fleet_fp} has "
                    f"{fleet_n} entries (are its schedule files where crawl_schedule_paths "
                    f"resolves?)")
        busy = [r.id for r in others if r.entries > 0]
        if busy:
            return (f"this replica's schedule is empty while live replica(s) "
                    f"{', '.join(busy[:3])} have entries")
        return None
    if fleet_fp is not None and fingerprint != fleet_fp:
        holders = [r.id for r in others if r.schedule == fleet_fp]
        if holders:
            return (f"this replica's schedule {fingerprint} ({entries} entries) differs from "
                    f"the fleet's {fleet_fp} ({fleet_n} entries), which live replica(s) "
                    f"{', '.join(holders[:3])} still hold")
    return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class FleetSchedule:
    """This replica's reading of the fleet's schedule record and of the other replicas.

    Args:
        store: the lease store.
        replica_id: this replica (left out of ``others``).
        alive_s: a presence record last written longer ago than this is a dead replica's.
        now: the reference clock (presence ``last_seen`` is written on it).
    """

    def __init__(self, store: LeaseStore, *, replica_id: str, alive_s: float,
                 now: Callable[[], datetime]) -> None:
        self.store = store
        self.replica_id = replica_id
        self.alive_s = alive_s
        self.now = now
        #: the fleet's record as last read or written (None: none yet)
        self.fleet: dict[str, Any] | None = None
        self._others: list[Replica] = []
        self._next_scan = 0.0

    @property
    def fingerprint(self) -> str | None:
        return str(self.fleet["fingerprint"]) if self.fleet else None

    def read(self) -> dict[str, Any] | None:
        """Read the fleet's record (kept on a store error)."""
        try:
            record = self.store.get(keys.BEAT_SCHEDULE)
        except StoreError as exc:
            log.debug("beat: cannot read the fleet's schedule: %s", exc)
            return self.fleet
        self.fleet = record if isinstance(record, dict) and record.get("fingerprint") else None
        return self.fleet

    def others(self, *, between: Callable[[], None] | None = None) -> list[Replica]:
        """The other replicas seen alive (presence written within ``alive_s``); ``between``
        runs between the pages of the scan (the leader renews there)."""
        started = monotonic()
        records = self.store.scan(keys.beat_presence(""), between=between)
        self._next_scan = monotonic() + _SCAN_SPACING * (monotonic() - started)
        now = self.now()
        out = []
        for rec in records.values():
            if not isinstance(rec, dict) or rec.get("id") == self.replica_id:
                continue
            try:
                seen = parse_slot(str(rec.get("last_seen")))
            except StoreDataError:
                continue
            if (now - seen).total_seconds() > self.alive_s:
                continue
            fp = rec.get("schedule")
            out.append(Replica(str(rec.get("id")), fp if isinstance(fp, str) else None,
                               _int(rec.get("entries"))))
        return out

    def check(self, fingerprint: str, entries: int, *, fresh: bool = False,
              between: Callable[[], None] | None = None) -> str | None:
        """Read the store and :func:`judge` this replica. The presence records are read only
        when the verdict depends on them, and (unless ``fresh``) not more often than a crowded
        store allows; a store error keeps the last reading."""
        fleet = self.read()
        if entries > 0 and (fleet is None or fleet.get("fingerprint") == fingerprint):
            return None  # the common case costs one read
        if fresh or monotonic() >= self._next_scan:
            try:
                self._others = self.others(between=between)
            except StoreError as exc:
                log.debug("beat: cannot read the replicas' presence: %s", exc)
        return judge(fingerprint, entries, fleet, self._others)

    def adopt(self, lease: Lease, fingerprint: str, entries: int) -> bool:
        """Record ``fingerprint`` as the fleet's schedule (with the leader lease); returns
        whether it changed.

        Raises:
            StoreError, LeaseError: the write failed or the lease is gone.
        """
        old = self.fleet
        if old is not None and old.get("fingerprint") == fingerprint \
                and old.get("entries") == entries:
            return False
        record = {"fingerprint": fingerprint, "entries": entries, "token": lease.token,
                  "replica": self.replica_id, "since": format_slot(self.now())}
        self.store.put(keys.BEAT_SCHEDULE, record, lease=lease)
        self.fleet = record
        if old is None:
            log.warning("beat: the fleet runs schedule %s (%d entries)", fingerprint, entries)
        else:
            log.warning("beat: the fleet now runs schedule %s (%d entries), was %s (%s entries)",
                        fingerprint, entries, old.get("fingerprint"), old.get("entries"))
        return True
