#!/usr/bin/env python3
"""Run Celery's own integration tests against the plugins, side by side with stock Celery.

Not run by CI: a full run takes the better part of an hour. It answers one question: does any
test of Celery's ``t/integration/test_tasks.py`` and ``t/integration/test_canvas.py`` fail
with celery-crawl installed where it passes on stock Celery?

Celery's wheel has no ``t/`` package; take it from the source distribution of the installed
version (``pip download celery==X.Y.Z --no-binary :all:`` and unpack it) and name that
directory with ``--sdist``. The tests' task module needs ``pydantic``.

For each setup, one at a time, the script

* copies ``t/`` into a temp dir and adds a shim to its ``t/integration/conftest.py``
  (``SHIM`` below): ``celery_session_worker`` waits for an EXTERNAL ``celery worker`` instead
  of starting Celery's in-process one, ``celery_config`` names the worker's broker and backend
  (``result_extended``, the ``celery`` queue), ``celery.contrib.testing.app.TestApp`` runs
  ``celery_crawl.install`` on every app the tests make (the crawl setups), the
  ``flaky``/``timeout`` marks are dropped (pytest-rerunfailures is not a dependency; the
  per-test ``--timeout`` of pytest-timeout applies), and the tests' ``result_backend`` gates
  (``startswith('redis')``) read ``crawlredis://`` as the Redis backend it is;
* starts its own redis-server on a free port (``tests/servers.py``) and, for a RabbitMQ setup,
  a fresh vhost on the machine's RabbitMQ (deleted at the end);
* starts ``celery worker -P prefork -c 1`` (the pool and concurrency of Celery's session
  worker) in its own session, runs pytest, and kills the worker's process group.

Setups (``--setups``, comma-separated, in this order by default):

``stock``         Redis broker, ``redis://`` backend, Celery's defaults.
``crawl-redis``   Redis broker, ``crawlredis://`` backend, ``install(app)`` on the worker's
                  and the tests' apps, ``crawl_lease_url`` = the broker URL (claims ride the
                  broker's round trips).
``stock-rabbit``  RabbitMQ broker, ``redis://`` backend (reference for the RabbitMQ-only tests).
``crawl-rabbit``  RabbitMQ broker, Redis lease store, ``crawlredis://`` backend (the claim line).

It prints one row per test with the outcome in each setup (pass, fail, error, skip, xfail), a
count per setup, and the "new failures": tests that fail or error with the plugins and pass
on the stock setup of the same broker (``stock-rabbit`` for ``crawl-rabbit`` when it ran,
else ``stock``). Each setup's junit XML, pytest output and worker log are kept under ``--out``.

Run it nice'd, e.g.::

    nice -n 10 .venv/bin/python scripts/celery_suite.py --sdist /tmp/csrc/celery-5.7.0 \
        --out /tmp/celery-suite

Tests that read the in-process worker's state, signals or log records (``worker_state``,
``caplog``) fail on every setup, stock included: 18 of 303 on Celery 5.7. A setup takes about
20 minutes.

``-k EXPR`` selects tests as pytest's ``-k`` does; ``--tests`` names other test files of ``t/``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.servers import RedisServer, delete_rabbit_vhost, make_rabbit_vhost  # noqa: E402

SETUPS = ("stock", "crawl-redis", "stock-rabbit", "crawl-rabbit")
DEFAULT_TESTS = ("t/integration/test_tasks.py", "t/integration/test_canvas.py")

#: The worker's app: one module, configured by the environment the script sets.
WORKER_APP = '''\
import os

from celery import Celery

app = Celery("celery.tests")
app.conf.update(
    broker_url=os.environ["SUITE_BROKER"],
    result_backend=os.environ["SUITE_BACKEND"],
    result_extended=True,
    task_create_missing_queues=False,
    accept_content={"json"},
    enable_utc=True,
    timezone="UTC",
    broker_heartbeat=0,
)
if os.environ.get("SUITE_CRAWL") == "1":
    # Before the tasks are bound: a task takes task_acks_late (which install sets) then.
    import celery_crawl

    app.conf.crawl_lease_url = os.environ["SUITE_LEASE_URL"]
    celery_crawl.install(app)
app.loader.import_task_module("celery.contrib.testing.tasks")
app.loader.import_task_module("t.integration.tasks")
from t.integration.tasks import ClassBasedAutoRetryTask  # noqa: E402

app.register_task(ClassBasedAutoRetryTask)
'''

#: Appended to the copy of ``t/integration/conftest.py``: its names replace the conftest's.
SHIM = '''

# --- celery_suite.py shim: an external worker, and the plugins on every test app ----------
import os as _os
import time as _time

import celery.contrib.testing.app as _testing_app
import pytest as _pytest

_SUITE_CRAWL = _os.environ.get("SUITE_CRAWL") == "1"
_suite_test_app = _testing_app.TestApp


def _crawl_test_app(*args, **kwargs):
    app = _suite_test_app(*args, **kwargs)
    if _SUITE_CRAWL:
        import celery_crawl

        app.conf.crawl_lease_url = _os.environ["SUITE_LEASE_URL"]
        celery_crawl.install(app)
    return app


_testing_app.TestApp = _crawl_test_app


@_pytest.fixture(scope="session")
def celery_config(request):
    return {
        "broker_url": _os.environ["SUITE_BROKER"],
        "result_backend": _os.environ["SUITE_BACKEND"],
        "result_extended": True,
        "task_create_missing_queues": False,
    }


@_pytest.fixture(scope="session")
def celery_session_worker(celery_session_app, celery_includes, celery_class_tasks):
    """The external worker the script started: wait until it answers a ping."""
    for module in celery_includes:
        celery_session_app.loader.import_task_module(module)
    for class_task in celery_class_tasks:
        celery_session_app.register_task(class_task)
    deadline = _time.monotonic() + 90
    while not celery_session_app.control.ping(timeout=1.0):
        if _time.monotonic() > deadline:
            raise RuntimeError("the external worker did not answer a ping in 90 s")
    yield None


def pytest_collection_modifyitems(items):
    for item in items:
        item.own_markers[:] = [m for m in item.own_markers if m.name not in ("flaky", "timeout")]
'''

#: Celery's own pytest settings (its pyproject.toml), less ``--strict-markers``.
PYTEST_INI = """\
[pytest]
python_classes = test_*
xfail_strict = true
markers =
    sleepdeprived_patched_module
    masked_modules
    patched_environ
    patched_module
    flaky: neutralised (pytest-rerunfailures is not used)
    timeout
    amqp
    celery
