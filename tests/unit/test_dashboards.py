"""deploy/grafana and the alert rules, statically: Grafana is provisioned by docker-compose.yml
with the compose Prometheus and the dashboard; every panel query is valid PromQL (``promtool``)
and names only metrics the plugins and the crawler export; every exported metric has a panel."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from celery_crawl import metrics
from tests.procs import ROOT
from tests.servers import RedisServer, missing_tool
from tests.unit.test_compose import interpolate
from workers.observe import CrawlerCollector, Recorder

COMPOSE = ROOT / "docker-compose.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "celery-crawl.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
_NAME = re.compile(r"\b(crawl(?:er)?_[a-z_]+)\b")
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("_sum", "_count")}


def _services() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"])


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """Container path -> checkout path of each ``./`` volume."""
    out = {}
    for volume in svc.get("volumes", []):
        src, dst = volume.split(":")[:2]
        if src.startswith("./"):
            out[dst] = ROOT / src
    return out


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _families() -> dict[str, str]:
    """Every metric family the plugins and the crawler export: name -> type."""
    found: dict[str, str] = {}
    for name in metrics.__all__:
        obj = getattr(metrics, name)
        if hasattr(obj, "describe") and hasattr(obj, "_type"):
            for family in obj.describe():
                found[family.name] = family.type
    return found


@pytest.fixture(scope="module")
def exported(redis_server: RedisServer) -> set[str]:
    """Sample names of every family, the crawler's read from a real collector's output."""
    families = _families()
    client = redis_server.client(7)
    ns = f"d{uuid.uuid4().hex[:6]}"
    Recorder(client, namespace=ns, worker="w").fetched(site="s", proxy="direct", status=500,
                                                       reason="status-500", elapsed_s=0.1)
    for family in CrawlerCollector(client, namespace=ns, worker="w", broker=client,
                                   queues=lambda: ["q"]).collect():
        families[family.name] = family.type
    assert any(n.startswith("crawler_") for n in families)
    return {name + suffix for name, kind in families.items() for suffix in _SUFFIXES[kind]}


def test_compose_provisions_grafana_with_the_prometheus_and_the_dashboard() -> None:
    services = _services()
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == GRAFANA / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    prom_port = services["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prom_port}" and source["type"] == "prometheus"
    assert "prometheus" in grafana["depends_on"]
    providers = yaml.safe_load((provisioning / "dashboards" / "celery-crawl.yml").read_text())
    (provider,) = providers["providers"]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[str(Path(home).parent)] / Path(home).name) == DASHBOARD
    # Every panel reads the provisioned datasource.
    dash = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
    assert uids == {source["uid"]}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    # The admin password comes from the environment: required, no default, on no command line.
    password = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert interpolate(password, {"GRAFANA_PASSWORD": "pw"}) == "pw"
    with pytest.raises(ValueError, match="GRAFANA_PASSWORD"):
        interpolate(password, {})
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    # Prometheus loads the alert rules the config names, from beside its config.
    prom = _mounts(services["prometheus"])
    config = yaml.safe_load(prom["/etc/prometheus/prometheus.yml"].read_text())
    assert {prom[f"/etc/prometheus/{f}"] for f in config["rule_files"]} == {ALERTS}


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing_tool("promtool not installed (apt-get install prometheus)")
    assert promtool is not None
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": expr} for i, expr in enumerate(_exprs())]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_queries_name_only_exported_metrics_and_cover_them_all(exported: set[str]) -> None:
    alert_exprs = [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"]
                   for r in g["rules"]]
    used = {m for expr in [*_exprs(), *alert_exprs] for m in _NAME.findall(expr)}
    assert used - exported == set(), "unknown metrics"
    dashboard_used = {m for expr in _exprs() for m in _NAME.findall(expr)}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in exported}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in dashboard_used}
    assert families - shown == set(), "metrics without a panel"
