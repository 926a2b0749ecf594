"""``RedisBroker.queued``: which task ids still wait in a kombu Redis queue (the beat's delivery
check reads it), across priority lists and with kombu's ``global_keyprefix``."""

from __future__ import annotations

import json
import uuid

import pytest
from celery import Celery

from celery_crawl.worker.broker import RedisBroker, broker_ops
from tests.servers import RedisServer


@pytest.mark.parametrize("prefix", ["", "tenant-a:"], ids=["plain", "global_keyprefix"])
def test_queued_finds_waiting_ids_in_every_priority_list_and_not_popped_ones(
        redis_server: RedisServer, prefix: str) -> None:
    options: dict[str, object] = {"socket_timeout": 5}
    if prefix:
        options["global_keyprefix"] = prefix
    app = Celery(f"q{uuid.uuid4().hex[:6]}", broker=redis_server.url_db(5),
                 set_as_current=False)
    app.conf.broker_transport_options = options
    queue = f"q-{uuid.uuid4().hex[:8]}"
    ids = [str(uuid.uuid4()) for _ in range(4)]
    for i, task_id in enumerate(ids):
        app.send_task("some.task", task_id=task_id, queue=queue, priority=(0, 0, 6, 9)[i])
    broker = broker_ops(app, timeout_s=5)
    assert isinstance(broker, RedisBroker)
    try:
        client = redis_server.client(5)
        assert client.llen(prefix + queue) == 2  # the others went to priority lists
        popped = client.rpop(prefix + queue)  # what a worker killed after BRPOP leaves: nothing
        assert popped is not None
        gone = next(i for i in ids if i in popped.decode())
        unknown = str(uuid.uuid4())
        found = broker.queued([queue], [*ids, unknown], chunk=1)  # chunked reads from the end
        assert found == set(ids) - {gone}
        assert broker.queued([], ids) == set() and broker.queued([queue], []) == set()
    finally:
        broker.close()


@pytest.mark.parametrize("priority", [0, 6], ids=["default-list", "priority-list"])
def test_a_restored_task_is_the_next_one_popped_not_the_last(
        redis_server: RedisServer, priority: int) -> None:
    """The reaper's restore puts a recovered task where BRPOP pops first (the right end of its
    own priority list), not behind the whole backlog (LPUSH, where kombu publishes)."""
    app = Celery(f"r{uuid.uuid4().hex[:6]}", broker=redis_server.url_db(6),
                 set_as_current=False)
    app.conf.broker_transport_options = {"socket_timeout": 5}
    queue = f"q-{uuid.uuid4().hex[:8]}"
    ids = [str(uuid.uuid4()) for _ in range(6)]
    for task_id in ids:
        app.send_task("some.task", task_id=task_id, queue=queue, priority=priority)
    broker = broker_ops(app, timeout_s=5)
    assert isinstance(broker, RedisBroker)
    with app.connection_for_read() as conn:
        chan = conn.default_channel
        taken = chan.basic_get(queue)  # delivered, unacked: what a worker that died leaves
        assert taken is not None and taken.headers["id"] == ids[0]
        try:
            assert broker.restore([taken.delivery_tag]) == 1
            # What the consumer does: one BRPOP over every priority list, highest first.
            keys = [chan._q_for_pri(queue, p) for p in chan.priority_steps]
            popped = []
            client = redis_server.client(6)
            while len(popped) < len(ids):
                item = client.brpop(keys, timeout=5)
                assert item is not None, f"only {len(popped)} of {len(ids)} messages came back"
                popped.append(json.loads(item[1])["headers"]["id"])
            assert popped == ids, "the recovered task must come back first, the rest in order"
        finally:
            broker.close()
