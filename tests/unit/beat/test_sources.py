"""django-celery-beat rows as entries (``beat.sources.rows``, rows as plain mappings, no Django),
and the promise that Django is needed only when that source is switched on."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from celery_crawl.beat.sources.rows import RowError, entry_from_row
from celery_crawl.config import CrawlConfig
from celery_crawl.errors import ConfigError

APP = Celery("rows", set_as_current=False)


def _row(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"id": 7, "name": "r", "task": "proj.crawl", "kind": "crontab",
                            "minute": "0", "hour": "3", "day_of_month": "*",
                            "month_of_year": "*", "day_of_week": "*", "timezone": "UTC"}
    return {**base, **kw}


@pytest.mark.parametrize(("row", "field"), [
    (_row(minute="61"), "crontab"),
    (_row(timezone="Not/AZone"), "crontab"),
    (_row(args="[1,"), "args"),
    (_row(kwargs="[1]"), "kwargs"),
    (_row(headers="3"), "headers"),
    (_row(task=""), "task"),
    (_row(kind="interval", every=0, period="seconds"), "interval"),
    (_row(kind="interval", every=5, period="fortnights"), "interval"),
    (_row(kind="interval", every=500, period="microseconds"), "interval"),
    (_row(kind="clocked", clocked_time=None), "clocked"),
    (_row(kind=None), None),
])
def test_a_bad_row_names_the_row_and_the_field(row: dict[str, Any], field: str | None) -> None:
    with pytest.raises(RowError) as err:
        entry_from_row(row, APP)
    assert "PeriodicTask 'r' (id 7)" in str(err.value)
    if field:
        assert f"field {field!r}" in str(err.value)


def test_start_time_and_expires_bound_the_slots() -> None:
    start = datetime(2030, 1, 1, 3, 0, tzinfo=UTC)
    end = datetime(2030, 1, 3, 3, 0, tzinfo=UTC)
    entry = entry_from_row(_row(start_time=start, expires=end), APP)
    src = entry.source
    assert src.next_slot(datetime(2029, 6, 1, tzinfo=UTC)) == start  # none before start_time
    assert src.next_slot(start) == start + timedelta(days=1)
    assert src.next_slot(start + timedelta(days=1)) is None  # the 3rd at 03:00 is the expiry
    assert entry.options["expires"] == end  # and the message expires then, as in dcb
    assert entry.fire_time(start) == start


def test_the_fingerprint_ignores_what_a_run_changes() -> None:
    a = entry_from_row(_row(last_run_at=datetime.now(UTC), total_run_count=3), APP)
    b = entry_from_row(_row(total_run_count=4), APP)
    c = entry_from_row(_row(args=json.dumps([1])), APP)
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_the_setting_names_its_sources() -> None:
    base = {"crawl_lease_url": "redis://127.0.0.1:1/0"}
    assert CrawlConfig.from_mapping(base).schedule_sources == ("files", "beat_schedule")
    conf = CrawlConfig.from_mapping({**base, "crawl_schedule_sources": ["django_celery_beat"]})
    assert conf.schedule_sources == ("django_celery_beat",)
    with pytest.raises(ConfigError, match="crawl_schedule_sources: unknown source 'django'"):
        CrawlConfig.from_mapping({**base, "crawl_schedule_sources": ["django"]})


_PROBE = """
import sys
{block}
from celery import Celery
from celery_crawl.beat.scheduler import LeasedScheduler  # noqa: F401
from celery_crawl.beat.assembly import assemble
from celery_crawl.beat.sources import row_source
app = Celery("p", set_as_current=False)
app.conf.crawl_schedule_paths = []
assemble(app)
print(any(m.split(".")[0] == "django" and sys.modules[m] is not None for m in sys.modules))
{then}
"""


def _probe(block: str = "", then: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROBE.format(block=block, then=then)],
                          capture_output=True, text=True, timeout=60)


def test_the_beat_runs_without_django_unless_the_source_is_on() -> None:
    # Celery itself imports Django when it is installed (its fix-up looks for it), so the
    # check is the stronger one: with Django not importable at all, nothing of ours needs it.
    out = _probe(block="sys.modules['django'] = None")
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_without_django_the_source_is_a_config_error_naming_the_extra() -> None:
    then = """
try:
    row_source(app)
except Exception as exc:
    print(type(exc).__name__, exc)
"""
    out = _probe(block="sys.modules['django'] = None", then=then)
    assert out.returncode == 0, out.stderr
    assert "ConfigError" in out.stdout and "celery-crawl[django]" in out.stdout
