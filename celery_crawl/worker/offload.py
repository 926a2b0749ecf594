"""One worker-side thread for the store calls of deliveries and completions.

The consumer's event loop receives, decides and acks every message of a prefork worker, so a
store round trip made on it is time no other message is handled. Claim decisions and completion
writes are handed to this thread instead; what must happen on the loop afterwards (running the
task, acking the message) is sent back with ``hub.call_soon``, which wakes the loop. Jobs that
arrived together run back to back and their results go back to the loop in one callback, so a
prefetch window costs one wake-up, not one per message.

Jobs run in submission order, one at a time: a completion submitted after a decision of the same
task sees that decision's effects.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Offloader"]

logger = logging.getLogger("celery_crawl.worker")

#: A job: runs on the thread and returns what to run on the loop afterwards (or None).
Job = Callable[[], Callable[[], Any] | None]
#: A batch handler: items of one kind, in order -> what to run on the loop afterwards.
Batch = Callable[[list[Any]], list[Callable[[], Any]]]

_STOP = object()


class Offloader:
    """A daemon thread running jobs; their follow-ups run on the loop via ``to_loop``.

    Args:
        to_loop: schedules a callable on the consumer's event loop (``hub.call_soon``).
    """

    def __init__(self, to_loop: Callable[[Callable[[], None]], None],
                 batches: dict[str, Batch] | None = None) -> None:
        self._to_loop = to_loop
        self._batches = dict(batches or {})
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="crawl-claims", daemon=True)
        self._started = False
        self._lock = threading.Lock()

    def submit(self, job: Job) -> None:
        self._put(job)

    def submit_item(self, kind: str, item: Any) -> None:
        """Queue ``item`` for the batch handler ``kind``: items of one kind queued one after
        the other are handed to it together (one store round trip for all of them)."""
        self._put((kind, item))

    def _put(self, entry: Any) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()
        self._jobs.put(entry)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Run the jobs already submitted, then end the thread (a later job starts a new
        one)."""
        with self._lock:
            started, thread = self._started, self._thread
            if started:
                self._jobs.put(_STOP)
                self._started = False
                self._thread = threading.Thread(target=self._run, name="crawl-claims",
                                                daemon=True)
        if started:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            batch = [job]
            while True:  # everything that arrived meanwhile, in one pass
                try:
                    batch.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            follow_ups: list[Callable[[], Any]] = []
            stop = False
            i = 0
            while i < len(batch):
                each = batch[i]
                i += 1
                if each is _STOP:
                    stop = True
                    continue
                try:
                    if isinstance(each, tuple):
                        kind, items = each[0], [each[1]]
                        while i < len(batch) and isinstance(batch[i], tuple) and (
                                batch[i][0] == kind):
                            items.append(batch[i][1])
                            i += 1
                        follow_ups.extend(self._batches[kind](items))
                        continue
                    after = each()
                except Exception:
                    logger.exception("celery-crawl: a claim or completion job failed")
                    continue
                if after is not None:
                    follow_ups.append(after)
            if follow_ups:
                self._to_loop(_run_all(follow_ups))
            if stop:
                return


def _run_all(calls: list[Callable[[], Any]]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            try:
                call()
            except Exception:
                logger.exception("celery-crawl: applying a claim decision or an ack failed")

    return run
