"""django-celery-beat ``PeriodicTask`` rows as beat entries, keeping django-celery-beat's meaning.

A row arrives as a plain mapping (the database module reads it; nothing here imports Django),
so the rules can be read and tested in one place:

* a ``crontab`` row becomes a :class:`~celery_crawl.schedules.TzCron` in the row's own
  ``timezone``, so it follows the project's DST rule (a fixed-time run in a spring-forward gap
  fires once at the jump, a fall-back hour runs it once) instead of django-celery-beat's;
* an ``interval`` row runs every ``every`` ``period`` (Celery's ``schedule``);
* a ``clocked`` row is one run at ``clocked_time`` (an instant already past when the beat first
  reads the row is not run: there is no slot after it);
* a ``solar`` row runs Celery's ``solar`` (which needs the ``ephem`` package; without it the row
  is refused with that reason);
* ``start_time``: no slot before it; ``expires``: no slot at or after it, and, as in
  django-celery-beat, the message expires then too (``expire_seconds``: the message expires that
  long after it is sent); ``queue``, ``exchange``, ``routing_key``, ``priority`` and ``headers``
  are publish options; ``args``/``kwargs`` are JSON; the ``periodic_task_name`` header is set as
  django-celery-beat sets it.

A row that cannot be used raises :class:`RowError` naming the row and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from ...errors import ScheduleError
from ...schedules import TzCron
from ...schedules.fingerprint import SHORT, fingerprint
from ...schedules.policies import DEFAULT_CATCHUP, DEFAULT_OVERLAP
from ..entries import BeatEntry, CelerySlotSource

__all__ = ["ORIGIN", "RowError", "entry_from_row"]

#: ``BeatEntry.origin`` of every row's entry (status, duplicates and the write-back use it).
ORIGIN = "django_celery_beat"

_PERIODS = ("days", "hours", "minutes", "seconds", "microseconds")


class RowError(ScheduleError):
    """A ``PeriodicTask`` row that cannot be run; the message names the row and the field."""


def _where(row: Mapping[str, Any], field: str | None = None) -> str:
    where = f"PeriodicTask {row.get('name')!r} (id {row.get('id')})"
    return f"{where}, field {field!r}" if field else where


def _aware(value: Any, row: Mapping[str, Any], field: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise RowError(f"{_where(row, field)}: {value!r} is not a datetime")
    # Django stores aware datetimes with USE_TZ; a naive one is UTC, as Celery assumes.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _json(row: Mapping[str, Any], field: str, kind: type, default: Any) -> Any:
    text = row.get(field)
    if text in (None, ""):
        return default
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise RowError(f"{_where(row, field)}: not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise RowError(f"{_where(row, field)}: expected a JSON {kind.__name__}, got "
                       f"{type(value).__name__}")
    return value


class Bounded:
    """A slot source limited to ``[start, end)``: ``start_time`` and ``expires`` of a row."""

    def __init__(self, inner: Any, start: datetime | None, end: datetime | None) -> None:
        self.inner, self.start, self.end = inner, start, end
        self._interval = isinstance(inner, CelerySlotSource) and inner._interval_s is not None

    def next_slot(self, after: datetime) -> datetime | None:
        if self.start is not None and after < self.start:
            if self._interval:  # django-celery-beat runs an interval row at its start_time
                nxt: datetime | None = self.start.astimezone(UTC).replace(microsecond=0)
                if nxt is not None and nxt < self.start:
                    nxt += timedelta(seconds=1)
            else:
                nxt = self.inner.next_slot(self.start - timedelta(microseconds=1))
        else:
            nxt = self.inner.next_slot(after)
        if nxt is not None and self.end is not None and nxt >= self.end:
            return None
        return nxt

    def fire_time(self, slot: datetime) -> datetime:
        fire = getattr(self.inner, "fire_time", None)
        return fire(slot) if fire is not None else slot

    def __repr__(self) -> str:
        return f"Bounded({self.inner!r}, start={self.start}, end={self.end})"


class Clocked:
    """One slot: a ``clocked`` row's instant."""

    def __init__(self, when: datetime) -> None:
        self.when = when.astimezone(UTC).replace(microsecond=0)

    def next_slot(self, after: datetime) -> datetime | None:
        return self.when if self.when > after else None

    def fire_time(self, slot: datetime) -> datetime:
        return slot

    def __repr__(self) -> str:
        return f"Clocked({self.when:%Y-%m-%dT%H:%M:%SZ})"


