"""The pieces of the task-id reuse rule that need no store: message digests and successors."""

from __future__ import annotations

from celery_crawl.worker.claims import Arrival, is_successor, message_digest


def test_a_redelivery_has_the_digest_of_the_message_and_any_other_message_another() -> None:
    headers = {"id": "t", "task": "canvas.add", "retries": 0, "replaced_task_nesting": 0}
    body = b'[[1, 2], {}, {"callbacks": null}]'
    digest = message_digest(headers, body)
    # RabbitMQ quorum queues count redeliveries in a header: still the same message.
    assert message_digest({**headers, "x-delivery-count": 3}, body) == digest
    assert message_digest(dict(reversed(list(headers.items()))), body) == digest
    assert message_digest(headers, body.decode()) == digest
    # A retry, a replacement, a re-publish (stamped with crawl_handoff), other arguments.
    assert message_digest({**headers, "retries": 1}, body) != digest
    assert message_digest({**headers, "task": "canvas.mul", "replaced_task_nesting": 1},
                          body) != digest
    assert message_digest({**headers, "crawl_handoff": "a1"}, body) != digest
    assert message_digest(headers, b'[[1, 3], {}, {"callbacks": null}]') != digest
    # Headers a producer may fill with anything do not break it.
    assert message_digest({**headers, "odd": object(), 7: "x"}, body)


def test_is_successor() -> None:
    done = {"handoff": True, "gen": [1, 2], "digest": "d"}
    assert is_successor(done, (1, 3), "e")  # a retry of the replacement
    assert is_successor(done, (2, 0), "e")  # a replacement of it
    assert is_successor(done, (1, 2), "e")  # a re-publish of its own id
    assert not is_successor(done, (1, 2), "d")  # the finished message again
    assert not is_successor(done, (0, 9), "e")  # older than the finished message
    assert not is_successor({**done, "handoff": False}, (9, 9), "e")
    assert not is_successor({"state": "done", "retries": 0}, (0, 1), "e")  # before the rule
    # Foreign tombstone fields read leniently; only a literal true hands off.
    assert is_successor({"handoff": True, "gen": "junk", "retries": 1}, (0, 1), "e")
    assert not is_successor({"handoff": 1, "gen": [0, 0]}, (1, 0), "e")


def test_only_a_tombstone_that_hands_the_id_on_computes_and_carries_the_digest() -> None:
    """The digest is compared only for a run that handed its id on (``is_successor``): any
    other tombstone carries none, and the message is not hashed for it."""
    from celery_crawl.worker.claims import Claimer, Held

    hashed: list[int] = []

    def source() -> str:
        hashed.append(1)
        return "d1"

    claimer = Claimer(None, lambda: None, max_deliveries=3, done_ttl_s=60.0)  # type: ignore[arg-type]
    held = Held(Arrival(task_id="t", delivery_tag="x", queue="q", digest_source=source),
                deliveries=1, token=5)
    _, _, value = claimer.end_item(held, "done", False)
    assert value["digest"] == "" and value["handoff"] is False and hashed == []
    held.handoff = True
    _, _, value = claimer.end_item(held, "done", False)
    assert value["digest"] == "d1" and hashed == [1]
    assert held.arrival.digest_now() == "d1" and hashed == [1]  # once


def test_a_new_publish_of_a_finished_id_runs_and_a_copy_of_a_recorded_one_does_not() -> None:
    from celery_crawl.worker.claims import is_new_publish

    done = {"handoff": False, "sent": ["p1", "p2"]}
    assert is_new_publish(done, "p3")  # a frozen signature applied again
    assert not is_new_publish(done, "p1")  # a redelivery of a publish that ran
    assert not is_new_publish(done, "p2")
    assert not is_new_publish(done, "")  # an unmarked message: the stricter rule
    # A tombstone written before publish ids were recorded, or a foreign one, is final.
    assert not is_new_publish({"state": "done"}, "p3")
    assert not is_new_publish({"sent": "p1"}, "p3")


