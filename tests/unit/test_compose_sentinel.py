"""docker-compose.yml's ``sentinel`` profile: a master, two replicas, three sentinels watching
it, and a fleet configured with the sentinels' addresses only, whose settings resolve to the
Sentinel forms of every Redis client. Checked statically, and (no Docker engine here) by running
its commands on loopback as tests/unit/test_compose.py runs the default services'."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from celery_crawl.leases._sentinel import parse_sentinel_url
from celery_crawl.up import find_redis_server
from tests.procs import ROOT, Proc
from tests.servers import free_port, wait_until
from tests.unit.test_compose import COMPOSE, Translator
from workers.settings import CrawlerSettings

PROFILE = "sentinel"
DATA = {"redis-primary", "redis-replica-1", "redis-replica-2"}
SENTINELS = {"sentinel-1", "sentinel-2", "sentinel-3"}
FLEET = {"sentinel-beat-1", "sentinel-beat-2", "sentinel-worker-1", "sentinel-worker-2"}


def _profiled() -> dict[str, Any]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {n: s for n, s in services.items() if PROFILE in (s.get("profiles") or ())}


def _sentinel_conf(svc: dict[str, Any]) -> list[str]:
    """The lines of the config file a sentinel service writes before it starts."""
    script = svc["command"][-1]
    printf = shlex.split(script.split(">", 1)[0])
    assert printf[0] == "printf" and "--sentinel" in script
    return [x for x in printf[1].replace("\\n", "\n").splitlines() if x]


def test_the_profile_holds_the_topology_and_a_fleet() -> None:
    services = _profiled()
    assert set(services) == DATA | SENTINELS | FLEET
    for name, svc in services.items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] == "CMD", f"{name}: healthcheck must be an exec-form CMD"
    for name in DATA:
        cmd = services[name]["command"]
        assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction", name
        assert cmd[cmd.index("--appendonly") + 1] == "yes", name
    for name in DATA - {"redis-primary"}:
        cmd = services[name]["command"]
        assert cmd[cmd.index("--replicaof") + 1:][:2] == ["redis-primary", "6379"], name


def test_three_sentinels_monitor_the_primary_with_a_majority_quorum() -> None:
    services = _profiled()
    confs = [_sentinel_conf(services[name]) for name in sorted(SENTINELS)]
    assert all(c == confs[0] for c in confs)
    conf = confs[0]
    monitor = next(x.split() for x in conf if x.startswith("sentinel monitor "))
    master, host, port, quorum = monitor[2:]
    assert (host, port) == ("redis-primary", "6379")
    assert int(quorum) == len(SENTINELS) // 2 + 1
    assert "port 26379" in conf
    assert "sentinel announce-hostnames yes" in conf and "sentinel resolve-hostnames yes" in conf
    assert any(x.startswith(f"sentinel down-after-milliseconds {master} ") for x in conf)


def test_the_fleet_knows_only_the_sentinels() -> None:
    services = _profiled()
    master = next(x.split()[2] for x in _sentinel_conf(services["sentinel-1"])
                  if x.startswith("sentinel monitor "))
    for name in FLEET:
        svc = services[name]
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert "ETCD_URL" not in env and "CRAWL_BROKER_URL" not in env, name
        assert set(svc["depends_on"]) == SENTINELS, name
        for var in ("REDIS_URL", "CRAWL_LEASE_URL"):
            spec = parse_sentinel_url(env[var])
            assert {h for h, _ in spec.sentinels} == SENTINELS, (name, var)
            assert {p for _, p in spec.sentinels} == {26379}
            assert spec.master == master
        conf = CrawlerSettings.from_env(env).celery_conf(audited_backend=True)
        assert conf["broker_url"] == ";".join(
            f"sentinel://sentinel-{i}:26379/0" for i in (1, 2, 3))
        assert conf["broker_transport_options"]["master_name"] == master
        assert conf["result_backend"].startswith("crawlredis+sentinel://sentinel-1:26379,")
        assert conf["crawl_lease_url"] == env["CRAWL_LEASE_URL"]
        # No data node by name: a failover moves the master, the sentinels say where.
        assert not any(d in " ".join(env.values()) for d in DATA), name
    names = {services[w]["command"][services[w]["command"].index("-n") + 1]
             for w in FLEET if "worker" in w}
    assert len(names) == 2


# -- the profile's commands, run for real ------------------------------------------------------
@pytest.mark.system
def test_the_profile_runs_and_passes_its_healthchecks(tmp_path: Path) -> None:
    """Each command as its container runs it, on loopback: the data nodes and the sentinels from
    their compose commands (hostnames and ports translated, each sentinel's config written by its
    own command), then a beat and a worker from theirs, every healthcheck passing, the beat
    leading and the worker saying that nothing rides behind Sentinel."""
    services = _profiled()
    translator = Translator(tmp_path)
    data_ports = {name: free_port() for name in sorted(DATA)}
    sentinel_ports = {name: free_port() for name in sorted(SENTINELS)}
    primary = data_ports["redis-primary"]

    def text(value: str, *, port: int | None = None) -> str:
        for name, p in sentinel_ports.items():
            value = value.replace(f"{name}:26379", f"127.0.0.1:{p}")
        value = value.replace("redis-primary 6379", f"127.0.0.1 {primary}")
        return translator.text(value, metrics_port=port)

    procs: list[Proc] = []
    try:
        redis_server = find_redis_server()
        for name, port in data_ports.items():
            argv = [redis_server, *(text(a) for a in services[name]["command"][1:]),
                    "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
            argv = [a if a != "redis-primary" else "127.0.0.1" for a in argv]
            if "--replicaof" in argv:
                argv[argv.index("--replicaof") + 2] = str(primary)
            (tmp_path / name).mkdir()
            argv[argv.index("--dir") + 1] = str(tmp_path / name)
            procs.append(Proc(argv, log_path=tmp_path / f"{name}.log"))
            wait_until(lambda p=port: _ok(["redis-cli", "-p", str(p), "ping"]), 30,
                       what=f"{name} answering")
        for name, port in sentinel_ports.items():
            script = services[name]["command"][-1]
            script = (script.replace("port 26379", f"port {port}")
                      .replace("redis-primary 6379", f"127.0.0.1 {primary}")
                      .replace("/tmp/sentinel.conf", str(tmp_path / f"{name}.conf"))
                      .replace("redis-server", redis_server))
            procs.append(Proc(["sh", "-c", script], log_path=tmp_path / f"{name}.log"))
            check = [a.replace("26379", str(port))
                     for a in services[name]["healthcheck"]["test"][1:]]
            wait_until(lambda c=check: _ok(c), 30, what=f"{name} healthcheck")
        wait_until(lambda: all(
            _ok(["redis-cli", "-p", str(p), "SENTINEL", "get-master-addr-by-name", "crawler"],
                want=str(primary)) for p in sentinel_ports.values()),
            30, what="every sentinel naming the primary")
        fleet: dict[str, tuple[Proc, list[str], dict[str, str]]] = {}
        for name in ("sentinel-beat-1", "sentinel-worker-1"):
            svc = services[name]
            port = free_port()
            env = {**os.environ, **{k: text(str(v)) for k, v in svc["environment"].items()},
                   "CRAWL_METRICS_PORT": str(port), "CRAWL_BEAT_LEASE_TTL": "3",
                   "CRAWL_WORKER_LEASE_TTL": "3"}
            argv = translator.argv(name, [text(a) for a in svc["command"]], metrics_port=port)
            check = translator.argv(name, svc["healthcheck"]["test"][1:], metrics_port=port)
            proc = Proc(argv, env=env, log_path=tmp_path / f"{name}.log")
            procs.append(proc)
            fleet[name] = (proc, check, env)
        for name, (proc, check, env) in fleet.items():
            wait_until(lambda c=check, e=env, p=proc: _ok(c, env=e) or not p.alive(), 90,
                       what=f"{name} healthcheck ({proc.log_path})")
            assert proc.alive(), f"{name} exited:\n{proc.log()[-3000:]}"
        beat, worker = fleet["sentinel-beat-1"][0], fleet["sentinel-worker-1"][0]
        wait_until(lambda: "is now the leader" in beat.log(), 60, what="the beat leading")
        wait_until(lambda: "claims and ends do not ride" in worker.log(), 60,
                   what="the worker's one line about riding")
        for proc in (beat, worker):
            assert "Traceback" not in proc.log(), proc.log()[-3000:]
    finally:
        for proc in reversed(procs):
            proc.stop()


def _ok(argv: list[str], *, env: dict[str, str] | None = None, want: str | None = None) -> bool:
    if argv[0] == "redis-cli":
        argv = [shutil.which("redis-cli") or "redis-cli", *argv[1:]]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=20, env=env,
                         cwd=str(ROOT))
    return out.returncode == 0 and (want is None or want in out.stdout)
