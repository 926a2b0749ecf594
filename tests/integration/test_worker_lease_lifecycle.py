"""The worker lease's life cycle against a real Redis (and etcd) store: loss and re-acquisition
applied in any order, loss at the local deadline while a renewal hangs, renewals bounded by the
validity left.

The worker runs the real ``LeaseStep`` and ``ClaimStep`` (real store, real keeper threads, real
claims); only Celery's event loop is replaced by a queue of callbacks the test runs when, and in
the order, it chooses, so a loss and the re-acquisition after it are both pending at once.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, signals

from celery_crawl import keys
from celery_crawl.errors import StoreTimeout
from celery_crawl.leases import open_store
from celery_crawl.leases.base import Lease, LeaseStore
from celery_crawl.worker.consumer_claims import ConsumerClaims
from celery_crawl.worker.keeper import Keeper, boottime
from celery_crawl.worker.steps import ClaimStep, LeaseStep
from tests.queued_hub import QueuedHub
from tests.servers import EtcdServer, RedisServer, wait_until
from tests.tcpproxy import TcpProxy

TTL_S = 3.0


class TaskConsumer:
    def __init__(self) -> None:
        self.consuming = True

    def cancel(self) -> None:
        self.consuming = False

    def consume(self) -> None:
        self.consuming = True


class Message:
    """A delivery as the claim strategy sees it (headers, tag, settle calls recorded)."""

    def __init__(self, task_id: str, tag: int) -> None:
        self.headers: dict[str, Any] = {"id": task_id, "retries": 0}
        self.delivery_info = {"routing_key": "q", "exchange": ""}
        self.delivery_tag = tag
        self.body = b"[[], {}, {}]"
        self.acknowledged = False
        self.rejected: list[bool] = []

    def reject(self, requeue: bool = False) -> None:
        self.acknowledged = True
        self.rejected.append(requeue)


@pytest.fixture
def step(redis_server: RedisServer) -> Iterator[tuple[ConsumerClaims, Any, RedisServer]]:
    app = Celery("lifecycle", broker="memory://", set_as_current=False)
    app.conf.update(crawl_lease_url=redis_server.url, crawl_namespace=f"lc{uuid.uuid4().hex[:8]}",
                    crawl_worker_lease_ttl=TTL_S, crawl_store_timeout=1.0)
    hub = QueuedHub()
    worker = SimpleNamespace(app=app, pool_cls="threads", hostname="lc@localhost", hub=hub,
                             pool=None)
    lease_step = LeaseStep(worker)
    consumer = SimpleNamespace(
        controller=worker, strategies={}, task_consumer=TaskConsumer(), connection=None,
        connection_errors=(),
        timer=SimpleNamespace(call_repeatedly=lambda *a: SimpleNamespace(cancel=lambda: None)),
        on_connection_error_after_connected=lambda exc: None)
    # As Celery does: both steps are built, then the worker's starts, then the consumer's.
    claim_step = ClaimStep(consumer).claims
    lease_step.start(worker)
    claim_step.start(consumer)
    try:
        yield claim_step, consumer, redis_server
    finally:
        signals.worker_shutdown.disconnect(lease_step._on_worker_shutdown)
        lease_step.release()


def _deliver(step: ConsumerClaims, task_id: str, tag: int, started: list[str]) -> Message:
    """Hand one delivery to the claim strategy, as Celery's consumer does."""

    def original(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                 **kw: Any) -> None:
        started.append(message.headers["id"])

    strategy = step._wrap("crawltest.work", original)
    message = Message(task_id, tag)
    strategy(message, None, lambda *a, **k: None, lambda *a, **k: None, None)
    return message


