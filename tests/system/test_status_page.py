"""``/status`` and ``/status.json`` of a real beat and a real worker, read by headless Chromium and
compared with ``celery -A ... crawl status``: the same leader, token, replicas, entries and skips;
every hostile value a store record can carry shown as text, no password, no console error, and
nothing but GET and HEAD answered."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from celery_crawl import keys
from celery_crawl.beat.state import SkipLog
from celery_crawl.leases import open_store
from tests.chromium import cells, render, screenshot
from tests.procs import ROOT, Proc, celery_args, worker_args
from tests.servers import RedisServer, free_port, wait_until

pytestmark = pytest.mark.system

APP = "tests.system.beatapp"
HOSTILE = "<script>alert(1)</script>\"'><img src=x onerror=alert(2)>"
SECRET = "s3cr3t-pw"


class Fleet:
    def __init__(self, redis_srv: RedisServer, logs: Path) -> None:
        self.ns = f"stp-{uuid.uuid4().hex[:6]}"
        self.env = {
            "CRAWL_B_BROKER": redis_srv.url_db(1),
            "CRAWL_B_LEASE": redis_srv.url_db(0),
            "CRAWL_B_NS": self.ns,
            "CRAWL_B_TTL": "3",
            "CRAWL_B_SINK": redis_srv.url_db(2),
            # Installs the worker plugin (lease, claims) in the app the worker runs.
            "CRAWL_B_VERIFY": "2",
            # Slot times are shown in the entries' zone beside UTC.
            "CRAWL_B_TZ": "Asia/Shanghai",
        }
        self.store = open_store(redis_srv.url_db(0), namespace=self.ns, timeout_s=2.0)
        self.ports = {"beat": free_port(), "worker": free_port()}
        self.procs = [
            Proc(celery_args(APP, "beat", "-S", "celery_crawl.beat:LeasedScheduler", "-l", "INFO",
                             "-s", str(logs / "unused")),
                 env={**self.env, "CRAWL_B_METRICS": str(self.ports["beat"])},
                 log_path=logs / "beat.log"),
            Proc(worker_args(APP, pool="threads", concurrency=2, hostname=f"w-{self.ns}@%h"),
                 env={**self.env, "CRAWL_B_METRICS": str(self.ports["worker"])},
                 log_path=logs / "worker.log"),
        ]

    def url(self, who: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[who]}{path}"

    def crawl(self, *args: str) -> str:
        out = subprocess.run(celery_args(APP, "crawl", *args), env={**os.environ, **self.env},
                             cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def stop(self) -> None:
        for p in self.procs:
            if p.alive():
                p.signal_group(signal.SIGTERM)
        for p in self.procs:
            p.stop(grace_s=3)
        self.store.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    redis_srv = RedisServer().start()
    fleet = Fleet(redis_srv, tmp_path_factory.mktemp("status"))
    try:
        wait_until(lambda: fleet.store.holder(keys.BEAT_LEADER), 30, what="a beat leader")

        def served(who: str) -> bool:
            try:
                r = httpx.get(fleet.url(who, "/status.json"), timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and "process" in r.json()

        for who in ("beat", "worker"):
            wait_until(lambda w=who: served(w), 60, interval_s=0.3, what=f"{who} /status.json")
        fleet.crawl("pause", "e1")
        wait_until(lambda: SkipLog.from_record(fleet.store.get(keys.beat_skips("e1")))
                   .totals.get("paused", 0) >= 1, 20, what="a paused slot recorded")
        # A record anyone who can reach the store could write.
        fleet.store.put(keys.beat_presence("evil"), {
            "id": HOSTILE, "host": f"redis://crawl:{SECRET}@10.0.0.5:6379/0", "role": HOSTILE,
            "blocked": f"{HOSTILE} redis://:{SECRET}@x/0", "last_seen": HOSTILE,
            "clock_offset_s": "not a number", "token": HOSTILE}, ttl_s=120)
        yield fleet
    finally:
        fleet.stop()
        redis_srv.cleanup()


def _cli_leader(text: str) -> tuple[str, int]:
    m = re.search(r"^leader:   (\S+)  token (\d+)", text, re.M)
    assert m, text
    return m.group(1), int(m.group(2))


def _comparable(view: dict[str, Any]) -> dict[str, Any]:
    """What cannot change between two reads a second apart (runs and lease left do)."""
    return {
        "leader": (view["leader"]["holder"], view["leader"]["token"]),
        "replicas": sorted(str(r["id"]) for r in view["replicas"]),
        "roles": sorted(str(r["role"]) for r in view["replicas"]),
        "entries": (view["entries_total"], sorted(r["name"] for r in view["next_fires"])),
        "paused": sorted(r["name"] for r in view["next_fires"] if r["paused"]),
        "skip_reasons": sorted(view["skipped"]),
        "namespace": view["namespace"],
        "store": view["store"],
    }


def test_json_and_cli_show_the_same_fleet(fleet: Fleet) -> None:
    cli_text = fleet.crawl("status")
    cli = json.loads(fleet.crawl("status", "--json"))
    assert (cli["leader"]["holder"], cli["leader"]["token"]) == _cli_leader(cli_text)
    assert "skipped:  paused " in cli_text and "PAUSED" in cli_text
    for who in ("beat", "worker"):
        page = httpx.get(fleet.url(who, "/status.json"), timeout=10).json()
        assert _comparable(page) == _comparable(cli), who
        assert page["skipped"]["paused"] >= 1
        assert SECRET not in json.dumps(page)
    beat_view = httpx.get(fleet.url("beat", "/status.json"), timeout=10).json()
    beat = beat_view["process"]
    assert beat["kind"] == "beat" and beat["role"] == "leader"
    # Lease time left has one name everywhere (the metric adds Prometheus' unit suffix).
    assert beat_view["leader"]["lease_time_left_s"] > 0 and beat["lease_time_left_s"] > 0
    assert beat["schedule"] == beat_view["schedule"]["fingerprint"] and beat["entries"] == 2
    assert (beat["id"], beat["token"]) == _cli_leader(cli_text)
    worker = httpx.get(fleet.url("worker", "/status.json"), timeout=10).json()["process"]
    assert worker["kind"] == "worker" and worker["holder"] and worker["token"]
    assert worker["lease_time_left_s"] > 0 and "time_left_s" not in worker
    assert worker["claims"] >= 0 and worker["reaper_recovered"] == 0


@pytest.mark.parametrize("who", ["beat", "worker"])
def test_the_page_renders_in_chromium_and_escapes_every_value(fleet: Fleet, who: str) -> None:
    page = render(fleet.url(who, "/status"))
    assert page.console == [], page.console
    body = re.search(r"<body[^>]*>", page.dom)
    assert body and 'data-ready="1"' in body.group(0) and "data-errors" not in body.group(0)
    holder, token = _cli_leader(fleet.crawl("status"))
    leader = {row[0][1]: row[1][1] for row in cells(page.dom, table_id="leader")}
    assert (leader["holder"], leader["token"]) == (holder, str(token))
    replicas = cells(page.dom, table_id="replicas")
    shown = {field: text for row in replicas for field, text in row if field}
    # The hostile record is shown as the text it is; only the page's own scripts exist.
    assert any(text == HOSTILE for row in replicas for _, text in row), replicas
    assert len(re.findall(r"<script\b", page.dom)) == 2 and "<img" not in page.dom
    assert SECRET not in page.dom and "redis://crawl:***@10.0.0.5:6379/0" in page.dom
    assert shown
    entries = {row[1][1]: row for row in cells(page.dom, table_id="entries")}
    assert set(entries) == {"e0", "e1"}
    assert dict(entries["e1"])["paused"] == "PAUSED"
    local = dict(entries["e0"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d CST", local["next_fire_local"]), local
    assert local["last_run_local"].endswith(" CST")
    assert "does not take the lead" in page.dom and "blocked: why it may not lead" in page.dom
    ours = [dict(row) for row in replicas if dict(row).get("id") != HOSTILE]
    assert ours and all(r["entries"] == "2" and r["blocked"] == "no" for r in ours), ours
    assert "The fleet runs schedule" in page.dom
    # A worker's page is read for the worker: its own figures come first, above the fleet.
    first = "process" if who == "worker" else "leader"
    later = "leader" if who == "worker" else "process"
    assert page.dom.index(f'id="{first}"') < page.dom.index(f'id="{later}"')
    assert "paused" in dict(entries["e1"])["skipped"]
    skipped = {row[0][1]: int(row[1][1]) for row in cells(page.dom, table_id="skipped")}
    assert skipped["paused"] >= 1
    process = {row[0][1]: row[1][1] for row in cells(page.dom, table_id="process")}
    assert process["kind"] == who
    if who == "worker":
        assert process["claims"].isdigit() and process["reaper_recovered"] == "0"
    screenshot(fleet.url(who, "/status"), f"status-{who}.png", size="1280,1000")


def test_read_only(fleet: Fleet) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("/status", "/status.json", "/metrics"):
            r = httpx.request(method, fleet.url("beat", path), content=b"{}", timeout=10)
            assert r.status_code == 405, (method, path)
    r = httpx.get(fleet.url("beat", "/status"), timeout=10)
    assert "script-src 'sha256-" in r.headers["content-security-policy"]
    assert "default-src 'none'" in r.headers["content-security-policy"]
