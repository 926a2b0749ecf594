"""TzCron agrees exactly with the brute-force reference around real zone transitions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from hypothesis import event, given, settings
from hypothesis import strategies as st

from celery_crawl.schedules import TzCron

from .reference import RefCron, reference_fires, transitions_in_year

# Zones with unusual transitions, zones whose rules changed, and ordinary ones, each with years
# in which something happened.
ZONES: dict[str, tuple[int, ...]] = {
    "Australia/Lord_Howe": (1985, 2008, 2024, 2030),  # 30-minute DST
    "Antarctica/Troll": (2005, 2015, 2025),           # 2-hour DST (+00 <-> +02)
    "Europe/Dublin": (1971, 1995, 2024, 2031),        # negative DST in tzdata (IST standard)
    "Pacific/Apia": (2010, 2011, 2012, 2021),         # skipped 30 Dec 2011; DST abolished 2021
    "Europe/Moscow": (2010, 2011, 2014),              # permanent +4 in 2011, back to +3 in 2014
    "America/Caracas": (2007, 2016),                  # -04:30 from 2007 to 2016
    "Asia/Pyongyang": (2015, 2018),                   # -30 min in 2015, back in 2018
    "America/Sao_Paulo": (2017, 2018, 2019),          # DST at midnight; abolished 2019
    "America/Havana": (2012, 2024),                   # DST at 00:00 / 01:00
    "America/St_Johns": (1995, 2010, 2024),           # transitions at 00:01 until 2011
    "Asia/Kathmandu": (1986,),                        # +05:30 -> +05:45
    "Pacific/Chatham": (2024,),                       # +12:45 / +13:45
    "Africa/Casablanca": (2019, 2024),                # Ramadan: clocks back then forward
    "America/Mexico_City": (2021, 2022),              # DST abolished 2022
    "America/Nuuk": (2022, 2023, 2024),               # -03 -> -02 standard in 2023
    "Europe/Volgograd": (2018, 2020),                 # +4 and back to +3
    "America/New_York": (2007, 2024, 2026),
    "Europe/Berlin": (1996, 2024, 2026),
    "Asia/Shanghai": (1988, 2024),                    # DST 1986-1991
    "Asia/Kolkata": (2024,),                          # nothing happens
}


def _values(draw: st.DrawFn, lo: int, hi: int, near: list[int]) -> str:
    """One non-star field item, biased towards values near the transition."""
    pick = st.one_of(st.sampled_from(sorted({v for v in near if lo <= v <= hi})),
                     st.integers(lo, hi))
    kind = draw(st.sampled_from(["value", "value", "range", "list", "range_step"]))
    if kind == "value":
        return str(draw(pick))
    if kind == "list":
        items = draw(st.lists(pick, min_size=2, max_size=4, unique=True))
        return ",".join(str(v) for v in sorted(items))
    a = draw(pick)
    b = draw(st.integers(a, min(hi, a + draw(st.integers(0, hi - lo)))))
    if kind == "range":
        return f"{a}-{b}"
    return f"{a}-{b}/{draw(st.integers(1, max(1, b - a + 1)))}"


def _field(draw: st.DrawFn, lo: int, hi: int, near: list[int], star_weight: int) -> str:
    choice = draw(st.integers(0, 9))
    if choice < star_weight:
        return "*"
    if choice == star_weight:
        return f"*/{draw(st.integers(1, hi - lo))}"
    return _values(draw, lo, hi, near)


@st.composite
def window_and_expr(draw: st.DrawFn, seconds: bool) -> tuple[str, str, datetime, datetime]:
    zone = draw(st.sampled_from(sorted(ZONES)))
    year = draw(st.sampled_from(ZONES[zone]))
    transitions = transitions_in_year(zone, year)
    if transitions:
        center = draw(st.sampled_from(transitions))
    else:
        center = datetime(year, draw(st.integers(1, 12)), 15, 1, tzinfo=UTC)
    if seconds:
        before = timedelta(seconds=draw(st.integers(0, 25 * 60)))
        after = timedelta(seconds=draw(st.integers(1, 25 * 60)))
    else:
        before = timedelta(minutes=draw(st.integers(0, 9 * 60)))
        after = timedelta(minutes=draw(st.integers(1, 9 * 60)))
    start = center - before - timedelta(microseconds=draw(st.sampled_from([0, 1, 500_000])))
    end = center + after
    tz = ZoneInfo(zone)
    walls_at = [(center + d).astimezone(tz) for d in (timedelta(seconds=-1), timedelta(0))]
    hours = sorted({h % 24 for w in walls_at for h in (w.hour - 1, w.hour, w.hour + 1)})
    minutes = sorted({m for w in walls_at for m in (w.minute, (w.minute + 15) % 60,
                                                 (w.minute + 30) % 60, 59, 0)})
    days = sorted({w.day for w in walls_at})
    dows = sorted({w.isoweekday() % 7 for w in walls_at} | {7})
    off_before = walls_at[0].utcoffset()
    off_after = walls_at[1].utcoffset()
    assert off_before is not None and off_after is not None
    if off_after > off_before and draw(st.booleans()):
        # aim a fixed-time job at a wall time that the jump skips
        skipped = (center + off_before).replace(tzinfo=None) + timedelta(
            seconds=draw(st.integers(0, int((off_after - off_before).total_seconds()) - 1)))
        minute, hour = str(skipped.minute), str(skipped.hour)
        if seconds:
            minutes, hours = [skipped.minute], [skipped.hour]
    elif off_after < off_before and draw(st.booleans()):
        # aim at a wall time shown twice; a wildcard minute keeps the job wildcard sometimes
        repeated = (center + off_after).replace(tzinfo=None) + timedelta(
            seconds=draw(st.integers(0, int((off_before - off_after).total_seconds()) - 1)))
        minute = draw(st.sampled_from([str(repeated.minute), "*/10", f"{repeated.minute},*/7"]))
        minute = minute if not minute.endswith("*/7") else "*/7"
        hour = str(repeated.hour)
        if seconds:
            minutes, hours = [repeated.minute], [repeated.hour]
            # a short window that still holds both passes of the repeated wall time
            start = (repeated - off_before).replace(tzinfo=UTC) - timedelta(
                seconds=draw(st.integers(0, 300)))
            end = (repeated - off_after).replace(tzinfo=UTC) + timedelta(
                seconds=draw(st.integers(1, 300)))
    elif draw(st.booleans()):  # fixed-time
        minute = _values(draw, 0, 59, minutes)
        hour = _values(draw, 0, 23, hours)
    else:
        minute = _field(draw, 0, 59, minutes, star_weight=4)
        hour = "*" if minute[0] != "*" else _field(draw, 0, 23, hours, star_weight=4)
    dom = draw(st.sampled_from(["*"] * 6 + [_values(draw, 1, 31, days), "*/2"]))
    month = draw(st.sampled_from(["*"] * 6 + [f"{walls_at[0].month}", "1-6", "7-12"]))
    dow = draw(st.sampled_from(["*"] * 6 + [_values(draw, 0, 7, dows), "1-5"]))
    fields = [minute, hour, dom, month, dow]
    if seconds:
        sec_near = sorted({walls_at[1].second, 0, 30, 59})
        if not any(c in minute for c in "*-/,") and draw(st.booleans()):
            sec_near = [draw(st.integers(0, 59))]
        fields.insert(0, _field(draw, 0, 59, sec_near, star_weight=1))
    return " ".join(fields), zone, start, end


def _check(expr: str, zone: str, start: datetime, end: datetime, gap: str, fold: str,
           probes: list[float]) -> None:
    tz = ZoneInfo(zone)
    expected = reference_fires(expr, tz, start, end, gap=gap, fold=fold)
    cron = TzCron(expr, zone, gap=gap, fold=fold)
    got = list(cron.slots(start, end))
    assert got == expected, (expr, zone, start, end, gap, fold)
    event(f"fixed={cron.is_fixed_time}")
    event(f"fires={'0' if not got else '1-3' if len(got) < 4 else '4+'}")
    walls = [f.astimezone(tz).replace(tzinfo=None) for f in got]
    if len(set(walls)) < len(walls):
        event("a wall time fired twice (fold)")
    ref = RefCron(expr)
    if any(not ref.matches(w) for w in walls):
        event("a fire at a transition instant (gap shift)")
    # next_slot from arbitrary instants (inside folds too) agrees with the reference.
    span = (end - start).total_seconds()
    for fraction in probes:
        after = start + timedelta(seconds=span * fraction)
        want = next((f for f in expected if f > after), None)
        if want is not None:
            assert cron.next_slot(after) == want, (expr, zone, after, gap, fold)
        assert cron.next_fire(after) == cron.next_slot(after)


POLICIES = st.tuples(st.sampled_from(["shift", "skip"]),
                     st.sampled_from(["first", "last", "both"]))
PROBES = st.lists(st.floats(0, 1), min_size=1, max_size=4)


@settings(max_examples=800)
@given(case=window_and_expr(seconds=False), policies=POLICIES, probes=PROBES)
def test_five_field_matches_reference(case, policies, probes):
    expr, zone, start, end = case
    _check(expr, zone, start, end, *policies, probes)


@settings(max_examples=250)
@given(case=window_and_expr(seconds=True), policies=POLICIES, probes=PROBES)
def test_six_field_matches_reference(case, policies, probes):
    expr, zone, start, end = case
    _check(expr, zone, start, end, *policies, probes)
