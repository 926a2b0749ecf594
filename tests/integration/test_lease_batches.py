"""The Redis lease store's batched script calls (``_eval_batch``), sent on its own connections:
a failure never leaves a reply unread for the next call, and an error reply stands for its own
item only."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_crawl import keys
from celery_crawl.errors import StoreError
from celery_crawl.leases.base import Lease
from celery_crawl.leases.redis import RedisLeaseStore
from tests.servers import RedisServer


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RedisLeaseStore]:
    s = RedisLeaseStore(redis_server.url_db(7), namespace=f"lb{uuid.uuid4().hex[:8]}",
                        timeout_s=2.0)
    yield s
    s.close()


def _lease(store: RedisLeaseStore) -> Lease:
    lease = store.acquire(f"worker:{uuid.uuid4().hex[:6]}", 30.0, "w@host")
    assert lease is not None
    return lease


def _fresh(task_id: str) -> tuple[str, dict[str, object], list[tuple[str, str]]]:
    return (keys.task_claim(task_id), {"deliveries": 1},
            [(keys.done(task_id), ""), (f"deliveries/{task_id}", "")])


def test_a_connection_killed_between_batches_costs_one_call_and_no_reply_is_misread(
        store: RedisLeaseStore, redis_server: RedisServer) -> None:
    lease = _lease(store)
    first = store.claim_unless_changed_many(lease, [_fresh("a"), _fresh("b")])
    assert all(isinstance(t, int) for t in first), first
    probe = redis_server.client(7)
    probe.client_kill_filter(_type="normal", skipme=True)
    try:
        again = store.claim_unless_changed_many(lease, [_fresh("c")])
    except StoreError:
        again = store.claim_unless_changed_many(lease, [_fresh("c")])
    assert len(again) == 1 and isinstance(again[0], int), again
    # Every token read is the reply to its own call: c's is newer than a's and b's.
    assert again[0] > max(first)  # type: ignore[type-var]
    done = store.finish_claims(lease, [(keys.task_claim(t), keys.done(t), {"state": "done"})
                                       for t in ("a", "b", "c")], ttl_s=60.0)
    assert done == [True, True, True]


def test_an_error_reply_stands_for_its_own_item_only(
        store: RedisLeaseStore, redis_server: RedisServer) -> None:
    lease = _lease(store)
    tokens = store.claim_unless_changed_many(lease, [_fresh("x"), _fresh("y")])
    assert all(isinstance(t, int) for t in tokens)
    # x's tombstone key holds foreign data of the wrong type: its finish fails, y's does not.
    probe = redis_server.client(7)
    probe.rpush(f"{store._prefix}rec:{keys.done('x')}", "foreign")
    got = store.finish_claims(lease, [(keys.task_claim(t), keys.done(t), {"state": "done"})
                                      for t in ("x", "y")], ttl_s=60.0)
    assert isinstance(got[0], StoreError) and got[1] is True, got
    # The connection was left with no unread reply: the next batch reads its own.
    later = store.claim_unless_changed_many(lease, [_fresh("z")])
    assert len(later) == 1 and isinstance(later[0], int) and later[0] > max(tokens), later
