"""A parked delivery is named for what it is, and counted apart (the claim step's ``_apply``):
a retry or replacement waiting for its own previous run is not a duplicate delivery."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from celery_crawl.worker.claims import Arrival, ClaimBook, Decision, Held, Outcome
from celery_crawl.worker.consumer_claims import ConsumerClaims
from celery_crawl.worker.desk import Desk

OWN, OTHER = "host:1:own", "host:2:other"


def _step() -> ConsumerClaims:
    step = ConsumerClaims.__new__(ConsumerClaims)
    step.book = ClaimBook()
    # Parking and claiming only touch the book: no store is needed for them.
    step.desk = Desk(None, None, lambda: None, book=step.book)  # type: ignore[arg-type]
    step.lease_step = SimpleNamespace(keeper=SimpleNamespace(holder=OWN))  # type: ignore[assignment]
    step._run = lambda held: None  # type: ignore[method-assign]  # the pool is not wanted here
    return step


def _count(outcome: str) -> float:
    return REGISTRY.get_sample_value("crawl_worker_duplicates_total",
                                             {"outcome": outcome}) or 0.0


def _park_then_run(step: ConsumerClaims, held: Held, holder: str | None) -> None:
    step._apply(held, Decision(Outcome.PARK, holder=holder), None, first=True)
    step._apply(held, Decision(Outcome.RUN, token=9), None, first=False)


@pytest.mark.parametrize(("generation", "holder", "kind", "words"), [
    ((0, 1), OWN, "waiting", "is a retry waiting for its previous run to end on this worker"),
    ((1, 0), None, "waiting", "is a replacement waiting for its previous run to end (that "
                              "run's claim ended while being read"),
    ((0, 0), None, "parked", "is a duplicate delivery whose run's claim ended while being read"),
    ((0, 0), OTHER, "parked", f"is a duplicate delivery: its run holds a live claim on worker "
                              f"{OTHER}"),
    ((0, 2), OTHER, "parked", "is a duplicate delivery"),
])
def test_each_parked_case_is_named_and_counted_apart(
        caplog: pytest.LogCaptureFixture, generation: tuple[int, int], holder: str | None,
        kind: str, words: str) -> None:
    step = _step()
    held = Held(Arrival(task_id="t", delivery_tag=1, queue="q", generation=generation,
                        task_name="crawl"), deliveries=1)
    before = {k: _count(k) for k in ("waiting", "parked", "run")}
    with caplog.at_level(logging.INFO, logger="celery_crawl"):
        _park_then_run(step, held, holder)
    record = next(r for r in caplog.records if "parked (not run" in r.getMessage())
    assert words in record.getMessage(), record.getMessage()
    assert "None" not in record.getMessage()
    assert record.levelno == (logging.INFO if kind == "waiting" else logging.WARNING)
    after = {k: _count(k) - before[k] for k in before}
    # A waiting retry is counted once, as waiting; a duplicate as parked, then run.
    assert after == ({"waiting": 1, "parked": 0, "run": 0} if kind == "waiting"
                     else {"waiting": 0, "parked": 1, "run": 1})
