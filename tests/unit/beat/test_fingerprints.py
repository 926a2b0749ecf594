"""One fingerprint for every entry, and policies typed as enums without a format change.

Stored entry states carry the fingerprint of their definition; a changed value restarts an
entry's history. The pinned values below are what the releases before the policy enums wrote.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_crawl.beat.entries import from_beat_schedule, from_spec
from celery_crawl.beat.slots import CatchupPolicy
from celery_crawl.schedules import EntrySpec, TzCron, policies
from celery_crawl.schedules.fingerprint import SHORT, fingerprint
from celery_crawl.schedules.policies import (
    DEFAULT_CATCHUP,
    DEFAULT_OVERLAP,
    Catchup,
    Fold,
    Gap,
    Overlap,
)

CRON = TzCron("0 3 * * *", "Europe/Paris", name="n", gap="skip", fold="both", jitter=5)


@pytest.fixture(scope="module")
def app() -> Celery:
    return Celery("unit", set_as_current=False)


def test_schedule_and_file_entry_fingerprints_are_unchanged() -> None:
    assert CRON.fingerprint() == (
        "58197c10fea46b0d6e548b9c9d586eca0fb058407170960a9cb2794ea90fda26")
    spec = EntrySpec(name="e", task="t.x", schedule=CRON, args=(1,), kwargs={"a": 1},
                     overlap=Overlap.ALLOW, catchup=Catchup.ALL, queue="q", priority=3,
                     expires_s=9.0)
    assert spec.fingerprint() == (
        "a9d5da90361ed575a9c7cd68c0cfdd1de6840bc252c93eec995642e273655e11")
    assert from_spec(spec).fingerprint == spec.fingerprint()


def test_beat_schedule_fingerprints_are_the_short_form_and_unchanged(app: Celery) -> None:
    options: dict[str, Any] = {"queue": "q", "crawl_overlap": "cancel_other",
                               "crawl_catchup": "none", "crawl_catchup_window": 60}
    entry = from_beat_schedule("b", {"task": "t.y", "schedule": CRON, "args": [1],
                                     "options": options}, app)
    assert entry.fingerprint == "0bee290e6be77845"
    assert len(entry.fingerprint) == SHORT
    assert entry.fingerprint == fingerprint(
        {"task": "t.y", "schedule": CRON.fingerprint(), "args": [1], "kwargs": {},
         "options": {"queue": "q"}, "overlap": "cancel_other",
         "catchup": {"mode": "none", "window_s": 60.0, "max_runs": 10, "grace_s": 1.0}},
        digits=SHORT)


def test_policy_fields_hold_enum_members_whatever_spelling_came_in(app: Celery) -> None:
    spec = EntrySpec(name="e", task="t.x", schedule=CRON,
                     overlap="buffer_one", catchup="none")  # type: ignore[arg-type]
    assert spec.overlap is Overlap.BUFFER_ONE and spec.catchup is Catchup.NONE
    assert CRON.gap is Gap.SKIP and CRON.fold is Fold.BOTH
    assert CatchupPolicy("all").mode is Catchup.ALL  # type: ignore[arg-type]
    entry = from_beat_schedule("b", {"task": "t", "schedule": CRON,
                                     "options": {"crawl_overlap": "allow"}}, app)
    assert entry.overlap is Overlap.ALLOW and entry.catchup.mode is Catchup.LATEST
    # What is written out stays the plain words (schedule files, durable records, repr).
    assert CRON.to_dict()["gap"] == "skip" and type(CRON.to_dict()["gap"]) is str
    assert "gap='skip'" in repr(CRON)
    with pytest.raises(ValueError):
        EntrySpec(name="e", task="t.x", schedule=CRON, overlap="sometimes")  # type: ignore[arg-type]


def test_both_origins_take_their_policies_and_defaults_from_one_place(app: Celery) -> None:
    spec = EntrySpec(name="e", task="t.x", schedule=CRON)
    entry = from_beat_schedule("b", {"task": "t.x", "schedule": CRON}, app)
    assert from_spec(spec).catchup == entry.catchup == DEFAULT_CATCHUP == spec.catchup_policy()
    assert from_spec(spec).overlap is entry.overlap is DEFAULT_OVERLAP
    assert CatchupPolicy is policies.CatchupPolicy  # beat.slots re-exports the one type
