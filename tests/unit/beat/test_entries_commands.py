"""beat_schedule adaptation (Celery schedules as slot sources) and operator command records."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_crawl.beat.commands import make_command, parse_command
from celery_crawl.beat.entries import CelerySlotSource, from_beat_schedule
from celery_crawl.errors import ConfigError
from celery_crawl.schedules import TzCron

T0 = datetime(2026, 3, 1, 12, 0, 0, 500_000, tzinfo=UTC)


@pytest.fixture(scope="module")
def app() -> Celery:
    app = Celery("unit", set_as_current=False)
    app.conf.timezone = "UTC"
    return app


def test_interval_slots_are_exactly_one_period_apart(app: Celery) -> None:
    src = CelerySlotSource(schedule(timedelta(seconds=10), app=app))
    first = src.next_slot(T0)
    assert first == datetime(2026, 3, 1, 12, 0, 10, tzinfo=UTC)
    assert src.next_slot(first) == first + timedelta(seconds=10)


def test_crontab_slots_are_its_due_instants(app: Celery) -> None:
    src = CelerySlotSource(crontab(minute="*/15", app=app))
    assert src.next_slot(T0) == datetime(2026, 3, 1, 12, 15, tzinfo=UTC)
    assert src.next_slot(datetime(2026, 3, 1, 12, 15, tzinfo=UTC)) == datetime(
        2026, 3, 1, 12, 30, tzinfo=UTC)


def test_beat_schedule_entry_options_and_policies(app: Celery) -> None:
    e = from_beat_schedule("x", {
        "task": "t.x", "schedule": 30.0, "args": [1],
        "options": {"queue": "crawl", "expires": 20, "crawl_overlap": "allow",
                    "crawl_catchup": "all", "crawl_catchup_window": "10m"},
    }, app)
    assert e.options == {"queue": "crawl", "expires": 20}
    assert e.overlap == "allow" and e.catchup.mode == "all" and e.catchup.window_s == 600
    assert e.expires_s == 20
    same = from_beat_schedule("x", {
        "task": "t.x", "schedule": 30.0, "args": [1],
        "options": {"queue": "crawl", "expires": 20, "crawl_overlap": "allow",
                    "crawl_catchup": "all", "crawl_catchup_window": "10m"},
    }, app)
    assert same.fingerprint == e.fingerprint
    other = from_beat_schedule("x", {"task": "t.x", "schedule": 30.0, "args": [2]}, app)
    assert other.fingerprint != e.fingerprint


def test_tzcron_keeps_its_own_slots(app: Celery) -> None:
    cron = TzCron("15 2 * * *", "Asia/Shanghai")
    e = from_beat_schedule("jd", {"task": "t", "schedule": cron}, app)
    assert e.source is cron
    assert e.source.next_slot(T0) == datetime(2026, 3, 1, 18, 15, tzinfo=UTC)


@pytest.mark.parametrize("raw, field", [
    ({"task": "t"}, "needs 'task' and 'schedule'"),
    ({"task": "t", "schedule": 5, "options": {"crawl_overlap": "maybe"}}, "crawl_overlap"),
    ({"task": "t", "schedule": 5, "options": {"crawl_catchup": "some"}}, "catchup mode"),
])
def test_bad_beat_schedule_entries_name_the_field(app: Celery, raw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        from_beat_schedule("bad", raw, app)


def test_commands_roundtrip_and_validation() -> None:
    rec = make_command("backfill", "jd", start=T0, end=T0 + timedelta(hours=1))
    cmd = parse_command(rec)
    assert cmd.op == "backfill" and cmd.start == T0.replace(microsecond=500_000)
    assert parse_command(make_command("trigger", "jd")).op == "trigger"
    with pytest.raises(ConfigError, match="unknown op"):
        make_command("explode", "jd")
    with pytest.raises(ConfigError, match="time zone"):
        make_command("backfill", "jd", start=datetime(2026, 1, 1), end=datetime(2026, 1, 2))
    with pytest.raises(ConfigError, match="before"):
        make_command("backfill", "jd", start=T0, end=T0 - timedelta(seconds=1))
    with pytest.raises(ValueError, match="not a beat command"):
        parse_command({"op": "pause"})
