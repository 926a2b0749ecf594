"""``crawl_beat_schedule_mismatch`` with in-process schedulers on a real Redis: while a live
replica holds the fleet's schedule, one with another schedule is refused the lead (``refuse``)
or leads without adopting its schedule, so no stored state is collected (``warn``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from celery import Celery

from celery_crawl import keys
from celery_crawl.beat import LeasedScheduler
from celery_crawl.beat.state import format_slot
from celery_crawl.leases import open_store
from celery_crawl.schedules import TzCron
from tests.servers import RedisServer

EVERY_SECOND = TzCron("* * * * * *", "UTC")
BOTH = {"keep": {"task": "t.a", "schedule": EVERY_SECOND},
        "gone": {"task": "t.b", "schedule": EVERY_SECOND}}
ONE = {"keep": {"task": "t.a", "schedule": EVERY_SECOND}}


def _app(server: RedisServer, ns: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    app = Celery(ns, set_as_current=False)
    app.conf.update({"broker_url": server.url_db(1), "crawl_lease_url": server.url_db(0),
                     "crawl_namespace": ns, "crawl_beat_lease_ttl": 1.5,
                     "crawl_store_timeout": 1.0, "crawl_schedule_paths": [],
                     "beat_schedule": schedule, "task_default_queue": f"q-{ns}", **conf})
    return app


@pytest.fixture
def fleet(redis_server: RedisServer) -> Iterator[tuple[str, Any, list[LeasedScheduler]]]:
    ns = f"fm-{uuid.uuid4().hex[:8]}"
    store = open_store(redis_server.url_db(0), namespace=ns)
    made: list[LeasedScheduler] = []
    yield ns, store, made
    for s in made:
        s.close()
    store.close()


def _run(s: LeasedScheduler, seconds: float, also: Any = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if also is not None:
            also()
        time.sleep(min(max(s.tick(), 0.0), 0.05))


@pytest.mark.parametrize("mode", ["refuse", "warn"])
def test_a_replica_with_another_schedule_beside_a_live_holder_of_the_fleets(
        redis_server: RedisServer, fleet: tuple[str, Any, list[LeasedScheduler]],
        mode: str) -> None:
    ns, store, made = fleet
    first = LeasedScheduler(_app(redis_server, ns, BOTH))
    made.append(first)
    _run(first, 1.0)
    assert first.election.is_leader
    fleet_fp = first.schedule_fingerprint
    assert store.get(keys.BEAT_SCHEDULE)["fingerprint"] == fleet_fp
    first.close()

    def holder_alive() -> None:  # a replica still running the fleet's schedule
        store.put(keys.beat_presence("old"), {
            "id": "old", "schedule": fleet_fp, "entries": 2, "role": "standby",
            "last_seen": format_slot(datetime.now(UTC))}, ttl_s=5)

    other = LeasedScheduler(_app(redis_server, ns, ONE, crawl_beat_schedule_mismatch=mode))
    made.append(other)
    _run(other, 2.0, also=holder_alive)
    assert other.schedule_fingerprint != fleet_fp
    if mode == "refuse":
        assert not other.election.is_leader
        reason = other.election.blocked_reason or ""
        assert f"differs from the fleet's {fleet_fp}" in reason and "old" in reason, reason
    else:
        assert other.election.is_leader and other.election.blocked_reason is None
    # Either way the fleet's schedule stands and the entry only it has keeps its state.
    assert store.get(keys.BEAT_SCHEDULE)["fingerprint"] == fleet_fp
    assert store.get(keys.beat_entry("gone")) is not None
    # The holder goes: the other schedule now leads and is adopted; only then is "gone" removed.
    # (The warn-mode leader adopts in its running term.)
    store.delete(keys.beat_presence("old"))
    _run(other, 2.5)
    assert other.election.is_leader
    assert store.get(keys.BEAT_SCHEDULE)["fingerprint"] == other.schedule_fingerprint
    assert store.get(keys.beat_entry("gone")) is None
