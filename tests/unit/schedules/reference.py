"""A brute-force reference for the DST rule, written independently of the implementation.

It walks every minute (every second for 6-field expressions) of real time in a window, maps
each instant to wall time with zoneinfo, matches the wall time against the expression with its
own small matcher (no croniter) and applies the rule of DESIGN.md literally:

* fixed-time job: neither minute nor hour field starts with ``*``;
* a matching wall time seen once fires at that instant;
* a matching wall time seen twice (fold): wildcard jobs fire both times; fixed-time jobs per
  ``fold`` (first / last / both);
* wall times that never occur (gap): a fixed-time job with ``gap="shift"`` and at least one
  matching skipped wall time fires once at the transition instant.

Only the plain cron grammar is supported: ``*``, numbers, ``a-b``, steps, lists.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

_RANGES = {"second": (0, 59), "minute": (0, 59), "hour": (0, 23), "dom": (1, 31),
           "month": (1, 12), "dow": (0, 7)}


def expand_field(text: str, kind: str) -> frozenset[int]:
    lo, hi = _RANGES[kind]
    out: set[int] = set()
    for part in text.split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/")
            step = int(step_text)
        if part == "*":
            a, b = lo, hi
        elif "-" in part:
            a_text, b_text = part.split("-")
            a, b = int(a_text), int(b_text)
        else:
            a = int(part)
            b = hi if step != 1 else a
        out.update(range(a, b + 1, step))
    if kind == "dow" and 7 in out:
        out.discard(7)
        out.add(0)
    return frozenset(out)


class RefCron:
    """Matcher for plain cron syntax with Vixie's day-of-month / day-of-week rule."""

    def __init__(self, expr: str) -> None:
        fields = expr.split()
        self.has_seconds = len(fields) == 6
        if not self.has_seconds:
            fields = ["0", *fields]
        sec, minute, hour, dom, month, dow = fields
        self.sec = expand_field(sec, "second")
        self.minute = expand_field(minute, "minute")
        self.hour = expand_field(hour, "hour")
        self.dom = expand_field(dom, "dom")
        self.month = expand_field(month, "month")
        self.dow = expand_field(dow, "dow")
        self.dom_star = dom.startswith("*")
        self.dow_star = dow.startswith("*")
        self.fixed = not minute.startswith("*") and not hour.startswith("*")
        self.step = timedelta(seconds=1 if self.has_seconds else 60)

    def matches(self, w: datetime) -> bool:
        if w.second not in self.sec or w.minute not in self.minute or w.hour not in self.hour:
            return False
        if w.month not in self.month:
            return False
        dom_ok = w.day in self.dom
        dow_ok = (w.isoweekday() % 7) in self.dow
        if self.dom_star or self.dow_star:
            return dom_ok and dow_ok
        return dom_ok or dow_ok


def _offset(u: datetime, tz: ZoneInfo) -> timedelta:
    off = u.astimezone(tz).utcoffset()
    assert off is not None
    return off


def _floor(u: datetime, step: timedelta) -> datetime:
    seconds = int(step.total_seconds())
    ts = int(u.timestamp())
    return datetime.fromtimestamp(ts - ts % seconds, UTC)


def _gap_transitions(start: datetime, end: datetime, tz: ZoneInfo) -> Iterator[
        tuple[datetime, timedelta, timedelta]]:
    """(T, offset before, offset after) for every forward jump with T in (start, end]."""
    u = _floor(start, timedelta(seconds=60))
    one = timedelta(seconds=1)
    prev = _offset(u, tz)
    while u < end + timedelta(minutes=1):
        nxt = u + timedelta(minutes=1)
        off = _offset(nxt, tz)
        if off != prev:
            # walk the minute second by second: transitions fall on whole seconds
            t = u + one
            while _offset(t, tz) == prev:
                t += one
            if off > prev and start < t <= end:
                yield t, prev, off
            prev = off
        u = nxt


def reference_fires(expr: str, tz: ZoneInfo, start: datetime, end: datetime, *,
                    gap: str = "shift", fold: str = "first") -> list[datetime]:
    """Every nominal slot in ``(start, end]`` by brute force, sorted, aware UTC."""
    cron = RefCron(expr)
    fires: set[datetime] = set()
    u = _floor(start, cron.step) + cron.step
    while u <= end:
        local = u.astimezone(tz)
        wall = local.replace(tzinfo=None)
        if u > start and cron.matches(wall):
            first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
            second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
            seen_once = first == second
            on_allowed_pass = fold == "both" or (fold == "first") == (u == first)
            if seen_once or not cron.fixed or on_allowed_pass:
                fires.add(u)
        u += cron.step
    if cron.fixed and gap == "shift":
        for t, before, after in _gap_transitions(start, end, tz):
            w = (t + before).replace(tzinfo=None)
            w_end = (t + after).replace(tzinfo=None)
            w = _floor(w.replace(tzinfo=UTC), cron.step).replace(tzinfo=None)
            if w < (t + before).replace(tzinfo=None):
                w += cron.step
            while w < w_end:
                if cron.matches(w):
                    fires.add(t)
                    break
                w += cron.step
    return sorted(fires)


@functools.lru_cache(maxsize=512)
def transitions_in_year(zone: str, year: int) -> tuple[datetime, ...]:
    """Every UTC instant in ``year`` at which ``zone``'s UTC offset changes."""
    tz = ZoneInfo(zone)
    u = datetime(year, 1, 1, tzinfo=UTC)
    end = datetime(year + 1, 1, 1, tzinfo=UTC)
    step = timedelta(hours=3)
    out = []
    prev = _offset(u, tz)
    while u < end:
        nxt = u + step
        off = _offset(nxt, tz)
        if off != prev:
            lo, hi = u, nxt
            while hi - lo > timedelta(seconds=1):
                mid = lo + (hi - lo) / 2
                mid = mid.replace(microsecond=0)
                if _offset(mid, tz) == prev:
                    lo = mid
                else:
                    hi = mid
            out.append(hi)
            prev = off
        u = nxt
    return tuple(out)
