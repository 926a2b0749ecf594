"""Replicated stores on loopback: a Redis primary + replica, a 3-master Redis Cluster, a
3-member etcd.

Both are real servers started from ``tests.servers``; faults are real (``kill -9`` of a member,
``REPLICAOF NO ONE`` on a replica while its primary still runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import (
    RedisServer,
    _kill_group,
    _tmp_root,
    etcd_binary,
    free_cluster_port,
    free_port,
    missing_tool,
    wait_until,
)

__all__ = [
    "EtcdCluster",
    "EtcdMember",
    "RedisCluster3",
    "RedisReplicaPair",
    "etcd_cluster",
    "redis_cluster",
    "redis_replica_pair",
]


# -- Redis: one primary, one replica ----------------------------------------------------------
class RedisReplicaPair:
    """A primary and a replica of it, both on loopback, both with AOF on.

    ``promote()`` turns the replica into a primary (``REPLICAOF NO ONE``) without touching the
    old primary, which is exactly the split brain an operator or a Sentinel produces when the
    old primary was only unreachable, not dead.
    """

    def __init__(self) -> None:
        # No 5 s wait for more replicas before the first full sync.
        self.primary = RedisServer(appendonly=True, extra=["--repl-diskless-sync-delay", "0"])
        self.replica = RedisServer(appendonly=True)

    def start(self) -> RedisReplicaPair:
        self.primary.start()
        self.replica.extra = ["--replicaof", "127.0.0.1", str(self.primary.port),
                              "--repl-diskless-sync-delay", "0"]
        self.replica.start()
        self.wait_synced()
        return self

    def wait_synced(self, timeout_s: float = 30.0) -> None:
        """Wait until the replica's link is up and it has applied everything the primary has."""

        def synced() -> bool:
            info = self.replica.client().info("replication")
            if info.get("master_link_status") != "up":
                return False
            primary = self.primary.client().info("replication")
            return int(primary["master_repl_offset"]) == int(info["slave_repl_offset"])

        wait_until(synced, timeout_s, what="replica in sync with its primary")

    def replica_count(self) -> int:
        """Replicas the primary currently sees connected (what ``WAIT`` can count on)."""
        return int(self.primary.client().info("replication").get("connected_slaves", 0))

    def cut_link(self) -> None:
        """Cut the replication link (a partition between the two): the replica keeps its data,
        stays read-only and stops receiving writes. A stopped replica process would not do:
        the kernel keeps buffering the stream and the replica applies it when it resumes."""
        dead = free_port()
        self.replica.client().execute_command("REPLICAOF", "127.0.0.1", str(dead))
        wait_until(lambda: self.replica_count() == 0, 10, what="primary to drop its replica")

    def promote(self) -> None:
        """``REPLICAOF NO ONE`` on the replica; the old primary is left as it is."""
        self.replica.client().execute_command("REPLICAOF", "NO", "ONE")
        wait_until(lambda: self.replica.client().info("replication")["role"] == "master", 10,
                   what="replica promoted to primary")

    def cleanup(self) -> None:
        self.replica.cleanup()
        self.primary.cleanup()


@contextlib.contextmanager
def running_replica_pair() -> Iterator[RedisReplicaPair]:
    pair = RedisReplicaPair().start()
    try:
        yield pair
    finally:
        pair.cleanup()


@pytest.fixture
def redis_replica_pair() -> Iterator[RedisReplicaPair]:
    """A fresh Redis primary with one synced replica, for one test."""
    with running_replica_pair() as pair:
        yield pair


# -- Redis Cluster: three masters -------------------------------------------------------------
class RedisCluster3:
    """Three ``--cluster-enabled`` masters on loopback, joined by ``redis-cli --cluster create``
    (16384 slots split three ways, no replicas). ``url`` is a ``redis+cluster://`` URL naming the
    first node; the others are found through ``CLUSTER SLOTS``."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="crawl-rcluster-", dir=_tmp_root()))
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster3:
        cli = shutil.which("redis-cli")
        if cli is None:
            missing_tool("redis-cli not found (apt-get install redis-tools)")
        for i in range(3):
            node_dir = self.base / f"n{i}"
            node_dir.mkdir()
            node = RedisServer(port=free_cluster_port(), base_dir=str(node_dir), extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "5000"])
            self.nodes.append(node.start())
        out = subprocess.run(
            [str(cli), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, timeout=60, check=False)
        assert out.returncode == 0, f"redis-cli --cluster create failed: {out.stdout!r}"

        def ready() -> bool:
            for n in self.nodes:
                info = n.client().execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text or "cluster_known_nodes:3" not in text:
                    return False
            return True

        wait_until(ready, 60, what="the Redis Cluster to agree on its 3 masters")
        return self

    def owner(self, key: str) -> RedisServer:
        """The master holding ``key``'s slot."""
        slot = int(self.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key))
        for first, last, master, *_ in self.nodes[0].client().execute_command("CLUSTER", "SLOTS"):
            if int(first) <= slot <= int(last):
                port = int(master[1])
                return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no master owns slot {slot}")

    def move_slot_of(self, key: str) -> RedisServer:
        """Move ``key``'s slot, with its keys, to another master (what a resharding does, slot
        by slot: IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE on every master); returns the new
        owner. Clients that knew the old owner get ``MOVED``."""
        old = self.owner(key)
        new = next(n for n in self.nodes if n is not old)
        src, dst = old.client(), new.client()
        slot = int(src.execute_command("CLUSTER", "KEYSLOT", key))
        src_id = src.execute_command("CLUSTER", "MYID").decode()
        dst_id = dst.execute_command("CLUSTER", "MYID").decode()
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", new.port, "", 0, 5000, "KEYS", *keys)
        for n in self.nodes:
            n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        wait_until(lambda: all(self._owner_seen_by(n, slot) == new.port for n in self.nodes), 30,
                   what=f"every master to agree slot {slot} moved")
        return new

    @staticmethod
    def _owner_seen_by(node: RedisServer, slot: int) -> int | None:
        for first, last, master, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
            if int(first) <= slot <= int(last):
                return int(master[1])
        return None

    def cleanup(self) -> None:
        for n in self.nodes:
            n.cleanup()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def running_redis_cluster() -> Iterator[RedisCluster3]:
    cluster = RedisCluster3()
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster3]:
    """One 3-master Redis Cluster for the session (tests use unique namespaces)."""
    with running_redis_cluster() as cluster:
        yield cluster


