"""Claims and ends sent from the consumer's loop without waiting (``worker/store_line.py``).

The broker is one real redis-server, the lease store another (so nothing can ride in kombu's
round trips), with the real ``LeaseStep`` and ``ClaimStep``; only Celery's consumer and hub are
replaced: the test hands each delivery to the claim strategy, reads the claim line's socket when
it is readable (the hub's reader) and runs what the steps scheduled on the loop. Faults are
real: the lease store is frozen (SIGSTOP) with calls on the line.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, signals
from kombu import Consumer, Queue

from celery_crawl import keys
from celery_crawl.worker.consumer_claims import ConsumerClaims
from celery_crawl.worker.steps import ClaimStep, LeaseStep
from tests.queued_hub import QueuedHub, stub_consumer
from tests.servers import RedisServer, wait_until

#: Long enough that the freezes below (3 s at most) never cost the worker its lease.
TTL_S = 8.0
TASK = "linetest.work"


class ReadingHub(QueuedHub):
    """A ``QueuedHub`` with the reader registration of Celery's hub: ``pump`` calls the
    reader of each registered socket that has something to read, then runs what is queued."""

    def __init__(self) -> None:
        super().__init__()
        self.readers: dict[int, Callable[[], None]] = {}

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)

    def pump(self) -> None:
        if self.readers:
            ready, _, _ = select.select(list(self.readers), [], [], 0.05)
            for fd in ready:
                callback = self.readers.get(fd)
                if callback is not None:
                    callback()
        while self.run():
            pass


@dataclass
class Rig:
    app: Celery
    step: ConsumerClaims
    hub: ReadingHub
    conn: Any
    queue: str
    store_server: RedisServer
    broker_db: Any
    #: Deliveries that reached the task (what Celery's strategy would run), with their acks.
    started: dict[str, Callable[[], Any]] = field(default_factory=dict)
    #: How many times each task id reached the task.
    starts: dict[str, int] = field(default_factory=dict)
    messages: dict[str, Any] = field(default_factory=dict)

    def publish(self, task_id: str) -> None:
        self.app.send_task(TASK, args=[1], task_id=task_id, queue=self.queue)

    def receive(self, n: int) -> None:
        before = len(self.messages)
        wait_until(lambda: self._drain() or len(self.messages) >= before + n, 10.0,
                   what=f"{n} deliveries")

    def _drain(self) -> bool:
        try:
            self.conn.drain_events(timeout=0.1)
        except TimeoutError:
            pass
        except Exception as exc:  # socket.timeout on older Pythons
            if "timed out" not in str(exc):
                raise
        return False

    def loop_until(self, predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Turn the loop (the hub's readers and queued callbacks, the parked re-check) until
        ``predicate`` holds."""
        def turn() -> Any:
            self.hub.pump()
            return predicate()
        return wait_until(turn, timeout_s, what=what)

    @property
    def line(self) -> Any:
        line = self.step._line
        assert line is not None, "no claim line: the claims went another way"
        return line.line

    def unacked(self) -> int:
        return int(self.broker_db.hlen("unacked"))


