"""A Sentinel-managed Redis with TLS and ACL users: one master, ``replicas`` replicas and one
sentinel, all real ``redis-server`` processes on loopback.

``tls``: the data nodes and the sentinel speak only TLS (client certificates required, the
test PKI of ``tlsservers.make_pki``); replication and the sentinel's own links to the data
nodes use TLS too. Every node has its ``default`` user off and an ``admin`` user; the data
nodes get ``data_users`` (name -> ACL rules) and the sentinel ``sentinel_users``; the sentinel
reaches the data nodes as ``sentinel_auth`` (``sentinel auth-user``/``auth-pass``) and the
replicas their master as ``replica_auth`` (``masteruser``/``masterauth``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import redis

from celery_crawl.up import find_redis_server
from tests.security.tlsservers import ADMIN_USER, Pki, _kill_group, _secret, _tmp_root
from tests.servers import free_port, wait_until

__all__ = ["MASTER", "SecureSentinel", "secure_sentinel"]

MASTER = "crawl"


class SecureSentinel:
    def __init__(self, *, pki: Pki | None, replicas: int,
                 data_users: Mapping[str, Sequence[str]],
                 sentinel_users: Mapping[str, Sequence[str]],
                 sentinel_auth: tuple[str, Sequence[str]],
                 replica_auth: tuple[str, Sequence[str]]) -> None:
        self.pki = pki
        self.base = Path(tempfile.mkdtemp(prefix="crawl-sec-sentinel-", dir=_tmp_root()))
        self.admin_password = _secret()
        #: Every user's password, by name (data nodes' and sentinel's users).
        self.passwords: dict[str, str] = {}
        self._data_users = {**data_users, sentinel_auth[0]: sentinel_auth[1],
                            replica_auth[0]: replica_auth[1]}
        self._sentinel_users = dict(sentinel_users)
        self._sentinel_user = sentinel_auth[0]
        self._replica_user = replica_auth[0]
        for name in (*self._data_users, *self._sentinel_users):
            self.passwords.setdefault(name, _secret())
        self.ports = [free_port() for _ in range(replicas + 1)]
        self.sentinel_port = free_port()
        self._procs: list[subprocess.Popen[bytes]] = []

    # -- addresses ------------------------------------------------------------------------------
    @property
    def master_port(self) -> int:
        return self.ports[0]

    def _tls_kwargs(self) -> dict[str, object]:
        if self.pki is None:
            return {}
        return {"ssl": True, "ssl_ca_certs": str(self.pki.ca), "ssl_certfile":
                str(self.pki.client_cert), "ssl_keyfile": str(self.pki.client_key),
                "ssl_cert_reqs": "required"}

    def admin(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, username=ADMIN_USER,
                           password=self.admin_password, socket_timeout=5,
                           socket_connect_timeout=5, decode_responses=True,
                           **self._tls_kwargs())  # type: ignore[arg-type]

    # -- life -----------------------------------------------------------------------------------
    def _acl_lines(self, users: Mapping[str, Sequence[str]]) -> list[str]:
        return ["user default off", f"user {ADMIN_USER} on >{self.admin_password} ~* &* +@all",
                *(f"user {name} on >{self.passwords[name]} {' '.join(rules)}"
                  for name, rules in users.items())]

    def _tls_conf(self, port: int) -> list[str]:
        if self.pki is None:
            return [f"port {port}"]
        return ["port 0", f"tls-port {port}", f"tls-cert-file {self.pki.server_cert}",
                f"tls-key-file {self.pki.server_key}", f"tls-ca-cert-file {self.pki.ca}",
                f"tls-client-cert-file {self.pki.client_cert}",
                f"tls-client-key-file {self.pki.client_key}", "tls-auth-clients yes",
                "tls-replication yes"]

    def _spawn(self, name: str, lines: list[str], *extra: str) -> None:
        where = self.base / name
        where.mkdir()
        conf = where / "redis.conf"
        conf.write_text("\n".join([*lines, "bind 127.0.0.1", "protected-mode no", f"dir {where}",
                                   f"logfile {where / 'redis.log'}", ""]))
        self._procs.append(subprocess.Popen([find_redis_server(), str(conf), *extra],
                                            start_new_session=True, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))

    def start(self) -> SecureSentinel:
        repl = self._replica_user
        for i, port in enumerate(self.ports):
            (self.base / f"d{i}").mkdir()
            acl = self.base / f"d{i}" / "users.acl"
            acl.write_text("\n".join(self._acl_lines(self._data_users)) + "\n")
            # Every node may be a replica (the master, once demoted): all know the user.
            follow = [f"masteruser {repl}", f"masterauth {self.passwords[repl]}",
                      *([] if i == 0 else [f"replicaof 127.0.0.1 {self.master_port}"])]
            self._spawn(f"n{i}", [*self._tls_conf(port), f"aclfile {acl}", 'save ""',
                                  "appendonly no", "repl-diskless-sync-delay 0", *follow])
            wait_until(lambda p=port: self.admin(p).ping(), 15, what=f"data node {port}")
        user = self._sentinel_user
        self._spawn("s0", [
            *self._tls_conf(self.sentinel_port), *self._acl_lines(self._sentinel_users),
            f"sentinel monitor {MASTER} 127.0.0.1 {self.master_port} 1",
            f"sentinel auth-user {MASTER} {user}",
            f"sentinel auth-pass {MASTER} {self.passwords[user]}",
            f"sentinel down-after-milliseconds {MASTER} 1000"], "--sentinel")

        def settled() -> bool:
            state = self.admin(self.sentinel_port).sentinel_master(MASTER)
            # Each replica has acknowledged an offset: its master streams writes to it (until
            # then they wait in the master's buffer, and a failover would lose them).
            info = self.admin(self.master_port).info("replication")
            acked = [int(info[f"slave{i}"]["offset"]) for i in range(len(self.ports) - 1)
                     if f"slave{i}" in info]
            return ("s_down" not in str(state.get("flags"))
                    and int(state.get("num-slaves", 0)) >= len(self.ports) - 1
                    and len(acked) == len(self.ports) - 1
                    and min(acked) > 0)

        wait_until(settled, 30, interval_s=0.1, what="sentinel, master and replicas settled")
        return self

    def cleanup(self) -> None:
        for proc in self._procs:
            _kill_group(proc)
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def secure_sentinel(**kw: object) -> Iterator[SecureSentinel]:
    topology = SecureSentinel(**kw)  # type: ignore[arg-type]
    try:
        yield topology.start()
    finally:
        topology.cleanup()