# -- etcd: three members ----------------------------------------------------------------------
class EtcdMember:
    """One member of an ``EtcdCluster``; ``kill()`` and ``start()`` keep its data directory."""

    def __init__(self, name: str, base: Path) -> None:
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.dir = base / name
        self.proc: subprocess.Popen[bytes] | None = None
        self.initial_cluster = ""

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self) -> None:
        binary = etcd_binary()
        assert binary, "etcd binary not found"
        args = [
            binary, "--name", self.name, "--data-dir", str(self.dir / "data"),
            "--listen-client-urls", f"http://{self.endpoint}",
            "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "new", "--initial-cluster-token", self.dir.parent.name,
            "--log-level", "error",
            # Defaults (100 ms / 1 s) elect spuriously on a loaded 2-core machine.
            "--heartbeat-interval", "200", "--election-timeout", "2000",
        ]
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "etcd.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(args, start_new_session=True, stdout=log, stderr=log)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            _kill_group(self.proc, sig)
            self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, object] | None:
        """``etcdctl endpoint status`` of this member (its id, the leader's id, raft term)."""
        if not self.alive():
            return None
        with socket.create_connection(("127.0.0.1", self.client_port), timeout=1):
            pass
        out = subprocess.run(
            [shutil.which("etcdctl") or "etcdctl", f"--endpoints={self.endpoint}",
             "--command-timeout=2s", "endpoint", "status", "-w", "json"],
            capture_output=True, timeout=5, env={**os.environ, "ETCDCTL_API": "3"})
        if out.returncode != 0:
            return None
        rows = json.loads(out.stdout)
        header = rows[0]["Status"]["header"]
        return {"member_id": header["member_id"], "leader": rows[0]["Status"]["leader"],
                "raft_term": header.get("raft_term")}


class EtcdCluster:
    """Three etcd members on loopback forming one raft group."""

    def __init__(self, size: int = 3) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="crawl-etcdc-", dir=_tmp_root()))
        tag = uuid.uuid4().hex[:6]
        self.members = [EtcdMember(f"m{i}-{tag}", self.base) for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    def start(self) -> EtcdCluster:
        for m in self.members:
            m.start()
        self.wait_leader()
        return self

    def leader(self) -> EtcdMember | None:
        """The member that currently leads, as seen by a majority of the live members."""
        votes: dict[object, int] = {}
        ids: dict[object, EtcdMember] = {}
        for m in self.members:
            try:
                st = m.status()
            except OSError:
                st = None
            if st is None:
                continue
            ids[st["member_id"]] = m
            votes[st["leader"]] = votes.get(st["leader"], 0) + 1
        for leader_id, n in votes.items():
            if leader_id and n * 2 > len(self.members) - 1 and leader_id in ids:
                return ids[leader_id]
        return None

    def wait_leader(self, timeout_s: float = 45.0, *, not_: EtcdMember | None = None) -> EtcdMember:
        def found() -> EtcdMember | None:
            m = self.leader()
            return m if m is not None and m is not not_ else None

        member: EtcdMember = wait_until(found, timeout_s, interval_s=0.2, what="an etcd leader")
        return member

    def move_leader(self, to: EtcdMember, timeout_s: float = 30.0) -> None:
        """Hand raft leadership to ``to`` (``etcdctl move-leader``), e.g. away from the member
        the clients talk to, so that killing the leader is a failover and not an outage."""
        leader = self.wait_leader()
        if leader is to:
            return
        st = to.status()
        assert st is not None, f"{to.name} is not answering"
        subprocess.run(
            [shutil.which("etcdctl") or "etcdctl", f"--endpoints={leader.endpoint}",
             "--command-timeout=5s", "move-leader", f"{int(st['member_id']):x}"],
            capture_output=True, timeout=10, env={**os.environ, "ETCDCTL_API": "3"}, check=True)
        wait_until(lambda: self.leader() is to, timeout_s, interval_s=0.2,
                   what=f"{to.name} to lead")

    def followers(self) -> list[EtcdMember]:
        leader = self.leader()
        return [m for m in self.members if m is not leader and m.alive()]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def cleanup(self) -> None:
        for m in self.members:
            m.kill()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def running_etcd_cluster() -> Iterator[EtcdCluster]:
    cluster = EtcdCluster().start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd cluster on loopback for one test (skips without an etcd binary)."""
    if etcd_binary() is None:
        if os.environ.get("CRAWL_REQUIRE_ETCD") == "1" or os.environ.get("CI") == "true":
            pytest.fail("etcd binary not found and CRAWL_REQUIRE_ETCD=1")
        pytest.skip("etcd binary not found (apt-get install etcd-server); "
                    "set CRAWL_REQUIRE_ETCD=1 to make this a failure")
    with running_etcd_cluster() as cluster:
        yield cluster
