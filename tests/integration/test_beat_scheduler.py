"""LeasedScheduler in-process against a real Redis (store and broker): leadership, publishing,
durable state, fencing, catch-up, overlap and operator commands.

The schedulers are driven by calling ``tick()`` like ``celery beat`` does; what they publish is
read back from the broker's queue list, so every assertion is about real messages.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from celery_crawl import keys
from celery_crawl.beat import LeasedScheduler
from celery_crawl.beat.commands import make_command
from celery_crawl.beat.state import EntryState, SkipLog
from celery_crawl.leases import make_holder, open_store
from celery_crawl.schedules import TzCron, task_id_for
from tests.servers import RedisServer, wait_until

EVERY_SECOND = TzCron("* * * * * *", "UTC")


def make_app(server: RedisServer, ns: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    app = Celery(ns, set_as_current=False)
    app.conf.update({
        "broker_url": server.url_db(1),
        "crawl_lease_url": server.url_db(0),
        "crawl_namespace": ns,
        "crawl_beat_lease_ttl": 1.5,
        "crawl_store_timeout": 1.0,
        "crawl_schedule_paths": [],
        "beat_schedule": schedule,
        "task_default_queue": f"q-{ns}",
        "broker_connection_timeout": 5,
        **conf,
    })
    return app


def drain(server: RedisServer, ns: str) -> list[dict[str, Any]]:
    """Every message published to the test queue so far (removed from the queue)."""
    client = server.client(1)
    out = []
    # kombu's Redis transport keeps one list per priority step: q, q\x06\x163, ...
    for queue in sorted(client.keys(f"q-{ns}*")):
        while True:
            raw = client.rpop(queue)
            if raw is None:
                break
            msg = json.loads(raw)
            body = json.loads(base64.b64decode(msg["body"])) if msg.get("body") else None
            out.append({**msg["headers"], "body": body, "properties": msg["properties"]})
    return sorted(out, key=lambda m: m["crawl_slot"])


def run_for(schedulers: list[LeasedScheduler], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sleep = min(s.tick() for s in schedulers)
        time.sleep(min(max(sleep, 0.0), 0.05))


@pytest.fixture
def ns() -> str:
    return f"beat-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def opened() -> Iterator[list[LeasedScheduler]]:
    made: list[LeasedScheduler] = []
    yield made
    for s in made:
        s.close()


def start(app: Celery, opened: list[LeasedScheduler]) -> LeasedScheduler:
    s = LeasedScheduler(app)
    opened.append(s)
    return s


def test_one_leader_publishes_each_slot_once_with_headers(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    sched = {"tick": {"task": "t.record", "schedule": EVERY_SECOND, "args": [1],
                      "options": {"expires": 30, "priority": 5}}}
    a = start(make_app(redis_server, ns, sched), opened)
    b = start(make_app(redis_server, ns, sched), opened)
    run_for([a, b], 3.2)
    assert [a.election.is_leader, b.election.is_leader].count(True) == 1
    leader = a if a.election.is_leader else b
    msgs = drain(redis_server, ns)
    slots = [m["crawl_slot"] for m in msgs]
    assert len(slots) >= 2 and len(slots) == len(set(slots))
    for m in msgs:
        slot = datetime.fromisoformat(m["crawl_slot"].replace("Z", "+00:00"))
        assert m["id"] == task_id_for(ns, "tick", slot)
        # One publish per slot, whichever leader sends it: a copy of it is a duplicate.
        assert m["crawl_sent"] == m["id"]
        assert m["crawl_entry"] == "tick"
        assert m["crawl_leader_token"] == leader.election.lease.token
        assert m["body"][0] == [1]
        assert m["expires"] is not None and m["properties"]["priority"] == 5
        assert m["properties"]["delivery_info"]["routing_key"] == f"q-{ns}"
    store = open_store(redis_server.url_db(0), namespace=ns)
    st = EntryState.from_record(store.get(keys.beat_entry("tick")))
    assert st.run_count == len(msgs) and st.last_task_id == msgs[-1]["id"]
    presence = store.scan(keys.beat_presence(""))
    assert {r["role"] for r in presence.values()} == {"leader", "standby"}
    store.close()


def test_registered_task_is_published_on_the_fast_path(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler],
    caplog: pytest.LogCaptureFixture
) -> None:
    """A registered task's own options (serializer, queue) come back from routing; passing
    them twice to send_task_message once sent every run through the slow send_task path."""
    sched = {"reg": {"task": "t.registered", "schedule": EVERY_SECOND}}
    app = make_app(redis_server, ns, sched, task_serializer="json")

    @app.task(name="t.registered", serializer="json", queue=f"q-{ns}", shared=False)
    def registered() -> None:  # pragma: no cover - never run here
        return None

    a = start(app, opened)
    with caplog.at_level("WARNING", logger="celery_crawl.beat"):
        run_for([a], 2.5)
    msgs = drain(redis_server, ns)
    assert msgs and all(m["crawl_entry"] == "reg" for m in msgs)
    assert all(m["properties"]["delivery_info"]["routing_key"] == f"q-{ns}" for m in msgs)
    assert not a._publisher._fallback_logged, caplog.text
    assert "through send_task" not in caplog.text


def test_handoff_continues_without_repeating_a_slot(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    sched = {"tick": {"task": "t.record", "schedule": EVERY_SECOND}}
    a = start(make_app(redis_server, ns, sched), opened)
    run_for([a], 2.2)
    assert a.election.is_leader
    b = start(make_app(redis_server, ns, sched), opened)
    run_for([a, b], 0.5)
    assert not b.election.is_leader
    a.close()
    t0 = time.monotonic()
    wait_until(lambda: (b.tick(), b.election.is_leader)[1], 3, what="standby takes over")
    assert time.monotonic() - t0 < 1.0
    run_for([b], 2.2)
    slots = [m["crawl_slot"] for m in drain(redis_server, ns)]
    assert len(slots) == len(set(slots)), slots
    stamps = sorted(datetime.fromisoformat(s.replace("Z", "+00:00")) for s in slots)
    gaps = [(y - x).total_seconds() for x, y in itertools.pairwise(stamps)]
    store = open_store(redis_server.url_db(0), namespace=ns)
    skips = SkipLog.from_record(store.get(keys.beat_skips("tick")))
    store.close()
    # every slot between the first and the last is either published or recorded as skipped
    assert sum(int(g) - 1 for g in gaps) == sum(skips.totals.values())


def test_frozen_leader_is_fenced_and_demotes_without_publishing(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    sched = {"tick": {"task": "t.record", "schedule": EVERY_SECOND}}
    a = start(make_app(redis_server, ns, sched), opened)
    b = start(make_app(redis_server, ns, sched), opened)
    run_for([a], 1.2)
    assert a.election.is_leader
    # a "freezes" (no ticks) past its TTL; b takes over
    wait_until(lambda: (b.tick(), b.election.is_leader)[1], 6, what="b takes over")
    drain(redis_server, ns)
    old_token = a.election.lease.token
    a.tick()  # resumes: must notice, demote, and not publish
    assert not a.election.is_leader
    run_for([a, b], 1.5)
    assert not a.election.is_leader
    msgs = drain(redis_server, ns)
    assert msgs and all(m["crawl_leader_token"] > old_token for m in msgs)


def test_catchup_latest_records_superseded_slots(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    sched = {"tick": {"task": "t.record", "schedule": EVERY_SECOND}}
    app = make_app(redis_server, ns, sched)
    a = start(app, opened)
    run_for([a], 1.5)
    fp = a.states["tick"].fingerprint
    a.close()
    store = open_store(redis_server.url_db(0), namespace=ns)
    past = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=20)
    rec = EntryState(fp, last_slot=past, run_count=5).to_record()
    store.put(keys.beat_entry("tick"), rec)  # as if the last leader stopped 20 s ago
    store.delete(keys.beat_skips("tick"))
    drain(redis_server, ns)
    b = start(app, opened)
    run_for([b], 0.6)
    msgs = drain(redis_server, ns)
    assert msgs, "the latest missed slot runs at once"
    skips = SkipLog.from_record(store.get(keys.beat_skips("tick")))
    assert skips.ranges[0].reason == "superseded"
    assert skips.ranges[0].first == past + timedelta(seconds=1)
    assert skips.ranges[0].count >= 18
    store.close()


def test_changed_definition_starts_afresh_and_removed_entries_are_collected(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    a = start(make_app(redis_server, ns, {
        "keep": {"task": "t.a", "schedule": EVERY_SECOND},
        "gone": {"task": "t.b", "schedule": EVERY_SECOND},
    }), opened)
    run_for([a], 1.3)
    a.close()
    b = start(make_app(redis_server, ns, {
        "keep": {"task": "t.a", "schedule": EVERY_SECOND, "args": ["changed"]},
    }), opened)
    run_for([b], 0.3)
    store = open_store(redis_server.url_db(0), namespace=ns)
    assert store.get(keys.beat_entry("gone")) is None
    st = EntryState.from_record(store.get(keys.beat_entry("keep")))
    assert st.fingerprint == b.entries["keep"].fingerprint and st.run_count <= 1
    store.close()


def test_overlap_skip_uses_the_previous_runs_claim(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    sched = {"slow": {"task": "t.slow", "schedule": EVERY_SECOND}}
    a = start(make_app(redis_server, ns, sched), opened)
    wait_until(lambda: (a.tick(), a.states.get("slow") and a.states["slow"].last_task_id)[1],
               5, what="first run")
    first = a.states["slow"].last_task_id
    store = open_store(redis_server.url_db(0), namespace=ns)
    worker = store.acquire(keys.worker_lease("w1"), 30, make_holder())
    assert worker is not None
    assert store.claim(worker, keys.task_claim(first), {"queue": "q"}) is not None
    run_for([a], 2.2)
    assert a.states["slow"].last_task_id == first  # nothing new while the claim lives
    skips = SkipLog.from_record(store.get(keys.beat_skips("slow")))
    assert skips.totals.get("overlap", 0) >= 1
    store.unclaim(worker, keys.task_claim(first))
    store.put(keys.done(first), {"state": "SUCCESS"})
    run_for([a], 1.3)
    assert a.states["slow"].last_task_id != first
    store.close()


def test_operator_commands(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    hourly = TzCron("0 * * * *", "UTC")
    sched = {
        "tick": {"task": "t.record", "schedule": EVERY_SECOND},
        "hourly": {"task": "t.hourly", "schedule": hourly},
    }
    a = start(make_app(redis_server, ns, sched), opened)
    run_for([a], 0.5)
    store = open_store(redis_server.url_db(0), namespace=ns)
    store.push(keys.BEAT_COMMANDS, make_command("pause", "tick"))
    wait_until(lambda: (a.tick(), a.states["tick"].paused)[1], 3, what="pause applied")
    drain(redis_server, ns)
    run_for([a], 1.5)
    assert [m for m in drain(redis_server, ns) if m["crawl_entry"] == "tick"] == []
    assert SkipLog.from_record(store.get(keys.beat_skips("tick"))).totals["paused"] >= 1
    store.push(keys.BEAT_COMMANDS, make_command("resume", "tick"))
    store.push(keys.BEAT_COMMANDS, make_command("trigger", "hourly"))
    end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    store.push(keys.BEAT_COMMANDS, make_command(
        "backfill", "hourly", start=end - timedelta(hours=2), end=end))
    run_for([a], 1.5)
    msgs = drain(redis_server, ns)
    hourly_msgs = [m for m in msgs if m["crawl_entry"] == "hourly"]
    assert len(hourly_msgs) == 1 + 3 and all(m["crawl_manual"] for m in hourly_msgs)
    assert any(m["crawl_entry"] == "tick" for m in msgs)
    store.close()


def test_evicting_redis_is_refused_for_leadership(
    fresh_redis: RedisServer, ns: str, opened: list[LeasedScheduler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fresh_redis.client().config_set("maxmemory", "100mb")
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    a = start(make_app(fresh_redis, ns, {"tick": {"task": "t", "schedule": EVERY_SECOND}}),
              opened)
    run_for([a], 0.6)
    assert not a.election.is_leader
    assert "maxmemory-policy" in (a.election.blocked_reason or "")
    assert any("refusing to lead" in r.getMessage() for r in caplog.records)
    # the fixture's Redis runs without AOF and RDB: slot state would not survive a restart
    assert any("neither AOF nor RDB" in r.getMessage() for r in caplog.records)


def test_schedule_files_reload_and_a_broken_file_keeps_its_entries(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler], tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "crawl.toml"
    path.write_text('[defaults]\ntz = "UTC"\n\n[entries.filed]\ntask = "t.filed"\n'
                    'cron = "* * * * * *"\nargs = [1]\n')
    app = make_app(redis_server, ns, {}, crawl_schedule_paths=[str(tmp_path / "*.toml")])
    a = start(app, opened)
    run_for([a], 1.5)
    assert any(m["crawl_entry"] == "filed" for m in drain(redis_server, ns))
    fp = a.entries["filed"].fingerprint
    path.write_text("[entries.filed\ntask = ")  # broken: the previous definition stays
    run_for([a], 1.5)
    assert a.entries["filed"].fingerprint == fp
    assert any("keeps its previous schedule" in r.getMessage() for r in caplog.records)
    assert any(m["crawl_entry"] == "filed" for m in drain(redis_server, ns))
    path.write_text('[defaults]\ntz = "UTC"\n\n[entries.filed]\ntask = "t.filed"\n'
                    'cron = "* * * * * *"\nargs = [2]\n')
    run_for([a], 3.0)
    assert a.entries["filed"].fingerprint != fp
    msgs = [m for m in drain(redis_server, ns) if m["crawl_entry"] == "filed"]
    assert msgs and msgs[-1]["body"][0] == [2]


def test_metrics_endpoint_reports_leadership_and_dispatch(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    import httpx

    from tests.servers import free_port

    port = free_port()
    a = start(make_app(redis_server, ns, {"tick": {"task": "t", "schedule": EVERY_SECOND}},
                       crawl_metrics_port=port), opened)
    run_for([a], 1.3)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert "crawl_beat_leader 1.0" in text
    assert 'crawl_lease_time_left_seconds{role="beat"}' in text
    assert "crawl_beat_dispatched_total" in text and "crawl_beat_dispatch_lag_seconds" in text


def _claim_last_run(a: LeasedScheduler, store: Any, name: str) -> tuple[Any, str]:
    wait_until(lambda: (a.tick(), a.states.get(name) and a.states[name].last_task_id)[1],
               5, what="first run")
    first = a.states[name].last_task_id
    worker = store.acquire(keys.worker_lease(f"w-{uuid.uuid4().hex[:6]}"), 30, make_holder())
    assert worker is not None
    assert store.claim(worker, keys.task_claim(first), {"queue": "q"}) is not None
    return worker, first


def test_overlap_buffer_one_holds_one_slot_until_the_previous_run_ends(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    sched = {"slow": {"task": "t.slow", "schedule": EVERY_SECOND,
                      "options": {"crawl_overlap": "buffer_one"}}}
    a = start(make_app(redis_server, ns, sched), opened)
    store = open_store(redis_server.url_db(0), namespace=ns)
    worker, first = _claim_last_run(a, store, "slow")
    drain(redis_server, ns)
    run_for([a], 2.5)
    buffered = a.states["slow"].buffered_slot
    assert buffered is not None and drain(redis_server, ns) == []
    skips = SkipLog.from_record(store.get(keys.beat_skips("slow")))
    assert skips.totals.get("overlap_buffered", 0) >= 1
    store.unclaim(worker, keys.task_claim(first))
    store.put(keys.done(first), {"state": "SUCCESS"})
    run_for([a], 1.5)
    msgs = drain(redis_server, ns)
    assert msgs[0]["crawl_slot"] == f"{buffered:%Y-%m-%dT%H:%M:%SZ}"
    store.close()


def test_overlap_cancel_other_revokes_the_previous_run(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = {"slow": {"task": "t.slow", "schedule": EVERY_SECOND,
                      "options": {"crawl_overlap": "cancel_other"}}}
    a = start(make_app(redis_server, ns, sched), opened)
    store = open_store(redis_server.url_db(0), namespace=ns)
    _, first = _claim_last_run(a, store, "slow")
    run_for([a], 1.5)
    assert a.states["slow"].last_task_id != first
    assert any(f"revoked the previous run {first}" in r.getMessage() for r in caplog.records)
    # The revoked run's slot is on record as cancelled, so no slot is left unaccounted.
    skips = store.get(keys.beat_skips("slow"))
    assert skips is not None
    assert any(r["reason"] == "cancelled_by_overlap" for r in skips["ranges"]), skips
    store.close()


def test_an_entry_in_beat_schedule_and_a_file_is_an_error_naming_both(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler], tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "dup.toml"
    path.write_text('[entries.twice]\ntask = "t.file"\ncron = "0 * * * *"\ntz = "UTC"\n')
    app = make_app(redis_server, ns, {"twice": {"task": "t.conf", "schedule": EVERY_SECOND}},
                   crawl_schedule_paths=[str(path)])
    a = start(app, opened)
    assert a.entries["twice"].task == "t.conf"  # beat_schedule's definition is kept
    messages = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("twice" in m and "beat_schedule" in m and "dup.toml" in m for m in messages), \
        messages


def test_unmeasured_clock_skew_fails_closed(
    etcd_server: Any, ns: str, opened: list[LeasedScheduler]
) -> None:
    """With etcd leases the skew guard's reference is the broker's Redis: while that clock
    cannot be read the replica's skew is unknown and it must not lead; once the reference
    answers it measures the offset and leads."""
    from tests.servers import free_port

    port = free_port()
    app = Celery(ns, set_as_current=False)
    app.conf.update({
        "broker_url": f"redis://127.0.0.1:{port}/1",
        "crawl_lease_url": etcd_server.url,
        "crawl_namespace": ns,
        "crawl_beat_lease_ttl": 3,
        "crawl_schedule_paths": [],
        "crawl_store_timeout": 1.0,
        "beat_schedule": {},
    })
    a = start(app, opened)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        a.tick()
        assert not a.election.is_leader
        time.sleep(0.05)
    assert "could not be compared" in (a.election.blocked_reason or "")
    reference = RedisServer(port=port).start()
    try:
        wait_until(lambda: (a.tick(), a.election.is_leader)[1], 15,
                   what="the replica leads once its clock is measured")
        assert a._clock is not None and a._clock.offset_s is not None
    finally:
        a.close()
        reference.cleanup()


def test_publish_retries_stay_within_the_lease_validity(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    """A frozen broker makes every publish attempt block for its socket timeout: the retries
    are budgeted by the lease's remaining validity (time, not a count), so one tick never
    outlives the lease, and the slot is recorded as publish_failed."""
    import signal

    broker = RedisServer().start()
    try:
        sched = {"tick": {"task": "t.record", "schedule": EVERY_SECOND}}
        app = make_app(redis_server, ns, sched, crawl_beat_lease_ttl=3.0,
                       broker_url=broker.url_db(1),
                       broker_transport_options={"socket_timeout": 0.7,
                                                 "socket_connect_timeout": 0.7})
        a = start(app, opened)
        wait_until(lambda: (a.tick(), broker.client(1).llen(f"q-{ns}"))[1] >= 1, 15,
                   what="a first publish")
        assert broker.proc is not None
        os.killpg(broker.proc.pid, signal.SIGSTOP)
        try:
            worst = 0.0
            deadline = time.monotonic() + 8.0
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                a.tick()
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.05)
        finally:
            os.killpg(broker.proc.pid, signal.SIGCONT)
        store = open_store(redis_server.url_db(0), namespace=ns)
        skips = SkipLog.from_record(store.get(keys.beat_skips("tick")))
        store.close()
        print(f"longest tick with a frozen broker: {worst:.2f}s (ttl 3 s)")
        assert worst < 4.5, worst  # the validity (< ttl 3 s) plus one attempt, with headroom
        assert skips.totals.get("publish_failed", 0) >= 1, skips.totals
    finally:
        broker.cleanup()


def test_leader_dispatches_again_after_a_store_outage_that_failed_its_state_write(
    redis_server: RedisServer, ns: str, opened: list[LeasedScheduler]
) -> None:
    """A state write that fails in a store outage holds further runs back until it succeeds;
    the outage also costs the lease. The held-back writes go with that leadership, so when the
    replica leads again it must dispatch, not stay held back by the old term's failed write."""
    import signal

    store = RedisServer().start()
    try:
        sched = {"tick": {"task": "t.record", "schedule": EVERY_SECOND}}
        app = make_app(redis_server, ns, sched, crawl_lease_url=store.url_db(0),
                       crawl_beat_lease_ttl=2.0, crawl_store_timeout=0.5)
        a = start(app, opened)
        run_for([a], 2.5)
        assert a.election.is_leader and drain(redis_server, ns)
        old_token = a.election.lease.token
        assert store.proc is not None
        os.killpg(store.proc.pid, signal.SIGSTOP)
        try:
            # The outage strikes a flush (as it does in the middle of a burst): it fails for
            # real against the frozen store and holds further runs back.
            assert a._book is not None
            a._book.queue("tick")
            a._book.flush()
            assert a._book.flush_failed
            wait_until(lambda: (a.tick(), not a.election.is_leader)[1], 15,
                       interval_s=0.05, what="the leader demotes in the outage")
        finally:
            os.killpg(store.proc.pid, signal.SIGCONT)
        wait_until(lambda: (a.tick(), a.election.is_leader)[1], 15, interval_s=0.05,
                   what="it leads again")
        drain(redis_server, ns)
        run_for([a], 2.5)
        msgs = drain(redis_server, ns)
        assert msgs, "a leader held back by the previous term's failed state write"
        assert all(m["crawl_leader_token"] > old_token for m in msgs)
    finally:
        store.cleanup()
