"""An end recorded again from the backlog never overwrites the tombstone of a later run.

The interleaving (found by the model test, ``tests/unit/worker/test_desk_model.py``): run 1 of
task X (message M0) replaces itself (``Task.replace``: M1, one nesting deeper, under the same
id); its end is executed by the store (tombstone "handed on, generation (0, 0)", claim deleted)
but the reply is lost, so the end waits in the backlog. M1 is decided against that tombstone,
runs and ends for good (tombstone "final"). Then the backlog is drained: writing run 1's
tombstone again would put back "handed on, generation (0, 0)", and a copy of M1 delivered
again (a restore that raced its ack, a publisher sending it again) would be judged a successor
and run a second time. Real servers (Redis, etcd) and the memory store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_crawl import keys
from celery_crawl.leases import LeaseStore
from celery_crawl.leases.base import Lease
from celery_crawl.worker.claims import Arrival, Claimer, Held, Outcome
from celery_crawl.worker.desk import Desk
from tests.servers import open_test_store

TTL_S = 10.0


@pytest.fixture(params=["redis", "etcd", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    opened = open_test_store(request, request.param, "replay")
    try:
        yield opened
    finally:
        opened.close()


def _desk(store: LeaseStore) -> tuple[Desk, Lease]:
    lease = store.acquire("worker:a", TTL_S, "a")
    assert lease is not None
    claimer = Claimer(store, lambda: lease, max_deliveries=5, done_ttl_s=60.0, worker="a")
    return Desk(store, claimer, lambda: lease), lease


def _message(task_id: str, tag: str, digest: str, generation: tuple[int, int]) -> Held:
    return Held(Arrival(task_id=task_id, delivery_tag=tag, queue="q", digest=digest,
                        generation=generation, retries=generation[1]))


def _run(desk: Desk, held: Held) -> None:
    decision, under = desk.decide(held)
    assert decision.outcome is Outcome.RUN, decision
    desk.claimed(held, decision, under)


@pytest.mark.parametrize("requeue_later", [False, True])
def test_an_end_replayed_from_the_backlog_leaves_a_later_runs_tombstone(
        store: LeaseStore, requeue_later: bool) -> None:
    desk, _ = _desk(store)
    task_id = f"x-{uuid.uuid4().hex[:6]}"
    first = _message(task_id, "t0", "m0", (0, 0))
    _run(desk, first)
    # Run 1 replaces itself; its end is executed, the reply lost: it waits in the backlog.
    first.handoff = True
    assert desk.ending(first)
    desk.claimer.finish(first, state="done")
    desk.failed(first, "done", False)
    assert len(desk.backlog) == 1
    # The replacement runs after it and ends for good.
    replacement = _message(task_id, "t1", "m1", (1, 0))
    _run(desk, replacement)
    desk.record(replacement, "done", False)
    final = store.get(keys.done(task_id))
    assert final is not None and final["handoff"] is False
    if requeue_later:
        # A later redelivery of the replacement finds the final tombstone: a duplicate.
        assert desk.decide(_message(task_id, "t2", "m1", (1, 0)))[0].outcome is (
            Outcome.DUPLICATE)
    desk.drain_backlog()
    assert len(desk.backlog) == 0 and desk.book.ending() == 0
    assert store.get(keys.done(task_id)) == final, (
        "the replayed end of run 1 overwrote the replacement's final tombstone")
    copy = _message(task_id, "t3", "m1", (1, 0))
    assert desk.decide(copy)[0].outcome is Outcome.DUPLICATE, (
        "a copy of the replacement ran again after it finished")


def test_an_end_whose_first_try_was_not_executed_is_recorded_from_the_backlog(
        store: LeaseStore) -> None:
    """The other half: an end the store never executed (its claim still carries the run's
    token) is recorded when the backlog drains, and its claim deleted."""
    desk, _ = _desk(store)
    task_id = f"x-{uuid.uuid4().hex[:6]}"
    held = _message(task_id, "t0", "m0", (0, 0))
    _run(desk, held)
    assert desk.ending(held)
    desk.failed(held, "done", False)
    desk.drain_backlog()
    assert len(desk.backlog) == 0 and desk.book.ending() == 0
    done = store.get(keys.done(task_id))
    assert done is not None and done["token"] == held.token
    assert store.claimant(keys.task_claim(task_id)) is None
    assert desk.decide(_message(task_id, "t1", "m0", (0, 0)))[0].outcome is Outcome.DUPLICATE