def test_loss_and_reacquisition_pending_together_end_consuming_under_the_new_lease(
    step: tuple[ConsumerClaims, Any, RedisServer],
) -> None:
    """The loss of lease 1 and the acquisition of lease 2 reach the loop together and run
    newest first. The worker must end consuming, with the delivery claimed under lease 2 still
    held (its claim alive) and only lease 1's delivery released."""
    claim_step, consumer, server = step
    keeper, store = claim_step.keeper, claim_step.store
    assert keeper is not None and store is not None
    hub: QueuedHub = claim_step.worker.hub
    started: list[str] = []
    first = keeper.lease
    assert first is not None
    old = _deliver(claim_step, "t-old", 1, started)
    # The decision is made off the loop and applied on it.
    wait_until(lambda: len(hub.pending) == 1, 5.0, what="the decision of t-old reached the loop")
    assert hub.run_reversed() == 1
    assert started == ["t-old"]
    # The store forgets the lease: the next renewal is refused, the one after takes lease 2.
    assert server.client().delete(f"{store.namespace}:lease:{first.name}") == 1
    second = wait_until(
        lambda: (lease := keeper.lease) is not None and lease.name != first.name and lease,
        5 * TTL_S, what="the keeper lost lease 1 and holds lease 2")
    assert isinstance(second, Lease) and keeper.losses == 1
    # Lease 2 is held but the loop has not run yet: a new delivery is claimed under lease 2.
    pending = len(hub.pending)
    new = _deliver(claim_step, "t-new", 2, started)
    wait_until(lambda: len(hub.pending) == pending + 1, 5.0,
               what="the decision of t-new reached the loop")
    claim = store.claimant(keys.task_claim("t-new"))
    assert claim is not None and claim.alive and claim.lease_name == second.name
    # Newest first: t-new's decision, the acquisition's notification, then the loss's.
    assert hub.run_reversed() >= 3
    assert started == ["t-old", "t-new"]
    assert consumer.task_consumer.consuming, "consumption stayed cancelled under a valid lease"
    assert claim_step.consuming
    held = [h.arrival.task_id for h in claim_step.book.snapshot()]
    assert held == ["t-new"], held
    assert old.rejected and not new.rejected
    claim = store.claimant(keys.task_claim("t-new"))
    assert claim is not None and claim.alive
    # Running everything again (a late duplicate notification) changes nothing.
    hub.call_soon(claim_step._reconcile)
    hub.run_reversed()
    assert consumer.task_consumer.consuming and [
        h.arrival.task_id for h in claim_step.book.snapshot()] == ["t-new"]


def test_a_decision_made_under_a_lease_lost_before_it_reaches_the_loop_does_not_run(
    step: tuple[ConsumerClaims, Any, RedisServer],
) -> None:
    """The claim is made off the loop under lease 1; lease 1 is lost (and lease 2 taken) before
    the decision is applied on the loop: the delivery must be released, not run under a claim
    of a dead lease (the reaper owns that claim now)."""
    claim_step, consumer, server = step
    keeper, store = claim_step.keeper, claim_step.store
    assert keeper is not None and store is not None
    hub: QueuedHub = claim_step.worker.hub
    started: list[str] = []
    first = keeper.lease
    assert first is not None
    late = _deliver(claim_step, "t-late", 1, started)
    wait_until(lambda: len(hub.pending) == 1, 5.0, what="the decision of t-late reached the loop")
    claim = store.claimant(keys.task_claim("t-late"))
    assert claim is not None and claim.lease_name == first.name
    assert server.client().delete(f"{store.namespace}:lease:{first.name}") == 1
    wait_until(lambda: (lease := keeper.lease) is not None and lease.name != first.name,
               5 * TTL_S, what="the keeper lost lease 1 and holds lease 2")
    hub.run_reversed()
    assert started == [], "a delivery claimed under a lost lease ran"
    assert late.rejected, "its message was neither run nor released"
    assert claim_step.book.snapshot() == []
    assert consumer.task_consumer.consuming


# -- loss at the local deadline, renewals bounded by the validity left --------------------------


@pytest.fixture(params=["redis", "etcd"])
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[LeaseStore, TcpProxy]]:
    """A store (5 s timeout) reached through a TCP proxy the test can black-hole."""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        proxy = TcpProxy("127.0.0.1", server.port)
        url = f"redis://127.0.0.1:{proxy.port}/0"
    else:
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        proxy = TcpProxy("127.0.0.1", etcd.client_port)
        url = f"etcd://127.0.0.1:{proxy.port}"
    store = open_store(url, namespace=f"lp{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    try:
        yield store, proxy
    finally:
        proxy.passthrough()
        store.close()
        proxy.close()


def test_renewal_is_bounded_by_the_validity_left(proxied: tuple[LeaseStore, TcpProxy]) -> None:
    store, proxy = proxied
    lease = store.acquire("worker:bounded", TTL_S, "h1")
    assert lease is not None
    store.renew(lease)
    proxy.black_hole()
    t0 = boottime()
    with pytest.raises(StoreTimeout, match=r"within 0\.4s"):
        store.renew(lease, timeout_s=0.4)
    took = boottime() - t0
    assert 0.3 <= took < 2.5, took  # not the store's 5 s
    proxy.passthrough()


def test_loss_is_declared_at_the_deadline_while_a_renewal_hangs(
    proxied: tuple[LeaseStore, TcpProxy],
) -> None:
    """The store stops answering (black hole; its timeout is 5 s, longer than the TTL). The
    keeper must declare the loss at its local deadline, not when the hung renewal returns."""
    store, proxy = proxied
    lost_at: list[float] = []
    keeper = Keeper(store, ttl_s=TTL_S, on_lost=lambda reason: lost_at.append(boottime()))
    lease = keeper.acquire_blocking(10)
    keeper.start()
    try:
        # Right after a successful renewal: the deadline is known exactly.
        wait_until(lambda: keeper.renew_ok >= 1, 3 * TTL_S, what="a renewal")
        proxy.black_hole()
        held = keeper.lease
        assert held is not None and held.valid_until >= lease.valid_until
        deadline = held.valid_until
        wait_until(lambda: lost_at, deadline - boottime() + 6, what="the loss")
        late = lost_at[0] - deadline
        assert 0 <= late < 1.0, f"loss declared {late:.2f}s after the local deadline"
        assert keeper.lease is None
    finally:
        proxy.passthrough()
        keeper.stop(release=False)


# -- no store call on the consumer's loop ----------------------------------------------------


class ThreadLog:
    """The store as the claimer uses it, recording which thread made each call."""

    def __init__(self, store: LeaseStore) -> None:
        self._store = store
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.get_ident()))
            return attr(*args, **kwargs)

        return call


