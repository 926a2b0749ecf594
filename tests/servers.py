"""Real servers for tests: redis-server and etcd on free loopback ports in a temp dir.

No mocks: every integration and system test talks to one of these (or to the machine's
RabbitMQ through a vhost made for the run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from celery_crawl.up import find_redis_server

if TYPE_CHECKING:
    from celery_crawl.leases import LeaseStore


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_cluster_port() -> int:
    """A free port whose Redis Cluster bus port (port + 10000) is free and below 65536.

    The kernel's ephemeral range reaches 60999, so ``free_port()`` alone can hand out a port
    whose bus port does not exist, and redis-server then refuses to start.
    """
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    for port in range(20000, 55000, 7):
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


#: ``result_backend_transport_options`` for a test's client app whose Redis stops with its
#: module: an ``AsyncResult`` collected later unsubscribes through the backend's retry policy,
#: and Celery's default (20 retries a second apart) would stall whichever test ran the collector.
CLIENT_RESULT_OPTIONS = {"retry_policy": {"max_retries": 1, "interval_start": 0,
                                          "interval_step": 0.2, "interval_max": 0.2}}


def missing_tool(reason: str) -> None:
    """Skip for a missing tool; fail under CI (``CI=true``, set by .ci/run), which installs
    every tool, so that a broken install cannot pass as a green run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: every tool must be installed)")
    pytest.skip(reason)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail with ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as exc:  # the server may still be starting
            last_exc = exc
            value = None
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {what}") from last_exc


def _kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class RedisServer:
    """One redis-server; ``restart()`` keeps the port (and, with AOF on, the data)."""

    def __init__(self, *, appendonly: bool = False, extra: list[str] | None = None,
                 port: int | None = None, base_dir: str | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="crawl-redis-", dir=_tmp_root()))
        self.appendonly = appendonly
        self.extra = list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def url_db(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=5,
                           socket_connect_timeout=5)

    def start(self) -> RedisServer:
        args = [
            find_redis_server(),
            "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always", "--logfile", str(self.dir / "redis.log"),
            "--protected-mode", "no", *self.extra,
        ]
        self.proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_until(lambda: self.client().ping(), 15, what=f"redis on port {self.port}")
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            _kill_group(self.proc, sig)
            self.proc = None

    def restart(self, *, down_s: float = 0.0) -> None:
        self.stop()
        if down_s:
            time.sleep(down_s)  # the outage itself is the fault being injected
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class EtcdServer:
    """One single-member etcd with its data under /dev/shm when available; ``args`` are more
    flags (e.g. ``--quota-backend-bytes``)."""

    def __init__(self, args: Sequence[str] = ()) -> None:
        self.args = list(args)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.name = f"crawl-{uuid.uuid4().hex[:8]}"
        self.dir = Path(tempfile.mkdtemp(prefix="crawl-etcd-", dir=_tmp_root()))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        binary = etcd_binary()
        assert binary, "etcd binary not found"
        args = [
            binary, "--name", self.name, "--data-dir", str(self.dir / "data"),
            "--listen-client-urls", f"http://127.0.0.1:{self.client_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", f"{self.name}=http://127.0.0.1:{self.peer_port}",
            "--initial-cluster-state", "new", "--log-level", "error", *self.args,
        ]
        log = open(self.dir / "etcd.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(args, start_new_session=True, stdout=log, stderr=log)
        wait_until(self._healthy, 30, what=f"etcd on port {self.client_port}")
        return self

    def _healthy(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.client_port), timeout=1):
            pass
        out = subprocess.run(
            [shutil.which("etcdctl") or "etcdctl", f"--endpoints=127.0.0.1:{self.client_port}",
             "endpoint", "health"], capture_output=True, timeout=5,
            env={**os.environ, "ETCDCTL_API": "3"})
        return out.returncode == 0

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            _kill_group(self.proc, sig)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def etcd_binary() -> str | None:
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.path.exists(p)), None)


def _tmp_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@contextlib.contextmanager
def running_redis(**kw) -> Iterator[RedisServer]:
    server = RedisServer(**kw).start()
    try:
        yield server
    finally:
        server.cleanup()


@contextlib.contextmanager
def running_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.cleanup()


# -- RabbitMQ (the machine's; one vhost per test run) ---------------------------------------
def make_rabbit_vhost() -> str | None:
    """Create a fresh vhost on the local RabbitMQ for guest; None when RabbitMQ is absent."""
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    if not os.path.exists(ctl):
        return None
    vhost = f"crawl-{uuid.uuid4().hex[:10]}"
    try:
        subprocess.run([ctl, "add_vhost", vhost], check=True, capture_output=True, timeout=60)
        subprocess.run([ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
                       check=True, capture_output=True, timeout=60)
    except (subprocess.SubprocessError, OSError):
        return None
    return vhost


def delete_rabbit_vhost(vhost: str) -> None:
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run([ctl, "delete_vhost", vhost], capture_output=True, timeout=60)


class Monitor:
    """``MONITOR`` lines of one server, read by a thread until ``stop()``."""

    def __init__(self, server: RedisServer) -> None:
        self.lines: list[str] = []
        self._stop = threading.Event()
        # No read timeout: redis-py drops a connection whose read timed out, which would end
        # the MONITOR during a quiet spell; ``stop`` kills the connection instead.
        self._client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=None,
                                   socket_connect_timeout=5)
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        with self._client.monitor() as mon:
            while not self._stop.is_set():
                try:
                    raw = mon.connection.read_response()
                except (redis.ConnectionError, AttributeError):  # killed by ``stop``
                    return
                self.lines.append(raw.decode() if isinstance(raw, bytes) else str(raw))

    def start(self, probe: redis.Redis) -> Monitor:
        self._thread.start()
        self.sync(probe)
        return self

    def sync(self, probe: redis.Redis) -> None:
        """Wait until every command sent before this call is in ``lines``."""
        mark = f"monitor-mark-{uuid.uuid4().hex}"
        wait_until(lambda: probe.echo(mark) and any(mark in x for x in self.lines), 10,
                   what="MONITOR to show a marker")

    def stop(self, probe: redis.Redis) -> None:
        self.sync(probe)
        self._stop.set()
        for client in probe.client_list():
            if "O" in str(client.get("flags", "")):  # a MONITOR connection
                probe.client_kill_filter(_id=client["id"])
        self._thread.join(5)


def open_test_store(request: pytest.FixtureRequest, kind: str, prefix: str) -> LeaseStore:
    """A lease store of ``kind`` (``memory``, ``redis``, ``etcd``) on the session's servers,
    in a namespace of its own starting with ``prefix``."""
    from celery_crawl.leases import open_store

    ns = f"{prefix}{uuid.uuid4().hex[:8]}"
    if kind == "memory":
        url = f"memory://{ns}"
    elif kind == "redis":
        url = request.getfixturevalue("redis_server").url_db(0)
    else:
        url = request.getfixturevalue("etcd_server").url
    return open_store(url, namespace=ns)
