"""``celery crawl schedules check`` / ``celery crawl next`` and TzCron in stock ``celery beat``,
all as real subprocesses. No broker or store is needed: the app uses the in-memory transport.
"""

from __future__ import annotations

import os
import re
import shelve
import subprocess
from datetime import date, timedelta
from pathlib import Path

import pytest

from celery_crawl.schedules import TzCron
from tests.procs import CELERY, ROOT, Proc, celery_args
from tests.servers import wait_until

pytestmark = pytest.mark.system

APP = '''
from celery import Celery
from celery_crawl.schedules import TzCron

app = Celery("schedapp", broker="memory://", backend="cache+memory://")
app.conf.crawl_namespace = "crawltest"
app.conf.crawl_schedule_paths = [{paths!r}]
app.conf.beat_schedule = {{
    "code-entry": {{
        "task": "tasks.ping",
        "schedule": TzCron("*/2 * * * * *", "Europe/Berlin", name="code-entry"),
        "options": {{"queue": "pings"}},
    }},
    "plain-interval": {{"task": "tasks.ping", "schedule": 3600.0}},
}}


@app.task(name="tasks.ping")
def ping():
    return "pong"
'''

NOW = "2026-03-28T12:00:00+00:00"

BAD = """
[defaults]
tz = "Europe/Berlin"

[entries.good-one]
task = "workers.crawler.crawl_site"
cron = "0 3 * * *"

[entries.typo]
task = "workers.crawler.crawl_site"
cron = "0 3 * * *"
cronn = "0 4 * * *"

[entries.bad-zone]
task = "workers.crawler.crawl_site"
cron = "0 3 * * *"
tz = "Local"

[entries.bad-cron]
task = "workers.crawler.crawl_site"
cron = "0 24 * * *"
"""


def make_app(tmp_path: Path, paths: str) -> Path:
    (tmp_path / "schedapp.py").write_text(APP.format(paths=paths))
    return tmp_path


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CRAWL_NOW": NOW,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([CELERY, "-A", "schedapp", "crawl", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    return make_app(tmp_path, str(ROOT / "beat_schedules" / "*.toml"))


def test_check_shipped_files_prints_next_fires_in_zone_and_utc(app_dir):
    result = run(app_dir, "schedules", "check", str(ROOT / "beat_schedules"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Traceback" not in out + result.stderr
    block = out.split("jd-prices", 1)[1].split("\n\n", 1)[0].splitlines()
    fires = [line.split() for line in block if re.match(r"\s+2026-", line)][:5]
    assert len(fires) == 5
    for i, (day, local_time, offset, zone, utc_text) in enumerate(fires):
        assert day == str(date(2026, 3, 29) + timedelta(days=i))
        assert local_time.startswith("02:15:") and offset == "+0800" and zone == "CST"
        assert re.fullmatch(r"2026-\d\d-\d\dT18:15:\d\dZ", utc_text)
    # Berlin's spring gap on 29 March: the 02:00 Sunday run fires once, at 03:00 CEST
    assert "2026-03-29 03:00:00 +0200 CEST      2026-03-29T01:00:00Z" in out
    assert "6 entries ok in 3 file(s)" in out


def test_check_bad_file_exits_1_with_every_error_and_no_traceback(app_dir):
    (app_dir / "bad.toml").write_text(BAD)
    (app_dir / "broken.toml").write_text("[entries.x\n")
    (app_dir / "dup.toml").write_text(
        '[entries.code-entry]\ntask = "t.x"\ncron = "0 1 * * *"\ntz = "UTC"\n')
    result = run(app_dir, "schedules", "check", "bad.toml", "broken.toml", "missing.toml",
                 "dup.toml")
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert "good-one" in result.stdout  # the good entry still loads and is shown
    err = result.stderr
    assert "6 error(s)" in err
    assert "bad.toml, entry 'typo', field 'cronn': unknown key" in err
    assert "bad.toml, entry 'bad-zone', field 'tz': time zone 'Local'" in err
    assert "bad.toml, entry 'bad-cron', field 'cron': cron '0 24 * * *'" in err
    assert "broken.toml: invalid TOML" in err
    assert "missing.toml: no such file" in err
    assert "dup.toml, entry 'code-entry': entry 'code-entry' is also defined in " \
        "app.conf.beat_schedule" in err


def test_next_for_a_file_entry_shows_slots_and_task_ids(app_dir):
    result = run(app_dir, "next", "jd-prices", "-n", "3")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+2026-", line)]
    assert len(rows) == 3
    from uuid import NAMESPACE_URL, uuid5

    first = rows[0]
    assert first[0] == "2026-03-29" and first[1].startswith("02:15:") and first[2] == "+0800"
    assert first[5] == "2026-03-28T18:15:00Z"  # nominal slot, before jitter
    assert first[6] == str(uuid5(NAMESPACE_URL, "crawltest|jd-prices|2026-03-28T18:15:00Z"))


def test_next_for_a_beat_schedule_entry(app_dir):
    result = run(app_dir, "next", "code-entry", "-n", "2")
    assert result.returncode == 0, result.stderr
    assert "(beat_schedule)" in result.stdout and "queue=pings" in result.stdout
    assert "2026-03-28 13:00:02 +0100 CET" in result.stdout


def test_next_unknown_entry_and_duplicates(tmp_path):
    (tmp_path / "dup.toml").write_text(
        '[entries.code-entry]\ntask = "t.x"\ncron = "0 1 * * *"\ntz = "UTC"\n')
    make_app(tmp_path, "*.toml")
    result = run(tmp_path, "next", "nope")
    assert result.returncode == 1
    assert "no entry 'nope'" in result.stderr and "code-entry" in result.stderr
    assert "Traceback" not in result.stderr
    # the file copy of a beat_schedule name is reported; the beat_schedule copy is used
    result = run(tmp_path, "next", "code-entry", "-n", "1")
    assert result.returncode == 0 and "(beat_schedule)" in result.stdout
    assert "1 error(s)" in result.stderr
    # a stock interval entry is named, not crashed on
    result = run(tmp_path, "next", "plain-interval")
    assert result.returncode == 1 and "has schedule 3600.0, not a TzCron" in result.stderr


def test_stock_celery_beat_runs_a_tzcron_entry(app_dir, tmp_path):
    log = tmp_path / "beat.log"
    proc = Proc(celery_args("schedapp", "beat", "-l", "INFO", "--max-interval", "1",
                            "-s", str(tmp_path / "beat-schedule")),
                log_path=log, cwd=app_dir)
    try:
        sent = re.compile(r"Sending due task code-entry \(tasks\.ping\)")
        wait_until(lambda: len(sent.findall(proc.log())) >= 2, timeout_s=60,
                   what="two runs of the TzCron entry from stock beat")
    finally:
        proc.stop()
    assert "Traceback" not in proc.log()
    # beat pickled the entry into its shelve on shutdown; it comes back with zone and options
    with shelve.open(str(tmp_path / "beat-schedule"), flag="r") as db:
        entry = db["entries"]["code-entry"]
    assert isinstance(entry.schedule, TzCron)
    assert (entry.schedule.expr, entry.schedule.zone_name, entry.schedule.name) == (
        "*/2 * * * * *", "Europe/Berlin", "code-entry")
    assert entry.total_run_count >= 2
