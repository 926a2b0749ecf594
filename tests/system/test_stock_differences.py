"""What the plugins still change in stock Celery, each case run on both apps of
``diffapp.py`` (stock Celery with ``task_acks_late`` set by hand, and ``celery_crawl.install``
with its defaults), on a real RabbitMQ (a vhost of the session) and on the Redis broker.

One ``celery worker -P threads -c 1`` per app, prefetch multiplier 1: one running task fills
the prefetch window. Celery's own integration suite is not installable here (its ``t/``
package is not in the wheel), so its cases for these differences are written out below.
"""

from __future__ import annotations

import gc
import importlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import chain, chord, group, states
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as ResultTimeout

from celery_crawl.tasks import deadline_headers
from tests.procs import Proc, worker_args
from tests.servers import RedisServer, wait_until

pytestmark = pytest.mark.system

TIMEOUT_S = 30.0
MODES = ("stock", "crawl")
CELERY_5_7 = tuple(int(p) for p in celery.__version__.split(".")[:2]) >= (5, 7)


class Stack:
    def __init__(self, broker: str, server: RedisServer, log_dir: Path) -> None:
        self.broker = broker
        self.server = server
        self.log_dir = log_dir
        self.workers: dict[str, Proc] = {}
        self.hostnames: dict[str, str] = {}

    def side(self) -> Any:
        return self.server.client(db=2)

    def runs(self, key: str) -> list[Any]:
        return [json.loads(v) for v in self.side().lrange(f"runs:{key}", 0, -1)]

    def log(self, mode: str) -> str:
        return self.workers[mode].log()[-4000:]


def _diffapp() -> Any:
    from tests.system import diffapp

    return diffapp


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def diff_redis() -> Iterator[RedisServer]:
    """One redis-server for both brokers' stacks: results of the first stack collected as
    garbage during the second unsubscribe from a live server (``tests/conftest.py``)."""
    server = RedisServer().start()
    yield server
    gc.collect()
    server.cleanup()


