"""``celery -A app crawl ...`` with hostile arguments: a non-zero exit with a message, never a
traceback; with passwords in every URL, nothing it prints contains one.

The app (tests/security/cliapp.py) talks to a real redis-server whose ``default`` user is off:
broker, result backend and lease store all need a password. Arguments are fuzzed in-process
through Celery's own click entry point (many examples), and a few representative cases run as
real ``celery`` subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.procs import ROOT
from tests.security.leaks import assert_no_secret
from tests.security.tlsservers import AclRedis

APP = "tests.security.cliapp"
CELERY = str(Path(sys.executable).with_name("celery"))
HOSTILE_TOML = b'[entries.bad]\ntask = 5\ncron = "61 25 32 13 8"\ntz = "Mars/Olympus"\n\xff\n'
GOOD_TOML = '[entries.good]\ntask = "t.x"\ncron = "15 2 * * *"\ntz = "Asia/Shanghai"\n'


@pytest.fixture(scope="module")
def cli_env(acl_redis: AclRedis, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, str]]:
    """Environment for the CLI app: every URL carries a password; one good and one hostile
    schedule file."""
    password = acl_redis.add_user("cli", ["~*", "&*", "+@all"])
    sched = tmp_path_factory.mktemp("schedules")
    (sched / "good.toml").write_text(GOOD_TOML)
    (sched / "hostile.toml").write_bytes(HOSTILE_TOML)
    env = {
        "CRAWL_SEC_BROKER": acl_redis.url("cli", password, db=1),
        "CRAWL_SEC_BACKEND": acl_redis.url("cli", password).replace("redis://", "crawlredis://"),
        "CRAWL_SEC_LEASE": acl_redis.url("cli", password),
        "CRAWL_SEC_NS": f"cli{uuid.uuid4().hex[:6]}",
        "CRAWL_SEC_SCHEDULES": str(sched / "*.toml"),
        "CRAWL_SEC_PASSWORD": password,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the in-process runs import the app module with these
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _celery_main() -> object:
    from celery.bin.celery import celery

    return celery


def _run_inprocess(args: list[str]) -> tuple[int, str, BaseException | None]:
    runner = CliRunner()
    result = runner.invoke(_celery_main(), ["-A", APP, "crawl", *args], catch_exceptions=True)
    return result.exit_code, result.output, result.exception


words = st.sampled_from([
    "status", "pause", "resume", "trigger", "backfill", "schedules", "check", "next", "audit",
    "verify", "show", "export", "--start", "--end", "-n", "--since", "--count", "-q", "--help",
    "-1", "0", "99999999999999999999", "nan", "inf", "0001-01-01T00:00:00+01:00",
    "9999-12-31T23:59:59-14:00", "2026-03-01T00:00:00", "2026-02-30T00:00:00Z", "99999999d",
    "1e400s", "", " ", "good", "bad", "💥", "../../..", "/dev/zero", "/", "*", "--", "-",
    "no-such.toml", "\x1b[2J", "a" * 5000, "--start=2026-01-01T00:00:00Z",
])
argv = st.lists(st.one_of(words, st.text(st.characters(blacklist_categories=("Cs", "Cc")),
                                         max_size=12)), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(args=argv)
@example(args=["backfill", "good", "--start", "0001-01-01T00:00:00+01:00", "--end",
               "2026-01-01T00:00:00Z"])
@example(args=["backfill", "good", "--start", "2026-01-01T00:00:00Z", "--end",
               "9999-12-31T23:59:59-14:00"])
@example(args=["audit", "export", "--since", "99999999d"])
@example(args=["audit", "export", "--since", "1e400s"])
@example(args=["next", "good", "-n", "99999999999999999999"])
@example(args=["schedules", "check", "/dev/zero"])
@example(args=["status", "-n", "-1"])
@example(args=["status"])
def test_garbage_arguments_in_process(cli_env: dict[str, str], args: list[str]) -> None:
    code, output, exc = _run_inprocess(args)
    assert exc is None or isinstance(exc, SystemExit), (
        f"crawl {args!r} crashed with {type(exc).__name__}: {exc}\n{output}")
    assert "Traceback" not in output, f"crawl {args!r} printed a traceback:\n{output}"
    if code != 0:
        assert output.strip(), f"crawl {args!r} failed silently"
    assert_no_secret(output, [cli_env["CRAWL_SEC_PASSWORD"]], f"the output of crawl {args!r}")


#: (arguments, variant, expected success). Run side by side as real processes.
SUBPROCESS_CASES = [
    (["backfill", "good", "--start", "0001-01-01T00:00:00+01:00", "--end", "2026-01-01T00:00:00Z"],
     None, False),
    (["schedules", "check", "/dev/zero"], None, False),
    (["no-such-command"], None, False),
    (["status"], "wrong-password", False),
    # No schedule files: a failure in the schedule part of status cannot hide a leak elsewhere.
    (["status"], "no-schedules", True),
]


def test_arguments_as_real_processes(cli_env: dict[str, str], tmp_path: Path) -> None:
    """Real ``celery`` processes: bad arguments exit != 0 with a message and no traceback;
    ``status`` against a store that refuses the password too; ``status`` that works prints
    the leader. No output carries the password."""
    procs = []
    for i, (args, variant, ok) in enumerate(SUBPROCESS_CASES):
        env = {**os.environ, **cli_env, "PYTHONPATH": str(ROOT)}
        if variant == "wrong-password":
            env["CRAWL_SEC_LEASE"] = cli_env["CRAWL_SEC_LEASE"].replace(
                cli_env["CRAWL_SEC_PASSWORD"], f"wrong-{cli_env['CRAWL_SEC_PASSWORD']}")
        elif variant == "no-schedules":
            env["CRAWL_SEC_SCHEDULES"] = str(tmp_path / "none" / "*.toml")
        out = open(tmp_path / f"out-{i}.txt", "wb")  # noqa: SIM115 - closed below
        procs.append((args, ok, out, subprocess.Popen(
            [CELERY, "-A", APP, "crawl", *args], cwd=str(ROOT), env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)))
    failures = []
    for args, ok, out, proc in procs:
        try:
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            out.close()
        text = Path(out.name).read_text(errors="replace")
        if ok and (code != 0 or "leader" not in text):
            failures.append(f"crawl {args!r}: exit {code}, expected success\n{text[-2000:]}")
        elif not ok and (code == 0 or "Traceback" in text or not text.strip()):
            failures.append(f"crawl {args!r}: exit {code}\n{text[-2000:]}")
        assert_no_secret(text, [cli_env["CRAWL_SEC_PASSWORD"]], f"the output of crawl {args!r}")
    assert not failures, "\n\n".join(failures)


def test_status_prints_no_password(cli_env: dict[str, str]) -> None:
    code, output, exc = _run_inprocess(["status"])
    assert exc is None or isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}\n{output}"
    assert code == 0, output
    assert "leader" in output
    assert_no_secret(output, [cli_env["CRAWL_SEC_PASSWORD"]], "the status output")


def test_status_does_not_echo_control_characters_from_the_store(cli_env: dict[str, str],
                                                                acl_redis: AclRedis) -> None:
    """Presence records are written by whoever can write the namespace: what ``status`` prints
    from them must not carry terminal escapes (retitle, clear screen) or forge whole lines."""
    acl_redis.admin().hset(
        f"{cli_env['CRAWL_SEC_NS']}:rec:beat/presence/forged", "v",
        '{"id": "\\u001b]0;pwned\\u0007\\u001b[2JEVIL", "role": "leader\\nFORGED LINE", '
        '"last_seen": 1}')
    _code, output, exc = _run_inprocess(["status"])
    assert exc is None or isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}\n{output}"
    assert "\x1b" not in output and "\x07" not in output, repr(output)
    assert not any(line.startswith("FORGED LINE") for line in output.splitlines()), output
