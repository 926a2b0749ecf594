"""The status page's rendering and the metrics server's routing, in-process.

The page against a real fleet (beat, worker, CLI, Chromium) is tests/system/test_status_page.py.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client import REGISTRY

from celery_crawl import metrics
from celery_crawl.status import render_html, scrub, text_lines
from tests.servers import free_port

HOSTILE = "<script>alert(1)</script>\"'><img src=x onerror=alert(2)>"
SECRET_URL = "redis://crawl:s3cr3t-pw@10.0.0.5:6379/0"


def _view() -> dict:
    return {
        "generated": "2026-03-01T00:00:00Z", "namespace": "ns", "store": SECRET_URL,
        "leader": {"holder": HOSTILE, "token": 7, "lease_time_left_s": 2.5},
        "replicas": [{"id": HOSTILE, "host": "h", "role": "leader", "token": 7,
                      "clock_offset_s": 0.012, "last_seen": "2026-03-01T00:00:00Z",
                      "blocked": f"store {SECRET_URL} refused", "entries": 2}],
        "entries_total": 1,
        "next_fires": [{"name": HOSTILE, "next_fire": "2026-03-01T00:00:01Z", "runs": 3,
                        "last_run": None, "paused": True, "skipped": {HOSTILE: 2}}],
        "skipped": {HOSTILE: 2},
        "errors": [HOSTILE],
        "process": {"kind": "beat", "id": HOSTILE, "role": "leader"},
    }


def test_every_value_is_escaped_and_no_password_is_shown() -> None:
    page = render_html(_view())
    assert "<script>alert" not in page and "<img" not in page
    # Exactly the page's own two scripts, nothing injected.
    assert len(re.findall(r"<script\b", page)) == 2
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#x27;&gt;&lt;img" in page
    assert "s3cr3t-pw" not in page and "redis://crawl:***@10.0.0.5:6379/0" in page
    assert "s3cr3t-pw" not in json.dumps(scrub(_view()))


def test_the_cli_lines_escape_control_characters() -> None:
    view = _view()
    view["leader"]["holder"] = "evil\x1b[2J\nholder"
    lines = text_lines(scrub(view))
    assert lines[0].startswith("leader:   evil\\x1b[2J\\nholder  token 7")
    assert "\x1b" not in "".join(lines)
    assert lines[-1] == f"skipped:  {text_lines(scrub(_view()))[-1][10:]}"


def test_scrub_masks_credentials_anywhere() -> None:
    assert scrub({"a": [f"x {SECRET_URL} y", ("etcd://u:p@h:2379",)]}) == {
        "a": ["x redis://crawl:***@10.0.0.5:6379/0 y", ["etcd://u:***@h:2379"]]}
    assert scrub("redis://:only-pw@h/0") == "redis://:***@h/0"


@pytest.fixture(scope="module")
def server() -> str:
    port = free_port()
    metrics.add_page("/status-test", lambda: metrics.Response(
        200, "text/html; charset=utf-8", b"<p>ok</p>", (("X-Extra", "1"),)))

    def broken() -> metrics.Response:
        raise RuntimeError("boom")

    metrics.add_page("/status-broken", broken)
    assert metrics.start_metrics_server(port) == port
    return f"http://127.0.0.1:{port}"


def test_pages_and_metrics_share_one_read_only_server(server: str) -> None:
    r = httpx.get(f"{server}/status-test", timeout=10)
    assert r.status_code == 200 and r.text == "<p>ok</p>"
    assert r.headers["x-extra"] == "1" and r.headers["cache-control"] == "no-store"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "crawl_lease_renewals_total" in httpx.get(f"{server}/metrics", timeout=10).text
    head = httpx.head(f"{server}/status-test", timeout=10)
    assert head.status_code == 200 and head.content == b""
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        for path in ("/status-test", "/metrics"):
            refused = httpx.request(method, f"{server}{path}", content=b"x", timeout=10)
            assert refused.status_code == 405, (method, path)
            assert refused.headers["allow"] == "GET, HEAD"
    failed = httpx.get(f"{server}/status-broken", timeout=10)
    assert failed.status_code == 500 and "boom" not in failed.text


def test_renewal_failures_are_counted_by_cause() -> None:
    from celery_crawl.errors import LeaseLost, StoreTimeout, StoreUnavailable

    def value(cause: str) -> float:
        return metrics.LEASE_RENEWAL_FAILURES.labels("unit", cause)._value.get()

    before = {c: value(c) for c in ("timeout", "lease_lost", "refused")}
    metrics.renewal_failed("unit", StoreTimeout("slow"))
    metrics.renewal_failed("unit", LeaseLost("gone"))
    metrics.renewal_failed("unit", StoreUnavailable("down"))
    metrics.renewal_failed("unit", StoreUnavailable("down"))
    assert {c: value(c) - before[c] for c in before} == {
        "timeout": 1, "lease_lost": 1, "refused": 2}


_FIRST_VIEW = r"""
import sys
from celery import Celery
from celery_crawl.status import page

app = Celery("p", broker="memory://")
app.conf.crawl_lease_url = sys.argv[1]
app.conf.crawl_namespace = "first-view"
source = page.install(app, lambda: {"kind": "test"})
before = {m for m in sys.modules if m.startswith("celery_crawl")}
code, view = source.view()
new = sorted({m for m in sys.modules if m.startswith("celery_crawl")} - before)
print(code, new)
"""


def test_the_first_view_imports_nothing_on_a_server_thread(tmp_path) -> None:
    """The page is served on the metrics server's threads. A module first imported there while
    the main thread imports it too can come out half initialized (importlib's deadlock guard:
    "cannot import name 'RedisLeaseStore' from partially initialized module"). So ``install``,
    on the main thread, imports everything the first view needs; the view imports nothing."""
    import subprocess
    import sys

    from tests.servers import running_redis

    with running_redis() as server:
        out = subprocess.run([sys.executable, "-c", _FIRST_VIEW, server.url_db(0)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "200 []", out


def test_an_empty_skipped_table_says_none_and_a_differing_schedule_is_marked() -> None:
    view = _view()
    view["skipped"] = {}
    view["schedule"] = {"fingerprint": "f00d", "entries": 1, "since": "2026-03-01T00:00:00Z"}
    view["replicas"][0].update(schedule="beef", schedule_differs=True)
    page = render_html(view)
    assert '<td data-field="reason">none</td>' in page
    assert "beef DIFFERS" in page and "The fleet runs schedule <code>f00d</code>" in page
    lines = text_lines(scrub(view))
    assert "schedule: f00d (1 entries), the one the fleet runs since 2026-03-01T00:00:00Z" \
        in lines
    assert any("SCHEDULE DIFFERS FROM THE LEADER'S" in line for line in lines)


def test_known_label_sets_start_at_zero() -> None:
    metrics.start_at_zero("worker")
    metrics.start_at_zero("beat")
    sample = REGISTRY.get_sample_value
    assert sample("crawl_worker_duplicates_total", {"outcome": "waiting"}) is not None
    assert sample("crawl_beat_skipped_slots_total", {"reason": "paused"}) is not None
    assert sample("crawl_lease_renewals_total", {"role": "beat", "result": "lost"}) is not None
    assert sample("crawl_lease_renewal_failures_total",
                {"role": "worker", "cause": "timeout"}) is not None
