"""The beat's durable state written by someone else: garbage entry-state, skip-log, presence
and operator-command records are reported, and the leader keeps dispatching every entry.

Record parsers are fuzzed directly (any JSON object -> a state or ``StoreDataError``); then a
real ``LeasedScheduler`` (in-process, ticking like ``celery beat``) runs against a real Redis
whose namespace was salted with garbage.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from celery_crawl import keys
from celery_crawl.beat import LeasedScheduler
from celery_crawl.beat.commands import parse_command
from celery_crawl.beat.state import EntryState, SkipLog
from celery_crawl.errors import StoreDataError
from celery_crawl.schedules import TzCron
from tests.security.leaks import assert_no_secret
from tests.security.tlsservers import AclRedis
from tests.servers import RedisServer

EVERY_SECOND = TzCron("* * * * * *", "UTC")

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["2026-01-01T00:00:00Z", "0001-01-01T00:00:00+01:00",
                     "9999-12-31T23:59:59-14:00", "2026-01-01T00:00:00", "not a slot", ""]),
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=8)
STATE_FIELDS = ["fingerprint", "last_slot", "run_count", "last_task_id", "last_run_slot",
                "paused", "buffered_slot", "token"]
state_records = st.dictionaries(st.sampled_from(STATE_FIELDS), json_values, max_size=8)
skip_records = st.fixed_dictionaries({}, optional={
    "ranges": st.one_of(json_values, st.lists(st.dictionaries(
        st.sampled_from(["first", "last", "count", "reason", "approx"]), json_values),
        max_size=3)),
    "totals": st.one_of(json_values, st.dictionaries(st.text(max_size=5), json_values)),
})
command_records = st.dictionaries(st.sampled_from(["op", "entry", "start", "end", "at", "id"]),
                                  json_values, max_size=6)

_fuzz = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])


@_fuzz
@given(record=state_records)
@example(record={"fingerprint": "f", "run_count": 1e999})
@example(record={"fingerprint": "f", "last_slot": "0001-01-01T00:00:00+01:00"})
def test_entry_state_record_parses_or_is_store_data_error(record: dict[str, Any]) -> None:
    try:
        state = EntryState.from_record(record, key="beat/entry/x")
    except StoreDataError as exc:
        assert "beat/entry/x" in str(exc)
        return
    # What was accepted must be usable: it is written back as JSON on the next dispatch.
    json.dumps(state.to_record(), allow_nan=False)
    assert isinstance(state.run_count, int)
    assert state.paused in (None, True, False)
    assert state.token is None or isinstance(state.token, int)
    assert state.last_task_id is None or isinstance(state.last_task_id, str)


@_fuzz
@given(record=skip_records)
@example(record={"ranges": [{"first": "2026-01-01T00:00:00Z", "last": "2026-01-01T00:00:00Z",
                             "count": 1e999, "reason": "x"}]})
def test_skip_log_record_parses_or_is_store_data_error(record: dict[str, Any]) -> None:
    try:
        log = SkipLog.from_record(record, key="beat/skips/x")
    except StoreDataError as exc:
        assert "beat/skips/x" in str(exc)
        return
    json.dumps(log.to_record(), allow_nan=False)


@_fuzz
@given(record=command_records)
def test_operator_command_record_parses_or_is_value_error(record: dict[str, Any]) -> None:
    with contextlib.suppress(ValueError):
        parse_command(record)


def _plant(raw: Any, ns: str, variant: str) -> None:
    if variant == "non-json-entry-state":
        raw.hset(f"{ns}:rec:{keys.beat_entry('a')}", "v", b"\xff not json")
        return
    raw.hset(f"{ns}:rec:{keys.beat_entry('b')}", "v",
             b'{"fingerprint": "old", "run_count": 1e999, '
             b'"last_slot": "0001-01-01T00:00:00+01:00"}')
    raw.hset(f"{ns}:rec:{keys.beat_skips('c')}", "v", b"[" * 100_000)
    raw.hset(f"{ns}:rec:{keys.beat_presence('forged')}", "v",
             b'{"id": [1], "clock_offset_s": "x"}')
    raw.rpush(f"{ns}:q:{keys.BEAT_COMMANDS}", b"\xff", b'{"op": "pause"}',
              b'{"op": "backfill", "entry": "c", "start": "0001-01-01T00:00:00+01:00"}')


@pytest.mark.parametrize("variant", ["non-json-entry-state", "hostile-values"])
def test_leader_keeps_dispatching_past_garbage_state(redis_server: RedisServer,
                                                     variant: str) -> None:
    """Garbage in one entry's state, another's skip log, a presence record or the command
    queue: every entry is still dispatched."""
    ns = f"beatsec{uuid.uuid4().hex[:6]}"
    _plant(redis_server.client(0), ns, variant)
    app = Celery(ns, set_as_current=False)
    app.conf.update(
        broker_url=redis_server.url_db(1), crawl_lease_url=redis_server.url_db(0),
        crawl_namespace=ns, crawl_beat_lease_ttl=1.5, crawl_store_timeout=1.0,
        crawl_schedule_paths=[],
        beat_schedule={name: {"task": "t.record", "schedule": EVERY_SECOND}
                       for name in ("a", "b", "c")},
        task_default_queue=f"q-{ns}", broker_connection_timeout=5,
    )
    scheduler = LeasedScheduler(app)
    try:
        deadline = time.monotonic() + 2.2
        while time.monotonic() < deadline:
            time.sleep(min(max(scheduler.tick(), 0.0), 0.05))
    finally:
        scheduler.close()
    broker = redis_server.client(1)
    entries = set()
    while (msg := broker.rpop(f"q-{ns}")) is not None:
        entries.add(json.loads(msg)["headers"].get("crawl_entry"))
    assert entries == {"a", "b", "c"}, f"entries dispatched: {sorted(entries)}"


def test_beat_logs_info_and_metrics_carry_no_password(acl_redis: AclRedis,
                                                      all_logs: pytest.LogCaptureFixture) -> None:
    """A leader whose lease store and broker need a password: the password is in none of its
    log lines, its ``celery beat`` banner line (``Scheduler.info``) or the process's metrics."""
    password = acl_redis.add_user("beat", ["~*", "&*", "+@all"])
    ns = f"beatpw{uuid.uuid4().hex[:6]}"
    app = Celery(ns, set_as_current=False)
    app.conf.update(
        broker_url=acl_redis.url("beat", password, db=1),
        crawl_lease_url=acl_redis.url("beat", password), crawl_namespace=ns,
        crawl_beat_lease_ttl=1.5, crawl_store_timeout=1.0, crawl_schedule_paths=[],
        beat_schedule={"a": {"task": "t.record", "schedule": EVERY_SECOND}},
        task_default_queue=f"q-{ns}", broker_connection_timeout=5,
    )
    scheduler = LeasedScheduler(app)
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            time.sleep(min(max(scheduler.tick(), 0.0), 0.05))
        info = scheduler.info
        assert scheduler.election.is_leader
    finally:
        scheduler.close()
    assert_no_secret(str(info), [password], "the scheduler banner")
    assert_no_secret(all_logs.text, [password], "the beat's logs")
    assert_no_secret(generate_latest().decode(), [password], "the metrics")
