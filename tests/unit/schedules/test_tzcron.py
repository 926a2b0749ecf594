"""TzCron: worked DST examples, errors, jitter, serialisation and the BaseSchedule interface."""

from __future__ import annotations

import itertools
import json
import pickle
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import BaseSchedule
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_crawl.errors import CrawlError, ScheduleError
from celery_crawl.schedules import TzCron, task_id_for

from .reference import reference_fires


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def local_slots(cron: TzCron, start: datetime, end: datetime) -> list[str]:
    return [f"{s.astimezone(cron.tz):%m-%d %H:%M%z}" for s in cron.slots(start, end)]


# -- worked examples (the ones in docs/schedules.md) -------------------------------------

NY_SPRING = (utc(2024, 3, 9, 12), utc(2024, 3, 11, 12))   # 2024-03-10 02:00 EST -> 03:00 EDT
NY_FALL = (utc(2024, 11, 2, 12), utc(2024, 11, 4, 12))    # 2024-11-03 02:00 EDT -> 01:00 EST


@pytest.mark.parametrize(
    ("expr", "kwargs", "window", "expected"),
    [
        # fixed-time job in the gap: once, at the jump (03:00 EDT), then normally
        ("30 2 * * *", {}, NY_SPRING, ["03-10 03:00-0400", "03-11 02:30-0400"]),
        ("30 2 * * *", {"gap": "skip"}, NY_SPRING, ["03-11 02:30-0400"]),
        # several skipped times still fire once
        ("0,15,30,45 2 * * *", {}, NY_SPRING,
         ["03-10 03:00-0400", "03-11 02:00-0400", "03-11 02:15-0400", "03-11 02:30-0400",
          "03-11 02:45-0400"]),
        # fixed-time job in the fold: first pass only by default
        ("30 1 * * *", {}, NY_FALL, ["11-03 01:30-0400", "11-04 01:30-0500"]),
        ("30 1 * * *", {"fold": "last"}, NY_FALL, ["11-03 01:30-0500", "11-04 01:30-0500"]),
        ("30 1 * * *", {"fold": "both"}, NY_FALL,
         ["11-03 01:30-0400", "11-03 01:30-0500", "11-04 01:30-0500"]),
        # wildcard job (hour '*'): both passes of the repeated hour, none in the skipped hour
        ("30 * * * *", {}, (utc(2024, 11, 3, 4), utc(2024, 11, 3, 8)),
         ["11-03 00:30-0400", "11-03 01:30-0400", "11-03 01:30-0500", "11-03 02:30-0500"]),
        ("30 * * * *", {}, (utc(2024, 3, 10, 5), utc(2024, 3, 10, 8)),
         ["03-10 00:30-0500", "03-10 01:30-0500", "03-10 03:30-0400"]),
        # minute '*/20' makes it wildcard even with a fixed hour
        ("*/20 1 * * *", {}, (utc(2024, 11, 3, 4, 50), utc(2024, 11, 3, 7)),
         ["11-03 01:00-0400", "11-03 01:20-0400", "11-03 01:40-0400", "11-03 01:00-0500",
          "11-03 01:20-0500", "11-03 01:40-0500"]),
    ],
)
def test_new_york_examples(expr, kwargs, window, expected):
    cron = TzCron(expr, "America/New_York", **kwargs)
    assert local_slots(cron, *window) == expected
    ref = reference_fires(expr, cron.tz, *window, **kwargs)
    assert [f"{s.astimezone(cron.tz):%m-%d %H:%M%z}" for s in ref] == expected


def test_lord_howe_half_hour_dst():
    # 2024-10-06 02:00 +1030 -> 02:30 +11; 2024-04-07 02:00 +11 -> 01:30 +1030
    cron = TzCron("15 2 * * *", "Australia/Lord_Howe")
    assert local_slots(cron, utc(2024, 10, 5, 10), utc(2024, 10, 6, 10)) == ["10-06 02:30+1100"]
    cron = TzCron("45 1 * * *", "Australia/Lord_Howe", fold="both")
    assert local_slots(cron, utc(2024, 4, 6, 10), utc(2024, 4, 7, 10)) == [
        "04-07 01:45+1100", "04-07 01:45+1030"]


def test_troll_two_hour_dst():
    # 2024-03-31 01:00 +00 -> 03:00 +02: both 01:30 and 02:30 are skipped, one run at 03:00
    cron = TzCron("30 1,2 * * *", "Antarctica/Troll")
    assert local_slots(cron, utc(2024, 3, 30, 12), utc(2024, 3, 31, 12)) == ["03-31 03:00+0200"]


