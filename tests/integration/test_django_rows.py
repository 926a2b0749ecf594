"""django-celery-beat rows as beat entries, on a real SQLite database with real Django and real
django-celery-beat (the PostgreSQL and multi-process cases are in
tests/system/test_django_beat.py).

Django is configured in this process with ``settings.configure`` (no ``DJANGO_SETTINGS_MODULE``,
so Celery's Django fix-up stays off for the other tests of the session).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

django = pytest.importorskip("django")
pytest.importorskip("django_celery_beat")

from celery import Celery  # noqa: E402

from celery_crawl.beat.assembly import assemble  # noqa: E402
from celery_crawl.beat.sources import row_source  # noqa: E402
from celery_crawl.beat.sources.django_db import DjangoBeatSource  # noqa: E402
from celery_crawl.errors import FencedError  # noqa: E402
from celery_crawl.schedules import TzCron  # noqa: E402

_DIR = tempfile.mkdtemp(prefix="crawl-django-")


@pytest.fixture(scope="module")
def db() -> Iterator[None]:
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            USE_TZ=True, TIME_ZONE="UTC", INSTALLED_APPS=["django_celery_beat"],
            DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                   "NAME": f"{_DIR}/db.sqlite3"}})
    django.setup()
    from django.core.management import call_command

    call_command("migrate", "django_celery_beat", verbosity=0)
    try:
        yield
    finally:
        from django.db import connections

        connections.close_all()
        shutil.rmtree(_DIR, ignore_errors=True)


@pytest.fixture
def app(db: None) -> Iterator[Celery]:
    from django_celery_beat.models import PeriodicTask

    PeriodicTask.objects.all().delete()
    app = Celery("rows", set_as_current=False)
    app.conf.update(crawl_schedule_sources=["files", "beat_schedule", "django_celery_beat"],
                    crawl_schedule_paths=[], crawl_namespace="rows", crawl_store_timeout=2.0)
    yield app


def _crontab(minute: str, hour: str, tz: str, **kw: str) -> Any:
    from django_celery_beat.models import CrontabSchedule

    return CrontabSchedule.objects.create(minute=minute, hour=hour, timezone=tz, **kw)


def _task(name: str, **kw: Any) -> Any:
    from django_celery_beat.models import PeriodicTask

    return PeriodicTask.objects.create(name=name, task=kw.pop("task", "proj.crawl"), **kw)


def _queries(source: DjangoBeatSource) -> list[str]:
    """A list that receives every SQL statement the source's own connection runs."""
    seen: list[str] = []

    def install() -> None:
        from django.db import connection

        def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            seen.append(sql)
            return execute(sql, params, many, context)

        connection.execute_wrappers.append(wrapper)

    source._pool.submit(install).result()
    return seen


def test_rows_become_entries_with_their_meaning(app: Celery) -> None:
    from django_celery_beat.models import ClockedSchedule, IntervalSchedule

    start = datetime(2030, 1, 1, tzinfo=UTC)
    _task("ny", crontab=_crontab("30", "2", "America/New_York"), args=json.dumps([1]),
          kwargs=json.dumps({"a": 2}), queue="crawl", priority=5, routing_key="rk",
          exchange="ex", headers=json.dumps({"h": "v"}), expire_seconds=60)
    _task("every-10s", interval=IntervalSchedule.objects.create(every=10, period="seconds"),
          start_time=start)
    when = datetime.now(UTC) + timedelta(hours=1)
    _task("once", clocked=ClockedSchedule.objects.create(clocked_time=when), one_off=True)
    _task("off", crontab=_crontab("*", "*", "UTC"), enabled=False)
    _task("bad-cron", crontab=_crontab("61", "2", "UTC"))
    from django.db import connection

    _task("bad-zone", crontab=_crontab("0", "2", "UTC"))
    with connection.cursor() as cur:  # a zone this tz database does not know (as if removed)
        cur.execute("UPDATE django_celery_beat_crontabschedule SET timezone = 'Mars/Olympus' "
                    "WHERE hour = '2' AND minute = '0'")

    from django_celery_beat.models import SolarSchedule

    _task("dawn", solar=SolarSchedule.objects.create(event="dawn_civil", latitude=52.52,
                                                     longitude=13.40))
    try:
        import ephem  # noqa: F401
        has_ephem = True
    except ImportError:
        has_ephem = False

    schedule = assemble(app)
    assert set(schedule.entries) - {"dawn"} == {"ny", "every-10s", "once"}
    assert ("dawn" in schedule.entries) is has_ephem
    ny = schedule.entries["ny"]
    assert isinstance(ny.source, TzCron) and ny.source.zone_name == "America/New_York"
    assert ny.source.expr == "30 2 * * *" and ny.source.is_fixed_time
    assert ny.args == (1,) and dict(ny.kwargs) == {"a": 2}
    assert ny.options == {"queue": "crawl", "priority": 5, "routing_key": "rk", "exchange": "ex",
                          "expires": 60.0, "headers": {"h": "v", "periodic_task_name": "ny"}}
    # The project's DST rule: 02:30 does not exist on 2026-03-08 in New York; it runs once, at
    # the jump (07:00 UTC), not skipped as stock crontab does.
    night = datetime(2026, 3, 8, 5, 0, tzinfo=UTC)
    assert ny.source.next_slot(night) == datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
    every = schedule.entries["every-10s"]
    assert every.source.next_slot(datetime(2029, 1, 1, tzinfo=UTC)) == start
    assert every.source.next_slot(start) == start + timedelta(seconds=10)
    once = schedule.entries["once"].source
    assert once.next_slot(when - timedelta(days=1)) == when.replace(microsecond=0)
    assert once.next_slot(when) is None
    errors = "\n".join(schedule.errors)
    assert "PeriodicTask 'bad-cron'" in errors and "crontab" in errors
    assert "PeriodicTask 'bad-zone'" in errors and "Mars/Olympus" in errors
    if not has_ephem:  # refused with its reason, the other rows run
        assert "PeriodicTask 'dawn'" in errors and "ephem" in errors


