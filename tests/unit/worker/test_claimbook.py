"""Which holds a lease loss takes from the claim book."""

from __future__ import annotations

from celery_crawl.worker.claims import Arrival, ClaimBook, Held


def _held(task_id: str, lease_name: str | None, *, parked: bool = False) -> Held:
    return Held(Arrival(task_id=task_id, delivery_tag=task_id, queue="q"), deliveries=1,
                token=None if parked else 7, lease_name=lease_name, parked=parked)


def test_a_loss_applied_under_a_new_lease_takes_only_the_other_leases_claims() -> None:
    book = ClaimBook()
    old, new, parked = _held("a", "worker:1"), _held("b", "worker:2"), _held("c", None,
                                                                             parked=True)
    for held in (old, new, parked):
        book.add(held)
    assert [h.arrival.task_id for h in book.take_not_of("worker:2")] == ["a"]
    assert sorted(h.arrival.task_id for h in book.snapshot()) == ["b", "c"]
    # No lease at all: every claimed hold and every parked one goes.
    assert sorted(h.arrival.task_id for h in book.take_not_of(None)) == ["b", "c"]
    assert len(book) == 0
