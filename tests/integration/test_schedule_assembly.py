"""The beat, ``crawl status``, ``crawl next`` and ``crawl schedules check`` see one schedule.

One app, one directory of schedule files with a good file, a broken one (a good entry beside a
bad one) and an entry that ``beat_schedule`` also defines; each of the four callers is asked
which entries the app runs, and they must agree (in-process: the beat adapter's own reload,
the status view against a real Redis, the two CLI commands through click).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from celery import Celery
from click.testing import CliRunner

from celery_crawl.beat import LeasedScheduler
from celery_crawl.beat.assembly import assemble
from celery_crawl.cli import crawl
from celery_crawl.leases import open_store
from celery_crawl.schedules import TzCron
from celery_crawl.status import gather
from tests.servers import RedisServer

GOOD = """
[entries.good-a]
task = "t.a"
cron = "*/5 * * * *"
tz = "UTC"

[entries.good-b]
task = "t.b"
cron = "0 2 * * *"
tz = "Asia/Shanghai"
"""
BROKEN = """
[entries.fine-but-in-a-broken-file]
task = "t.c"
cron = "0 3 * * *"
tz = "UTC"

[entries.typo]
task = "t.d"
cronn = "0 4 * * *"
"""
DUPLICATE = """
[entries.code-entry]
task = "t.e"
cron = "0 5 * * *"
tz = "UTC"
"""
EXPECTED = {"code-entry", "good-a", "good-b"}


@pytest.fixture
def app_dir(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[Celery, Path]]:
    (tmp_path / "beat_schedules").mkdir()
    (tmp_path / "beat_schedules" / "good.toml").write_text(GOOD)
    (tmp_path / "beat_schedules" / "broken.toml").write_text(BROKEN)
    (tmp_path / "beat_schedules" / "dup.toml").write_text(DUPLICATE)
    app = Celery("assembly", broker=redis_server.url_db(1), set_as_current=False)
    app.conf.update(
        crawl_lease_url=redis_server.url_db(0), crawl_namespace=f"asm-{uuid.uuid4().hex[:8]}",
        crawl_schedule_paths=["beat_schedules/*.toml"],
        beat_schedule={"code-entry": {"task": "t.code",
                                      "schedule": TzCron("0 1 * * *", tz="Europe/Berlin")}})
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield app, tmp_path
    finally:
        os.chdir(old)


class _Obj:
    def __init__(self, app: Celery) -> None:
        self.app = app


def _cli(app: Celery, *args: str) -> Any:
    return CliRunner().invoke(crawl, list(args), obj=_Obj(app), catch_exceptions=False)


def test_the_four_callers_get_the_same_entries(app_dir: tuple[Celery, Path]) -> None:
    app, _ = app_dir
    schedule = assemble(app)
    assert set(schedule.entries) == EXPECTED
    assert schedule.broken == {"beat_schedules/broken.toml"}
    assert schedule.entries["code-entry"].origin == "beat_schedule"  # beat_schedule wins

    # The beat: the scheduler's own reload (lazy: no store is opened).
    beat = LeasedScheduler(app, lazy=True)
    beat._reload(force=True)
    assert set(beat.entries) == EXPECTED
    assert {n: e.fingerprint for n, e in beat.entries.items()} == \
        {n: e.fingerprint for n, e in schedule.entries.items()}

    # crawl status: the entries it lists and the errors it shows.
    store = open_store(app.conf.crawl_lease_url, namespace=app.conf.crawl_namespace)
    try:
        view = gather(app, store, limit=100)
    finally:
        store.close()
    assert {row["name"] for row in view["next_fires"]} == EXPECTED
    assert view["entries_total"] == len(EXPECTED)
    assert any("field 'cronn'" in e for e in view["errors"]), view["errors"]
    assert any("also defined in app.conf.beat_schedule" in e for e in view["errors"])

    # crawl next: every entry the beat runs is shown, the broken file's good entry is not.
    for name in EXPECTED:
        result = _cli(app, "next", name, "-n", "1")
        assert result.exit_code == 0, (name, result.output)
    result = _cli(app, "next", "fine-but-in-a-broken-file")
    assert result.exit_code == 1 and "broken.toml has errors" in result.output

    # crawl schedules check: lists each file entry, says which ones do not run, and why.
    result = _cli(app, "schedules", "check", "beat_schedules/*.toml")
    assert result.exit_code == 1
    shown = [line for line in result.output.splitlines() if line.startswith("  not run:")]
    assert len(shown) == 2, result.output  # the broken file's entry and the duplicate
    runs = {line.split()[0] for line in result.output.splitlines()
            if line and not line.startswith(" ") and "->" in line}
    not_run = set()
    lines = result.output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  not run:"):
            not_run.add(lines[i - 2].split()[0])
    assert (runs - not_run) | {"code-entry"} == EXPECTED
    assert not_run == {"fine-but-in-a-broken-file", "code-entry"}


def test_a_broken_file_keeps_the_beats_previous_entries(app_dir: tuple[Celery, Path]) -> None:
    app, root = app_dir
    first = assemble(app)
    (root / "beat_schedules" / "good.toml").write_text(GOOD + "\n[entries.x\n")
    again = assemble(app, previous=first.entries)
    assert set(again.entries) == EXPECTED and again.kept == {"good-a", "good-b"}
    assert set(assemble(app).entries) == {"code-entry"}  # a fresh process: none of that file
    assert not again.files_ok


def test_click_group_is_the_real_one() -> None:
    assert isinstance(crawl, click.Group) and {"next", "schedules"} <= set(crawl.commands)
