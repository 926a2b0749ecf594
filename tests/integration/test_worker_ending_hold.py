"""A redelivered copy parked behind a run that just ended here must not take that run's claim
while the run's end waits to be recorded (defect: the task ran twice).

The claim-line rig of ``test_worker_claim_line.py`` (real broker and store redis-servers, the
real steps, the test turning the loop). The interleaving is forced, step by step: task X runs
under claim C (tag t); kombu restores the same message with the same tag and the copy parks
behind C; the claim line's connection is killed (``CLIENT KILL``) so X's end gets no reply and
goes to the backlog; the keeper's backlog hook is held back, so the parked copy's re-check runs
before the backlog drains. The copy must stay parked (C's end is still *ending*), then be
dropped as a duplicate once the end is recorded: X starts once. The same on the riding route
(the riding rig of ``test_worker_riding.py``): X's end rides its ack, which never comes (a
closed channel), and is swept into the backlog.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery_crawl import _celery_compat as compat
from celery_crawl import keys
from tests.integration import test_worker_claim_line as line_rig
from tests.integration import test_worker_riding as ride_rigs
from tests.integration.test_worker_claim_line import Rig, _connect_the_line
from tests.integration.test_worker_riding import Rig as RideRig
from tests.servers import wait_until

#: The claim-line rig fixture, shared with ``test_worker_claim_line.py``.
rig = line_rig.rig


def _kill_line_connection(rig: Rig) -> None:
    conn = rig.line._conn
    assert conn is not None, "the claim line is not connected"
    sock = compat.redis_socket(conn)
    assert sock is not None
    host, port = sock.getsockname()[:2]
    killed = rig.store_server.client().execute_command("CLIENT", "KILL", "ADDR",
                                                       f"{host}:{port}")
    assert killed in (b"OK", "OK", True, 1), killed


def _recheck_once(rig: Rig) -> None:
    """One periodic re-check of the parked deliveries, applied on the loop."""
    rig.step._recheck_parked()
    rig.loop_until(lambda: not rig.step._rechecking, 10.0, what="the re-check applied")


def test_a_copy_parked_behind_an_ending_run_does_not_take_its_claim(rig: Rig) -> None:
    store, keeper = rig.step.store, rig.step.keeper
    assert store is not None and keeper is not None
    _connect_the_line(rig)
    task_id = f"x-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    rig.loop_until(lambda: task_id in rig.started, 10.0, what="X started")
    first = rig.messages[task_id]
    claim = store.claimant(keys.task_claim(task_id))
    assert claim is not None and claim.alive
    # The backlog is drained by the keeper's hook thread after each renewal: held back here,
    # so the re-check below runs first (as it may on any worker).
    hooks = list(keeper.hooks)
    keeper.hooks = [h for h in hooks if h != rig.step.drain_backlog]
    try:
        # kombu restores X's message with its tag (a channel close, say): a copy arrives.
        first.channel.qos.restore_by_tag(first.delivery_tag, leftmost=True)

        def copy() -> Any:
            rig._drain()
            return [h for h in rig.step.book.snapshot()
                    if h.arrival.task_id == task_id and h.parked and h.arrival.message is not first]

        parked = rig.loop_until(copy, 15.0, what="the copy parked behind claim C")[0]
        assert parked.arrival.delivery_tag == first.delivery_tag
        # X ends; the claim line's connection dies before the end's reply: backlog.
        _kill_line_connection(rig)
        rig.started[task_id]()
        rig.loop_until(lambda: len(rig.step.backlog) == 1, 10.0,
                       what="X's end in the backlog")
        for _ in range(2):
            _recheck_once(rig)
        assert rig.starts[task_id] == 1, "X started a second time while its end was pending"
        current = store.claimant(keys.task_claim(task_id))
        assert current is not None and current.token == claim.token
    finally:
        keeper.hooks = hooks
    rig.step.drain_backlog()
    assert len(rig.step.backlog) == 0
    done = store.get(keys.done(task_id))
    assert done is not None and done["state"] == "done" and done["token"] == claim.token
    assert store.claimant(keys.task_claim(task_id)) is None
    # The copy is now a duplicate of a finished run: dropped, not run.
    dropped = rig.step.duplicates
    wait_until(lambda: _recheck_once(rig) or rig.step.duplicates > dropped, 10.0,
               what="the copy dropped as a duplicate")
    assert rig.starts[task_id] == 1
    assert not [h for h in rig.step.book.snapshot() if h.arrival.task_id == task_id]


#: The riding rig of ``test_worker_riding.py`` (the store is the broker's Redis database).
ride_rig = ride_rigs.rig


def test_a_copy_parked_behind_a_ridden_end_does_not_take_its_claim(ride_rig: RideRig) -> None:
    """The same interleaving on the riding route: X's end rides its ack, which never comes
    (its channel closed); the end is swept into the backlog; the copy's re-check runs first."""
    rig, step = ride_rig, ride_rig.step
    store, keeper, riding = step.store, step.keeper, step._riding
    assert store is not None and keeper is not None and riding is not None
    task_id = f"x-{uuid.uuid4().hex[:8]}"
    rig.publish(task_id)
    rig.receive(1)
    first, first_ack = rig.messages[task_id], rig.started[task_id]
    claim = store.claimant(keys.task_claim(task_id))
    assert claim is not None and claim.alive
    hooks = list(keeper.hooks)
    keeper.hooks = [h for h in hooks if h != step.drain_backlog]
    try:
        first.channel.qos.restore_by_tag(first.delivery_tag, leftmost=True)

        def copy() -> Any:
            rig._drain()
            rig.hub.run()
            return [h for h in step.book.snapshot()
                    if h.arrival.task_id == task_id and h.parked and h.arrival.message is not first]

        wait_until(copy, 15.0, what="the copy parked behind claim C")
        rig.lose_acks = True  # X's ack, carrying its end, never reaches kombu
        first_ack()
        step._sweep_rides(riding, overdue_s=0.0)
        assert len(step.backlog) == 1
        for _ in range(2):
            step._recheck_parked()
            wait_until(lambda: (rig.hub.run() and False) or not step._rechecking, 10.0,
                       what="the re-check applied")
        assert rig.started[task_id] is first_ack, "X started a second time"
        current = store.claimant(keys.task_claim(task_id))
        assert current is not None and current.token == claim.token
    finally:
        keeper.hooks = hooks
    step.drain_backlog()
    done = store.get(keys.done(task_id))
    assert done is not None and done["token"] == claim.token
    assert store.claimant(keys.task_claim(task_id)) is None