def test_dublin_negative_dst_is_just_offsets():
    # Irish Standard Time is +01 in summer; GMT (+00) in winter is "negative DST" in tzdata
    cron = TzCron("30 1 * * *", "Europe/Dublin")
    assert local_slots(cron, utc(2024, 10, 26, 12), utc(2024, 10, 27, 12)) == ["10-27 01:30+0100"]
    assert local_slots(cron, utc(2024, 3, 30, 12), utc(2024, 3, 31, 12)) == ["03-31 02:00+0100"]


def test_samoa_skipped_day_fires_once_at_the_jump():
    # Pacific/Apia skipped 2011-12-30 entirely: -10 -> +14 at 2011-12-30 10:00 UTC
    cron = TzCron("0 12 * * *", "Pacific/Apia")
    got = list(cron.slots(utc(2011, 12, 28, 12), utc(2011, 12, 31, 23)))
    assert got == [utc(2011, 12, 28, 22), utc(2011, 12, 29, 22),  # 12:00 -10
                   utc(2011, 12, 30, 10),                          # 30 Dec skipped: the jump
                   utc(2011, 12, 30, 22), utc(2011, 12, 31, 22)]   # 12:00 +14
    assert got == reference_fires("0 12 * * *", cron.tz, utc(2011, 12, 28, 12),
                                  utc(2011, 12, 31, 23))


def test_six_field_seconds_first():
    cron = TzCron("*/20 30 2 * * *", "Europe/Berlin")
    assert cron.is_fixed_time
    got = list(cron.slots(utc(2024, 3, 30, 0), utc(2024, 4, 1, 0)))
    # 02:30:xx on 2024-03-31 is skipped: one run at the jump (01:00 UTC), then the next day
    assert got == [utc(2024, 3, 30, 1, 30, 0), utc(2024, 3, 30, 1, 30, 20),
                   utc(2024, 3, 30, 1, 30, 40), utc(2024, 3, 31, 1, 0, 0)]


def test_next_slot_inside_a_fold_first_pass():
    # after = 01:40 EDT, on the first pass. In real time the next wall-clock minute ending
    # in :00/:20/:40 is 01:00 EST (06:00 UTC), the second pass, not 02:00.
    cron = TzCron("*/20 * * * *", "America/New_York")
    after = datetime(2024, 11, 3, 1, 40, tzinfo=ZoneInfo("America/New_York"))
    assert cron.next_slot(after) == utc(2024, 11, 3, 6, 0)
    fixed_last = TzCron("10 1 * * *", "America/New_York", fold="last")
    assert fixed_last.next_slot(after) == utc(2024, 11, 3, 6, 10)


def test_slots_strictly_increase_and_are_aware_utc():
    cron = TzCron("*/7 * * * *", "Australia/Lord_Howe", fold="both")
    slots = list(cron.slots(utc(2024, 4, 6, 12), utc(2024, 4, 6, 18)))
    assert all(b > a for a, b in itertools.pairwise(slots))
    assert all(s.tzinfo is UTC for s in slots)


