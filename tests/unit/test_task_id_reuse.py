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
