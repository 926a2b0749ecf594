"""The leader's delivery check: a run lost between the Redis broker and a worker runs anyway.

kombu's Redis transport pops a message before it records it as unacked; a worker killed in
between loses it without a trace. The test takes messages off the queue itself (what such a
worker does), with no worker running, so the other runs wait in the queue past the check's
delay: the lost runs must be published again and run once, the waiting ones must not be.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_crawl import keys
from celery_crawl.beat.state import EntryState
from tests.procs import Proc, celery_args, worker_args
from tests.servers import RedisServer, wait_until

pytestmark = pytest.mark.system

VERIFY_S = 2.0
TIMEOUT_S = 45.0


def _resent(log: str) -> list[str]:
    """Task ids the beat logged as published again."""
    return re.findall(r"run (\S+) \(slot [^)]*\) is neither at a worker", log)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    yield srv
    srv.cleanup()


def test_a_run_taken_off_the_queue_and_lost_is_published_again_and_runs_once(
        server: RedisServer, tmp_path: Path) -> None:
    ns = f"dv{uuid.uuid4().hex[:6]}"
    env = {"CRAWL_B_BROKER": server.url_db(0), "CRAWL_B_LEASE": server.url_db(1),
           "CRAWL_B_NS": ns, "CRAWL_B_TTL": "3", "CRAWL_B_SINK": server.url_db(2),
           "CRAWL_B_ENTRIES": "1", "CRAWL_B_VERIFY": str(VERIFY_S)}
    broker, sink = server.client(0), server.client(2)
    beat = Proc(celery_args("tests.system.beatapp", "beat", "-S",
                            "celery_crawl.beat:LeasedScheduler", "-l", "INFO",
                            "-s", str(tmp_path / "unused")),
                env=env, log_path=tmp_path / "beat.log")
    worker: Proc | None = None
    try:
        wait_until(lambda: broker.llen("celery") >= 4, TIMEOUT_S,
                   what=f"runs waiting in the queue\n{beat.log()}")
        lost = [json.loads(broker.rpop("celery"))["headers"]["id"] for _ in range(2)]
        # The rest now wait in the queue past the check's delay: found there, not resent.
        wait_until(lambda: set(_resent(beat.log())) == set(lost), TIMEOUT_S,
                   what=f"the lost runs published again\n{beat.log()}")
        # Only the lost runs were published again: the ones waiting were found in the queue.
        # Judged before a worker runs: once one does, a run it has popped but not yet claimed
        # is briefly nowhere, and may be published again too (its copy is then dropped).
        resent_before_worker = _resent(beat.log())
        worker = Proc(worker_args("tests.system.beatapp", concurrency=2,
                                  hostname=f"w-{ns}@%h"),
                      env=env, log_path=tmp_path / "worker.log")

        def ran() -> Counter[str]:
            return Counter(json.loads(x)["id"] for x in sink.lrange("runs", 0, -1))

        wait_until(lambda: all(ran()[i] for i in lost), TIMEOUT_S,
                   what=f"the lost runs ran\n{beat.log()}\n{worker.log()}")
        wait_until(lambda: broker.llen("celery") == 0, TIMEOUT_S, what="the queue drained")
        counts = ran()
        assert all(counts[i] == 1 for i in lost), counts
        assert max(counts.values()) == 1, f"a run ran twice: {counts}"
        assert sorted(resent_before_worker) == sorted(lost), beat.log()
        # Each run is checked off once a worker has it: the durable list empties.
        from celery_crawl.leases import open_store

        store = open_store(server.url_db(1), namespace=ns, timeout_s=2.0)
        try:
            def checked_off() -> bool:
                st = EntryState.from_record(store.get(keys.beat_entry("e0")) or {})
                return len(st.unverified) <= 4  # the newest few, not yet due for a look
            wait_until(checked_off, TIMEOUT_S, what="runs checked off")
        finally:
            store.close()
    finally:
        for p in (beat, worker):
            if p is not None:
                p.stop()
