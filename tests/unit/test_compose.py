"""docker-compose.yml: the services, their healthchecks, and every command really running.

There is no Docker engine here, so each command is run as the container would run it, against
local servers: hostnames and container ports are translated to loopback and free ports, paths
under /data and /app to a temp dir and the checkout. Redis, etcd, the demo site, a beat replica,
a worker, Flower and (when the ``prometheus`` binary is installed: ``apt-get install
prometheus``) Prometheus are started from their compose commands, and each one's compose
healthcheck must pass against it. Without that binary the Prometheus config is still checked by
``promtool check config`` when promtool is there, and always statically (YAML, scrape targets
against the services' metrics ports).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from celery_crawl.schedules.files import load_schedule_files
from celery_crawl.up import find_redis_server
from tests.procs import ROOT, Proc
from tests.servers import etcd_binary, free_port, missing_tool, wait_until

COMPOSE = ROOT / "docker-compose.yml"
EXPECTED = {"redis", "etcd", "demo-site", "beat-1", "beat-2", "worker-1", "worker-2", "flower",
            "prometheus", "grafana"}
METRICS_PORT = "9100"
_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def _compose() -> dict[str, Any]:
    """The default profile: what ``docker compose up`` starts (services of a named profile,
    such as ``sentinel``, are checked by their own tests)."""
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    compose["services"] = {n: s for n, s in compose["services"].items()
                           if not s.get("profiles")}
    return compose


def _prometheus_config() -> Path:
    services = _compose()["services"]
    mount = next(v for v in services["prometheus"]["volumes"] if "prometheus.yml" in v)
    return ROOT / mount.split(":")[0]


def command_lines_holding(secret: str) -> list[str]:
    """Command lines of every process on this host that contain ``secret``.

    A command line is world-readable (``ps``, ``/proc/<pid>/cmdline``); a process's
    environment is readable only by its owner and root.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # the process ended meanwhile
            continue
        if secret.encode() in raw:
            found.append(raw.replace(b"\0", b" ").decode(errors="replace"))
    return found


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``."""
    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name, "")
        if value:
            return value
        if op == "?":
            raise ValueError(f"{name}: {arg}")
        return arg if op == "-" else ""
    return _VAR.sub(sub, text)


# -- static checks ----------------------------------------------------------------------------
def test_services_and_healthchecks() -> None:
    services = _compose()["services"]
    assert set(services) == EXPECTED
    for name, svc in services.items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] == "CMD", f"{name}: healthcheck must be an exec-form CMD"
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "noeviction"
    # etcd compacts its history by itself (else its quota fills: docs/leases.md), and the
    # crawler image has the etcd extra its ETCD_URL needs.
    etcd_cmd = services["etcd"]["command"]
    assert etcd_cmd[etcd_cmd.index("--auto-compaction-mode") + 1] == "periodic"
    assert etcd_cmd[etcd_cmd.index("--auto-compaction-retention") + 1] == "1m"
    assert int(etcd_cmd[etcd_cmd.index("--quota-backend-bytes") + 1]) >= 2**30
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"pip install '\.\[[^\]]*\betcd\b[^\]]*\]'", dockerfile), dockerfile
    for beat in ("beat-1", "beat-2"):
        cmd = services[beat]["command"]
        assert cmd[cmd.index("-S") + 1] == "celery_crawl.beat:LeasedScheduler"
    names = {services[w]["command"][services[w]["command"].index("-n") + 1]
             for w in ("worker-1", "worker-2")}
    assert len(names) == 2
    # Flower's credentials come from its environment, never from a command line.
    for name, svc in services.items():
        argv = " ".join([*svc.get("command", []), *svc["healthcheck"]["test"]])
        assert "--basic-auth" not in argv and "FLOWER_PASSWORD" not in argv, name
    auth = services["flower"]["environment"]["FLOWER_BASIC_AUTH"]
    assert interpolate(auth, {"FLOWER_PASSWORD": "pw"}) == "crawl:pw"
    with pytest.raises(ValueError, match="FLOWER_PASSWORD"):
        interpolate(auth, {})


def test_prometheus_scrapes_every_metrics_port() -> None:
    """Static: the config parses and scrapes exactly the beats' and workers' metrics ports."""
    services = _compose()["services"]
    config = yaml.safe_load(_prometheus_config().read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    exporters = {f"{name}:{svc['environment']['CRAWL_METRICS_PORT']}"
                 for name, svc in services.items()
                 if svc.get("environment", {}).get("CRAWL_METRICS_PORT")
                 and name.startswith(("beat", "worker"))}
    assert exporters == {"beat-1:9100", "beat-2:9100", "worker-1:9100", "worker-2:9100"}
    assert targets == exporters


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing_tool("promtool not installed (apt-get install prometheus); the config is "
                     "still checked statically by test_prometheus_scrapes_every_metrics_port")
    out = subprocess.run([promtool, "check", "config", str(_prometheus_config())],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_files_the_compose_file_refers_to_exist() -> None:
    data = _compose()
    build = data["x-crawler"]["build"]
    dockerfile = ROOT / build["context"] / build["dockerfile"]
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile COPY {src}"
    for svc in data["services"].values():
        for volume in svc.get("volumes", []):
            if volume.startswith("./"):
                assert (ROOT / volume.split(":")[0]).exists(), volume


def test_the_demo_schedule_is_valid_and_names_real_tasks() -> None:
    env = _compose()["x-crawler"]["environment"]
    pattern = env["CRAWL_SCHEDULE_PATHS"].replace("/app/", "")
    result = load_schedule_files([pattern], base_dir=ROOT)
    assert not result.errors, [str(e) for e in result.errors]
    assert result.entries
    tasks = {"workers.crawler.crawl_site", "workers.crawler.crawl_listing",
             "workers.crawler.crawl_item"}
    assert {spec.task for spec in result.entries.values()} <= tasks


# -- every command, run for real ----------------------------------------------------------------
class Translator:
    """Container names, ports and paths -> this machine's."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.password = f"compose-{secrets.token_urlsafe(12)}"
        self.env = {"FLOWER_PASSWORD": self.password}
        self.ports = {name: free_port() for name in
                      ("redis", "etcd", "etcd-peer", "site", "proxy", "flower", "prometheus")}
        p = self.ports
        self.common = [
            ("redis://redis:6379", f"redis://127.0.0.1:{p['redis']}"),
            ("etcd://etcd:2379", f"etcd://127.0.0.1:{p['etcd']}"),
            ("http://0.0.0.0:2379", f"http://127.0.0.1:{p['etcd']}"),
            ("http://etcd:2379", f"http://127.0.0.1:{p['etcd']}"),
            ("http://127.0.0.1:2379", f"http://127.0.0.1:{p['etcd']}"),
            ("http://0.0.0.0:2380", f"http://127.0.0.1:{p['etcd-peer']}"),
            ("http://etcd:2380", f"http://127.0.0.1:{p['etcd-peer']}"),
            ("http://demo-site:8001", f"http://127.0.0.1:{p['proxy']}"),
            ("http://demo-site:8000", f"http://127.0.0.1:{p['site']}"),
            ("127.0.0.1:8000", f"127.0.0.1:{p['site']}"),
            ("127.0.0.1:5555", f"127.0.0.1:{p['flower']}"),
            ("--port=5555", f"--port={p['flower']}"),
            ("127.0.0.1:9090", f"127.0.0.1:{p['prometheus']}"),
            ("/etc/prometheus/prometheus.yml", str(_prometheus_config())),
            ("0.0.0.0", "127.0.0.1"),
            ("/etcd-data", str(tmp / "etcd-data")),
            ("/data/", str(tmp) + "/"),
            ("/app/", str(ROOT) + "/"),
            ("/tmp/celerybeat-schedule", str(tmp / "celerybeat-schedule")),
        ]

    def text(self, value: str, *, metrics_port: int | None) -> str:
        for old, new in self.common:
            value = value.replace(old, new)
        if metrics_port is not None:
            value = value.replace(f"127.0.0.1:{METRICS_PORT}", f"127.0.0.1:{metrics_port}")
        return value

    def argv(self, service: str, argv: list[str], *, metrics_port: int | None) -> list[str]:
        out = [self.text(interpolate(a, self.env), metrics_port=metrics_port) for a in argv]
        if service == "prometheus" and out[0].startswith("--"):
            # Arguments of the image's entrypoint (the prometheus binary), whose working
            # directory holds the data; here both are explicit, on a loopback port.
            out = ["prometheus", *out, f"--storage.tsdb.path={self.tmp / 'prometheus'}",
                   f"--web.listen-address=127.0.0.1:{self.ports['prometheus']}"]
        if service == "demo-site":
            out = [self._port_arg(out, i, a) for i, a in enumerate(out)]
        if out[0] == "celery":
            out[0] = str(Path(sys.executable).with_name("celery"))
        elif out[0] == "python":
            out[0] = sys.executable
        elif out[0] == "redis-server":
            out[0] = find_redis_server()
        elif out[0] in ("etcd", "etcdctl", "prometheus"):
            out[0] = shutil.which(out[0]) or (etcd_binary() if out[0] == "etcd" else out[0])
        return out

    def _port_arg(self, argv: list[str], i: int, arg: str) -> str:
        prev = argv[i - 1] if i else ""
        if prev == "--port":
            return str(self.ports["site"])
        if prev == "--proxy-port":
            return str(self.ports["proxy"])
        return arg


