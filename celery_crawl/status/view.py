"""The status view: one gathering behind both ``crawl status`` and the ``/status`` page.

Everything an operator asks first (who leads, with which token, how long the lease has left,
which replicas are there and how far their clocks are off, what fires next, what ran last, what
was skipped and why) is read here from the store and the app's schedule, once, into a plain
JSON-able dict. The CLI prints it and the page renders it, so the two cannot disagree.

Store records are written by whoever can reach the store, so the view is built defensively: a
malformed record becomes an error line, never an exception, and any credentials inside a URL
anywhere in the view are masked.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .. import keys
from ..errors import CrawlError

__all__ = ["gather", "scrub"]

_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/@:]*):[^\s/@]*@")


def scrub(value: Any) -> Any:
    """``value`` with the password of every ``scheme://user:password@`` in its strings masked."""
    if isinstance(value, str):
        return _CREDENTIALS.sub(r"\g<scheme>\g<user>:***@", value)
    if isinstance(value, dict):
        return {scrub(str(k)): scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return scrub(str(value))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _replica(rec: Any) -> dict[str, Any]:
    rec = rec if isinstance(rec, dict) else {"id": repr(rec)}
    return {
        "id": rec.get("id"),
        "host": rec.get("host"),
        "role": rec.get("role"),
        "token": rec.get("token"),
        "clock_offset_s": _number(rec.get("clock_offset_s")),
        "last_seen": rec.get("last_seen"),
        "blocked": rec.get("blocked") or None,
        "entries": rec.get("entries"),
        "schedule": rec.get("schedule"),
    }


def _mark_differing(replicas: list[dict[str, Any]], leader: str | None,
                    fleet: dict[str, Any] | None) -> None:
    """Set each replica's ``schedule_differs``: its schedule fingerprint is not the leader's
    (or, with no leader, not the one the fleet last ran)."""
    ref = next((r["schedule"] for r in replicas if leader is not None and r["id"] == leader),
               None) or (fleet or {}).get("fingerprint")
    for r in replicas:
        r["schedule_differs"] = bool(ref) and r["schedule"] != ref


def gather(app: Any, store: Any, *, limit: int = 10,
           local: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The status of the beat fleet of ``store``'s namespace, as ``app`` schedules it.

    Args:
        app: the Celery app (its ``beat_schedule`` and ``crawl_schedule_paths``).
        store: an open lease store.
        limit: how many of the next fires to list (every entry's skips are counted anyway).
        local: the figures of the process serving the view (the page), if any.

    Raises:
        StoreError: the store could not be read (the CLI says so; the page shows it).
    """
    from ..beat.state import format_slot

    now = datetime.now(UTC)
    holder = store.holder(keys.BEAT_LEADER)
    left = store.lease_ttl_left(keys.BEAT_LEADER)
    leader = ({"holder": holder[0], "token": holder[1], "lease_time_left_s": left}
              if holder else None)
    presence = store.scan(keys.beat_presence(""))
    replicas = sorted((_replica(r) for r in presence.values()), key=lambda r: str(r["id"]))
    fleet = store.get(keys.BEAT_SCHEDULE)
    fleet = ({"fingerprint": fleet.get("fingerprint"), "entries": fleet.get("entries"),
              "since": fleet.get("since")} if isinstance(fleet, dict) else None)
    _mark_differing(replicas, holder[0] if holder else None, fleet)
    entries, errors = _entries(app, store, now, limit)
    skipped: dict[str, int] = {}
    for row in entries.pop("all"):
        for reason, count in row["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
    view: dict[str, Any] = {
        "generated": format_slot(now),
        "namespace": getattr(store, "namespace", None),
        "store": getattr(store, "url", None),
        "leader": leader,
        "schedule": fleet,
        "replicas": replicas,
        "entries_total": entries["total"],
        "next_fires": entries["next"],
        "skipped": dict(sorted(skipped.items())),
        "errors": errors,
    }
    if local is not None:
        view["process"] = local()
    return dict(scrub(view))


def preload() -> None:
    """Import what :func:`gather` imports lazily (the beat modules import this package)."""
    from ..beat import assembly, entries, state  # noqa: F401


def _entries(app: Any, store: Any, now: datetime,
             limit: int) -> tuple[dict[str, Any], list[str]]:
    from ..beat.assembly import assemble
    from ..beat.entries import zone_name, zoned
    from ..beat.state import EntryState, SkipLog, format_slot

    schedule = assemble(app)  # what the beat runs, the same way it assembles it
    defined = schedule.entries
    errors = schedule.errors
    names = sorted(defined)
    records = store.get_many([keys.beat_entry(n) for n in names]) if names else []
    skip_records = store.get_many([keys.beat_skips(n) for n in names]) if names else []
    rows: list[tuple[datetime | None, dict[str, Any]]] = []
    for name, rec, skip_rec in zip(names, records, skip_records, strict=True):
        entry = defined[name]
        st = None
        if rec:
            try:
                st = EntryState.from_record(rec, key=keys.beat_entry(name))
            except CrawlError as exc:
                errors.append(str(exc))
        try:
            totals = SkipLog.from_record(skip_rec, key=keys.beat_skips(name)).totals
        except CrawlError as exc:
            errors.append(str(exc))
            totals = {}
        start = max(now, st.last_slot) if st and st.last_slot else now
        nxt = entry.source.next_slot(start)
        paused = st.paused if st and st.paused is not None else entry.paused
        rows.append((nxt, {
            "name": name,
            "next_fire": format_slot(nxt) if nxt else None,
            "zone": zone_name(entry),
            "next_fire_local": zoned(entry, nxt) if nxt else None,
            "runs": st.run_count if st else 0,
            "last_run": format_slot(st.last_run_slot) if st and st.last_run_slot else None,
            "last_run_local": (zoned(entry, st.last_run_slot) if st and st.last_run_slot
                               else None),
            "paused": bool(paused),
            "skipped": dict(sorted(totals.items())),
        }))
    rows.sort(key=lambda r: (r[0] is None, r[0] or now))
    ordered = [row for _, row in rows]
    return {"total": len(ordered), "next": ordered[:limit], "all": ordered}, errors