def _run_pending(hub: QueuedHub, n: int, what: str) -> None:
    wait_until(lambda: len(hub.pending) >= n, 5.0, what=what)
    hub.run_reversed()


def test_a_parked_recheck_reads_the_store_off_the_loop(
    step: tuple[ConsumerClaims, Any, RedisServer],
) -> None:
    """The consumer's timer re-checks parked deliveries; with a slow or frozen store, a read on
    the loop would stall every other message for up to the store timeout per parked delivery.
    The reads go to the offload thread and the decision comes back to the loop."""
    claim_step, _, _ = step
    hub: QueuedHub = claim_step.worker.hub
    started: list[str] = []
    _deliver(claim_step, "t-busy", 1, started)
    _run_pending(hub, 1, "the first delivery's decision")
    assert started == ["t-busy"]  # claimed, running (never acked here)
    _deliver(claim_step, "t-busy", 2, started)  # a copy: parks behind the live claim
    _run_pending(hub, 1, "the copy's decision")
    assert [h.parked for h in claim_step.book.snapshot()] == [False, True]
    assert claim_step.claimer is not None
    log = ThreadLog(claim_step.claimer.store)
    claim_step.claimer.store = log  # type: ignore[assignment]
    loop = threading.get_ident()
    claim_step._recheck_parked()
    claim_step._recheck_parked()  # a second tick while the first is out asks nothing more
    assert not [c for c in log.calls if c[1] == loop], log.calls
    _run_pending(hub, 1, "the re-check's decision")
    assert log.calls and not [c for c in log.calls if c[1] == loop], log.calls
    assert [h.parked for h in claim_step.book.snapshot()] == [False, True]
    assert started == ["t-busy"]
    # The next tick re-checks again (the first one came back).
    before = len(log.calls)
    claim_step._recheck_parked()
    _run_pending(hub, 1, "the next re-check's decision")
    assert len(log.calls) > before and not [c for c in log.calls if c[1] == loop]


def test_a_run_ending_after_its_lease_was_lost_is_checked_off_the_loop(
    step: tuple[ConsumerClaims, Any, RedisServer],
) -> None:
    """A task ends after the worker lost the lease its claim was made under, before the loss
    reached the loop: whether the claim is still ours is a store read, made off the loop; the
    message is settled on the loop once it is known."""
    claim_step, _, server = step
    keeper, store = claim_step.keeper, claim_step.store
    assert keeper is not None and store is not None and claim_step.claimer is not None
    hub: QueuedHub = claim_step.worker.hub
    acks: list[Callable[..., Any]] = []
    settled: list[str] = []

    def original(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                 **kw: Any) -> None:
        acks.append(ack)

    strategy = claim_step._wrap("crawltest.work", original)
    strategy(Message("t-stale", 1), None, lambda *a, **k: settled.append("ack"),
             lambda *a, **k: settled.append("reject"), None)
    _run_pending(hub, 1, "the decision")
    assert len(acks) == 1
    first = keeper.lease
    assert first is not None
    assert server.client().delete(f"{store.namespace}:lease:{first.name}") == 1
    wait_until(lambda: (lease := keeper.lease) is not None and lease.name != first.name,
               5 * TTL_S, what="the keeper lost lease 1 and holds lease 2")
    log = ThreadLog(claim_step.claimer.store)
    claim_step.claimer.store = log  # type: ignore[assignment]
    claim_step.lease_step.store = log  # type: ignore[assignment]
    loop = threading.get_ident()
    pending = len(hub.pending)  # the loss and the new lease, not applied on the loop yet
    acks[0]()  # the pool reports the end, on the loop
    assert settled == [] and not [c for c in log.calls if c[1] == loop], log.calls
    _run_pending(hub, pending + 1, "the stale end's follow-up")
    assert log.calls and not [c for c in log.calls if c[1] == loop], (log.calls, settled)
    assert settled == ["ack"]  # the claim was still ours: the run counts


