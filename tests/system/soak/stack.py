"""The servers and celery processes of one soak run.

* the *stack* Redis (AOF on, ``appendfsync always``): broker (db 0), audited result backend
  (db 0) and, in the Redis run, the lease store — everything a Redis fault hits;
* for the etcd run, a 3-member etcd cluster holding the leases;
* for the Sentinel run, instead of the stack Redis, one master, two replicas and three
  sentinels (``tests.sentinels``): the broker is kombu's ``sentinel://``, the result backend
  ``crawlredis+sentinel://`` and the lease store ``redis+sentinel://``, each finding the master
  through the sentinels (no proxies: a process connects to whichever node is the master);
* the *sink* Redis: where the recorder writes its evidence; no fault ever touches it;
* three ``celery beat -S celery_crawl.beat:LeasedScheduler`` replicas and two prefork workers,
  each in its own session (``tests.procs.Proc``), restartable, one replica optionally under
  libfaketime (preloaded into that process only);
* for every process, its own TCP proxy (``tests.tcpproxy``) in front of each lease-store
  endpoint, so a fault can cut one process off the store (or slow its link) while it keeps the
  broker and the result backend;
* the last beat replica always runs under libfaketime with its offset read from a file
  (``FAKETIME_TIMESTAMP_FILE``, no cache): writing the file steps that process's wall clock
  while it runs.

A process that exits while the soak did not stop it is an *unexpected exit*: it is counted,
its log tail kept, and it is restarted so the soak goes on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.clusters import EtcdCluster
from tests.procs import CELERY, Proc, celery_args, faketime_lib, worker_args
from tests.sentinels import MASTER, SentinelSet
from tests.servers import RedisServer, wait_until
from tests.tcpproxy import TcpProxy

__all__ = ["ENTRIES", "Member", "Stack"]

APP = "tests.system.soak.recorder"

#: The soak's schedule: every-second and every-few-seconds TzCron entries in several zones,
#: with mixed overlap and catch-up policies. ``duration_s`` is how long each run works.
ENTRIES: dict[str, dict[str, Any]] = {
    "sec-latest": {"cron": "* * * * * *", "tz": "UTC", "duration_s": 0.2,
                   "overlap": "skip", "catchup": "latest"},
    "sec-all": {"cron": "* * * * * *", "tz": "Europe/Berlin", "duration_s": 0.1,
                "overlap": "allow", "catchup": "all", "catchup_window": "20s",
                "catchup_max": 5},
    "three-skip": {"cron": "*/3 * * * * *", "tz": "Asia/Shanghai", "duration_s": 4.0,
                   "overlap": "skip", "catchup": "none"},
    "two-buffer": {"cron": "*/2 * * * * *", "tz": "America/New_York", "duration_s": 2.5,
                   "overlap": "buffer_one", "catchup": "latest"},
    "five-cancel": {"cron": "*/5 * * * * *", "tz": "Australia/Lord_Howe", "duration_s": 0.5,
                    "overlap": "cancel_other", "catchup": "all", "catchup_window": "30s"},
}


def schedule_toml(entries: dict[str, dict[str, Any]]) -> str:
    """The schedule file of the soak (TOML, as users write it)."""
    out = ['[defaults]', 'queue = "celery"', ""]
    for name, spec in entries.items():
        out.append(f"[entries.{name}]")
        out.append('task = "soak.record"')
        out.append(f'cron = "{spec["cron"]}"')
        out.append(f'tz = "{spec["tz"]}"')
        out.append(f'args = ["{name}", {spec["duration_s"]}]')
        for key in ("overlap", "catchup", "catchup_window", "catchup_max"):
            if key in spec:
                value = spec[key]
                out.append(f"{key} = " + (f'"{value}"' if isinstance(value, str) else str(value)))
        out.append("")
    return "\n".join(out)


@dataclass
class Member:
    """One beat replica or worker: its command, its current process, how it was last stopped."""

    name: str
    role: str  # "beat" | "worker"
    args: list[str]
    env: dict[str, str]
    log_dir: Path
    proc: Proc | None = None
    skew: str | None = None  # libfaketime offset, e.g. "+5s"; None: the real clock
    clock_file: Path | None = None  # libfaketime offset file, stepped at run time
    proxies: list[TcpProxy] = field(default_factory=list)  # this process -> the lease store
    expected_down: bool = False
    stopped: bool = False  # SIGSTOPped by the soak
    starts: int = 0
    exits: list[str] = field(default_factory=list)
    term_hangs: int = 0  # SIGTERMs it did not obey within the grace (then SIGKILLed)

    def start(self) -> None:
        env = dict(self.env)
        preload = None
        if self.skew or self.clock_file is not None:
            preload = faketime_lib()
            assert preload, "libfaketime is not installed (apt-get install faketime)"
            env.update(FAKETIME_DONT_FAKE_MONOTONIC="1", FAKETIME_NO_CACHE="1",
                       PYTHONPATH=str(Path(__file__).with_name("faketime_site")))
            if self.skew:
                env["FAKETIME"] = self.skew
            else:
                assert self.clock_file is not None
                env["FAKETIME_TIMESTAMP_FILE"] = str(self.clock_file)
        self.starts += 1
        log = self.log_dir / f"{self.name}.{self.starts}.log"
        self.proc = Proc(self.args, env=env, log_path=log, preload=preload)
        self.expected_down = False
        self.stopped = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            self.proc.signal_group(sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def kill9(self) -> None:
        self.expected_down = True
        if self.proc is not None:
            self.proc.kill9()
            self.proc.stop(grace_s=0)

    def terminate(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (after SIGCONT, in case it is stopped) and wait; SIGKILL after the grace."""
        self.expected_down = True
        if self.proc is None:
            return None
        self.proc.signal_group(signal.SIGCONT)
        code = self.proc.stop(grace_s=grace_s)
        self.stopped = False
        if code == -signal.SIGKILL:
            self.term_hangs += 1
        return code

    def cut_off(self) -> None:
        """A partition between this process and the lease store (broker and backend stay)."""
        for proxy in self.proxies:
            proxy.black_hole()

    def slow_store(self, delay_s: float) -> None:
        for proxy in self.proxies:
            proxy.latency(delay_s)

    def heal_store(self) -> None:
        for proxy in self.proxies:
            proxy.passthrough()

    def step_clock(self, offset: str) -> None:
        """Step the wall clock of a process running on ``clock_file`` (e.g. ``"+1h"``)."""
        assert self.clock_file is not None, f"{self.name} does not run on a clock file"
        tmp = self.clock_file.with_suffix(".tmp")
        tmp.write_text(offset + "\n")
        tmp.replace(self.clock_file)  # libfaketime never reads a half-written offset

    def log_tail(self, n: int = 30) -> str:
        text = self.proc.log() if self.proc is not None else ""
        return "\n".join(text.splitlines()[-n:])


