"""The fleet's schedule rule (beat/fleet.py) and where relative schedule paths resolve."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from celery import Celery

from celery_crawl.beat.entries import from_beat_schedule, zone_name, zoned
from celery_crawl.beat.fleet import Replica, judge
from celery_crawl.schedules import TzCron
from celery_crawl.schedules.fingerprint import schedule_fingerprint
from celery_crawl.schedules.root import schedule_base

V1 = {"fingerprint": "v1", "entries": 2}


def test_a_matching_replica_may_lead() -> None:
    assert judge("v1", 2, V1, [Replica("b", "v1", 2)]) is None
    assert judge("v1", 2, None, []) is None  # nothing adopted yet


def test_a_different_schedule_waits_while_a_live_replica_holds_the_fleets() -> None:
    reason = judge("v2", 3, V1, [Replica("a", "v1", 2), Replica("c", "v2", 3)])
    assert reason is not None
    assert "v2 (3 entries) differs from the fleet's v1 (2 entries)" in reason
    assert "replica(s) a still hold" in reason
    # The rollout: once nobody alive holds v1, the new schedule may lead (and be adopted).
    assert judge("v2", 3, V1, [Replica("c", "v2", 3)]) is None


def test_an_empty_schedule_never_leads_a_fleet_with_entries() -> None:
    reason = judge(schedule_fingerprint({}), 0, V1, [])
    assert reason is not None and "empty" in reason and "crawl_schedule_paths" in reason
    assert judge("e", 0, None, [Replica("a", None, 4)]) is not None
    assert judge("e", 0, None, [Replica("a", "x", 0)]) is None


def test_the_schedule_fingerprint_follows_names_and_definitions() -> None:
    a = schedule_fingerprint({"x": "1", "y": "2"})
    assert a == schedule_fingerprint({"y": "2", "x": "1"})
    assert a != schedule_fingerprint({"x": "1", "y": "3"})
    assert a != schedule_fingerprint({"x": "1"})
    assert len(a) == 16


def test_slots_are_shown_in_the_entrys_zone() -> None:
    app = Celery("z", set_as_current=False)
    entry = from_beat_schedule("sh", {"task": "t", "schedule": TzCron("15 2 * * *",
                                                                      "Asia/Shanghai")}, app)
    slot = datetime(2026, 3, 1, 18, 15, tzinfo=UTC)
    assert zone_name(entry) == "Asia/Shanghai"
    assert zoned(entry, slot) == "2026-03-02 02:15:00 CST"


def test_relative_schedule_paths_resolve_against_the_apps_import_root(tmp_path: Path) -> None:
    """The same app imported from two working directories reads the same files."""
    project = tmp_path / "project"
    (project / "proj").mkdir(parents=True)
    (project / "proj" / "__init__.py").write_text("")
    (project / "proj" / "celery.py").write_text(
        "from celery import Celery\napp = Celery('proj', set_as_current=False)\n")
    code = ("import proj.celery, sys\nfrom celery_crawl.schedules.root import schedule_base\n"
            "print(schedule_base(proj.celery.app).path)")
    seen = set()
    (tmp_path / "elsewhere").mkdir()
    for cwd in (tmp_path, tmp_path / "elsewhere"):
        out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                             text=True, timeout=60, env={"PYTHONPATH": str(project),
                                                          "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        seen.add(out.stdout.strip())
    assert seen == {str(project.resolve())}


def test_an_app_no_module_holds_falls_back_to_the_working_directory_and_says_so() -> None:
    base = schedule_base(Celery("local", set_as_current=False))
    assert base.module is None and base.path == Path.cwd()
    assert "working directory" in base.describe()
