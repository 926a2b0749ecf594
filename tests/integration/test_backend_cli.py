"""`celery -A app crawl audit verify|show|export` as a user runs it, against a real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import states
from celery.app.task import Context
from click.testing import CliRunner, Result

from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


def crawl_process(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    """The command in its own process, exactly as an operator runs it."""
    env = {**os.environ, "TASKSAPP_REDIS_PORT": str(port), "PYTHONPATH": str(ROOT)}
    return subprocess.run([CELERY, "-A", "tests.system.tasksapp", "crawl", "audit", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def crawl(port: int, *args: str) -> Result:
    """The same command line through Celery's click entry point, in this process (faster)."""
    from celery.bin.celery import celery

    return CliRunner().invoke(celery, ["-A", "tests.system.tasksapp", "crawl", "audit", *args])


@pytest.fixture
def written(fresh_redis: RedisServer):
    from tests.system import tasksapp

    tasksapp.configure(fresh_redis.port)
    backend = tasksapp.app.backend
    backend.store_result("cli-1", {"rows": 3}, states.SUCCESS, request=Context(hostname="w1"))
    backend.store_result("cli-1", None, states.STARTED, request=Context(hostname="w2"))
    backend.store_result("cli-2", {"rows": 4}, states.SUCCESS, request=Context(hostname="w1"))
    return fresh_redis, backend


def test_verify_show_export_and_a_manually_altered_result(written) -> None:
    server, backend = written
    ok = crawl(server.port, "verify")
    assert ok.exit_code == 0, ok.output
    assert "2 ok" in ok.stdout and "0 diverging" in ok.stdout

    shown = crawl(server.port, "show", "cli-1")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:3] == ["time", "(UTC)", "state"]
    assert "written" in lines[2] and "w1" in lines[2]
    assert "refused-regression" in lines[3] and "STARTED" in lines[3]

    exported = crawl(server.port, "export", "--since", "2000-01-01T00:00:00+00:00")
    assert exported.exit_code == 0, exported.output
    rows = [json.loads(line) for line in exported.stdout.splitlines()]
    assert [(r["task"], r["state"], r["outcome"]) for r in rows] == [
        ("cli-1", "SUCCESS", "written"), ("cli-1", "STARTED", "refused-regression"),
        ("cli-2", "SUCCESS", "written")]
    assert crawl(server.port, "export", "--since", "2999-01-01T00:00:00Z").stdout == ""

    key = backend.get_key_for_task("cli-2")
    client = server.client()
    client.set(key, client.get(key).replace(b'"rows": 4', b'"rows": 5'))
    bad = crawl_process(server.port, "verify")
    assert bad.returncode == 1
    assert "DIVERGING cli-2" in bad.stdout


def test_bad_input_is_a_clear_error(written) -> None:
    server, _ = written
    missing = crawl(server.port, "show", "no-such-task")
    assert missing.exit_code != 0 and "no audit records" in missing.stderr
    naive = crawl(server.port, "export", "--since", "2026-01-01T00:00:00")
    assert naive.exit_code != 0 and "time zone" in naive.stderr
    assert missing.exception is None or isinstance(missing.exception, SystemExit)