@pytest.fixture
def rig(redis_server: RedisServer, fresh_redis: RedisServer) -> Iterator[Rig]:
    broker_url = redis_server.url_db(6)
    app = Celery("linetest", broker=broker_url, set_as_current=False)
    app.conf.update(crawl_lease_url=fresh_redis.url_db(0),
                    crawl_namespace=f"line{uuid.uuid4().hex[:8]}",
                    crawl_worker_lease_ttl=TTL_S, crawl_store_timeout=1.0,
                    task_serializer="json", accept_content=["json"])
    hub = ReadingHub()
    worker = SimpleNamespace(app=app, pool_cls="prefork", hostname="line@localhost", hub=hub,
                             pool=None)
    lease_step = LeaseStep(worker)
    conn = app.connection_for_read()
    conn.ensure_connection(max_retries=1)
    channel = conn.default_channel
    queue = f"line-{uuid.uuid4().hex[:8]}"

    def original(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                 **kw: Any) -> None:
        task_id = message.headers["id"]
        rig.started[task_id] = ack
        rig.starts[task_id] = rig.starts.get(task_id, 0) + 1

    consumer = stub_consumer(worker, {TASK: original}, conn, channel)
    step = ClaimStep(consumer).claims
    lease_step.start(worker)
    step.start(consumer)
    strategy = consumer.strategies[TASK]
    rig = Rig(app, step, hub, conn, queue, fresh_redis, redis_server.client(6))

    def on_message(message: Any) -> None:
        rig.messages[message.headers["id"]] = message
        strategy(message, None, lambda *a, **k: message.ack(), lambda *a, **k: None, None)

    kombu_consumer = Consumer(channel, queues=[Queue(queue)], on_message=on_message,
                              accept=["json"])
    kombu_consumer.consume()
    try:
        yield rig
    finally:
        if fresh_redis.proc is not None:
            os.kill(fresh_redis.proc.pid, signal.SIGCONT)
        step.stop(consumer)
        signals.worker_shutdown.disconnect(lease_step._on_worker_shutdown)
        lease_step.release()
        conn.release()


def _connect_the_line(rig: Rig) -> None:
    """One task claimed, run and acked: the claim line is connected (it connects on first
    use) and its reader registered."""
    warm = f"w-{uuid.uuid4().hex[:8]}"
    rig.publish(warm)
    rig.receive(1)
    rig.loop_until(lambda: warm in rig.started, 10.0, what="the warm-up task started")
    rig.started[warm]()
    rig.loop_until(lambda: len(rig.line) == 0 and rig.unacked() == 0, 10.0,
                   what="the warm-up task acked")


def test_a_claim_and_an_end_go_out_on_the_loop_without_a_store_round_trip(rig: Rig) -> None:
    """The claim is sent and the strategy returns; the reply, read when the socket has it,
    starts the task. The end is sent when the run acks; the ack waits for the end's reply
    (the tombstone is written before the ack)."""
    store = rig.step.store
    assert store is not None
    _connect_the_line(rig)
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    assert task_id not in rig.started and len(rig.line) == 1
    rig.loop_until(lambda: task_id in rig.started, 10.0, what="the task started")
    claim = store.claimant(keys.task_claim(task_id))
    assert claim is not None and claim.alive
    rig.started[task_id]()
    assert len(rig.line) == 1 and rig.unacked() == 1  # the end is out; the ack waits
    rig.loop_until(lambda: rig.unacked() == 0, 10.0, what="the ack after the end")
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done"
    assert store.claimant(keys.task_claim(task_id)) is None
    # Nothing went to the offload thread: no claim, end or decision was handed to it.
    assert not rig.step._offload._started
    assert rig.step.status()["claim_line"] is True
    assert rig.step.status()["rides_broker"] is False


def test_the_loop_does_not_wait_for_a_frozen_store(rig: Rig) -> None:
    """With the lease store frozen, the strategy and the run's ack return at once: the claim
    and the end wait on the line, not on the loop."""
    assert rig.store_server.proc is not None
    _connect_the_line(rig)
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    pid = rig.store_server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(3.0, os.kill, (pid, signal.SIGCONT))
    resume.start()
    try:
        began = time.monotonic()
        rig.receive(1)
        took = time.monotonic() - began
        pending = len(rig.line)
    finally:
        resume.join()
    assert took < 1.5 and pending == 1, f"the claim waited ({took:.2f}s, {pending} pending)"
    rig.loop_until(lambda: task_id in rig.started, 10.0, what="the task started")
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(3.0, os.kill, (pid, signal.SIGCONT))
    resume.start()
    try:
        began = time.monotonic()
        rig.started[task_id]()
        took = time.monotonic() - began
    finally:
        resume.join()
    assert took < 1.5, f"the end waited for the frozen store ({took:.2f}s)"
    rig.loop_until(lambda: rig.unacked() == 0, 10.0, what="the ack after the end")
    assert rig.starts[task_id] == 1