@pytest.fixture(scope="module", params=["rabbit", "redis"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          monkeypatch_module: pytest.MonkeyPatch, diff_redis: RedisServer) -> Iterator[Stack]:
    server = diff_redis
    broker = (request.getfixturevalue("rabbit_url") if request.param == "rabbit"
              else server.url_db(1))  # the Redis stack's broker; each stack has its own queues
    env = {"DIFF_REDIS_PORT": str(server.port), "DIFF_BROKER": broker,
           "DIFF_QUEUE": f"diff-{uuid.uuid4().hex[:8]}"}
    for key, value in env.items():
        monkeypatch_module.setenv(key, value)
    diffapp = importlib.reload(_diffapp())  # the apps point at this stack
    st = Stack(request.param, server, tmp_path_factory.mktemp(f"diff-{request.param}"))
    try:
        for mode in MODES:
            host = f"{mode}-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
            st.hostnames[mode] = host
            st.workers[mode] = Proc(
                worker_args(f"tests.system.diffapp:{mode}", pool="threads", concurrency=1,
                            hostname=host),
                env=env, log_path=st.log_dir / f"{mode}.log")
        for mode in MODES:
            assert diffapp.TASKS[mode].add.delay(1, 2).get(timeout=90) == 3, st.log(mode)
        yield st
    finally:
        for proc in st.workers.values():
            proc.stop()


def _t(mode: str) -> Any:
    return _diffapp().TASKS[mode]


def _app(mode: str) -> Any:
    return getattr(_diffapp(), mode)


def _hold_the_slot(stack: Stack, t: Any) -> tuple[str, Any]:
    gate = uuid.uuid4().hex[:10]
    blocker = t.block.apply_async((gate,))
    wait_until(lambda: stack.side().exists(f"started:{gate}"), TIMEOUT_S,
               what="the blocker to fill the prefetch window")
    return gate, blocker


def _past(instant: datetime) -> None:
    """Wait until ``instant`` (wall clock) has passed: an expiry is judged on it."""
    wait_until(lambda: datetime.now(UTC) > instant, TIMEOUT_S, what=f"{instant} to pass")


@pytest.mark.parametrize("mode", MODES)
def test_an_expiring_task_queued_behind_a_full_prefetch_window(stack: Stack, mode: str) -> None:
    """``expires=1`` while the only slot runs an acks_late task. Stock on RabbitMQ: the broker
    discards the expired message (Celery set its AMQP ``expiration``), nothing records it, and
    the task and its chord stay PENDING for ever. With the plugins (and on the Redis broker,
    which has no per-message TTL) the worker revokes it when it gets to it: REVOKED, and the
    chord fails."""
    t = _t(mode)
    gate, blocker = _hold_the_slot(stack, t)
    sent = datetime.now(UTC)
    expiring = t.add.apply_async((1, 1), expires=1)
    at_instant = t.add.apply_async((1, 2), expires=sent + timedelta(seconds=1))
    in_chord = chord([t.add.si(2, 2), t.add.si(3, 3).set(expires=1)], t.tsum.s()).apply_async()
    _past(sent + timedelta(seconds=2))
    stack.side().set(f"gate:{gate}", 1)
    opened = time.monotonic()
    marker = t.add.apply_async((5, 5))  # queued after them: its result means they were taken
    assert marker.get(timeout=TIMEOUT_S) == 10, stack.log(mode)
    assert blocker.get(timeout=TIMEOUT_S) == gate
    if mode == "stock" and stack.broker == "rabbit":
        assert expiring.state == states.PENDING  # vanished
        assert at_instant.state == states.PENDING
        assert in_chord.state == states.PENDING
        return
    wait_until(lambda: expiring.state == states.REVOKED, TIMEOUT_S, what="REVOKED")
    print(f"\n[{stack.broker}/{mode}] expired task REVOKED "
          f"{time.monotonic() - opened:.2f}s after the slot freed")
    for result in (expiring, at_instant):
        with pytest.raises(TaskRevokedError, match="expired"):
            result.get(timeout=TIMEOUT_S)
    with pytest.raises(Exception, match=r"expired|Dependency"):
        in_chord.get(timeout=TIMEOUT_S)
    assert in_chord.state == states.FAILURE


def test_a_crawl_child_whose_deadline_passes_in_the_queue_is_recorded(stack: Stack) -> None:
    """A task with a deadline publishes a blocker and a child (both inherit it as
    ``expires``); the child waits behind the blocker past the deadline, and ends REVOKED with
    a reason naming the deadline."""
    t = _t("crawl")
    gate = uuid.uuid4().hex[:10]
    deadline = datetime.now(UTC) + timedelta(seconds=3)
    parent = t.spawn.apply_async((gate,), headers=deadline_headers(deadline))
    _, child_id = parent.get(timeout=TIMEOUT_S)
    wait_until(lambda: stack.side().exists(f"started:{gate}"), TIMEOUT_S, what="the blocker")
    _past(deadline + timedelta(seconds=0.5))
    stack.side().set(f"gate:{gate}", 1)
    child = _app("crawl").AsyncResult(child_id)
    wait_until(lambda: child.state == states.REVOKED, TIMEOUT_S, what="the child REVOKED")
    with pytest.raises(TaskRevokedError, match="crawl deadline"):
        child.get(timeout=TIMEOUT_S)


@pytest.mark.parametrize("mode", MODES)
def test_revoke_during_retry_records_revoked_at_once(stack: Stack, mode: str) -> None:
    """Celery 5.7's ``revoke`` records REVOKED for a task waiting in RETRY (earlier versions
    record nothing until a worker drops the retry); the plugins record the same, at once."""
    t = _t(mode)
    key = uuid.uuid4().hex[:10]
    result = t.retry_later.apply_async((key,))
    wait_until(lambda: result.state == states.RETRY, TIMEOUT_S, what="RETRY")
    replies = _app(mode).control.revoke(result.id, reply=True, timeout=10,
                                        destination=[stack.hostnames[mode]])
    assert replies, "the worker did not answer the revoke"
    expected = states.REVOKED if CELERY_5_7 else states.RETRY
    assert result.state == expected, stack.log(mode)
    assert stack.runs(key) == [0]


@pytest.mark.parametrize("mode", MODES)
def test_a_task_acked_early_retries(stack: Stack, mode: str) -> None:
    """A task with ``acks_late = False`` (the plugins warn about it at start, and otherwise
    support it) calls ``self.retry()`` after its end was recorded (at the early ack): the
    retry runs and the task succeeds, as on stock (``Held.acked_early``). Before, the retry
    was dropped as a duplicate and the task stayed RETRY (Celery's ``test_tasks.py`` retry
    tests failed so when the worker's tasks were bound before ``install`` set
    ``task_acks_late``)."""
    t = _t(mode)
    key = uuid.uuid4().hex[:10]
    result = t.retry_acked_early.apply_async((key,))
    try:
        assert result.get(timeout=TIMEOUT_S) == 1
    except ResultTimeout:
        pytest.fail(f"still {result.state}; worker log: {stack.log(mode)}")
    assert [json.loads(v) for v in stack.side().lrange(f"runs:{key}", 0, -1)] == [0, 1]


@pytest.mark.parametrize("mode", MODES)
def test_a_reused_id_in_a_second_canvas_runs_again(stack: Stack, mode: str) -> None:
    """One task id in two chords and a chain (a frozen signature used twice): each use is a
    new publish, and it runs again for each, on stock and with the plugins alike."""
    t = _t(mode)
    key = uuid.uuid4().hex[:10]
    reused = str(uuid.uuid4())
    first = chord([t.record.si(key, 2).set(task_id=reused), t.add.si(2, 2)], t.tsum.s())
    assert first.apply_async().get(timeout=TIMEOUT_S) == 6
    second = chord([t.record.si(key, 3).set(task_id=reused), t.add.si(3, 3)], t.tsum.s())
    assert second.apply_async().get(timeout=TIMEOUT_S) == 9, stack.log(mode)
    in_chain = chain(t.record.si(key, 4).set(task_id=reused), t.add.s(10))
    assert in_chain.apply_async().get(timeout=TIMEOUT_S) == 14, stack.log(mode)
    assert len(stack.runs(key)) == 3


@pytest.mark.parametrize("mode", MODES)
def test_a_reused_id_from_an_unmarked_producer_completes_or_fails_the_canvas(
        stack: Stack, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same from a producer that never called ``install`` (its messages carry no publish
    id, so the plugins cannot tell a new publish from a copy and run a finished id once).
    Stock runs it again for each; the plugins give each later canvas the recorded outcome:
    the chord and the chain complete with the same values, a failing one fails the second
    chord too and calls its errback."""
    from celery_crawl import publishes

    monkeypatch.setattr(publishes, "_marking", False)
    t = _t(mode)
    key, bad = uuid.uuid4().hex[:10], uuid.uuid4().hex[:10]
    reused = str(uuid.uuid4())
    first = chord([t.record.si(key, 2).set(task_id=reused), t.add.si(2, 2)], t.tsum.s())
    assert first.apply_async().get(timeout=TIMEOUT_S) == 6
    second = chord([t.record.si(key, 2).set(task_id=reused), t.add.si(3, 3)], t.tsum.s())
    assert second.apply_async().get(timeout=TIMEOUT_S) == 8, stack.log(mode)
    in_chain = chain(t.record.si(key, 2).set(task_id=reused), t.add.s(10))
    assert in_chain.apply_async().get(timeout=TIMEOUT_S) == 12, stack.log(mode)
    assert len(stack.runs(key)) == (3 if mode == "stock" else 1)
    if mode == "crawl":
        assert stack.workers[mode].log().count(
            f"[{reused}]: the dropped duplicate belongs to another canvas") == 2

    failing = str(uuid.uuid4())
    for n in (1, 2):
        c = chord([t.boom.si().set(task_id=failing), t.add.si(1, 1)],
                  t.tsum.s().on_error(t.on_error.s(key=f"{bad}-{n}")))
        with pytest.raises(Exception, match=r"boom|Dependency"):
            c.apply_async().get(timeout=TIMEOUT_S)
        wait_until(lambda n=n: stack.side().llen(f"errbacks:{bad}-{n}"), TIMEOUT_S,
                   what=f"chord {n}'s errback")


@pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning")
@pytest.mark.parametrize("mode", MODES)
def test_one_failing_signature_in_a_header_then_in_a_body(
        stack: Stack, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's ``test_mutable_errback_called_by_chord_from_group`` (and ``..._from_chain``):
    one frozen failing signature in a chord's header group, then in another chord's body group,
    then in the middle of a third chord's body chain, errbacks linked to each. Each later chord
    fails too and calls its errback. Published marked, the signature runs again in each (as on
    stock); unmarked (a producer without ``install``), the plugins give each later chord the
    first run's recorded FAILURE, which also marks the rest of the chain FAILURE."""
    from celery_crawl import publishes

    for marked in (True, False):
        monkeypatch.setattr(publishes, "_marking", marked)
        _one_failing_signature(stack, mode)


def _one_failing_signature(stack: Stack, mode: str) -> None:
    t = _t(mode)
    key = uuid.uuid4().hex[:10]
    fail_sig = t.boom.s()
    fail_id = fail_sig.freeze().id
    first = chord((group(t.identity.si(42), fail_sig),), t.identity.s())
    first.link_error(t.on_error.s(key=f"{key}-1"))
    with pytest.raises(ValueError, match="boom"):
        first.delay().get(timeout=TIMEOUT_S)
    wait_until(lambda: stack.side().llen(f"errbacks:{key}-1"), TIMEOUT_S, what="errback 1")
    second = chord((t.identity.si(42),), group(t.identity.si(42), fail_sig))
    second.link_error(t.on_error.s(key=f"{key}-2"))
    with pytest.raises(ValueError, match="boom"):
        second.delay().get(timeout=TIMEOUT_S)
    wait_until(lambda: stack.side().llen(f"errbacks:{key}-2"), TIMEOUT_S, what="errback 2")
    assert [json.loads(v) for v in stack.side().lrange(f"errbacks:{key}-2", 0, -1)] == [
        [fail_id, "ValueError"]]
    # ``..._from_chain``: in the middle of a body chain, the caller waits on the chain's end.
    third = chord((t.identity.si(42),), chain(t.identity.si(1), fail_sig, t.identity.si(2)))
    third.link_error(t.on_error.s(key=f"{key}-3"))
    with pytest.raises(ValueError, match="boom"):
        third.delay().get(timeout=TIMEOUT_S)
    wait_until(lambda: stack.side().llen(f"errbacks:{key}-3"), TIMEOUT_S, what="errback 3")


@pytest.mark.parametrize("mode", MODES)
def test_a_frozen_chord_applied_again_runs_its_body_again(stack: Stack, mode: str) -> None:
    """Celery's ``test_reapplying_frozen_chord_dispatches_body_again``: a frozen chord reuses
    its ids, but each application is a new run; its header and body run again."""
    t = _t(mode)
    key, body_key = uuid.uuid4().hex[:10], uuid.uuid4().hex[:10]
    c = chord([t.record.si(key, 1), t.record.si(key, 2)], t.tsum_record.s(body_key))
    c.freeze()
    assert c.apply_async().get(timeout=TIMEOUT_S) == 3
    wait_until(lambda: len(stack.runs(body_key)) == 1, TIMEOUT_S, what="the first body")
    again = c.apply_async()
    assert again.get(timeout=TIMEOUT_S) == 3, stack.log(mode)
    wait_until(lambda: len(stack.runs(body_key)) == 2, TIMEOUT_S,
               what=f"the body's second run ({stack.log(mode)})")
    assert len(stack.runs(key)) == 4
    assert len(stack.runs(body_key)) == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_duplicated_chord_header_message_completes_the_chord_once(
        stack: Stack, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At least once: the broker delivers a chord header's message twice (published twice
    here). Stock runs the header task twice; the plugins run it once and drop the copy (a
    deliberate difference); the chord completes once either way."""
    t = _t(mode)
    app = _app(mode)
    key, body_key = uuid.uuid4().hex[:10], uuid.uuid4().hex[:10]
    dup = str(uuid.uuid4())
    send = app.amqp.send_task_message

    def twice(producer: Any, name: str, message: Any, **kw: Any) -> Any:
        sent = send(producer, name, message, **kw)
        if message.headers.get("id") == dup:
            send(producer, name, message, **kw)
        return sent

    monkeypatch.setattr(app.amqp, "send_task_message", twice)
    c = chord([t.record.si(key, 2).set(task_id=dup), t.add.si(1, 1)], t.tsum_record.s(body_key))
    assert c.apply_async().get(timeout=TIMEOUT_S) == 4
    monkeypatch.undo()
    if mode == "stock":
        wait_until(lambda: len(stack.runs(key)) == 2, TIMEOUT_S, what="the header's second run")
    else:
        wait_until(lambda: f"[{dup}] already finished" in stack.workers[mode].log(), TIMEOUT_S,
                   what="the copy dropped")
        assert len(stack.runs(key)) == 1
        assert len(stack.runs(body_key)) == 1
        # The copy is the same message: its canvas had the outcome, nothing is replayed.
        assert f"[{dup}]: the dropped duplicate belongs" not in stack.workers[mode].log()