def test_special_syntax_and_aliases():
    assert TzCron("@daily", "UTC").next_slot(utc(2024, 1, 1, 5)) == utc(2024, 1, 2)
    # '@daily' stays at midnight even with a name (croniter would hash it)
    assert TzCron("@daily", "UTC", name="x").next_slot(utc(2024, 1, 1, 5)) == utc(2024, 1, 2)
    assert TzCron("0 3 L * *", "UTC").next_slot(utc(2024, 2, 1)) == utc(2024, 2, 29, 3)
    assert TzCron("0 3 * * 1#2", "UTC").next_slot(utc(2024, 2, 1)) == utc(2024, 2, 12, 3)
    # Vixie: day-of-month and weekday ORed when both restricted, ANDed if one starts with '*'
    assert TzCron("0 0 13 * 5", "UTC").next_slot(utc(2024, 1, 1)) == utc(2024, 1, 5)
    assert TzCron("0 0 */2 * 5", "UTC").next_slot(utc(2024, 1, 1)) == utc(2024, 1, 5)
    assert TzCron("0 0 */2 * 5", "UTC").next_slot(utc(2024, 1, 5)) == utc(2024, 1, 19)
    # equal ranges are the single value (croniter alone would read '5-5' as '*')
    assert TzCron("5-5 * * * *", "UTC").next_slot(utc(2024, 1, 1)) == utc(2024, 1, 1, 0, 5)
    h1 = TzCron("H 3 * * *", "UTC", name="a").next_slot(utc(2024, 1, 1))
    assert h1 == TzCron("H 3 * * *", "UTC", name="a").next_slot(utc(2024, 1, 1))
    assert h1.hour == 3


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (("0 2 * * *", "Local"), {}, "local zone"),
        (("0 2 * * *", "localtime"), {}, "local zone"),
        (("0 2 * * *", "CRON_TZ=Europe/Berlin"), {}, "drop the prefix"),
        (("TZ=Europe/Berlin 0 2 * * *", "Europe/Berlin"), {}, "CRON_TZ=/TZ= prefix"),
        (("CRON_TZ=UTC 0 2 * * *", "UTC"), {}, "CRON_TZ=/TZ= prefix"),
        (("0 2 * * *", "Mars/Olympus"), {}, "unknown IANA zone"),
        (("0 2 * * *", "../../etc/passwd"), {}, "unknown IANA zone"),
        (("0 2 * * *", ""), {}, "empty"),
        (("0 2 * * *", None), {}, "IANA name"),
        (("61 2 * * *", "UTC"), {}, "61 2"),
        (("0 2 * *", "UTC"), {}, "expected 5 fields"),
        (("0 0 2 * * * 2024", "UTC"), {}, "got 7"),
        (("@reboot", "UTC"), {}, "@reboot"),
        (("H 2 * * *", "UTC"), {}, "'H' needs an entry name"),
        (("0 0 30 2 *", "UTC"), {}, "never matches"),
        (("", "UTC"), {}, "empty"),
        ((5, "UTC"), {}, "must be a string"),
        (("0 2 * * *", "UTC"), {"gap": "later"}, "gap"),
        (("0 2 * * *", "UTC"), {"fold": "middle"}, "fold"),
        (("0 2 * * *", "UTC"), {"jitter": -1}, "jitter"),
        (("0 2 * * *", "UTC"), {"jitter": float("nan")}, "jitter"),
        (("0 2 * * *", "UTC"), {"jitter": True}, "jitter"),
        (("0 2 * * *", "UTC"), {"jitter": "soon"}, "jitter"),
        (("0 2 * * *", "UTC"), {"name": ""}, "name"),
        (("0 2 * * *", "UTC"), {"jitter": 32 * 86400}, "more than 31 days"),
        (("0 2 * * *", "UTC"), {"jitter": 10**400}, "far too large"),
    ],
)
def test_errors_are_schedule_errors_naming_the_input(args, kwargs, needle):
    with pytest.raises(ScheduleError) as info:
        TzCron(*args, **kwargs)
    assert isinstance(info.value, CrawlError)
    assert needle in str(info.value)


def test_end_of_representable_time_is_a_schedule_error():
    for jitter in (0, 30):
        cron = TzCron("0 2 * * *", "America/New_York", jitter=jitter)
        with pytest.raises(ScheduleError, match=r"dates Python can represent|no further"):
            cron.next_fire(datetime(9999, 12, 31, 12, tzinfo=UTC))


def test_naive_after_is_refused():
    with pytest.raises(ScheduleError, match="aware"):
        TzCron("0 2 * * *", "UTC").next_slot(datetime(2024, 1, 1))


# -- jitter ------------------------------------------------------------------------------------


