"""What operators and tasks see: the claim token in the task, duplicates parked then dropped,
``inspect stats`` / ``crawl_leases`` / Flower's ``/api/workers``, and refused setups."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from celery_crawl import keys
from celery_crawl.leases import open_store
from tests.chromium import cells, render, screenshot
from tests.procs import CELERY, Proc, celery_args
from tests.servers import RedisServer, free_port, wait_until
from tests.system.workerapp_harness import APP, Combo, Workers, runs, send, workers

pytestmark = [pytest.mark.system]


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def running(redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[Combo, Workers]
]:
    """Two prefork workers shared by the tests of this module."""
    combo = Combo(broker=redis_srv.url_db(1), backend=redis_srv.url_db(2),
                  lease=redis_srv.url_db(0), sink=redis_srv.url_db(3))
    with workers(combo, tmp_path_factory.mktemp("vis")) as ws:
        ws.start("a", wait=False)
        ws.start("b", wait=False)
        ws.wait_ready("a")
        ws.wait_ready("b")
        yield combo, ws


def test_task_sees_its_claim_token_and_a_forged_header_does_not_survive(
    running: tuple[Combo, Workers],
) -> None:
    combo, _ws = running
    key = f"{combo.ns}-forged"
    client = combo.app()
    try:
        client.send_task("crawltest.work", args=[key, 0.0], queue=combo.queue,
                         headers={"crawl_claim_token": 10**18})
    finally:
        client.close()
    done = wait_until(lambda: runs(combo, key, "finished"), 30, what="task finished")[0]
    assert done["token"] is not None and done["token"] < 10**18
    assert done["header"] == done["token"]


FORGED = 2**53 - 1


def _publish_raw(combo: Combo, body: bytes, headers: dict[str, object]) -> None:
    client = combo.app()
    try:
        with client.producer_or_acquire() as producer:
            producer.publish(body, exchange="", routing_key=combo.queue, headers=headers,
                             content_type="application/json", content_encoding="utf-8")
    finally:
        client.close()


def test_a_claim_token_forged_into_the_body_does_not_reach_the_task(
    running: tuple[Combo, Workers],
) -> None:
    """Celery merges the protocol-2 embed over the headers in the pool: a token there (also
    spelt with a JSON escape, which no byte search would find) must not survive; nor one in a
    protocol-1 body (which runs without a claim)."""
    combo, _ws = running
    store = open_store(combo.lease, namespace=combo.ns)
    try:
        for n, key_text in enumerate(('"crawl_claim_token"', '"\\u0063rawl_claim_token"')):
            key, task_id = f"{combo.ns}-embed{n}", str(uuid.uuid4())
            headers = {"lang": "py", "task": "crawltest.work", "id": task_id,
                       "root_id": task_id, "retries": 0, "crawl_claim_token": FORGED}
            embed = ('{"callbacks": null, "errbacks": null, "chain": null, "chord": null, '
                     + key_text + ": " + str(FORGED) + "}")
            body = f'[["{key}", 0.0], {{}}, {embed}]'.encode()
            assert json.loads(body)[2]["crawl_claim_token"] == FORGED
            _publish_raw(combo, body, headers)
            done = wait_until(lambda k=key: runs(combo, k, "finished"), 30,
                              what="the task finished")[0]
            tombstone = wait_until(lambda t=task_id: store.get(keys.done(t)), 10,
                                   what="its end recorded")
            assert done["token"] != FORGED and done["header"] != FORGED, done
            assert done["token"] == done["header"] == tombstone["token"], (done, tombstone)
        key = f"{combo.ns}-proto1"
        body = json.dumps({"task": "crawltest.work", "id": str(uuid.uuid4()),
                           "args": [key, 0.0], "kwargs": {},
                           "crawl_claim_token": FORGED}).encode()
        _publish_raw(combo, body, {})
        done = wait_until(lambda: runs(combo, key, "finished"), 30, what="the task finished")[0]
        assert done["token"] is None and done["header"] is None, done
    finally:
        store.close()


def test_duplicate_delivery_is_parked_then_dropped(running: tuple[Combo, Workers]) -> None:
    combo, ws = running
    key = f"{combo.ns}-dup"
    task_id = str(uuid.uuid4())
    # One publish sent twice, as the beat re-sends a slot (its crawl_sent is the task id).
    same = {"crawl_sent": task_id}
    send(combo, key, 2.0, task_id=task_id, headers=same)
    wait_until(lambda: runs(combo, key), 30, what="first run started")
    send(combo, key, 2.0, task_id=task_id, headers=same)
    wait_until(lambda: "parked (not run, not acked)" in ws.logs(), 15, what="duplicate parked")
    wait_until(lambda: "as a duplicate" in ws.logs(), 30, what="duplicate dropped")
    assert len(runs(combo, key)) == 1
    assert len(runs(combo, key, "finished")) == 1
    # A new publish of the finished id (its own crawl_sent) runs again, as on stock Celery.
    send(combo, key, 0.5, task_id=task_id, headers={"crawl_sent": uuid.uuid4().hex})
    wait_until(lambda: len(runs(combo, key, "finished")) == 2, 30, what="the new publish's run")
    assert len(runs(combo, key)) == 2


def test_inspect_stats_crawl_leases_and_flower(
    running: tuple[Combo, Workers], tmp_path: Path,
) -> None:
    combo, ws = running
    client = combo.app()
    try:
        stats = wait_until(lambda: client.control.inspect(timeout=3).stats(), 20,
                           what="inspect stats")
        leases = wait_until(
            lambda: client.control.broadcast("crawl_leases", reply=True, timeout=3), 20,
            what="crawl_leases replies")
    finally:
        client.close()
    for name in ("a", "b"):
        info = stats[ws.hostname(name)]
        # Flat rows (Flower renders a nested dict as one blob), every value a scalar.
        assert "crawl_lease" not in info
        assert info["crawl_lease_holder"] and info["crawl_lease_token"]
        assert info["crawl_lease_time_left_s"] > 0
        assert info["crawl_renew_success_rate"] in (None, 1.0)
        assert info["crawl_claims"] == 0 and info["crawl_consuming"] is True
        assert all(v is None or isinstance(v, bool | int | float | str)
                   for k, v in info.items() if k.startswith("crawl_"))
    replies = {k: v for reply in leases for k, v in reply.items()}
    assert set(replies) == {ws.hostname("a"), ws.hostname("b")}
    assert all("claimed" in r and r["holder"] for r in replies.values())

    port = free_port()
    flower = Proc(celery_args(APP, "flower", f"--port={port}", "--address=127.0.0.1"),
                  env={**combo.env(), "FLOWER_UNAUTHENTICATED_API": "true"},
                  log_path=tmp_path / "flower.log")
    try:
        def workers_api() -> dict | None:
            r = httpx.get(f"http://127.0.0.1:{port}/api/workers", params={"refresh": "1"},
                          timeout=10)
            body = r.json() if r.status_code == 200 else {}
            ok = all("crawl_lease_token" in (body.get(ws.hostname(n), {}).get("stats") or {})
                     for n in ("a", "b"))
            return body if ok else None

        body = wait_until(workers_api, 60, interval_s=0.5, what="flower /api/workers")
        lease = body[ws.hostname("a")]["stats"]
        assert {"crawl_lease_holder", "crawl_lease_token", "crawl_lease_time_left_s",
                "crawl_claims", "crawl_renew_success_rate"} <= set(lease)
        # Flower's worker page, as a browser renders it: one row per figure in "Other".
        page = f"http://127.0.0.1:{port}/worker/{ws.hostname('a')}"
        rows = {row[0][1]: row[1][1] for row in
                cells(render(page).dom, caption="Other statistics") if len(row) == 2}
        assert rows["crawl_lease_holder"] == lease["crawl_lease_holder"], rows
        assert rows["crawl_lease_token"] == str(lease["crawl_lease_token"]), rows
        assert float(rows["crawl_lease_time_left_s"]) > 0, rows
        assert rows["crawl_claims"] == "0" and rows["crawl_consuming"] == "True", rows
        assert not any(k == "crawl_lease" or v.startswith("{") for k, v in rows.items()), rows
        screenshot(page + "#tab-other", "flower-worker.png", size="1280,1100")
    finally:
        flower.stop(grace_s=2)


@pytest.mark.parametrize(("extra", "needle"), [
    (("-P", "solo"), "'solo' pool is not supported"),
    (("-B",), "embedded beat"),
])
def test_unsupported_setups_refused_at_start(
    redis_srv: RedisServer, tmp_path: Path, extra: tuple[str, ...], needle: str,
) -> None:
    combo = Combo(broker=redis_srv.url_db(1), backend=redis_srv.url_db(2),
                  lease=redis_srv.url_db(0), sink=redis_srv.url_db(3))
    args = [CELERY, "-A", APP, "worker", "--without-mingle", "--without-gossip", "-c", "1",
            "-Q", combo.queue, *extra]
    env = {**os.environ, **combo.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(args, env=env, capture_output=True, timeout=60, start_new_session=True,
                         cwd=str(Path(__file__).resolve().parents[2]))
    text = (out.stdout + out.stderr).decode(errors="replace")
    assert out.returncode != 0, text[-2000:]
    assert needle in text, text[-2000:]