def test_a_name_defined_twice_is_an_error_naming_both(app: Celery) -> None:
    app.conf.beat_schedule = {"dup": {"task": "proj.crawl", "schedule": 60.0}}
    _task("dup", crontab=_crontab("0", "3", "Europe/Berlin"))
    schedule = assemble(app)
    assert schedule.entries["dup"].origin == "beat_schedule"
    assert any("'dup'" in e and "django-celery-beat" in e and "beat_schedule" in e
               for e in schedule.errors), schedule.errors


def test_rows_are_read_only_when_the_marker_moves(app: Celery) -> None:
    source = row_source(app)
    try:
        _task("a", crontab=_crontab("0", "4", "UTC"))
        assert source.poll()
        seen = _queries(source)
        for _ in range(5):
            assert not source.poll()
        # One read of the marker row per poll, never the PeriodicTask table.
        assert len(seen) == 5 and all("periodictasks" in q for q in seen), seen
        row = _task("b", crontab=_crontab("0", "5", "UTC"))  # an admin save moves the marker
        assert source.poll() and set(source.entries) == {"a", "b"}
        before = source.entries["b"].fingerprint
        row.args = json.dumps(["changed"])
        row.save()
        assert source.poll() and source.entries["b"].fingerprint != before
        cron = row.crontab
        cron.hour = "6"  # the schedule edited on its own admin page
        cron.save()
        assert source.poll() and source.entries["b"].source.expr == "0 6 * * *"
        row.enabled = False
        row.save()
        assert source.poll() and set(source.entries) == {"a"}
        from django_celery_beat.models import PeriodicTask

        PeriodicTask.objects.get(name="a").delete()
        assert source.poll() and source.entries == {}
    finally:
        source.close()


def test_write_back_is_fenced_by_the_leader_token(app: Celery) -> None:
    from django_celery_beat.models import PeriodicTask

    _task("w", crontab=_crontab("*", "*", "UTC"))
    new, old = row_source(app), row_source(app)
    try:
        for source in (new, old):
            source.poll()
        t1 = datetime(2030, 1, 1, 0, 0, tzinfo=UTC)
        new.ran(new.entries["w"], t1)
        new.ran(new.entries["w"], t1 + timedelta(minutes=1))
        new.write_back(token=20)
        old.ran(old.entries["w"], t1 + timedelta(minutes=5))  # a deposed leader, late
        with pytest.raises(FencedError, match="token 20"):
            old.write_back(token=10)
        row = PeriodicTask.objects.get(name="w")
        assert (row.last_run_at, row.total_run_count) == (t1 + timedelta(minutes=1), 2)
        assert old.pending == 0 and new.pending == 0
        new.ran(new.entries["w"], t1 + timedelta(minutes=2))
        new.write_back(token=20)  # the same leader again: accepted
        assert PeriodicTask.objects.get(name="w").total_run_count == 3
    finally:
        new.close()
        old.close()


def test_a_one_off_row_is_disabled_once_it_ran(app: Celery) -> None:
    """As django-celery-beat does: after its run the row is disabled and its count reset, and the
    change marker moves, so every replica drops the entry."""
    from django_celery_beat.models import PeriodicTask

    _task("once", crontab=_crontab("*", "*", "UTC"), one_off=True)
    _task("always", crontab=_crontab("*", "*", "UTC"))
    source = row_source(app)
    try:
        source.poll()
        assert set(source.entries) == {"once", "always"}
        t1 = datetime(2030, 1, 1, 0, 0, tzinfo=UTC)
        source.ran(source.entries["once"], t1)
        source.ran(source.entries["always"], t1)
        source.write_back(token=100)  # above the tokens the other tests left in the fence
        once, always = (PeriodicTask.objects.get(name=n) for n in ("once", "always"))
        assert (once.enabled, once.total_run_count, once.last_run_at) == (False, 0, t1)
        assert (always.enabled, always.total_run_count) == (True, 1)
        assert source.poll()  # the marker moved: the rows are read again
        assert set(source.entries) == {"always"}
    finally:
        source.close()
