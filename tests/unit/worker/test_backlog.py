"""The backlog of unrecorded ends: drained in order, and kept from the first refused one on."""

from __future__ import annotations

from typing import Any

from celery_crawl.errors import StoreError
from celery_crawl.worker.backlog import Backlog
from celery_crawl.worker.claims import Arrival, Held


def _held(task_id: str) -> Held:
    return Held(Arrival(task_id=task_id, delivery_tag=task_id, queue="q"), deliveries=1,
                token=1)


def test_a_refused_end_and_those_after_it_wait_for_the_next_drain() -> None:
    backlog = Backlog()
    for task_id in ("a", "b", "c"):
        backlog.add(_held(task_id), "done", False)
    recorded: list[str] = []

    def finish_until_b(held: Held, **kw: Any) -> None:
        if held.arrival.task_id == "b":
            raise StoreError("store down")
        recorded.append(held.arrival.task_id)

    backlog.drain(finish_until_b)
    assert recorded == ["a"] and len(backlog) == 2

    def finish(held: Held, *, state: str, requeue: bool) -> None:
        recorded.append(f"{held.arrival.task_id}:{state}:{requeue}")

    backlog.drain(finish)
    assert recorded == ["a", "b:done:False", "c:done:False"] and len(backlog) == 0
