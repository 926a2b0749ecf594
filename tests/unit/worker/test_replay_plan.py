"""What a dropped duplicate's canvas gets (``worker/replay.py``), and the canvas key."""

from __future__ import annotations

from typing import Any

from celery_crawl._canvas import META_FIELD, canvas_key
from celery_crawl.worker.replay import FAILED, NOTHING, REUSED, SUCCEEDED, plan


def key(**fields: Any) -> str | None:
    return canvas_key(fields.get)


def test_a_canvas_key_names_who_waits_on_the_message() -> None:
    chord = {"task": "tsum", "options": {"task_id": "body"}}
    first = key(group="g1", group_index=0, chord=chord, root_id="r")
    assert first is not None
    assert key(group="g1", group_index=0, chord=chord, root_id="r") == first
    assert key(group="g2", group_index=0, chord=chord, root_id="r") != first
    assert key(group="g1", group_index=1, chord=chord, root_id="r") != first
    assert key(callbacks=[{"task": "note"}]) != key(callbacks=[{"task": "other"}])
    # Only the links that make a canvas wait on the message itself give it a key.
    assert key(group="g1", group_index=0, root_id="r") is None
    assert key(chain=[{"task": "next"}]) is not None
    # The rest of the chain is not part of it (Celery 5.4 pops it before storing).
    assert key(chain=[{"task": "a"}], callbacks=[1]) == key(chain=[], callbacks=[1])


def test_plan() -> None:
    mine = "k1"
    assert plan(None, {"status": "SUCCESS"}) == NOTHING
    assert plan(mine, {"status": "SUCCESS", META_FIELD: mine}) == NOTHING
    assert plan(mine, {"status": "FAILURE", META_FIELD: mine}) == NOTHING
    assert plan(mine, {"status": "SUCCESS", META_FIELD: "k0"}) == SUCCEEDED
    assert plan(mine, {"status": "SUCCESS"}) == SUCCEEDED
    assert plan(mine, {"status": "FAILURE"}) == FAILED
    assert plan(mine, {"status": "REVOKED"}) == FAILED
    assert plan(mine, {"status": "PENDING"}) == REUSED
    assert plan(mine, {"status": "RETRY", META_FIELD: mine}) == REUSED
    assert plan(mine, None) == REUSED