class Stack:
    """Servers and processes of one soak run on one lease store (``"redis"`` or ``"etcd"``)."""

    def __init__(self, store: str, workdir: Path, *, ttl_s: float = 3.0, beats: int = 3,
                 workers: int = 2, concurrency: int = 3) -> None:
        if store not in ("redis", "etcd", "sentinel"):
            raise ValueError(f"store must be 'redis', 'etcd' or 'sentinel', not {store!r}")
        self.store_kind = store
        self.workdir = workdir
        self.ttl_s = ttl_s
        self.namespace = f"soak{os.getpid()}{store}"
        self.redis = RedisServer(appendonly=True)
        self.sink = RedisServer()
        self.etcd: EtcdCluster | None = EtcdCluster() if store == "etcd" else None
        self.sentinels: SentinelSet | None = SentinelSet() if store == "sentinel" else None
        self.beats: list[Member] = []
        self.workers: list[Member] = []
        self._n_beats = beats
        self._n_workers = workers
        self._concurrency = concurrency
        self.unexpected_exits: list[str] = []
        self._proxies: dict[str, list[TcpProxy]] = {}
        self.lock = threading.RLock()

    # -- servers ----------------------------------------------------------------------------
    @property
    def lease_url(self) -> str:
        if self.etcd is not None:
            # Every member: the store's gRPC channel fails over between them.
            return f"etcd://{self.etcd.endpoints}"
        if self.sentinels is not None:
            return self.sentinels.url()
        return self.redis.url

    def broker_client(self) -> Any:
        """A client of the broker's Redis (the current master behind Sentinel)."""
        if self.sentinels is not None:
            return self.sentinels.master().client()
        return self.redis.client()

    def _store_endpoints(self) -> list[tuple[str, int]]:
        if self.etcd is not None:
            return [(host, int(port)) for host, port in
                    (e.rsplit(":", 1) for e in self.etcd.endpoints.split(","))]
        return [("127.0.0.1", self.redis.port)]

    def _proxied(self, member_name: str) -> tuple[list[TcpProxy], str]:
        """Proxies in front of every store endpoint for one process, and its lease URL (none
        behind Sentinel: the master moves, the process follows the sentinels)."""
        if self.sentinels is not None:
            return [], self.lease_url
        proxies = [TcpProxy(host, port) for host, port in self._store_endpoints()]
        self._proxies[member_name] = proxies
        if self.etcd is not None:
            url = "etcd://" + ",".join(f"127.0.0.1:{p.port}" for p in proxies)
        else:
            url = f"redis://127.0.0.1:{proxies[0].port}/0"
        return proxies, url

    def env(self) -> dict[str, str]:
        if self.sentinels is not None:
            hosts = self.sentinels.url().split("://", 1)[1]
            urls = {"SOAK_BROKER_URL": self.sentinels.broker_url(),
                    "SOAK_BACKEND_URL": f"crawlredis+sentinel://{hosts}",
                    "SOAK_SENTINEL_MASTER": MASTER}
        else:
            urls = {"SOAK_BROKER_URL": self.redis.url,
                    "SOAK_BACKEND_URL": f"crawlredis://127.0.0.1:{self.redis.port}/0"}
        return {
            **urls,
            "SOAK_LEASE_URL": self.lease_url,
            "SOAK_NAMESPACE": self.namespace,
            "SOAK_SCHEDULES": str(self.workdir / "schedules" / "*.toml"),
            "SOAK_SINK_URL": self.sink.url,
            "SOAK_BEAT_TTL": str(self.ttl_s),
            "SOAK_WORKER_TTL": str(self.ttl_s),
        }

    def start(self) -> Stack:
        (self.workdir / "schedules").mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (self.workdir / "schedules" / "soak.toml").write_text(schedule_toml(ENTRIES))
        if self.sentinels is not None:
            self.sentinels.start()
        else:
            self.redis.start()
        self.sink.start()
        if self.etcd is not None:
            self.etcd.start()
        env = self.env()
        logs = self.workdir / "logs"

        def member(name: str, role: str, args: list[str]) -> Member:
            proxies, url = self._proxied(name)
            return Member(name, role, args, {**env, "SOAK_LEASE_URL": url}, logs,
                          proxies=proxies)

        for i in range(self._n_beats):
            args = celery_args(APP, "beat", "-S", "celery_crawl.beat:LeasedScheduler",
                               "-l", "INFO", "-s", str(self.workdir / f"beat{i}-schedule"),
                               "--max-interval", "1")
            self.beats.append(member(f"beat{i}", "beat", args))
        if self.sentinels is None:  # the Sentinel run is about the store, on real clocks
            stepped = self.beats[-1]
            stepped.clock_file = self.workdir / f"{stepped.name}.faketime"
            stepped.step_clock("+0")
        for i in range(self._n_workers):
            args = worker_args(APP, concurrency=self._concurrency, hostname=f"w{i}@soak")
            self.workers.append(member(f"w{i}", "worker", args))
        for m in [*self.workers, *self.beats]:
            m.start()
        return self

    # -- process supervision ----------------------------------------------------------------
    def members(self) -> list[Member]:
        return [*self.beats, *self.workers]

    def by_pid(self, pid: int) -> Member | None:
        return next((m for m in self.members() if m.pid == pid), None)

    def check_exits(self) -> None:
        """Count and restart processes that exited although the soak did not stop them."""
        with self.lock:
            for m in self.members():
                if m.proc is None or m.expected_down or m.alive():
                    continue
                code = m.proc.proc.returncode
                tail = m.log_tail()
                self.unexpected_exits.append(f"{m.name} (exit {code}):\n{tail}")
                m.exits.append(f"exit {code}")
                m.proc.stop(grace_s=0)
                m.start()

    def beat_exits(self) -> int:
        return sum(1 for e in self.unexpected_exits if e.startswith("beat"))

    # -- teardown ---------------------------------------------------------------------------
    def stop(self, grace_s: float = 8.0) -> dict[str, int | None]:
        """SIGTERM every process at once and wait for all of them within one grace period."""
        codes: dict[str, int | None] = {}
        with self.lock:
            members = [m for m in self.members() if m.proc is not None]
            for m in members:
                m.expected_down = True
                assert m.proc is not None
                m.proc.signal_group(signal.SIGCONT)
                # The main process only, once: that is a warm shutdown for celery (a second
                # SIGTERM, or one to the pool children, is not).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for m in members:
                assert m.proc is not None
                while m.proc.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                hung = m.proc.alive()
                codes[m.name] = m.proc.stop(grace_s=0)
                if hung and m.role == "beat":
                    m.term_hangs += 1
        return codes

    def term_hangs(self) -> list[str]:
        """Beat replicas that ignored a SIGTERM for longer than the grace period."""
        return [f"{m.name} x{m.term_hangs}" for m in self.beats if m.term_hangs]

    def cleanup(self) -> None:
        with self.lock:
            for m in self.members():
                if m.proc is not None:
                    m.expected_down = True
                    with contextlib.suppress(Exception):
                        m.proc.signal_group(signal.SIGCONT)
                        m.proc.stop(grace_s=0)
        for proxies in self._proxies.values():
            for proxy in proxies:
                proxy.close()
        self.redis.cleanup()
        if self.sentinels is not None:
            self.sentinels.cleanup()
        self.sink.cleanup()
        if self.etcd is not None:
            self.etcd.cleanup()

    # -- operator view ----------------------------------------------------------------------
    def celery(self, *rest: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``celery -A <soak app> ...`` with this stack's environment."""
        from tests.procs import ROOT

        env = {**os.environ, **self.env(), "PYTHONPATH": str(ROOT)}
        return subprocess.run([CELERY, "-A", APP, *rest], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=str(ROOT))

    def wait_sink(self, timeout_s: float) -> None:
        wait_until(lambda: self.sink.client().ping(), timeout_s, what="sink redis")

    def describe(self) -> str:
        where = (f"sentinels={self.sentinels.broker_url()} master={MASTER}"
                 if self.sentinels is not None else f"stack redis={self.redis.url} (AOF always)")
        return textwrap.dedent(f"""\
            store={self.store_kind} lease_url={self.lease_url} namespace={self.namespace}
            {where} sink={self.sink.url}
            workdir={self.workdir}""")


def now() -> float:
    """Wall clock for the soak's own timeline (epoch seconds, like the recorder's records)."""
    return time.time()