def test_a_poison_message_is_ended_off_the_loop(
        step: tuple[ConsumerClaims, Any, RedisServer]) -> None:
    """A delivery found at ``crawl_max_deliveries`` is ended as FAILURE without running: its
    hook, result write and end record are store and backend calls, made off the loop; only the
    ack comes back to it."""
    claim_step, _, _ = step
    store, claimer = claim_step.store, claim_step.claimer
    assert store is not None and claimer is not None
    hub: QueuedHub = claim_step.worker.hub
    task_id = f"t-poison-{uuid.uuid4().hex[:6]}"
    store.put(f"deliveries/{task_id}", {"n": claim_step.config.max_deliveries - 1})
    started: list[str] = []
    acked: list[str] = []

    def original(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                 **kw: Any) -> None:
        started.append(message.headers["id"])

    strategy = claim_step._wrap("crawltest.work", original)
    strategy(Message(task_id, 1), None, lambda *a, **k: acked.append("ack"),
             lambda *a, **k: None, None)
    log = ThreadLog(claimer.store)
    claimer.store = log  # type: ignore[assignment]
    claim_step.lease_step.store = log  # type: ignore[assignment]
    loop = threading.get_ident()
    _run_pending(hub, 1, "the decision")  # poison: its end goes off the loop
    assert acked == [] and not [c for c in log.calls if c[1] == loop], log.calls
    _run_pending(hub, 1, "the poison end's follow-up")
    assert acked == ["ack"] and started == []
    assert log.calls and not [c for c in log.calls if c[1] == loop], log.calls
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "FAILURE", done
    assert claim_step.status()["poisoned"] == 1


def test_claims_dropped_after_a_reconnection_are_given_back_off_the_loop(
    step: tuple[ConsumerClaims, Any, RedisServer],
) -> None:
    """After a reconnection Celery has dropped the old channel's reserved deliveries: their
    claims are given back (and their messages restored) off the loop."""
    claim_step, consumer, _ = step
    store, claimer = claim_step.store, claim_step.claimer
    assert store is not None and claimer is not None
    hub: QueuedHub = claim_step.worker.hub
    task_id = f"t-reconnect-{uuid.uuid4().hex[:6]}"
    started: list[str] = []
    _deliver(claim_step, task_id, 1, started)
    _run_pending(hub, 1, "the decision")
    assert started == [task_id]  # claimed; Celery never started it (no request tracked)
    assert store.claimant(keys.task_claim(task_id)) is not None
    log = ThreadLog(claimer.store)
    claimer.store = log  # type: ignore[assignment]
    loop = threading.get_ident()
    claim_step.start(consumer)  # the consumer restarts on the same (loop) thread
    wait_until(lambda: store.claimant(keys.task_claim(task_id)) is None, 10.0,
               what="the dropped claim given back")
    assert log.calls and not [c for c in log.calls if c[1] == loop], log.calls
    assert len(claim_step.book) == 0


def test_a_parked_copy_claimed_after_it_was_released_is_given_back(
    step: tuple[ConsumerClaims, Any, RedisServer],
) -> None:
    """A re-check decides to run a parked copy (the claim it waited behind is gone), but the
    copy was released meanwhile (a lease loss, a reconnection): the claim the re-check made is
    given back, and the copy does not run."""
    claim_step, _, _ = step
    store, claimer = claim_step.store, claim_step.claimer
    assert store is not None and claimer is not None
    hub: QueuedHub = claim_step.worker.hub
    task_id = f"t-gone-{uuid.uuid4().hex[:6]}"
    started: list[str] = []
    _deliver(claim_step, task_id, 1, started)
    _run_pending(hub, 1, "the first delivery's decision")
    _deliver(claim_step, task_id, 2, started)
    _run_pending(hub, 1, "the copy's decision")
    first, copy = sorted(claim_step.book.snapshot(), key=lambda h: h.arrival.delivery_tag)
    assert not first.parked and copy.parked and started == [task_id]
    # The first run's claim goes without a tombstone (its run will not end here).
    claim_step.book.pop(first)
    claimer.drop(first)
    claim_step._recheck_parked()
    wait_until(lambda: len(hub.pending) >= 1, 5.0, what="the re-check's decision")
    claim_step.book.pop(copy)  # released before the decision reaches the loop
    hub.run_reversed()  # the decision: run, but the copy is gone
    wait_until(lambda: store.claimant(keys.task_claim(task_id)) is None, 10.0,
               what="the re-check's claim given back")
    assert started == [task_id]
