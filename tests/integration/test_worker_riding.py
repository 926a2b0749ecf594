"""Claims and ends riding in kombu's own Redis round trips (``worker/riding.py``).

A real kombu connection to a real redis-server that is also the lease store, the real
``LeaseStep`` and ``ClaimStep``; only Celery's consumer around them is replaced: the test hands
each message kombu delivers to the claim strategy and settles it when it chooses. The store's
own round-trip counter tells whether a claim or an end needed a round trip of its own.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, signals
from kombu import Consumer, Queue

from celery_crawl import keys
from celery_crawl.worker import install_worker, ridden_transport
from celery_crawl.worker.consumer_claims import ConsumerClaims
from celery_crawl.worker.steps import ClaimStep, LeaseStep
from tests.queued_hub import QueuedHub, stub_consumer
from tests.servers import Monitor, RedisServer, wait_until

TTL_S = 3.0
TASK = "ridetest.work"


@dataclass
class Rig:
    app: Celery
    step: ConsumerClaims
    hub: QueuedHub
    conn: Any
    queue: str
    #: The broker's server (``RedisServer``; another server's object in other modules).
    redis: Any
    #: What reached the task (the strategy Celery would have run), with its ack.
    started: dict[str, Callable[[], Any]] = field(default_factory=dict)
    #: Messages kombu delivered, by task id.
    messages: dict[str, Any] = field(default_factory=dict)
    #: Whether the handler passes messages to the claim strategy (Celery may refuse one first).
    to_strategy: bool = True
    #: Whether acks are lost before they reach kombu (a closed channel, say).
    lose_acks: bool = False

    def publish(self, task_id: str, name: str = TASK) -> None:
        self.app.send_task(name, args=[1], task_id=task_id, queue=self.queue)

    def receive(self, n: int) -> None:
        before = len(self.messages)
        wait_until(lambda: self._drain() or len(self.messages) >= before + n, 10.0,
                   what=f"{n} deliveries")

    def _drain(self) -> bool:
        try:
            self.conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass
        except Exception as exc:  # socket.timeout on older Pythons
            if "timed out" not in str(exc):
                raise
        return False

    def store_round_trips(self) -> int:
        assert self.step.store is not None
        return int(self.step.store.round_trips)  # type: ignore[attr-defined]


@pytest.fixture
def rig(redis_server: RedisServer) -> Iterator[Rig]:
    with open_rig(redis_server.url_db(5), redis_server) as opened:
        yield opened


@contextlib.contextmanager
def open_rig(url: str, server: Any, *, transport: str = ridden_transport.PATH) -> Iterator[Rig]:
    """A rig on the broker (and lease store) at ``url``, on ``server``."""
    app = Celery("ridetest", broker=url, set_as_current=False)
    app.conf.update(crawl_lease_url=url, crawl_namespace=f"ride{uuid.uuid4().hex[:8]}",
                    crawl_worker_lease_ttl=TTL_S, crawl_store_timeout=1.0,
                    # As install_worker sets it: riding needs kombu's writes bounded too.
                    broker_transport_options={"socket_timeout": 1.0},
                    task_serializer="json", accept_content=["json"])
    install_worker(app)  # kombu's Redis transport, subclassed so claims ride (the URL stays)
    assert app.conf.broker_transport == transport
    hub = QueuedHub()
    worker = SimpleNamespace(app=app, pool_cls="prefork", hostname="ride@localhost", hub=hub,
                             pool=None)
    lease_step = LeaseStep(worker)
    conn = app.connection_for_read()
    conn.ensure_connection(max_retries=1)
    channel = conn.default_channel
    queue = f"ride-{uuid.uuid4().hex[:8]}"

    def original(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                 **kw: Any) -> None:
        rig.started[message.headers["id"]] = ack

    consumer = stub_consumer(worker, {TASK: original}, conn, channel)
    step = ClaimStep(consumer).claims
    lease_step.start(worker)
    step.start(consumer)
    strategy = consumer.strategies[TASK]
    rig = Rig(app, step, hub, conn, queue, server)

    def on_message(message: Any) -> None:
        rig.messages[message.headers["id"]] = message
        if rig.to_strategy:
            strategy(message, None, lambda *a, **k: None if rig.lose_acks else message.ack(),
                     lambda *a, **k: None, None)

    kombu_consumer = Consumer(channel, queues=[Queue(queue)], on_message=on_message,
                              accept=["json"])
    kombu_consumer.consume()
    try:
        yield rig
    finally:
        step.stop(consumer)
        signals.worker_shutdown.disconnect(lease_step._on_worker_shutdown)
        lease_step.release()
        conn.release()


def _unacked(rig: Rig) -> int:
    return int(rig.redis.client(5).hlen("unacked"))


def _answered(rig: Rig) -> None:
    """Wait until every ack sent on the loop without waiting has its reply read."""
    riding = rig.step._riding
    assert riding is not None and riding.ack_line is not None
    line = riding.ack_line
    wait_until(lambda: line.poll() or len(line) == 0, 10.0, what="the ack replies")


def test_a_claim_and_an_end_take_no_store_round_trip_of_their_own(rig: Rig) -> None:
    store = rig.step.store
    assert store is not None
    ids = [f"t-{uuid.uuid4().hex[:8]}" for _ in range(5)]
    for task_id in ids:
        rig.publish(task_id)
    before = rig.store_round_trips()
    rig.receive(len(ids))
    # Claimed in the round trip that recorded each message as unacked: the strategy ran on
    # the same turn, with nothing waiting on another thread.
    assert sorted(rig.started) == sorted(ids)
    assert rig.hub.pending == []
    for task_id in ids:
        rig.started[task_id]()
    _answered(rig)
    assert rig.store_round_trips() == before, "a claim or an end made a store round trip"
    assert _unacked(rig) == 0
    for task_id in ids:
        assert store.claimant(keys.task_claim(task_id)) is None
        done = store.get(keys.done(task_id))
        assert done is not None and done["state"] == "done", done
    assert rig.step.status()["claims"] == 0
    assert rig.step.status()["rides_broker"] is True


def test_a_claim_no_strategy_took_is_given_back(rig: Rig) -> None:
    store = rig.step.store
    assert store is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.to_strategy = False  # Celery refused the message before its strategy
    rig.publish(task_id)
    rig.receive(1)
    assert store.claimant(keys.task_claim(task_id)) is not None
    rig.step._recheck_parked()  # the consumer's timer sweeps
    wait_until(lambda: store.claimant(keys.task_claim(task_id)) is None, 10.0,
               what="the claim given back")
    assert task_id not in rig.started


def test_an_end_whose_ack_never_comes_is_recorded_separately(rig: Rig) -> None:
    store = rig.step.store
    assert store is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    rig.lose_acks = True
    rig.started[task_id]()
    assert store.get(keys.done(task_id)) is None
    riding = rig.step._riding
    assert riding is not None
    rig.step._sweep_rides(riding, overdue_s=0.0)
    rig.step.drain_backlog()
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done"
    assert store.claimant(keys.task_claim(task_id)) is None


def test_a_finished_task_found_by_the_ridden_claim_is_dropped_as_a_duplicate(rig: Rig) -> None:
    store = rig.step.store
    assert store is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    store.put(keys.done(task_id), {"state": "done", "token": 1, "handoff": False})
    rig.publish(task_id)
    rig.receive(1)
    # The guarded claim was refused; the delivery is decided by reading, off the loop.
    wait_until(lambda: (rig.hub.run() and False) or _unacked(rig) == 0, 10.0,
               what="the duplicate acked")
    assert task_id not in rig.started
    assert store.claimant(keys.task_claim(task_id)) is None
    assert rig.step.status()["duplicates_dropped"] == 1


def test_a_message_of_an_unregistered_task_rides_nothing(rig: Rig) -> None:
    store = rig.step.store
    assert store is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.to_strategy = False
    rig.publish(task_id, name="ridetest.unknown")
    rig.receive(1)
    assert store.claimant(keys.task_claim(task_id)) is None
    assert _unacked(rig) == 1
    rig.messages[task_id].ack()
    assert _unacked(rig) == 0


def _commands(lines: list[str]) -> list[tuple[str, str]]:
    """(source, command) of MONITOR lines: source ``lua`` for a command a script ran."""
    out = []
    for line in lines:
        head, _, rest = line.partition("] ")
        source = head.rsplit(" ", 1)[-1]
        out.append((source, rest.split(" ", 1)[0].strip('"').upper()))
    return out


def test_a_ridden_append_and_ack_each_send_one_script_in_place_of_kombus_transaction(
        rig: Rig) -> None:
    """kombu's MULTI/ZADD/HSET/EXEC and MULTI/ZREM/HDEL/EXEC become one script call each,
    which makes kombu's writes itself."""
    ids = [f"t-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for task_id in ids:
        rig.publish(task_id)
    probe = rig.redis.client(5)
    monitor = Monitor(rig.redis).start(probe)
    try:
        rig.receive(len(ids))
        assert sorted(rig.started) == sorted(ids)
        assert _unacked(rig) == len(ids)
        for task_id in ids:
            rig.started[task_id]()
        _answered(rig)
    finally:
        monitor.stop(probe)
    sent = _commands(monitor.lines)
    client = [name for source, name in sent if source != "lua"]
    ran = [name for source, name in sent if source == "lua"]
    assert "MULTI" not in client and "EXEC" not in client, client
    assert client.count("EVALSHA") == 2 * len(ids), client
    for name in ("ZADD", "HSET", "ZREM", "HDEL"):
        assert ran.count(name) >= len(ids), (name, ran)
    assert _unacked(rig) == 0
    assert int(probe.zcard("unacked_index")) == 0
    store = rig.step.store
    assert store is not None
    for task_id in ids:
        done = store.get(keys.done(task_id))
        assert done is not None and done["state"] == "done", done


def test_a_ridden_append_writes_kombus_own_unacked_entry(rig: Rig) -> None:
    """The entry is the one kombu writes, so kombu (and the reaper) restore it as usual."""
    import copy

    from kombu.utils.json import dumps

    from celery_crawl.worker.context import CLAIM_HEADER

    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    assert task_id in rig.started
    message = rig.messages[task_id]
    probe = rig.redis.client(5)
    tag = message.delivery_tag
    info = message.delivery_info
    # As received: the claim token is set on the headers after the append, for Celery.
    raw = copy.deepcopy(message._raw)
    assert raw["headers"].pop(CLAIM_HEADER) is not None
    assert probe.hget("unacked", tag).decode() == dumps(
        [raw, info["exchange"], info["routing_key"]])
    assert probe.zscore("unacked_index", tag) is not None
    message.channel.qos.restore_by_tag(tag, leftmost=True)
    assert int(probe.llen(rig.queue)) == 1
    assert _unacked(rig) == 0


def test_a_ridden_append_stores_byte_for_byte_what_kombus_real_append_stores(rig: Rig) -> None:
    """The installed kombu's own ``QoS.append`` (the class's, not the ridden one on this
    channel), called for the same message and tag, stores the same bytes."""
    from kombu.transport.redis import QoS

    assert rig.step.status()["route"] == "riding"
    rig.to_strategy = False  # nothing sets the claim token on the headers meanwhile
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    message = rig.messages[task_id]
    tag = message.delivery_tag
    store = rig.step.store
    assert store is not None
    # The claim was made by the append's script (no strategy ran).
    assert store.claimant(keys.task_claim(task_id)) is not None
    probe = rig.redis.client(5)
    ridden = probe.hget("unacked", tag)
    assert ridden is not None and probe.zscore("unacked_index", tag) is not None
    probe.hdel("unacked", tag)
    probe.zrem("unacked_index", tag)
    QoS.append(message.channel.qos, message, tag)
    assert probe.hget("unacked", tag) == ridden
    assert probe.zscore("unacked_index", tag) is not None
    message.channel.qos.restore_by_tag(tag, leftmost=True)


def test_a_script_the_server_lost_before_the_append_falls_back_to_kombus_call(
        rig: Rig) -> None:
    """SCRIPT FLUSH (a restarted server): kombu's own append follows, the claim is decided by
    reading, and the run's end rides again once the scripts are loaded anew."""
    store = rig.step.store
    assert store is not None
    rig.redis.client(5).script_flush()
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    assert _unacked(rig) == 1
    wait_until(lambda: (rig.hub.run() and False) or task_id in rig.started, 10.0,
               what="the delivery decided by reading")
    claim = store.claimant(keys.task_claim(task_id))
    assert claim is not None and claim.alive
    rig.started[task_id]()
    wait_until(lambda: (rig.hub.run() and False) or _unacked(rig) == 0, 10.0,
               what="the ack")
    rig.step.drain_backlog()
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done", done
    assert store.claimant(keys.task_claim(task_id)) is None


def test_a_script_the_server_lost_before_the_ack_still_acks_and_records_the_end(
        rig: Rig) -> None:
    store = rig.step.store
    assert store is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    assert task_id in rig.started
    rig.redis.client(5).script_flush()
    rig.started[task_id]()
    _answered(rig)
    assert _unacked(rig) == 0
    assert store.get(keys.done(task_id)) is None  # the ack's script did not run
    assert len(rig.step.backlog) == 1
    rig.step.drain_backlog()
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done", done
    assert store.claimant(keys.task_claim(task_id)) is None


def test_the_claims_gauge_counts_the_holds_when_read(rig: Rig) -> None:
    from celery_crawl import metrics

    def gauge() -> float:
        return float(metrics.WORKER_CLAIMS.collect()[0].samples[0].value)

    ids = [f"t-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for task_id in ids:
        rig.publish(task_id)
    rig.receive(len(ids))
    assert gauge() == len(ids)
    for task_id in ids:
        rig.started[task_id]()
    assert gauge() == 0
    _answered(rig)


def _connect_the_ack_line(rig: Rig) -> None:
    """One task run and acked first: the ack line is connected (it connects on first use)."""
    warm = f"w-{uuid.uuid4().hex[:8]}"
    rig.publish(warm)
    rig.receive(1)
    rig.started[warm]()
    _answered(rig)


def test_an_ack_on_the_loop_does_not_wait_for_the_server(rig: Rig) -> None:
    """The ridden ack is sent and the loop goes on; its reply is read later. Forced: the
    server is stopped (SIGSTOP) while the ack is made."""
    import os
    import signal
    import threading
    import time

    store = rig.step.store
    assert store is not None and rig.redis.proc is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    assert task_id in rig.started
    riding = rig.step._riding
    assert riding is not None and riding.ack_line is not None
    _connect_the_ack_line(rig)
    os.kill(rig.redis.proc.pid, signal.SIGSTOP)
    # The server resumes after 3 s whatever happens: an ack that waits for it takes as long.
    resume = threading.Timer(3.0, os.kill, (rig.redis.proc.pid, signal.SIGCONT))
    resume.start()
    try:
        began = time.monotonic()
        rig.started[task_id]()  # on the loop's thread (this one)
        took = time.monotonic() - began
        pending = len(riding.ack_line)
    finally:
        resume.join()
    done = took < 1.5 and pending == 1
    assert done, f"the ack waited for the stopped server ({took:.2f}s, {pending} pending)"
    _answered(rig)
    assert _unacked(rig) == 0
    assert store.claimant(keys.task_claim(task_id)) is None
    got = store.get(keys.done(task_id))
    assert got is not None and got["state"] == "done"


def test_acks_the_server_never_answered_go_to_the_backlog(rig: Rig) -> None:
    """Replies that do not come within the overdue bound fail their acks: each end goes to
    the backlog and is recorded from there (the ack itself was made or is made by the server
    anyway, atomically with an end; recording it again is idempotent)."""
    import os
    import signal

    store = rig.step.store
    assert store is not None and rig.redis.proc is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    riding = rig.step._riding
    assert riding is not None and riding.ack_line is not None
    _connect_the_ack_line(rig)
    os.kill(rig.redis.proc.pid, signal.SIGSTOP)
    try:
        rig.started[task_id]()
        assert len(riding.ack_line) == 1
        rig.step._sweep_rides(riding, overdue_s=0.0)
        assert len(riding.ack_line) == 0
        assert len(rig.step.backlog) == 1
    finally:
        os.kill(rig.redis.proc.pid, signal.SIGCONT)
    rig.step.drain_backlog()
    assert len(rig.step.backlog) == 0
    got = store.get(keys.done(task_id))
    assert got is not None and got["state"] == "done"
    assert store.claimant(keys.task_claim(task_id)) is None
    wait_until(lambda: _unacked(rig) == 0, 10.0, what="the ack made by the server")


def test_kombus_own_ack_writes_failing_on_the_line_send_the_end_to_the_backlog(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    store = rig.step.store
    assert store is not None
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    probe = rig.redis.client(5)
    probe.delete("unacked_index")
    probe.set("unacked_index", "foreign")  # kombu's ZREM fails in the script
    try:
        rig.started[task_id]()
        _answered(rig)
        assert len(rig.step.backlog) == 1
        assert any("kombu's ack of" in r.getMessage() for r in caplog.records)
        assert _unacked(rig) == 1  # nothing of the script ran
    finally:
        probe.delete("unacked_index")
    rig.step.drain_backlog()
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done"
