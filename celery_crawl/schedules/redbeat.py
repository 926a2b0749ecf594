"""RedBeat's entries as a schedule file: ``celery -A proj crawl schedules import redbeat``.

celery-redbeat keeps each entry in a Redis hash ``<prefix><name>`` (field ``definition``: JSON
with ``task``, ``schedule``, ``args``, ``kwargs``, ``options``, ``enabled``) and indexes the keys
in the sorted set ``<prefix>:schedule``. This module reads them with a plain Redis client (the
``redbeat`` package is not needed) and writes one ``[entries.<name>]`` table per entry:

* a ``crontab`` carries no zone in RedBeat (it runs in the app's ``timezone``): the entry gets
  ``tz`` = ``app.conf.timezone`` explicitly, and the file says so;
* an ``interval`` becomes the cron expression that fires at the same period when the period
  divides a minute, an hour or a day (runs are then aligned to the clock, not counted from the
  last run: the file says so); any other interval, and an ``rrule``, is refused with its reason;
* ``args``/``kwargs`` are kept; the options ``queue``, ``priority`` and ``expires`` (seconds) are
  kept; other options (``exchange``, ``routing_key``, ``headers`` ...) have no place in a schedule
  file and are listed in a comment above the entry; ``enabled = false`` becomes
  ``paused = true``.

:func:`dst_changes` lists, per fixed-time cron entry, the nights of the coming year whose wall
clock skips or repeats a time it fires at: stock beat skipped or doubled those runs, the
project's DST rule runs them once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from ..errors import ScheduleError, StoreError
from .tzcron import TzCron
from .zones import transition_between

__all__ = ["Converted", "dst_changes", "read_redbeat", "render_file"]

_NAME_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,199}")
_KEPT_OPTIONS = ("queue", "priority", "expires")


@dataclasses.dataclass
class Converted:
    """One RedBeat entry as a schedule-file table, or why it cannot be one.

    Attributes:
        name: the entry name in the file (RedBeat's, with characters a file refuses replaced).
        key: the Redis key it was read from.
        fields: the table's keys and values (empty when refused).
        notes: comment lines written above the table.
        refused: why the entry is not written (None when it is).
    """

    name: str
    key: str
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    refused: str | None = None


def _typed(obj: dict[str, Any]) -> Any:
    """RedBeat's JSON encoder tags schedules and datetimes with ``__type__``; keep the tag."""
    return obj


def _cron_of_interval(every_s: float) -> str | None:
    """The cron expression firing every ``every_s`` seconds, aligned to the clock, if any."""
    if every_s <= 0 or every_s != math.floor(every_s):
        return None
    n = int(every_s)
    if n < 60 and 60 % n == 0:
        return "* * * * * *" if n == 1 else f"*/{n} * * * * *"
    if n % 60 == 0 and n < 3600 and 60 % (n // 60) == 0:
        m = n // 60
        return "* * * * *" if m == 1 else f"*/{m} * * * *"
    if n % 3600 == 0 and n < 86400 and 24 % (n // 3600) == 0:
        h = n // 3600
        return "0 * * * *" if h == 1 else f"0 */{h} * * *"
    if n == 86400:
        return "0 0 * * *"
    return None


def _convert(key: str, name: str, definition: dict[str, Any], tz: str) -> Converted:
    out = Converted(name=name, key=key)
    if not _NAME_OK.fullmatch(name):
        out.name = re.sub(r"[^A-Za-z0-9_.:@-]", "-", name).lstrip("_.:@-")[:200] or "entry"
        out.notes.append(f"renamed from {name!r} (not a schedule-file entry name)")
    task = definition.get("task")
    if not isinstance(task, str) or not task:
        out.refused = "no task name"
        return out
    sched = definition.get("schedule")
    kind = sched.get("__type__") if isinstance(sched, dict) else None
    if kind == "crontab":
        assert isinstance(sched, dict)
        parts = [str(sched.get(f, "*")).replace(" ", "") or "*" for f in
                 ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")]
        cron = " ".join(parts)
    elif kind == "interval":
        assert isinstance(sched, dict)
        every = float(sched.get("every", 0))
        found = _cron_of_interval(every)
        if found is None:
            out.refused = (f"an interval of {every:g}s does not divide a minute, an hour or a "
                           "day, so no cron expression has its period; keep it in "
                           "beat_schedule as a Celery schedule")
            return out
        cron = found
        out.notes.append(f"was an interval of {every:g}s: now at fixed clock instants "
                         f"({cron!r}), not counted from the last run")
    else:
        out.refused = f"schedule type {kind or type(sched).__name__!r} has no cron equivalent"
        return out
    try:
        TzCron(cron, tz, name=out.name)
    except ScheduleError as exc:
        out.refused = f"cron {cron!r}: {exc}"
        return out
    out.fields = {"task": task, "cron": cron, "tz": tz}
    args, kwargs = definition.get("args") or [], definition.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        out.refused = "args must be a list and kwargs a mapping"
        return out
    if args:
        out.fields["args"] = args
    if kwargs:
        out.fields["kwargs"] = kwargs
    options = definition.get("options") or {}
    for opt, value in options.items():
        if opt == "queue" and isinstance(value, str) and value:
            out.fields["queue"] = value
        elif opt == "priority" and isinstance(value, int) and not isinstance(value, bool):
            out.fields["priority"] = value
        elif opt == "expires" and isinstance(value, int | float) and value > 0:
            out.fields["expires"] = f"{value:g}s"
        elif value is not None:
            out.notes.append(f"option {opt}={json.dumps(value, default=str)} dropped (a "
                             "schedule file has no place for it)")
    if definition.get("enabled") is False:
        out.fields["paused"] = True
    try:
        _toml_value(out.fields)
    except ValueError as exc:
        out.refused = str(exc)
        out.fields = {}
    return out


def read_redbeat(client: Any, prefix: str, tz: str) -> list[Converted]:
    """Every entry indexed under ``prefix`` (RedBeat's ``redbeat_key_prefix``), converted.

    Raises:
        StoreError: Redis failed.
    """
    import redis

    try:
        keys = [k.decode() if isinstance(k, bytes) else str(k)
                for k in client.zrange(f"{prefix}:schedule", 0, -1)]
        definitions = [client.hget(k, "definition") for k in keys]
    except redis.RedisError as exc:
        raise StoreError(f"reading RedBeat's entries under {prefix!r}: {exc}") from exc
    out: list[Converted] = []
    for key, raw in sorted(zip(keys, definitions, strict=True)):
        name = key[len(prefix):] if key.startswith(prefix) else key
        if raw is None:
            out.append(Converted(name=name, key=key, refused="no definition in its hash"))
            continue
        try:
            definition = json.loads(raw, object_hook=_typed)
        except ValueError as exc:
            out.append(Converted(name=name, key=key, refused=f"definition is not JSON ({exc})"))
            continue
        out.append(_convert(key, str(definition.get("name") or name), definition, tz))
    return out


# -- TOML ------------------------------------------------------------------------------------------
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} cannot be written to a schedule file")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's string escapes are TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    if value is None:
        raise ValueError("a null argument cannot be written to a schedule file (TOML has none)")
    raise ValueError(f"a {type(value).__name__} argument cannot be written to a schedule file")


def render_file(entries: list[Converted], *, tz: str, source: str) -> str:
    """The schedule file of the converted entries (refused ones as comments)."""
    lines = [
        f"# Imported from RedBeat ({source}).",
        f"# RedBeat's crontabs carry no zone: they ran in the app's timezone, {tz!r}, which",
        "# every entry below now names explicitly (tz). Change it per entry where a job",
        "# belongs to another zone.",
        "",
    ]
    for conv in entries:
        if conv.refused is not None:
            lines.append(f"# NOT IMPORTED {conv.name!r} ({conv.key}): {conv.refused}")
    if any(c.refused for c in entries):
        lines.append("")
    for conv in entries:
        if conv.refused is not None:
            continue
        lines += [f"# {note}" for note in conv.notes]
        lines.append(f"[entries.{json.dumps(conv.name)}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in conv.fields.items()]
        lines.append("")
    return "\n".join(lines)


# -- DST nights ------------------------------------------------------------------------------------
def _offset(naive_utc: datetime, zone: ZoneInfo) -> timedelta:
    return naive_utc.replace(tzinfo=UTC).astimezone(zone).utcoffset() or timedelta()


def _transitions(zone: ZoneInfo, start: datetime, days: int) -> list[datetime]:
    """The offset changes of ``zone`` (naive UTC) within ``days`` after ``start``."""
    out = []
    day = start.astimezone(UTC).replace(tzinfo=None, microsecond=0)
    for _ in range(days):
        nxt = day + timedelta(days=1)
        if _offset(day, zone) != _offset(nxt, zone):
            out.append(transition_between(day, nxt, zone))
        day = nxt
    return out


def dst_changes(cron: TzCron, *, start: datetime, days: int = 366) -> list[str]:
    """The DST nights within ``days`` of ``start`` on which ``cron`` fires at a wall time that
    is skipped or repeated: there, stock beat skipped or doubled the run; now it runs once.
    Wildcard jobs (which run every skipped or repeated time as it comes) have none."""
    from croniter import croniter

    if not cron.is_fixed_time:
        return []
    zone = cron.tz
    out: list[str] = []
    seconds = len(cron.expr.split()) == 6
    for t in _transitions(zone, start, days):
        before, after = _offset(t - timedelta(seconds=1), zone), _offset(t, zone)
        lo, hi = sorted((t + before, t + after))
        step = timedelta(seconds=1 if seconds else 60)
        wall = lo
        while wall < hi:
            if croniter.match(cron.expr, wall):
                gap = after > before
                what = ("does not exist: stock beat could skip the run; now it runs once at "
                        "the jump" if gap else
                        "happens twice: stock beat could run it twice; now it runs once "
                        "(first pass)")
                out.append(f"{wall:%Y-%m-%d %H:%M} {zone.key} {what}")
                break
            wall += step
    return out