def test_the_tombstone_remembers_the_newest_publishes() -> None:
    from celery_crawl.worker.claims import MAX_PUBLISHES, Arrival, Claimer, Held

    claimer = Claimer(None, lambda: None, max_deliveries=3, done_ttl_s=60.0)  # type: ignore[arg-type]
    before = tuple(f"p{i}" for i in range(MAX_PUBLISHES))
    held = Held(Arrival(task_id="t", delivery_tag="x", queue="q", sent="new"), deliveries=1,
                token=5, sent_before=before)
    _, _, value = claimer.end_item(held, "done", False)
    assert value["sent"] == [*before[1:], "new"]
    unmarked = Held(Arrival(task_id="t", delivery_tag="x", queue="q"), deliveries=1, token=5)
    assert claimer.end_item(unmarked, "done", False)[2]["sent"] == []


def test_decisions_on_a_store_follow_the_publish_rule() -> None:
    """Against the memory store: the first publish runs, its redelivery is a duplicate, a new
    publish runs and its end records both, after which neither runs again."""
    import uuid

    from celery_crawl.leases.memory import MemoryLeaseStore
    from celery_crawl.worker.claims import Arrival, Claimer, Held, Outcome

    store = MemoryLeaseStore(f"memory://reuse-{uuid.uuid4().hex[:8]}", namespace="r")
    lease = store.acquire("worker:w", 30.0, "w")
    assert lease is not None
    claimer = Claimer(store, lambda: lease, max_deliveries=5, done_ttl_s=60.0, worker="w")

    def deliver(sent: str, tag: int) -> tuple[Outcome, Held]:
        held = Held(Arrival(task_id="t", delivery_tag=tag, queue="q", sent=sent))
        decision = claimer.decide("t", delivery_tag=tag, queue="q", sent=sent)
        held.token, held.lease_name, held.holder = decision.token, lease.name, lease.holder
        held.sent_before = decision.sent_before
        return decision.outcome, held

    outcome, first = deliver("p1", 1)
    assert outcome is Outcome.RUN
    claimer.finish(first, state="done")
    assert deliver("p1", 1)[0] is Outcome.DUPLICATE
    assert deliver("", 2)[0] is Outcome.DUPLICATE
    outcome, second = deliver("p2", 3)
    assert outcome is Outcome.RUN and second.sent_before == ("p1",)
    claimer.finish(second, state="done")
    assert deliver("p1", 1)[0] is Outcome.DUPLICATE  # a late copy of the first publish
    assert deliver("p2", 3)[0] is Outcome.DUPLICATE
    store.close()


def test_a_copy_of_an_older_publish_is_no_successor_of_a_newer_one() -> None:
    """The first publish runs and is replaced (it hands its id on); the frozen signature is
    applied again (a new publish, of the same generation) and its run is replaced too; a late
    copy of the first publish must not pass as a successor of the second run, and the
    replacement still runs."""
    import uuid

    from celery_crawl.leases.memory import MemoryLeaseStore
    from celery_crawl.worker.claims import Arrival, Claimer, Held, Outcome

    store = MemoryLeaseStore(f"memory://older-{uuid.uuid4().hex[:8]}", namespace="r")
    lease = store.acquire("worker:w", 30.0, "w")
    assert lease is not None
    claimer = Claimer(store, lambda: lease, max_deliveries=9, done_ttl_s=60.0, worker="w")

    def deliver(sent: str, digest: str, gen: tuple[int, int]) -> tuple[Outcome, Held]:
        held = Held(Arrival(task_id="t", delivery_tag=digest, queue="q", sent=sent,
                            digest=digest, generation=gen))
        decision = claimer.decide("t", delivery_tag=digest, queue="q", sent=sent,
                                  digest=digest, generation=gen)
        held.token, held.lease_name, held.holder = decision.token, lease.name, lease.holder
        held.sent_before = decision.sent_before
        return decision.outcome, held

    outcome, first = deliver("p1", "d1", (0, 0))
    assert outcome is Outcome.RUN
    first.handoff = True  # Task.replace
    claimer.finish(first, state="done")
    outcome, second = deliver("p2", "d2", (0, 0))  # applied again
    assert outcome is Outcome.RUN
    second.handoff = True
    claimer.finish(second, state="done")
    assert deliver("p1", "d1", (0, 0))[0] is Outcome.DUPLICATE
    assert deliver("p2", "d2", (0, 0))[0] is Outcome.DUPLICATE
    assert deliver("p2x", "d2x", (1, 0))[0] is Outcome.RUN  # the replacement
    store.close()
