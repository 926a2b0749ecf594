"""Redis the way production runs it: one master, two replicas, three sentinels, all on loopback.

Real ``redis-server`` processes (the sentinels are ``redis-server <conf> --sentinel``, each with
a config file of its own, which Sentinel rewrites) on free ports in one temp dir. Timings are
small so a failover takes a few seconds: ``down-after-milliseconds`` 1000, ``failover-timeout``
3000. Faults are real: ``kill -9`` of the master, ``SENTINEL FAILOVER``, SIGSTOP/SIGCONT.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_crawl.up import find_redis_server
from tests.servers import RedisServer, _kill_group, _tmp_root, free_port, wait_until

__all__ = ["MASTER", "SentinelSet", "redis_sentinels", "running_sentinels"]

MASTER = "crawl"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


class SentinelSet:
    """One master, ``replicas`` replicas and ``sentinels`` sentinels (quorum 2)."""

    def __init__(self, *, replicas: int = 2, sentinels: int = 3, password: str | None = None,
                 sentinel_password: str | None = None) -> None:
        #: The data nodes' ``requirepass`` (and the sentinels' ``auth-pass``), the sentinels' own.
        self.password = password
        self.sentinel_password = sentinel_password
        self.base = Path(tempfile.mkdtemp(prefix="crawl-sentinel-", dir=_tmp_root()))
        self.nodes: list[RedisServer] = []
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self._replicas = replicas
        self._sentinels: list[subprocess.Popen[bytes]] = []

    # -- addresses ------------------------------------------------------------------------------
    def url(self, db: int = 0, scheme: str = "redis+sentinel") -> str:
        """The lease store's URL: every sentinel, the master's name, the db."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"{scheme}://{hosts}/{MASTER}/{db}"

    def broker_url(self, db: int = 0) -> str:
        """kombu's form: one ``sentinel://`` URL per sentinel, ``;``-separated."""
        return ";".join(f"sentinel://127.0.0.1:{p}/{db}" for p in self.sentinel_ports)

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.sentinel_ports[i], socket_timeout=5,
                           socket_connect_timeout=5, decode_responses=True,
                           password=self.sentinel_password)

    def master_port(self) -> int:
        """The master's port as a majority of the sentinels answering report it."""
        seen: dict[int, int] = {}
        for i in range(len(self.sentinel_ports)):
            with contextlib.suppress(redis.RedisError, OSError):
                _, port = self.sentinel(i).sentinel_get_master_addr_by_name(MASTER)
                seen[int(port)] = seen.get(int(port), 0) + 1
        return max(seen, key=lambda p: seen[p])

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def master(self) -> RedisServer:
        return self.node(self.master_port())

    # -- life -----------------------------------------------------------------------------------
    def start(self) -> SentinelSet:
        auth = ([] if self.password is None
                else ["--requirepass", self.password, "--masterauth", self.password])
        master = RedisServer(base_dir=str(self._dir("m0")),
                             extra=["--repl-diskless-sync-delay", "0", *auth])
        self._with_password(master)
        self.nodes.append(master.start())
        for i in range(self._replicas):
            replica = RedisServer(base_dir=str(self._dir(f"r{i}")), extra=[
                "--replicaof", "127.0.0.1", str(master.port), "--repl-diskless-sync-delay", "0",
                *auth])
            self._with_password(replica)
            self.nodes.append(replica.start())
        for i, port in enumerate(self.sentinel_ports):
            self._start_sentinel(i, port, master.port)
        self.wait_settled(master.port)
        return self

    def _with_password(self, node: RedisServer) -> None:
        """``node.client()`` authenticates when the data nodes have a password."""
        if self.password is None:
            return
        password = self.password

        def client(db: int = 0) -> redis.Redis:
            return redis.Redis(host="127.0.0.1", port=node.port, db=db, socket_timeout=5,
                               socket_connect_timeout=5, password=password)

        node.client = client  # type: ignore[method-assign]

    def _dir(self, name: str) -> Path:
        path = self.base / name
        path.mkdir(exist_ok=True)
        return path

    def _start_sentinel(self, i: int, port: int, master_port: int) -> None:
        where = self._dir(f"s{i}")
        conf = where / "sentinel.conf"
        conf.write_text("\n".join((
            f"port {port}", "bind 127.0.0.1", "protected-mode no", f"dir {where}",
            f"logfile {where / 'sentinel.log'}",
            f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 2",
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {MASTER} 2",
            *([] if self.password is None else [f"sentinel auth-pass {MASTER} {self.password}"]),
            *([] if self.sentinel_password is None
              else [f"requirepass {self.sentinel_password}",
                    f"sentinel sentinel-pass {self.sentinel_password}"]),
            "")))
        proc = subprocess.Popen([find_redis_server(), str(conf), "--sentinel"],
                                start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self._sentinels.append(proc)
        wait_until(lambda: self.sentinel(i).ping(), 15, what=f"sentinel on port {port}")

    def wait_settled(self, master_port: int | None = None, timeout_s: float = 30.0,
                     replicas: int | None = None) -> int:
        """Until every sentinel names the same master (``master_port`` when given), knows the
        other sentinels, and every running replica's link to it is up (``replicas``: at least
        that many linked replicas is enough: a returning old master is demoted by Sentinel
        only seconds later)."""
        want_sentinels = len(self.sentinel_ports) - 1

        def settled() -> int | None:
            ports = set()
            for i in range(len(self.sentinel_ports)):
                state = self.sentinel(i).sentinel_master(MASTER)
                if "s_down" in str(state.get("flags")) or "o_down" in str(state.get("flags")):
                    return None
                if int(state["num-other-sentinels"]) < want_sentinels:
                    return None
                ports.add(int(state["port"]))
            if len(ports) != 1:
                return None
            port = ports.pop()
            if master_port is not None and port != master_port:
                return None
            live = [n for n in self.nodes if n.proc is not None and n.port != port]
            info = self.node(port).client().info("replication")
            linked = int(info.get("connected_slaves", 0))
            if info.get("role") != "master":
                return None
            if replicas is not None:
                return port if linked >= replicas else None
            if linked < len(live):
                return None
            for n in live:
                r = n.client().info("replication")
                if r.get("role") != "slave" or r.get("master_link_status") != "up" or int(
                        r.get("master_port", 0)) != port:
                    return None
            return port

        return int(wait_until(settled, timeout_s, interval_s=0.1,
                              what="sentinels, master and replicas settled"))

    # -- faults ---------------------------------------------------------------------------------
    def kill_master(self) -> RedisServer:
        """``kill -9`` of the master; returns it (``restart_node`` brings it back as a replica)."""
        node = self.master()
        node.stop(signal.SIGKILL)
        return node

    def planned_failover(self) -> None:
        """``SENTINEL FAILOVER``: the sentinels promote a replica; the old master is demoted."""
        self.sentinel(0).execute_command("SENTINEL", "FAILOVER", MASTER)

    def wait_new_master(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Until every sentinel names the same master, not ``old_port``, which answers as one
        (a sentinel that has not heard of the switch yet still names the old one)."""

        def moved() -> int | None:
            # ``SENTINEL MASTERS`` (what redis-py's discovery reads): during the failover's
            # last phase the leading sentinel still reports the old address there.
            states = [self.sentinel(i).sentinel_master(MASTER)
                      for i in range(len(self.sentinel_ports))]
            if any("failover_in_progress" in str(st.get("flags")) for st in states):
                return None
            ports = {int(st["port"]) for st in states}
            if len(ports) != 1 or old_port in ports:
                return None
            port = ports.pop()
            role = self.node(port).client().info("replication").get("role")
            return port if role == "master" else None

        return int(wait_until(moved, timeout_s, interval_s=0.05, what="a new master"))

    def restart_node(self, node: RedisServer) -> None:
        """Start a killed node again on its port (the sentinels turn it into a replica)."""
        node.start()

    def pause(self, node: RedisServer) -> None:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP)

    def resume(self, node: RedisServer) -> None:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGCONT)

    def cleanup(self) -> None:
        for proc in self._sentinels:
            _kill_group(proc)
        for node in self.nodes:
            if node.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGCONT)
            node.cleanup()
        import shutil

        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def running_sentinels(**kw: int) -> Iterator[SentinelSet]:
    topology = SentinelSet(**kw)
    try:
        yield topology.start()
    finally:
        topology.cleanup()


@pytest.fixture(scope="session")
def redis_sentinels() -> Iterator[SentinelSet]:
    """One Sentinel-managed topology for a session's tests that leave it as they found it."""
    with running_sentinels() as topology:
        yield topology


def elapsed_until(predicate, timeout_s: float, interval_s: float = 0.02) -> float:
    """Seconds until ``predicate`` is true (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    wait_until(predicate, timeout_s, interval_s=interval_s, what="the fleet to go on")
    return time.monotonic() - t0
