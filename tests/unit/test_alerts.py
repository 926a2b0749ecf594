"""deploy/prometheus/alerts.yml: valid (``promtool check rules``) and firing exactly when it should
(``promtool test rules`` on synthetic series: each alert once where it must fire, and beside it
a case that sits just on the good side of the threshold)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import ROOT
from tests.servers import missing_tool

RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
WORKER = {"job": "celery-crawl-worker"}
NO_LEADER = ({"severity": "critical"},
             "No beat replica has held the leader lease for more than 2 lease TTLs")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing_tool("promtool not installed (apt-get install prometheus)")
    assert path is not None
    return path


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _description(alertname: str, labels: dict[str, str]) -> str:
    rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                if r["alert"] == alertname)
    text = str(rule["annotations"]["description"])
    for key, value in labels.items():
        text = text.replace(f"{{{{ $labels.{key} }}}}", value)
    return text


def _alert(alertname: str, at: str, fired: list[tuple[dict[str, str], str]],
           interval: str, series: list[dict[str, str]]) -> dict[str, Any]:
    """A promtool test: at ``at``, exactly the alerts ``fired`` (labels, summary) fire."""
    return {"interval": interval, "input_series": series, "alert_rule_test": [
        {"eval_time": at, "alertname": alertname,
         "exp_alerts": [{"exp_labels": labels, "exp_annotations": {
             "summary": summary, "description": _description(alertname, labels)}}
             for labels, summary in fired]}]}


def _tests() -> list[dict[str, Any]]:
    renew = "crawl_lease_renewals_total"
    lag = "crawl_beat_dispatch_lag_seconds_bucket"
    fail, health = "crawler_fetch_failures_total", "crawler_proxy_health_ratio"
    return [
        # 100 ok and 2 failed renewals a minute: 98% < 99%. Beside it 1 in 200: 99.5%.
        _alert("CrawlLeaseRenewalSuccessLow", "15m", [(
            {**WORKER, "instance": "w1", "role": "worker", "severity": "warning"},
            "w1: worker lease renewals succeed 98.04% of the time (< 99%)")], "1m", [
            _series(renew, "0+100x20", **WORKER, instance="w1", role="worker", result="ok"),
            _series(renew, "0+2x20", **WORKER, instance="w1", role="worker", result="error"),
            _series(renew, "0+200x20", **WORKER, instance="w2", role="worker", result="ok"),
            _series(renew, "0+1x20", **WORKER, instance="w2", role="worker", result="lost"),
        ]),
        # 10% of the runs published between 50 and 100 ms late: p99 > 50 ms.
        _alert("CrawlDispatchLagHigh", "15m", [
            ({"severity": "warning"}, "Beat dispatch lag p99 is 95ms (> 50 ms)")], "1m", [
            _series(lag, "0+50x20", le="0.01"), _series(lag, "0+90x20", le="0.05"),
            _series(lag, "0+100x20", le="0.1"), _series(lag, "0+100x20", le="+Inf"),
        ]),
        # 0.5% of them late: p99 still within 50 ms.
        _alert("CrawlDispatchLagHigh", "15m", [], "1m", [
            _series(lag, "0+150x20", le="0.01"), _series(lag, "0+199x20", le="0.05"),
            _series(lag, "0+200x20", le="0.1"), _series(lag, "0+200x20", le="+Inf"),
        ]),
        # The leader stops at 30 s and nobody takes over: firing 20 s later.
        _alert("CrawlNoBeatLeader", "60s", [NO_LEADER], "10s", [
            _series("crawl_beat_leader", "1 1 1 0 0 0 0 0 0 0", instance="b1"),
            _series("crawl_beat_leader", "0 0 0 0 0 0 0 0 0 0", instance="b2"),
        ]),
        # A failover within one TTL: never firing.
        _alert("CrawlNoBeatLeader", "90s", [], "10s", [
            _series("crawl_beat_leader", "1 1 1 0 0 0 0 0 0 0", instance="b1"),
            _series("crawl_beat_leader", "0 0 0 0 1 1 1 1 1 1", instance="b2"),
        ]),
        # No beat scraped at all.
        _alert("CrawlNoBeatLeader", "60s", [NO_LEADER], "10s", [
            _series("up", "1 1 1 1 1 1 1 1", job="celery-crawl-worker"),
        ]),
        # b2's schedule differs for 10 minutes: firing; b3's for 4 minutes only: not.
        _alert("CrawlBeatScheduleMismatch", "10m", [(
            {"instance": "b2", "job": "beat", "severity": "warning"},
            "b2: this beat replica's schedule has differed from the one the fleet runs for "
            "more than 5 minutes")], "1m", [
            _series("crawl_beat_schedule_mismatch", "0x10", job="beat", instance="b1"),
            _series("crawl_beat_schedule_mismatch", "1x10", job="beat", instance="b2"),
            _series("crawl_beat_schedule_mismatch", "0 0 0 0 0 0 1 1 1 1 1", job="beat",
                    instance="b3"),
        ]),
        # w1: 0.2 failures/s and a proxy at 50%; w2: as many failures, healthy proxies;
        # w3: an unhealthy proxy but only 0.05 failures/s.
        _alert("CrawlSiteFailingWithUnhealthyProxies", "15m", [(
            {**WORKER, "instance": "w1", "site": "shop", "severity": "warning"},
            "shop: 0.20 failed fetches/s on w1 while a proxy answers < 60% of fetches")], "1m", [
            _series(fail, "0+12x20", **WORKER, instance="w1", site="shop", reason="timeout"),
            _series(health, "0.5x20", **WORKER, instance="w1", proxy="proxy-2"),
            _series(health, "1x20", **WORKER, instance="w1", proxy="direct"),
            _series(fail, "0+12x20", **WORKER, instance="w2", site="shop", reason="timeout"),
            _series(health, "0.9x20", **WORKER, instance="w2", proxy="direct"),
            _series(fail, "0+3x20", **WORKER, instance="w3", site="shop", reason="network"),
            _series(health, "0.4x20", **WORKER, instance="w3", proxy="direct"),
        ]),
    ]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_rules_pass_promtool_check() -> None:
    out = _run(["check", "rules", str(RULES)])
    assert out.returncode == 0 and "SUCCESS: 5 rules found" in out.stdout, out.stdout + out.stderr


def test_each_alert_fires_exactly_when_it_should(tmp_path: Path) -> None:
    (tmp_path / "alerts.yml").write_text(RULES.read_text())
    names = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tests = _tests()
    assert {t["alert_rule_test"][0]["alertname"] for t in tests} == names
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "10s",
                                    "tests": tests}, sort_keys=False))
    out = _run(["test", "rules", str(spec)])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("broken", [
    # Each threshold moved to the wrong side makes the synthetic cases disagree.
    ("< 0.99", "< 0.97"), ("> 0.05", "> 0.2"), ("for: 20s", "for: 2m"), ("< 0.6", "< 0.3"),
    ("(crawl_beat_schedule_mismatch) >= 1", "(crawl_beat_schedule_mismatch) >= 2"),
])
def test_the_rule_tests_catch_a_wrong_threshold(tmp_path: Path, broken: tuple[str, str]) -> None:
    text = RULES.read_text()
    assert broken[0] in text
    (tmp_path / "alerts.yml").write_text(text.replace(broken[0], broken[1]))
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "10s",
                                    "tests": _tests()}, sort_keys=False))
    assert _run(["test", "rules", str(spec)]).returncode != 0