@pytest.fixture
def translator(tmp_path: Path) -> Translator:
    return Translator(tmp_path)


@pytest.fixture
def started() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for proc in reversed(procs):  # all shutdowns overlap; Redis and etcd get theirs last
        if proc.args[0].endswith(("redis-server", "etcd")):
            continue
        proc.signal_group(signal.SIGTERM)
    for proc in reversed(procs):
        proc.stop()


def _healthy(argv: list[str], env: dict[str, str]) -> bool:
    out = subprocess.run(argv[1:], capture_output=True, timeout=20, env=env, cwd=str(ROOT))
    return out.returncode == 0


@pytest.mark.system
def test_every_command_runs_and_passes_its_healthcheck(
        translator: Translator, started: list[Proc], tmp_path: Path) -> None:
    if etcd_binary() is None:
        missing_tool("etcd binary not found (apt-get install etcd-server)")
    services = _compose()["services"]
    redis_cmd = translator.argv("redis", services["redis"]["command"], metrics_port=None)
    redis_cmd += ["--port", str(translator.ports["redis"]), "--bind", "127.0.0.1",
                  "--dir", str(tmp_path)]
    env_base = {**os.environ, "ETCDCTL_API": "3"}
    unique: dict[str, str] = {}
    prometheus = shutil.which("prometheus") is not None
    for name, svc in services.items():
        if name == "prometheus" and not prometheus:
            continue  # no prometheus binary here: its config is checked statically above
        if name == "grafana":
            continue  # no grafana binary here: checked statically (tests/unit/test_dashboards.py)
        key = " ".join(svc["command"]).replace(name, "<svc>")
        if key in unique.values():
            continue  # beat-2 / worker-2 run exactly what beat-1 / worker-1 run
        unique[name] = key
    health: dict[str, tuple[list[str], dict[str, str]]] = {}
    for name in unique:
        svc = services[name]
        port = free_port() if svc.get("environment", {}).get("CRAWL_METRICS_PORT") else None
        env = {**env_base, **{k: translator.text(interpolate(str(v), translator.env),
                                                 metrics_port=None)
                              for k, v in svc.get("environment", {}).items()}}
        if port is not None:
            env["CRAWL_METRICS_PORT"] = str(port)
        env.update(CRAWL_BEAT_LEASE_TTL="3", CRAWL_WORKER_LEASE_TTL="3")
        argv = redis_cmd if name == "redis" else translator.argv(name, svc["command"],
                                                                 metrics_port=port)
        check = translator.argv(name, svc["healthcheck"]["test"][1:], metrics_port=port)
        if name == "redis":
            check += ["-p", str(translator.ports["redis"])]
        health[name] = (["CMD", *check], env)
        started.append(Proc(argv, env=env, log_path=tmp_path / f"{name}.log"))
        if name in ("redis", "etcd"):  # the others depend on these being healthy
            wait_until(lambda n=name: _healthy(*health[n]), 60, what=f"{name} healthy")
    assert {"redis", "etcd", "demo-site", "beat-1", "worker-1", "flower"} <= set(unique)
    for proc, name in zip(started, unique, strict=True):
        wait_until(lambda n=name, p=proc: _healthy(*health[n]) or not p.alive(), 90,
                   what=f"{name} healthcheck ({proc.log_path})")
        assert proc.alive(), f"{name} exited:\n{proc.log()[-3000:]}"
        assert "Traceback" not in proc.log(), proc.log()[-3000:]
    # Flower is behind basic auth, and its password is on no command line of this host.
    import urllib.error
    import urllib.request

    flower = f"http://127.0.0.1:{translator.ports['flower']}/"
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(flower, timeout=10)
    assert denied.value.code == 401
    request = urllib.request.Request(flower, headers={
        "Authorization": "Basic " + base64.b64encode(
            f"crawl:{translator.password}".encode()).decode()})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200
    assert command_lines_holding(translator.password) == []
    if prometheus:
        # The running Prometheus loaded the compose config: it scrapes every beat and worker.
        api = f"http://127.0.0.1:{translator.ports['prometheus']}/api/v1/targets"

        def scraped() -> set[str]:
            with urllib.request.urlopen(api, timeout=10) as resp:
                data = json.load(resp)["data"]
            return {t["labels"]["instance"] for t in data["activeTargets"]}

        wait_until(lambda: scraped() == {"beat-1:9100", "beat-2:9100", "worker-1:9100",
                                         "worker-2:9100"}, 30, what="prometheus targets")
