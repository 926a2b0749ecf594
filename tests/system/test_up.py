"""``celery-crawl up --duration 30`` as a user runs it: one leader, crawls run, clean exit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.system

CELERY_CRAWL = str(Path(sys.executable).with_name("celery-crawl"))


def test_up_runs_scheduled_crawls_under_one_leader_and_exits_cleanly(tmp_path: Path) -> None:
    workdir = tmp_path / "up"
    proc = subprocess.Popen(
        [CELERY_CRAWL, "up", "--duration", "30", "--no-color", "--workdir", str(workdir)],
        cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"celery-crawl up did not exit:\n{out[-5000:]}")
    (tmp_path / "up.log").write_text(out)
    assert proc.returncode == 0, out[-5000:]
    lines = out.splitlines()
    summary = "\n".join(lines[next(i for i, x in enumerate(lines) if "summary after" in x):])
    # One leader: elected once, never a second one without a kill.
    leaders = re.findall(r"leader is now (beat-\d)", out)
    assert len(leaders) == 1, out[-5000:]
    assert "leaders seen: 1 (failovers: 0" in summary
    # Scheduled crawls ran: demo-news fires every 5 s.
    runs = dict(re.findall(r"^\s+up \|\s+(demo-[\w-]+)\s+\S+\s+/\s+(\d+)", summary, re.M))
    assert int(runs.get("demo-news", 0)) >= 3, summary
    assert "pages: ok:" in summary
    # Flower was started with credentials printed, and everything stopped.
    assert re.search(r"flower\s+http://127\.0\.0\.1:\d+\s+user 'crawl' password '\S+'", out)
    assert "did not stop" not in out
    # No tracebacks from the supervisor, the site or the worker (a warm worker shutdown lets
    # running tasks finish). Beat replicas are checked by their own tests.
    noisy = [x for x in lines if "Traceback" in x and not x.lstrip().startswith("beat-")]
    assert not noisy, out[-5000:]
    assert "FAILED" not in summary
