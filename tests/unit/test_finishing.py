"""The marks pool runs leave for their main process (``_finishing``): files a prefork pool's
children inherit, or sets in memory for a pool that runs in the worker's own process."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from celery_crawl import _finishing as finishing


@pytest.fixture(params=["files", "memory"])
def marks(request: pytest.FixtureRequest) -> Iterator[str]:
    finishing.teardown()
    finishing.setup(in_process=request.param == "memory")
    yield request.param
    finishing.teardown()


def test_a_mark_is_seen_until_the_end_takes_it(marks: str) -> None:
    assert not finishing.finished("t1")
    finishing.mark("t1")
    assert finishing.finished("t1") and not finishing.finished("t2")
    assert not finishing.handed_off("t1")
    assert finishing.take("t1") is False
    assert not finishing.finished("t1")


def test_a_handoff_is_taken_once(marks: str) -> None:
    finishing.mark_handoff("t1")
    finishing.mark("t1")
    assert finishing.handed_off("t1")
    assert finishing.take("t1") is True
    assert finishing.take("t1") is False
    assert not finishing.finished("t1") and not finishing.handed_off("t1")


def test_clear_forgets_both_marks(marks: str) -> None:
    finishing.mark("t1")
    finishing.mark_handoff("t1")
    finishing.clear("t1")
    assert not finishing.finished("t1") and not finishing.handed_off("t1")


def test_marks_made_on_pool_threads_are_seen_by_the_main_thread(marks: str) -> None:
    ids = [f"t{i}" for i in range(200)]
    threads = [threading.Thread(target=finishing.mark, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(finishing.finished(i) for i in ids)


def test_a_pool_in_this_process_keeps_its_marks_without_files() -> None:
    """A threads pool runs its tasks in the worker's process: no directory, no file operation
    per task (each releases the GIL the loop and the pool threads share)."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    finishing.teardown()
    try:
        assert finishing.setup(in_process=True) is None
        finishing.mark("t1")
        finishing.mark_handoff("t1")
        assert finishing.finished("t1") and finishing.handed_off("t1")
        after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        assert not {n for n in after - before if n.startswith("crawl-finishing-")}
        assert not isinstance(finishing._marks, finishing._FileMarks)
    finally:
        finishing.teardown()
    assert not finishing.finished("t1")  # gone with the worker


def test_outside_a_worker_marks_are_ignored() -> None:
    finishing.teardown()
    finishing.mark("t1")
    finishing.mark_handoff("t1")
    assert not finishing.finished("t1") and finishing.take("t1") is False
