"""What a parked delivery is called, in the log and the counters.

A delivery parked behind a live claim is one of two things: a retry or replacement (a later
generation of the message) waiting for its own previous run to end, which is Celery's normal
course (INFO, counted ``outcome=waiting``), or a real duplicate delivery (a WARNING naming the
worker whose run holds the claim, counted ``outcome=parked``). A parked delivery that runs
later is counted ``outcome=run`` unless it was waiting for its own run. Celery-free.
"""

from __future__ import annotations

import logging

from .. import metrics
from .claims import Decision, Held

__all__ = ["run_after_parking", "say_parked", "waits_for_own_run"]

logger = logging.getLogger("celery_crawl.worker")


def waits_for_own_run(held: Held, holder: str | None, own_holder: str | None) -> bool:
    """A retry or replacement (a later generation of the message) parked behind a claim of
    this worker (``own_holder``), or one that ended while being read: it waits for its own
    run."""
    own = holder is None or (own_holder is not None and holder == own_holder)
    return own and held.arrival.generation != (0, 0)


def say_parked(held: Held, decision: Decision, own_holder: str | None) -> None:
    """Log and count a delivery parked for the first time."""
    waiting = waits_for_own_run(held, decision.holder, own_holder)
    metrics.WORKER_DUPLICATES_PARKED.labels("waiting" if waiting else "parked").inc()
    if waiting:
        # A retry or replacement received while the run that published it is still ending
        # (Celery's normal course, not a fault worth a warning).
        logger.info("celery-crawl: %s[%s] is a %s waiting for its previous run to end%s; "
                    "parked (not run, not acked) until then", held.arrival.task_name,
                    held.arrival.task_id,
                    "retry" if held.arrival.generation[0] == 0 else "replacement",
                    _on_worker(decision.holder, own_holder))
    elif decision.holder is None:
        logger.warning("celery-crawl: %s[%s] is a duplicate delivery whose run's claim ended "
                       "while being read; parked (not run, not acked) and looked at again "
                       "shortly", held.arrival.task_name, held.arrival.task_id)
    else:
        logger.warning("celery-crawl: %s[%s] is a duplicate delivery: its run holds a live "
                       "claim%s; parked (not run, not acked) until that claim ends",
                       held.arrival.task_name, held.arrival.task_id,
                       _on_worker(decision.holder, own_holder))


def run_after_parking(held: Held, own_holder: str | None) -> None:
    """Count a parked delivery that now runs (before its hold takes its new claim)."""
    if not waits_for_own_run(held, held.holder, own_holder):
        metrics.WORKER_DUPLICATES_PARKED.labels("run").inc()


def _on_worker(holder: str | None, own_holder: str | None) -> str:
    """`` on worker X`` for the log: this worker, another one, or unknown (ended meanwhile)."""
    if holder is None:
        return " (that run's claim ended while being read; looked at again shortly)"
    if own_holder is not None and holder == own_holder:
        return " on this worker"
    return f" on worker {holder}"
