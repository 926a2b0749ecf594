"""Operator commands for the beat leader, as records in the store's command queue.

``celery crawl pause|resume|trigger|backfill`` push a record onto ``keys.BEAT_COMMANDS``; the
leader reads the queue about twice a second and applies each one without a restart
(:class:`CommandQueue`). A queue rather than direct writes keeps every change of entry state in
one writer, the leader.

The leader reads commands without taking them, applies them, then records their effect and
takes them off the queue in one fenced write: a leader deposed in between leaves them to the
next one, which applies them again (pause/resume are idempotent; trigger and backfill publish
the same task ids again, which the worker's claim deduplicates).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from .. import keys
from ..errors import ConfigError, StoreError
from ..leases.base import LeaseStore
from .book import StateBook
from .election import Election
from .slots import iter_slots
from .state import format_slot, parse_slot

__all__ = ["OPS", "Command", "CommandQueue", "make_command", "parse_command"]

log = logging.getLogger("celery_crawl.beat")

OPS = ("pause", "resume", "trigger", "backfill")
#: Most slots one backfill command publishes.
MAX_BACKFILL = 1000
#: Commands applied and recorded together (one fenced write; etcd: one transaction).
COMMAND_BATCH = 20


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """One operator command.

    Attributes:
        op: ``pause`` | ``resume`` | ``trigger`` | ``backfill``.
        entry: the entry name.
        start: backfill start (exclusive: slots strictly after it).
        end: backfill end (inclusive).
        issued_at: when the operator issued it.
        issued_by: ``host:pid`` of the CLI.
    """

    op: str
    entry: str
    start: datetime | None = None
    end: datetime | None = None
    issued_at: datetime | None = None
    issued_by: str = ""


def make_command(op: str, entry: str, *, start: datetime | None = None,
                 end: datetime | None = None) -> dict[str, Any]:
    """The queue record of a command; validates it first.

    Raises:
        ConfigError: unknown op, empty entry name, or a backfill range that is missing,
            naive or reversed.
    """
    if op not in OPS:
        raise ConfigError(f"beat command: unknown op {op!r} (one of {', '.join(OPS)})")
    if not entry:
        raise ConfigError("beat command: an entry name is required")
    record: dict[str, Any] = {
        "op": op, "entry": entry, "issued_at": format_slot(datetime.now(UTC)),
        "issued_by": f"{socket.gethostname()}:{os.getpid()}",
    }
    if op == "backfill":
        if start is None or end is None:
            raise ConfigError("backfill: --start and --end are required")
        for label, value in (("--start", start), ("--end", end)):
            if value.tzinfo is None:
                raise ConfigError(f"backfill {label}: {value.isoformat()} has no time zone "
                                  f"(write e.g. 2026-03-01T00:00:00Z)")
        if end < start:
            raise ConfigError("backfill: --end is before --start")
        record["start"] = format_slot(start)
        record["end"] = format_slot(end)
    return record


def parse_command(record: dict[str, Any]) -> Command:
    """A queue record back to a :class:`Command`.

    Raises:
        ValueError: the record is not a command (the leader logs and drops it).
    """
    op = record.get("op")
    entry = record.get("entry")
    if op not in OPS or not isinstance(entry, str) or not entry:
        raise ValueError(f"not a beat command: {record!r}")
    try:
        start = parse_slot(record["start"]) if record.get("start") else None
        end = parse_slot(record["end"]) if record.get("end") else None
        issued = parse_slot(record["issued_at"]) if record.get("issued_at") else None
    except Exception as exc:
        raise ValueError(f"bad time in beat command {record!r}: {exc}") from exc
    if op == "backfill" and (start is None or end is None):
        raise ValueError(f"backfill without a range: {record!r}")
    return Command(op, entry, start, end, issued, str(record.get("issued_by", "")))


class CommandQueue:
    """The leader's side of the command queue.

    Args:
        store: holds the queue.
        election: a command is applied only while the lease lets this replica publish.
        book: the term's entry states (pause overrides; what a command published).
        entries: the current entries by name.
        now: the reference clock.
        renew: renews the lease (a backfill publishes up to ``MAX_BACKFILL`` runs).
        publish: ``publish(entry, state, slot, now, manual=True)``.
    """

    def __init__(self, store: LeaseStore, election: Election, book: StateBook, *,
                 entries: Callable[[], Mapping[str, Any]], now: Callable[[], datetime],
                 renew: Callable[[], None], publish: Callable[..., str | None]) -> None:
        self.store = store
        self.election = election
        self.book = book
        self.entries = entries
        self.now = now
        self.renew = renew
        self.publish = publish

    def poll(self) -> None:
        """Apply the commands at the head of the queue and take them off it with their effect."""
        if self.election.lease is None:
            return
        try:
            taken = self.store.peek(keys.BEAT_COMMANDS, limit=COMMAND_BATCH)
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
            self.apply(cmd)
            if not self.election.may_publish():
                return  # the effects so far are left unrecorded: the next leader redoes them
        self.book.flush(ack=taken)

    def apply(self, cmd: Command) -> None:
        entries = self.entries()
        entry = entries.get(cmd.entry)
        st = self.book.states.get(cmd.entry)
        if entry is None or st is None:
            log.error("beat: %s %r: no such entry (known: %d entries)", cmd.op, cmd.entry,
                      len(entries))
            return
        log.warning("beat: applying %s %r from %s", cmd.op, cmd.entry, cmd.issued_by or "?")
        now = self.now()
        if cmd.op in ("pause", "resume"):
            st.paused = cmd.op == "pause"
            self.book.queue(cmd.entry)
            return
        for slot in slots_of(cmd, entry.source, now):
            if self.election.renew_due():
                self.renew()
            if not self.election.may_publish():
                return
            self.publish(entry, st, slot, now, manual=True)
        self.book.queue(cmd.entry)


def slots_of(cmd: Command, source: Any, now: datetime) -> list[datetime]:
    """The slots a ``trigger`` or ``backfill`` publishes (never one after ``now``)."""
    if cmd.op == "trigger":
        # The instant it was issued, not applied: applied again by a next leader, it is
        # the same run (the same task id).
        return [cmd.issued_at or now.replace(microsecond=0)]
    assert cmd.start is not None and cmd.end is not None
    end = min(cmd.end, now)
    slots = list(iter_slots(source, cmd.start - timedelta(microseconds=1), end,
                            limit=MAX_BACKFILL))
    if len(slots) == MAX_BACKFILL:
        log.warning("beat: backfill %r capped at %d slots", cmd.entry, MAX_BACKFILL)
    return slots
