"""A worker cut off from Redis inside a ridden claim gets its loop back within
``crawl_store_timeout`` (the overlap bound of docs/design.md holds on the riding path).

The shipped layout (the lease store on the broker's Redis database) with the app set up by
``install_worker``: the real ``LeaseStep`` and ``ClaimStep`` on a real kombu connection, the
broker and the store both reached through a TCP proxy (``tests/tcpproxy.py``). The interleaving
is forced with a hook: the proxy black-holes right when the delivery's claim is about to ride in
kombu's append round trip. The delivery (run here on a thread standing for the consumer's loop)
must come back, with an error, within the store timeout (3x headroom); kombu's client waits
forever by default, and the lease-loss kill, which runs on that loop, would never run.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, signals
from kombu import Consumer, Queue

from celery_crawl.worker import install_worker
from celery_crawl.worker.steps import ClaimStep, LeaseStep
from tests.queued_hub import QueuedHub, stub_consumer
from tests.servers import RedisServer
from tests.tcpproxy import TcpProxy

STORE_TIMEOUT_S = 1.0
TASK = "ridecut.work"


@pytest.fixture
def cut_rig(fresh_redis: RedisServer) -> Iterator[SimpleNamespace]:
    with TcpProxy("127.0.0.1", fresh_redis.port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        app = Celery("ridecut", broker=url, set_as_current=False)
        app.conf.update(crawl_lease_url=url, crawl_namespace=f"cut{uuid.uuid4().hex[:8]}",
                        crawl_worker_lease_ttl=6.0, crawl_store_timeout=STORE_TIMEOUT_S,
                        task_serializer="json", accept_content=["json"])
        install_worker(app)
        hub = QueuedHub()
        worker = SimpleNamespace(app=app, pool_cls="prefork", hostname="cut@localhost",
                                 hub=hub, pool=None)
        lease_step = LeaseStep(worker)
        conn = app.connection_for_read()
        conn.ensure_connection(max_retries=1)
        channel = conn.default_channel
        queue = f"cut-{uuid.uuid4().hex[:8]}"
        started: list[str] = []

        def original(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                     **kw: Any) -> None:
            started.append(message.headers["id"])

        consumer = stub_consumer(worker, {TASK: original}, conn, channel)
        step = ClaimStep(consumer).claims
        lease_step.start(worker)
        step.start(consumer)
        strategy = consumer.strategies[TASK]

        def on_message(message: Any) -> None:
            strategy(message, None, lambda *a, **k: message.ack(), lambda *a, **k: None, None)

        Consumer(channel, queues=[Queue(queue)], on_message=on_message,
                 accept=["json"]).consume()
        try:
            yield SimpleNamespace(app=app, step=step, conn=conn, queue=queue, proxy=proxy,
                                  started=started)
        finally:
            proxy.passthrough()
            with contextlib.suppress(Exception):
                step.stop(consumer)
            signals.worker_shutdown.disconnect(lease_step._on_worker_shutdown)
            with contextlib.suppress(Exception):
                lease_step.release()
            with contextlib.suppress(Exception):
                conn.release()


def test_a_ridden_claim_cut_off_from_redis_gives_the_loop_back_in_time(
        cut_rig: SimpleNamespace) -> None:
    step = cut_rig.step
    riding = step._riding
    assert riding is not None, "the claims do not ride (the shipped layout should)"
    assert step.status()["route"] == "riding"
    cut_at: list[float] = []
    plain_claim = riding.claim

    def claim_then_cut(*args: Any, **kw: Any) -> Any:
        ride = plain_claim(*args, **kw)
        cut_rig.proxy.black_hole()  # the partition, right before the ridden write goes out
        cut_at.append(time.monotonic())
        return ride

    riding.claim = claim_then_cut
    cut_rig.app.send_task(TASK, args=[1], task_id=f"x-{uuid.uuid4().hex[:8]}",
                          queue=cut_rig.queue)
    returned: list[BaseException | None] = []

    def loop() -> None:
        """The consumer's loop: deliveries until the ridden one returns (or fails)."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                cut_rig.conn.drain_events(timeout=0.2)
            except BaseException as exc:  # the ridden write's timeout, or drain's own
                if cut_at:
                    returned.append(exc)
                    return
            if cut_at:
                returned.append(None)
                return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    bound = 3 * STORE_TIMEOUT_S
    try:
        # Polled with a deadline: the thread's end is what is awaited.
        while thread.is_alive() and (not cut_at or time.monotonic() - cut_at[0] < bound):
            thread.join(0.02)
        assert cut_at, "the delivery never reached its ridden claim"
        blocked = thread.is_alive()
        held_for = time.monotonic() - cut_at[0]
    finally:
        cut_rig.proxy.passthrough()
        thread.join(10.0)
    assert not blocked, (f"the loop was still inside the ridden write {held_for:.1f}s after "
                         f"the partition (crawl_store_timeout={STORE_TIMEOUT_S}s)")
    assert cut_rig.started == [], "a claim whose write failed must not start the task"