"""

GATES = (
    (".conf.result_backend.startswith(",
     ".conf.result_backend.replace('crawlredis', 'redis', 1).startswith("),
)


def _copy_suite(sdist: Path, into: Path) -> None:
    shutil.copytree(sdist / "t", into / "t")
    (into / "worker_app.py").write_text(WORKER_APP)
    (into / "pytest.ini").write_text(PYTEST_INI)
    with (into / "t" / "integration" / "conftest.py").open("a") as f:
        f.write(SHIM)
    for path in (into / "t" / "integration").glob("test_*.py"):
        text = path.read_text()
        for old, new in GATES:
            text = text.replace(old, new)
        path.write_text(text)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


RANK = {"pass": 0, "skip": 1, "xfail": 1, "fail": 2, "error": 2}


def _outcomes(junit: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".replace(
            "t.integration.", "")
        outcome = "pass"
        for child in case:
            if child.tag == "failure":
                outcome = "fail"
            elif child.tag == "error":
                outcome = "error"
            elif child.tag == "skipped":
                outcome = "xfail" if child.get("type") == "pytest.xfail" else "skip"
        # A test can appear twice (an error in teardown after its call): keep the worse.
        if RANK[outcome] >= RANK.get(out.get(name, "pass"), 0):
            out[name] = outcome
    return out


def run_setup(setup: str, args: argparse.Namespace, out: Path) -> tuple[dict[str, str], float]:
    rabbit = setup.endswith("rabbit")
    crawl = setup.startswith("crawl")
    work = Path(tempfile.mkdtemp(prefix=f"celery-suite-{setup}-"))
    server = RedisServer().start()
    vhost = None
    worker = None
    started = time.monotonic()
    try:
        if rabbit:
            vhost = make_rabbit_vhost()
            if vhost is None:
                print(f"[{setup}] no RabbitMQ here: skipped", flush=True)
                return {}, 0.0
            broker = f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
            lease = server.url_db(2)
        else:
            broker = server.url_db(0)
            lease = broker
        backend = server.url_db(1)
        _copy_suite(args.sdist, work)
        env = dict(os.environ)
        env.update({
            "SUITE_BROKER": broker,
            "SUITE_BACKEND": ("crawl" + backend) if crawl else backend,
            "SUITE_CRAWL": "1" if crawl else "0",
            "SUITE_LEASE_URL": lease,
            # Celery's conftest reads these for its gates and its own Redis helpers (db 0).
            "TEST_BROKER": broker,
            "TEST_BACKEND": backend,
            "REDIS_HOST": "127.0.0.1",
            "REDIS_PORT": str(server.port),
            "PYTHONPATH": os.pathsep.join([str(work), str(REPO)]),
        })
        wlog = (out / f"{setup}.worker.log").open("wb")
        worker = subprocess.Popen(
            [args.python, "-m", "celery", "-A", "worker_app", "worker", "-P", "prefork",
             "-c", "1", "-l", "info", "-n", f"suite-{setup}@%h", "--without-heartbeat",
             "--without-mingle", "--without-gossip"],
            cwd=work, env=env, stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True)
        junit = out / f"{setup}.junit.xml"
        cmd = [args.python, "-m", "pytest", *args.tests, "-p", "no:cacheprovider",
               "-p", "celery.contrib.pytest",
               f"--timeout={args.timeout}", f"--junitxml={junit}", "-o",
               "junit_family=xunit1", "-rA", "-q"]
        if args.k:
            cmd += ["-k", args.k]
        print(f"[{setup}] broker {broker}, backend {env['SUITE_BACKEND']}", flush=True)
        with (out / f"{setup}.pytest.log").open("wb") as plog:
            pytest_proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=plog,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            try:
                pytest_proc.wait(timeout=args.setup_timeout)
            except subprocess.TimeoutExpired:
                print(f"[{setup}] pytest still running after {args.setup_timeout} s: killed",
                      flush=True)
            finally:
                _kill_group(pytest_proc)
        return _outcomes(junit), time.monotonic() - started
    finally:
        if worker is not None:
            _kill_group(worker)
        server.cleanup()
        if vhost is not None:
            delete_rabbit_vhost(vhost)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _reference(setup: str, done: list[str]) -> str | None:
    if setup == "crawl-rabbit" and "stock-rabbit" in done:
        return "stock-rabbit"
    return "stock" if "stock" in done else None


def report(results: dict[str, dict[str, str]], times: dict[str, float]) -> str:
    done = list(results)
    names = sorted({n for r in results.values() for n in r})
    width = max([len(n) for n in names] + [10])
    lines = [f"{'test':<{width}}  " + "  ".join(f"{s:>12}" for s in done)]
    for n in names:
        lines.append(f"{n:<{width}}  " + "  ".join(f"{results[s].get(n, '-'):>12}" for s in done))
    lines.append("")
    for s in done:
        counts: dict[str, int] = {}
        for v in results[s].values():
            counts[v] = counts.get(v, 0) + 1
        summary = ", ".join(f"{k} {counts[k]}" for k in sorted(counts))
        lines.append(f"{s}: {len(results[s])} tests ({summary}) in {times[s]:.0f} s")
    lines.append("")
    lines.append("new failures (fail/error with the plugins, pass on stock of the same broker):")
    found = False
    for s in done:
        ref = _reference(s, done) if s.startswith("crawl") else None
        if ref is None:
            continue
        for n in names:
            if results[s].get(n) in ("fail", "error") and results[ref].get(n) == "pass":
                lines.append(f"  {s}: {n}")
                found = True
    if not found:
        lines.append("  none")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", type=Path, required=True,
                        help="unpacked Celery source distribution (has t/)")
    parser.add_argument("--setups", default="stock,crawl-redis,stock-rabbit,crawl-rabbit")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS))
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--setup-timeout", type=int, default=3600,
                        help="seconds for one setup's pytest run")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "celery-suite")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--keep", action="store_true", help="keep the temp copies of t/")
    parser.add_argument("--load", action="append", default=[], metavar="SETUP=JUNIT",
                        help="take a setup's outcomes from an earlier run's junit XML "
                             "(e.g. stock=/tmp/celery-suite/stock.junit.xml) instead of running it")
    args = parser.parse_args(argv)
    if not (args.sdist / "t" / "integration").is_dir():
        parser.error(f"{args.sdist} has no t/integration")
    setups = [s for s in args.setups.split(",") if s]
    for s in setups:
        if s not in SETUPS:
            parser.error(f"unknown setup {s!r}; known: {', '.join(SETUPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, str]] = {}
    times: dict[str, float] = {}
    for item in args.load:
        name, _, junit = item.partition("=")
        if name not in SETUPS or not Path(junit).exists():
            parser.error(f"--load {item!r}: SETUP=JUNIT with a known setup and an existing file")
        results[name] = _outcomes(Path(junit))
        times[name] = float(ET.parse(junit).getroot().iter("testsuite").__next__()
                            .get("time", 0))
        setups = [s for s in setups if s != name]
    for s in setups:
        outcome, took = run_setup(s, args, args.out)
        if outcome:
            results[s], times[s] = outcome, took
            print(f"[{s}] {len(outcome)} tests in {took:.0f} s", flush=True)
        (args.out / "table.txt").write_text(report(results, times) + "\n")
    text = report(results, times)
    print(text)
    (args.out / "table.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
