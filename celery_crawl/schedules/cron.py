"""Cron expressions read as *wall-clock* patterns, with croniter underneath.

A :class:`CronExpr` knows nothing about time zones: it answers "which wall-clock times match",
iterating naive datetimes. Mapping wall times to real instants (and the DST rule) is the job of
:mod:`celery_crawl.schedules.slots`, which keeps the two concerns testable on their own.
"""

from __future__ import annotations

import copy
import functools
import re
from datetime import datetime

from croniter import CroniterError, croniter

from ..errors import ScheduleError

__all__ = ["ALIASES", "CronExpr", "cron_expr"]

#: The ``@`` shorthands, expanded here rather than by croniter because croniter turns them into
#: hashed (``H``) expressions whenever a hash id is given, which would silently move an entry's
#: ``@daily`` run away from midnight just because the entry has a name.
ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

_PROBE = datetime(2000, 1, 1)
# A range whose two ends are equal ("5-5", "mon-mon", "3-3/2").
_EQUAL_RANGE = re.compile(r"([0-9A-Za-z]+)-([0-9A-Za-z]+)(/[0-9]+)?")
# A bare 'H' token (not the H inside a day name such as THU).
_HASH = re.compile(r"(?<![A-Z])H(?![A-Z])")


class CronExpr:
    """A validated 5-field (minute first) or 6-field (seconds first) cron expression.

    Day-of-month and day-of-week are ORed only when neither field starts with ``*`` (so ``*/2``
    counts as unrestricted), exactly as Vixie cron and cronie do; croniter's default would OR
    ``*/2`` with a weekday list, which is not what a crontab user expects.

    Raises:
        ScheduleError: naming the expression and the reason (field count, a bad field, a zone
            prefix, ``@reboot``, ``H`` without an entry name, or a pattern that never matches).
    """

    __slots__ = ("_base", "expr", "fields", "has_seconds", "is_fixed_time")

    def __init__(self, expr: object, *, hash_id: str | None = None) -> None:
        if not isinstance(expr, str):
            raise ScheduleError(f"cron expression must be a string, got {type(expr).__name__}")
        text = " ".join(expr.split())
        if not text:
            raise ScheduleError("cron expression is empty")
        upper = text.upper()
        if upper.startswith(("CRON_TZ=", "TZ=")):
            raise ScheduleError(
                f"cron {expr!r}: a CRON_TZ=/TZ= prefix is not supported; "
                "give the zone separately (tz = 'Area/City')"
            )
        if text.startswith("@"):
            alias = ALIASES.get(text.lower())
            if alias is None:
                raise ScheduleError(
                    f"cron {expr!r}: unknown shorthand (known: {', '.join(sorted(ALIASES))}; "
                    "@reboot has no meaning for a scheduler)"
                )
            text = alias
        fields = tuple(_normalize_field(f) for f in text.split(" "))
        text = " ".join(fields)
        if len(fields) not in (5, 6):
            raise ScheduleError(
                f"cron {expr!r}: expected 5 fields (minute hour day month weekday) or 6 "
                f"(second first), got {len(fields)}"
            )
        has_seconds = len(fields) == 6
        minute, hour = fields[1:3] if has_seconds else fields[0:2]
        uses_hash = _HASH.search(text.upper()) is not None
        if uses_hash and not hash_id:
            raise ScheduleError(f"cron {expr!r}: 'H' needs an entry name to hash on")
        try:
            base = croniter(
                text,
                _PROBE,
                hash_id=hash_id if uses_hash else None,
                second_at_beginning=has_seconds,
                implement_cron_bug=True,
            )
        except (CroniterError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise ScheduleError(f"cron {expr!r}: {exc}") from exc
        self.expr = expr.strip()
        self.fields = fields
        self.has_seconds = has_seconds
        # cronie's test: a job is "wildcard" when its minute or hour field starts with '*'.
        self.is_fixed_time = not minute.startswith("*") and not hour.startswith("*")
        self._base = base
        try:
            self.next_wall(_PROBE)
        except ScheduleError as exc:
            raise ScheduleError(f"cron {expr!r}: never matches any date") from exc

    def iter_walls(self, after: datetime) -> croniter:
        """A fresh croniter positioned at the naive wall time ``after`` (exclusive).

        A shallow copy of the pre-parsed instance: parsing once and copying is several times
        cheaper than parsing per call, and each caller gets its own cursor (thread-safe).
        """
        it = copy.copy(self._base)
        it.set_current(after.replace(tzinfo=None), force=True)
        return it

    def next_wall(self, after: datetime) -> datetime:
        """The first matching wall time strictly after the naive wall time ``after``.

        Raises:
            ScheduleError: when nothing matches within croniter's search horizon.
        """
        return wall_next(self.iter_walls(after), self.expr)

    def __repr__(self) -> str:
        return f"CronExpr({self.expr!r})"


@functools.lru_cache(maxsize=4096)
def _cached(expr: str, hash_id: str | None) -> CronExpr:
    return CronExpr(expr, hash_id=hash_id)


def cron_expr(expr: object, *, hash_id: str | None = None) -> CronExpr:
    """A shared :class:`CronExpr` (they are immutable): fleets reuse a few expressions, and
    parsing is most of the cost of building a schedule.

    Raises:
        ScheduleError: as :class:`CronExpr` does.
    """
    if not isinstance(expr, str):
        return CronExpr(expr, hash_id=hash_id)
    # The hash id only matters when the expression can contain an 'H'.
    return _cached(expr, hash_id if "H" in expr.upper() else None)


def _normalize_field(field: str) -> str:
    """Rewrite equal ranges ("5-5") to the single value, as cron reads them.

    croniter widens an equal range to the whole field ("5-5" would fire every minute), which
    is the opposite of what the expression says.
    """
    items = []
    for item in field.split(","):
        match = _EQUAL_RANGE.fullmatch(item)
        if match:
            a, b = match.group(1), match.group(2)
            same = int(a) == int(b) if a.isdigit() and b.isdigit() else a.lower() == b.lower()
            if same:
                item = a
        items.append(item)
    return ",".join(items)


def wall_next(it: croniter, expr: str) -> datetime:
    """Advance ``it`` to its next naive wall time, translating croniter's failures."""
    try:
        value: datetime = it.get_next(datetime)
    except (CroniterError, OverflowError, ValueError) as exc:
        raise ScheduleError(f"cron {expr!r}: no further matching time ({exc})") from exc
    return value