def _cron_expr(row: Mapping[str, Any]) -> str:
    fields = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    # django-celery-beat's own rendering (``cronexp``): spaces removed, empty means ``*``.
    return " ".join((str(row.get(f) or "").replace(" ", "") or "*") for f in fields)


def _schedule(row: Mapping[str, Any], app: Any) -> tuple[Any, str]:
    """The slot source of the row's schedule and the text its fingerprint covers."""
    kind = row.get("kind")
    if kind == "crontab":
        expr, zone = _cron_expr(row), str(row.get("timezone") or "UTC")
        try:
            cron = TzCron(expr, zone, name=str(row["name"]))
        except ScheduleError as exc:
            raise RowError(f"{_where(row, 'crontab')}: {exc}") from None
        return cron, cron.fingerprint()
    if kind == "interval":
        from celery.schedules import schedule

        period, every = row.get("period"), row.get("every")
        if period not in _PERIODS or not isinstance(every, int) or every < 1:
            raise RowError(f"{_where(row, 'interval')}: every={every!r} period={period!r} is "
                           f"not an interval (a positive count of {', '.join(_PERIODS)})")
        run_every = timedelta(**{str(period): every})
        if run_every < timedelta(seconds=1):
            raise RowError(f"{_where(row, 'interval')}: {run_every} is shorter than the "
                           "beat's one-second slots")
        return CelerySlotSource(schedule(run_every, app=app)), f"interval {run_every}"
    if kind == "clocked":
        when = _aware(row.get("clocked_time"), row, "clocked")
        if when is None:
            raise RowError(f"{_where(row, 'clocked')}: no clocked_time")
        return Clocked(when), f"clocked {when.isoformat()}"
    if kind == "solar":
        from celery.exceptions import ImproperlyConfigured
        from celery.schedules import solar

        event, lat, lon = row.get("event"), row.get("latitude"), row.get("longitude")
        try:
            sched = solar(str(event), float(lat), float(lon), app=app)  # type: ignore[arg-type]
        except (ImportError, ImproperlyConfigured):  # Celery's word for "ephem is missing"
            raise RowError(f"{_where(row, 'solar')}: solar schedules need the ephem package "
                           "(pip install ephem)") from None
        except (ValueError, TypeError) as exc:
            raise RowError(f"{_where(row, 'solar')}: {exc}") from None
        return CelerySlotSource(sched), f"solar {event} {lat} {lon}"
    raise RowError(f"{_where(row)}: no schedule (one of crontab, interval, clocked, solar)")


def entry_from_row(row: Mapping[str, Any], app: Any) -> BeatEntry:
    """The beat entry of one enabled ``PeriodicTask`` row.

    Raises:
        RowError: naming the row and the field that cannot be used.
    """
    task = row.get("task")
    if not isinstance(task, str) or not task:
        raise RowError(f"{_where(row, 'task')}: no task name")
    args = _json(row, "args", list, [])
    kwargs = _json(row, "kwargs", dict, {})
    headers = _json(row, "headers", dict, {})
    source, sched_text = _schedule(row, app)
    start = _aware(row.get("start_time"), row, "start_time")
    end = _aware(row.get("expires"), row, "expires")
    if start is not None or end is not None:
        source = Bounded(source, start, end)
    options: dict[str, Any] = {}
    for field in ("queue", "exchange", "routing_key", "priority"):
        if row.get(field) not in (None, ""):
            options[field] = row[field]
    expires_s: float | None = None
    if end is not None:
        options["expires"] = end
    elif row.get("expire_seconds"):
        expires_s = float(row["expire_seconds"])
        options["expires"] = expires_s
    options["headers"] = {**headers, "periodic_task_name": row["name"]}
    fp = fingerprint({"task": task, "schedule": sched_text, "args": args, "kwargs": kwargs,
                      "options": {k: (v.isoformat() if isinstance(v, datetime) else v)
                                  for k, v in options.items()},
                      "start": start.isoformat() if start else None,
                      "one_off": bool(row.get("one_off"))}, digits=SHORT)
    return BeatEntry(name=str(row["name"]), task=task, source=source,
                     fire_time=getattr(source, "fire_time", lambda s: s),
                     args=tuple(args), kwargs=kwargs, options=options,
                     overlap=DEFAULT_OVERLAP, catchup=DEFAULT_CATCHUP, paused=False,
                     fingerprint=fp, origin=ORIGIN, expires_s=expires_s)
