"""docker-compose.yml's ``sentinel`` profile, checked statically (no Docker engine here): a
master, two replicas, three sentinels watching it, and a fleet configured with the sentinels'
addresses only, whose settings resolve to the Sentinel forms of every Redis client."""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from celery_crawl.leases._sentinel import parse_sentinel_url
from tests.unit.test_compose import COMPOSE
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