def test_jitter_is_deterministic_across_processes():
    code = (
        "from datetime import datetime, UTC;"
        "from celery_crawl.schedules import TzCron;"
        "c = TzCron('15 2 * * *', 'Asia/Shanghai', name='jd-prices', jitter=30);"
        "print(c.fire_time(datetime(2026, 1, 1, 18, 15, tzinfo=UTC)).isoformat())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, timeout=60, env={"PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    cron = TzCron("15 2 * * *", "Asia/Shanghai", name="jd-prices", jitter=30)
    assert outs.pop().strip() == cron.fire_time(utc(2026, 1, 1, 18, 15)).isoformat()


@settings(max_examples=150)
@given(
    jitter=st.floats(0.5, 7200),
    name=st.text(min_size=1, max_size=20),
    expr=st.sampled_from(["*/5 * * * *", "15 2 * * *", "*/10 * * * * *", "0 * * * *"]),
    start_s=st.integers(0, 10 * 365 * 86400),
)
def test_jitter_bounds_and_next_fire(jitter, name, expr, start_s):
    cron = TzCron(expr, "Europe/Berlin", name=name, jitter=jitter)
    start = utc(2020, 1, 1) + timedelta(seconds=start_s)
    slot = cron.next_slot(start)
    following = cron.next_slot(slot)
    fire = cron.fire_time(slot)
    assert slot <= fire <= slot + timedelta(seconds=jitter)
    assert fire < following
    assert fire - slot <= (following - slot) / 2
    # next_fire from just before a fire returns that fire; from the fire, the next one
    assert cron.next_fire(fire - timedelta(microseconds=1)) == fire
    nxt = cron.next_fire(fire)
    assert nxt == cron.fire_time(following)
    assert [f for _, f in cron.fires(start, fire)][-1] == fire


def test_jitter_spreads_over_the_range():
    cron = TzCron("0 * * * *", "UTC", name="spread", jitter=600)
    offsets = [(cron.fire_time(s) - s).total_seconds()
               for s in cron.slots(utc(2024, 1, 1), utc(2024, 3, 1))]
    assert 0 <= min(offsets) < 30 and 570 < max(offsets) <= 600
    assert 250 < sum(offsets) / len(offsets) < 350


def test_zero_jitter_fire_is_slot():
    cron = TzCron("15 2 * * *", "Asia/Shanghai")
    slot = cron.next_slot(utc(2024, 1, 1))
    assert cron.fire_time(slot) == slot == cron.next_fire(utc(2024, 1, 1))


# -- serialisation and identity ----------------------------------------------------------------


def test_pickle_and_json_round_trips_keep_zone_and_options():
    cron = TzCron("H/15 2 * * *", "Australia/Lord_Howe", name="e1", gap="skip", fold="both",
                  jitter=12.5)
    for copy in (pickle.loads(pickle.dumps(cron)),
                 TzCron.from_dict(json.loads(json.dumps(cron.to_dict())))):
        assert copy == cron
        assert copy.zone_name == "Australia/Lord_Howe"
        assert (copy.gap, copy.fold, copy.jitter, copy.name) == ("skip", "both", 12.5, "e1")
        assert copy.fingerprint() == cron.fingerprint()
        assert copy.next_fire(utc(2024, 4, 1)) == cron.next_fire(utc(2024, 4, 1))


def test_from_dict_rejects_garbage():
    for bad in ({}, {"expr": "0 2 * * *"}, {"expr": "0 2 * * *", "tz": "UTC", "x": 1},
                {"kind": "crontab", "expr": "0 2 * * *", "tz": "UTC"}, [1]):
        with pytest.raises(ScheduleError):
            TzCron.from_dict(bad)  # type: ignore[arg-type]


def test_fingerprint_changes_with_each_defining_option():
    base = TzCron("0 2 * * *", "UTC")
    variants = [TzCron("0 3 * * *", "UTC"), TzCron("0 2 * * *", "Etc/GMT+1"),
                TzCron("0 2 * * *", "UTC", gap="skip"), TzCron("0 2 * * *", "UTC", fold="both"),
                TzCron("0 2 * * *", "UTC", jitter=1)]
    prints = {v.fingerprint() for v in variants} | {base.fingerprint()}
    assert len(prints) == 6
    assert TzCron(" 0  2 * * * ", "UTC").fingerprint() == base.fingerprint()


def test_task_id_for_is_uuid5_of_namespace_entry_slot():
    from uuid import NAMESPACE_URL, uuid5

    slot = datetime(2026, 3, 1, 2, 15, tzinfo=ZoneInfo("Asia/Shanghai"))
    expected = str(uuid5(NAMESPACE_URL, "crawl|jd-prices|2026-02-28T18:15:00Z"))
    assert task_id_for("crawl", "jd-prices", slot) == expected


# -- BaseSchedule ------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def test_is_due_and_remaining_estimate_for_stock_beat():
    clock = Clock(utc(2024, 3, 10, 6, 59, 30))
    cron = TzCron("30 2 * * *", "America/New_York", nowfun=clock)
    assert isinstance(cron, BaseSchedule)
    last = utc(2024, 3, 9, 8)
    due, next_s = cron.is_due(last)
    assert not due and next_s == pytest.approx(30)
    assert cron.remaining_estimate(last) == timedelta(seconds=30)
    clock.now = utc(2024, 3, 10, 7, 0, 1)
    due, next_s = cron.is_due(last)
    assert due
    # the next fire is 02:30 EDT the next day
    assert next_s == pytest.approx((utc(2024, 3, 11, 6, 30) - clock.now).total_seconds())
    # stock beat records the dispatch time as last_run_at; no second run that day
    assert not cron.is_due(clock.now)[0]
    # naive datetimes are UTC, as in celery's crontab
    assert cron.is_due(datetime(2024, 3, 9, 8))[0]


@pytest.mark.parametrize(
    ("expr", "fixed"),
    [("30 2 * * *", True), ("0,30 1 * * *", True), ("0-10 1-2 * * *", True),
     ("*/20 1 * * *", False), ("30 * * * *", False), ("* 2 * * *", False),
     ("*/10 30 2 * * *", True), ("0 */5 2 * * *", False), ("@daily", True), ("@hourly", False),
     ("H 3 * * THU", True), ("0 H/2 * * *", True)],
)
def test_fixed_time_classification(expr, fixed):
    assert TzCron(expr, "UTC", name="n").is_fixed_time is fixed


def test_day_names_are_not_hash_tokens():
    # 'THU' contains an H but is a day name: no entry name is needed
    assert TzCron("0 3 * * THU", "UTC").next_slot(utc(2024, 1, 1)) == utc(2024, 1, 4, 3)