def test_a_claim_made_whose_reply_was_lost_does_not_park_the_task_forever(rig: Rig) -> None:
    """The claim goes out, the store freezes, the line gives up on the reply (the claim may
    or may not have been made) and the drop and the decision made off the loop time out too;
    then the store resumes and executes the claim it had buffered. The delivery is parked
    behind a live claim of our own lease, for this very delivery, that no run holds: it must
    be claimed again and run, once."""
    store = rig.step.store
    assert store is not None and rig.store_server.proc is not None
    _connect_the_line(rig)
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    pid = rig.store_server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        rig.publish(task_id)
        rig.receive(1)
        assert len(rig.line) == 1
        rig.hub.pump()  # the claim is written to the socket
        rig.line.poll(overdue_s=0.0)  # the reply is given up on: "unknown"
        assert len(rig.line) == 0
        # The drop and the decision by reading run on the offload thread and time out
        # against the frozen store: the delivery is parked.
        held = rig.loop_until(lambda: [h for h in rig.step.book.snapshot()
                                       if h.arrival.task_id == task_id and h.parked], 15.0,
                              what="the delivery parked")[0]
        assert held.token is None
    finally:
        os.kill(pid, signal.SIGCONT)
    # The store executes what it had read before the line closed: the claim is made, under
    # our lease, for this delivery (whether it is depends on the server; forced if not).
    lease = rig.step.keeper.lease if rig.step.keeper else None
    assert lease is not None
    if not _made(store, task_id):
        _force_claim(rig, task_id, lease)
    claim = store.claimant(keys.task_claim(task_id))
    assert claim is not None and claim.alive and claim.lease_name == lease.name
    # The consumer's timer re-checks the parked deliveries.
    rig.loop_until(lambda: rig.step._recheck_parked() or task_id in rig.started, 20.0,
                   what="the parked task claimed again")
    rig.started[task_id]()
    rig.loop_until(lambda: rig.unacked() == 0, 10.0, what="the ack after the end")
    assert rig.starts[task_id] == 1
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done"
    assert store.claimant(keys.task_claim(task_id)) is None


def _made(store: Any, task_id: str) -> bool:
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if store.claimant(keys.task_claim(task_id)) is not None:
            return True
        time.sleep(0.05)
    return False


def _force_claim(rig: Rig, task_id: str, lease: Any) -> Any:
    """The claim the frozen store would have made, made as the line's call makes it."""
    store = rig.step.store
    assert store is not None and rig.step.claimer is not None
    held = next(h for h in rig.step.book.snapshot() if h.arrival.task_id == task_id)
    key, value, guarded = rig.step.claimer.fresh_item(held, lease)
    assert store.claim_unless_changed(lease, key, value, record=guarded[0][0], version="",
                                      also=guarded[1:]) is not None
    return store.claimant(key)


def test_an_end_whose_reply_never_came_goes_to_the_backlog(rig: Rig) -> None:
    """The end's reply does not come within the overdue bound: the end may or may not have
    been recorded, so it goes to the backlog (recorded again from there; idempotent) and the
    message is acked."""
    store = rig.step.store
    assert store is not None and rig.store_server.proc is not None
    _connect_the_line(rig)
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    rig.loop_until(lambda: task_id in rig.started, 10.0, what="the task started")
    pid = rig.store_server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        rig.started[task_id]()
        rig.hub.pump()
        assert len(rig.line) == 1
        rig.line.poll(overdue_s=0.0)
        rig.hub.pump()
        assert len(rig.line) == 0 and len(rig.step.backlog) == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    rig.loop_until(lambda: rig.unacked() == 0, 10.0, what="the ack")
    rig.step.drain_backlog()
    assert len(rig.step.backlog) == 0
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done"
    assert store.claimant(keys.task_claim(task_id)) is None
