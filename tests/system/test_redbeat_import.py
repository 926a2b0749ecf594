"""``celery -A proj crawl schedules import redbeat`` against entries written by the real
celery-redbeat package into a real Redis, run as a real ``celery`` subprocess."""

from __future__ import annotations

import os
import subprocess
import tomllib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_crawl.schedules import load_schedule_files
from tests.procs import ROOT, celery_args
from tests.servers import RedisServer

redbeat = pytest.importorskip("redbeat")

pytestmark = pytest.mark.system

APP = '''
from celery import Celery

app = Celery("rbapp", broker={broker!r})
app.conf.timezone = "America/New_York"
app.conf.redbeat_redis_url = {redbeat!r}
app.conf.redbeat_key_prefix = "shop:"
app.conf.crawl_schedule_paths = []
'''


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


def test_import_keeps_every_entry_with_an_explicit_zone(redis_server: RedisServer,
                                                        tmp_path: Path) -> None:
    app = Celery("rbapp", set_as_current=False)
    app.conf.update(timezone="America/New_York", redbeat_redis_url=redis_server.url_db(3),
                    redbeat_key_prefix="shop:")
    entry = redbeat.RedBeatSchedulerEntry
    entry("nightly", "shop.crawl", crontab(minute=30, hour=2), args=[1, "x"],
          kwargs={"site": "jd"}, options={"queue": "crawl", "priority": 3, "expires": 600,
                                          "routing_key": "rk"}, app=app).save()
    entry("every-5m", "shop.ping", schedule(timedelta(minutes=5)), enabled=False, app=app).save()
    entry("odd", "shop.ping", schedule(timedelta(seconds=7)), app=app).save()
    entry("weekly report", "shop.report", crontab(minute=0, hour=9, day_of_week="mon"),
          app=app).save()
    (tmp_path / "rbapp.py").write_text(APP.format(broker=redis_server.url_db(0),
                                                  redbeat=redis_server.url_db(3)))
    out_file = tmp_path / "beat_schedules" / "redbeat.toml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(ROOT))),
           "CRAWL_NOW": "2026-12-07T00:00:00+00:00"}
    run = subprocess.run(celery_args("rbapp", "crawl", "schedules", "import", "redbeat",
                                     "-o", str(out_file)),
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    text = out_file.read_text()
    assert "'America/New_York'" in text.splitlines()[1]  # the comment saying where tz came from
    data = tomllib.loads(text)["entries"]
    assert set(data) == {"nightly", "every-5m", "weekly-report"}
    assert all(e["tz"] == "America/New_York" for e in data.values())
    assert data["nightly"] == {"task": "shop.crawl", "cron": "30 2 * * *",
                               "tz": "America/New_York", "args": [1, "x"],
                               "kwargs": {"site": "jd"}, "queue": "crawl", "priority": 3,
                               "expires": "600s"}
    assert data["every-5m"] == {"task": "shop.ping", "cron": "*/5 * * * *",
                                "tz": "America/New_York", "paused": True}
    assert data["weekly-report"]["cron"] == "0 9 * * mon"
    assert "routing_key" in text and "dropped" in text  # said, not silently lost
    assert "not imported: odd" in run.stdout and "7s" in run.stdout
    # The DST nights that change, and only for the fixed-time job in the skipped hour.
    dst = run.stdout.split("DST nights", 1)[1].split("--- schedules check", 1)[0]
    assert "nightly: 2027-03-14 02:30 America/New_York does not exist" in dst
    assert "every-5m" not in dst and "weekly" not in dst
    assert "3 entries ok in 1 file(s)" in run.stdout
    loaded = load_schedule_files([str(out_file)])
    assert not loaded.errors and set(loaded.entries) == set(data)
