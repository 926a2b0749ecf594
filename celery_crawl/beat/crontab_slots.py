"""Slots of a stock Celery ``crontab``, computed here instead of by Celery.

Celery before 5.7 answers ``crontab.remaining_estimate(after)`` correctly only while ``after`` lies
within about a day of now, so a catch-up over a longer gap picked the wrong slots, and two beat
replicas on different Celery versions could disagree on an entry's slots. A crontab's expanded
fields (sets of integers, the same on every Celery 5.x) are turned into a cron pattern and walked
with the project's slot rule in the crontab's zone: the slots depend on the schedule alone.

Celery ANDs a restricted ``day_of_month`` with a restricted ``day_of_week`` where cron ORs them;
that case walks the day-of-month pattern and keeps the slots that fall on a listed weekday.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from ..errors import ScheduleError
from ..schedules.cron import cron_expr
from ..schedules.slots import SlotRule

__all__ = ["CrontabSlots", "crontab_zone"]

_FULL = {
    "minute": range(60),
    "hour": range(24),
    "day_of_month": range(1, 32),
    "month_of_year": range(1, 13),
    "day_of_week": range(7),
}
# Slots tried while looking for one on a listed weekday: every pairing of a day of month with a
# weekday recurs within 28 years of months, far fewer steps than this.
_MAX_WEEKDAY_STEPS = 20_000


def crontab_zone(schedule: Any) -> ZoneInfo:
    """The IANA zone a crontab's fields are read in (Celery: the app's ``timezone``).

    Raises:
        ScheduleError: when the zone is not an IANA zone (a local-time zone object), since the
            DST rule needs the zone's transitions.
    """
    tz = schedule.tz
    if isinstance(tz, ZoneInfo):
        return tz
    if tz is UTC or tz == UTC:
        return ZoneInfo("UTC")
    key = getattr(tz, "key", None) or getattr(tz, "zone", None)
    if isinstance(key, str):
        try:
            return ZoneInfo(key)
        except (ValueError, OSError) as exc:
            raise ScheduleError(f"{schedule!r}: zone {key!r}: {exc}") from exc
    raise ScheduleError(
        f"{schedule!r}: its zone {tz!r} is not an IANA zone; set app.conf.timezone "
        "(e.g. 'Europe/Berlin') or use TzCron with an explicit tz")


def _field(values: Any, name: str) -> str:
    found = sorted(int(v) for v in values)
    if not found:
        raise ScheduleError(f"crontab field {name} is empty")
    if found == list(_FULL[name]):
        return "*"
    return ",".join(str(v) for v in found)


class CrontabSlots:
    """``next_slot(after)`` of a Celery ``crontab``: the first due instant after ``after``."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        zone = crontab_zone(schedule)
        minute = _field(schedule.minute, "minute")
        hour = _field(schedule.hour, "hour")
        dom = _field(schedule.day_of_month, "day_of_month")
        month = _field(schedule.month_of_year, "month_of_year")
        dow = _field(schedule.day_of_week, "day_of_week")
        self._weekdays: frozenset[int] | None = None
        if dom != "*" and dow != "*":
            self._weekdays = frozenset(int(v) for v in dow.split(","))
            dow = "*"
        try:
            self._rule = SlotRule(cron_expr(f"{minute} {hour} {dom} {month} {dow}"), zone)
        except ScheduleError as exc:
            raise ScheduleError(f"{schedule!r}: {exc}") from exc

    def next_slot(self, after: datetime) -> datetime:
        slot = self._rule.next_slot(after)
        if self._weekdays is None:
            return slot
        for _ in range(_MAX_WEEKDAY_STEPS):
            # Celery numbers weekdays from Sunday = 0, as isoweekday() % 7 does.
            if slot.astimezone(self._rule.tz).isoweekday() % 7 in self._weekdays:
                return slot
            slot = self._rule.next_slot(slot)
        raise ScheduleError(f"{self.schedule!r}: no day matches both its day_of_month and "
                            "day_of_week")

    def __repr__(self) -> str:
        return f"CrontabSlots({self.schedule!r})"
