"""The beat's Celery-free cores: they load without Celery, and their cheap parts in-process.

The import check runs in a fresh interpreter with ``celery`` (and ``kombu``) blocked in
``sys.modules``. The package ``__init__`` modules are replaced by empty packages with the real
``__path__`` there, because the top-level ``celery_crawl`` re-exports Celery-bound classes on
purpose; what is checked is that each core module, and every module it imports, needs no Celery.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest

import celery_crawl
from celery_crawl.beat.commands import MAX_BACKFILL, Command, slots_of
from celery_crawl.beat.dispatch import Dispatcher
from celery_crawl.beat.election import Election
from celery_crawl.beat.guards import Guards
from celery_crawl.beat.reload import FileWatch, changed_names
from celery_crawl.clock import Clock, monotonic
from celery_crawl.schedules.policies import (
    CATCHUP_POLICIES,
    OVERLAP_POLICIES,
    Catchup,
    Fold,
    Gap,
    Overlap,
)

CORES = [
    "celery_crawl.beat.election", "celery_crawl.beat.slots", "celery_crawl.beat.state",
    "celery_crawl.beat.clockstep", "celery_crawl.beat.index", "celery_crawl.beat.guards",
    "celery_crawl.beat.book", "celery_crawl.beat.dispatch", "celery_crawl.beat.commands",
    "celery_crawl.beat.reload", "celery_crawl.beat.verify", "celery_crawl.beat.term",
    "celery_crawl.beat.fleet", "celery_crawl.schedules.root",
    "celery_crawl.schedules.policies",
]

_PROBE = """
import importlib, json, sys, types
from pathlib import Path
root = Path(sys.argv[1])
for blocked in ("celery", "kombu"):
    sys.modules[blocked] = None  # any import of it raises ImportError
for init in sorted(root.rglob("__init__.py")):
    rel = init.parent.relative_to(root.parent)
    name = ".".join(rel.parts)
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(init.parent)]
    sys.modules[name] = pkg
loaded, failed = [], {}
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
        loaded.append(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
bound = sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "kombu")
               and sys.modules[m] is not None)
print(json.dumps({"loaded": loaded, "failed": failed, "celery_modules": bound}))
"""


def test_the_cores_load_with_celery_blocked() -> None:
    root = Path(celery_crawl.__file__).parent
    out = subprocess.run([sys.executable, "-c", _PROBE, str(root), json.dumps(CORES)],
                         capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(out.stdout)
    assert report["failed"] == {}, report["failed"]
    assert report["loaded"] == CORES and report["celery_modules"] == []


def test_the_probe_does_catch_a_celery_import() -> None:
    # The probe must fail for a module that imports Celery, or the test above proves nothing.
    root = Path(celery_crawl.__file__).parent
    out = subprocess.run([sys.executable, "-c", _PROBE, str(root),
                          json.dumps(["celery_crawl.beat.scheduler"])],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "celery_crawl.beat.scheduler" in json.loads(out.stdout)["failed"]


def test_policies_are_their_strings() -> None:
    assert Overlap("buffer_one") is Overlap.BUFFER_ONE and Overlap.SKIP == "skip"
    assert OVERLAP_POLICIES == ("skip", "buffer_one", "allow", "cancel_other")
    assert CATCHUP_POLICIES == ("none", "latest", "all") and Catchup.ALL == "all"
    assert {Gap.SHIFT, Fold.BOTH} == {"shift", "both"}
    assert json.dumps({"o": Overlap.CANCEL_OTHER}) == '{"o": "cancel_other"}'  # fingerprints


def test_every_overlap_policy_has_a_handler() -> None:
    d = Dispatcher(cast(Any, None), Election(3.0, clock=monotonic), cast(Any, None),
                   now=lambda: datetime.now(UTC),
                   renew=lambda: None, publish=lambda *a, **k: None, revoke=lambda *a: None)
    assert set(d._on_overlap) == set(Overlap)


class _Slots:
    def next_slot(self, after: datetime) -> datetime:
        return (after + timedelta(minutes=1)).replace(second=0, microsecond=0)


def test_backfill_and_trigger_slots() -> None:
    start = datetime(2026, 3, 1, tzinfo=UTC)
    now = start + timedelta(minutes=10, seconds=30)
    cmd = Command("backfill", "e", start=start, end=start + timedelta(hours=1))
    slots = slots_of(cmd, _Slots(), now)
    assert slots[0] == start and slots[-1] == start + timedelta(minutes=10)  # never the future
    assert len(slots_of(Command("backfill", "e", start=start - timedelta(days=30), end=now),
                        _Slots(), now)) == MAX_BACKFILL
    issued = start + timedelta(seconds=7)
    assert slots_of(Command("trigger", "e", issued_at=issued), _Slots(), now) == [issued]


def test_file_watch_sees_changes_not_touches(tmp_path: Path) -> None:
    f = tmp_path / "a.toml"
    f.write_text("x")
    watch = FileWatch([str(tmp_path / "*.toml")])
    assert watch.changed(force=True) and not watch.changed()
    f.write_text("xy")
    assert watch.changed() and not watch.changed()
    (tmp_path / "b.toml").write_text("")
    assert watch.changed()
    os.utime(f, ns=(1, 1))
    assert watch.changed()  # a new mtime is a change of signature; fingerprints decide later


def test_changed_names_by_fingerprint() -> None:
    class E:
        def __init__(self, fp: str) -> None:
            self.fingerprint = fp

    old = {"a": E("1"), "b": E("2"), "c": E("3")}
    new = {"a": E("1"), "b": E("x"), "d": E("4")}
    assert changed_names(old, new) == {"b", "c", "d"}


class _RefClock:
    """A reference clock the test sets (a real ``Clock`` calibrates against it)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def server_time(self) -> float:
        import time
        return time.time() + self.offset


@pytest.mark.parametrize(("offset", "blocked"), [(0.0, False), (5.0, True)])
def test_skew_guard_blocks_a_skewed_standby(offset: float, blocked: bool) -> None:
    demoted: list[str] = []
    election = Election(3.0, clock=monotonic)
    ref = _RefClock()
    ref.offset = offset
    clock = Clock(cast(Any, ref))
    guards = Guards(cast(Any, None), clock, election, max_skew_s=1.0, store_timeout_s=1.0,
                    demoted=demoted.append)
    guards.check_skew()
    assert (election.blocked_reason is not None) is blocked
    assert demoted == []  # a standby has no leadership to end
    if blocked:
        assert "crawl_max_clock_skew=1s" in (guards.reason or "")
    guards.judge_skew(None)  # never measured: fail closed
    assert election.blocked_reason and "could not be compared" in election.blocked_reason
