"""An end and an unclaim name the exact claim they end (its token), on every store driver.

The interleaving: run 1 of task X holds claim C1 under lease L; its end's reply is lost (the end
waits in the backlog); a copy of the same message is claimed again under the same lease (C2,
after C1 was given back as "a claim whose reply was lost"); then run 1's end is recorded from the
backlog. It must write its record and leave C2 alone: deleting it would let a third copy be
claimed elsewhere while run 2 still runs. Real servers (Redis, etcd) and the memory store; the
ridden and claim-line form of the end (``finish_command``) on Redis too.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_crawl import keys
from celery_crawl.leases import LeaseStore, open_store
from celery_crawl.leases.base import Lease
from celery_crawl.leases.redis import RedisLeaseStore
from celery_crawl.worker.claims import Arrival, Claimer, Held
from tests.servers import RedisServer, open_test_store

TTL_S = 3.0


@pytest.fixture(params=["redis", "etcd", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    opened = open_test_store(request, request.param, "endtok")
    try:
        yield opened
    finally:
        opened.close()


def _two_claims(store: LeaseStore) -> tuple[Lease, Claimer, Held, Held]:
    """Claim C1 of task X, given back, then C2 of the same task under the same lease."""
    lease = store.acquire("worker:a", TTL_S, "a")
    assert lease is not None
    claimer = Claimer(store, lambda: lease, max_deliveries=5, done_ttl_s=60.0, worker="a")
    task_id = f"x-{uuid.uuid4().hex[:6]}"
    first = Held(Arrival(task_id=task_id, delivery_tag="t", queue="q"))
    decided = claimer.decide(task_id, delivery_tag="t", queue="q")
    first.token, first.lease_name, first.holder = decided.token, lease.name, lease.holder
    assert first.token is not None
    # The claim is given back (a lost-reply drop).
    claimer.drop(first)
    assert store.claimant(keys.task_claim(task_id)) is None
    second = Held(Arrival(task_id=task_id, delivery_tag="t", queue="q"))
    again = claimer.decide(task_id, delivery_tag="t", queue="q")
    second.token, second.lease_name, second.holder = again.token, lease.name, lease.holder
    assert second.token is not None and second.token != first.token
    return lease, claimer, first, second


def test_a_late_end_of_an_earlier_claim_leaves_the_later_claim_alone(store: LeaseStore) -> None:
    lease, claimer, first, second = _two_claims(store)
    key = keys.task_claim(first.arrival.task_id)
    claimer.finish(first, state="done")  # run 1's end, recorded late (from the backlog)
    current = store.claimant(key)
    assert current is not None and current.token == second.token, (
        "the end of claim C1 deleted claim C2 of the same lease")
    assert store.get(keys.done(first.arrival.task_id)) is not None  # its record is written anyway
    # The batched form and an unclaim name their claim too.
    assert claimer.finish_many([(first, "done", False)]) == [None]
    assert store.claimant(key) is not None
    assert not store.unclaim(lease, key, token=first.token)
    assert store.claimant(key) is not None
    claimer.finish(second, state="done")
    assert store.claimant(key) is None


def test_a_ridden_end_names_its_claim(redis_server: RedisServer) -> None:
    """The script the claim line and riding send (``finish_command``) compares the token."""
    ns = f"endtok{uuid.uuid4().hex[:8]}"
    store = open_store(redis_server.url_db(0), namespace=ns)
    try:
        assert isinstance(store, RedisLeaseStore)
        lease, claimer, first, second = _two_claims(store)
        key, record, value = claimer.end_item(first, "done", False)
        command, outcome = store.finish_command(lease, key, record, value, ttl_s=60.0,
                                                token=first.token)
        client = redis_server.client(0)
        assert outcome(client.execute_command(*command)) is None
        current = store.claimant(key)
        assert current is not None and current.token == second.token
    finally:
        store.close()
