"""Slots of stock ``crontab`` entries do not depend on the Celery version.

Before Celery 5.7, ``crontab.remaining_estimate(after)`` is right only while ``after`` is within
about a day of now; these tests put ``after`` days in the past, as a catch-up after an outage
does, and expect the same slots on every supported Celery.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_crawl.beat.crontab_slots import CrontabSlots, crontab_zone
from celery_crawl.beat.entries import CelerySlotSource
from celery_crawl.errors import ScheduleError


def _app(zone: str) -> Celery:
    app = Celery("crontab-slots", set_as_current=False)
    app.conf.timezone = zone
    return app


def _walk(src: CelerySlotSource, start: datetime, end: datetime) -> list[datetime]:
    out, cur = [], start
    while True:
        cur = src.next_slot(cur)
        if cur > end:
            return out
        out.append(cur)


def test_a_catch_up_over_a_three_day_gap_picks_every_due_instant() -> None:
    src = CelerySlotSource(crontab(minute=30, hour="2,14", app=_app("Asia/Shanghai")))
    # A fixed window: the answer must not depend on "now" (days before it here).
    start = datetime(2026, 11, 1, 0, 0, tzinfo=UTC)
    end = start + timedelta(days=3)
    slots = _walk(src, start, end)
    shanghai = ZoneInfo("Asia/Shanghai")
    expected = [datetime(2026, 11, d, h, 30, tzinfo=shanghai).astimezone(UTC)
                for d in (1, 2, 3, 4) for h in (2, 14)]
    expected = [s for s in expected if start < s <= end]
    assert slots == expected
    assert len(slots) == 6


def test_slots_far_in_the_past_are_the_schedules_own() -> None:
    src = CelerySlotSource(crontab(minute="*/15", app=_app("UTC")))
    after = datetime(2020, 1, 1, 12, 0, 0, 500_000, tzinfo=UTC)
    assert src.next_slot(after) == datetime(2020, 1, 1, 12, 15, tzinfo=UTC)


def test_day_of_month_and_weekday_both_restricted_must_both_match() -> None:
    # Celery ANDs them (cron would OR): the 13th that is a Friday (weekday 5).
    src = CelerySlotSource(crontab(minute=0, hour=9, day_of_month=13, day_of_week=5,
                                   app=_app("UTC")))
    first = src.next_slot(datetime(2026, 1, 1, tzinfo=UTC))
    assert first == datetime(2026, 2, 13, 9, 0, tzinfo=UTC)
    assert src.next_slot(first) == datetime(2026, 3, 13, 9, 0, tzinfo=UTC)


def test_a_dst_night_follows_the_project_rule() -> None:
    # 02:30 does not exist in Berlin on 2026-03-29: a fixed-time job runs once, at the jump.
    src = CelerySlotSource(crontab(minute=30, hour=2, app=_app("Europe/Berlin")))
    slots = _walk(src, datetime(2026, 3, 27, tzinfo=UTC), datetime(2026, 3, 31, tzinfo=UTC))
    assert datetime(2026, 3, 29, 1, 0, tzinfo=UTC) in slots
    assert len(slots) == 4


def test_a_zone_that_is_not_iana_is_refused_with_the_schedule_named() -> None:
    class Local:
        tz = timezone(timedelta(hours=2))  # a fixed offset, as a local-time zone gives

    with pytest.raises(ScheduleError, match="not an IANA zone"):
        crontab_zone(Local())


def test_repr_names_the_crontab() -> None:
    assert "crontab" in repr(CrontabSlots(crontab(minute=1, app=_app("UTC"))))
