"""Marks of tasks whose body has returned, left by pool children for their main process.

On a lease loss the main process cancels the tasks it runs (``crawl_on_lease_loss="cancel"``,
fail closed), because the reaper may hand them to another worker. A task whose body has already
returned and that is only writing its result (blocked on a store that everyone lost, say) has
done its work: killing it does not undo that work, it only makes the task run a second time.
So the pool child marks a task here as soon as its body has returned: ``IdempotentTask`` right
after ``run`` (before its ledger bookkeeping), the audited result backend just before it writes
a ready state of any task. The main process keeps marked tasks on a lease loss and records
their end once the store answers again (the reaper gives an orphaned claim one grace period
before it reaps it). Every end of a delivery clears its mark.

A second kind of mark says that a run handed its task id on (it published a retry or a
replacement of itself, see ``worker/handoffs.py``); the main process records it in the done
tombstone.

With a prefork pool, marks are empty files in a directory private to this worker process
start (under ``/dev/shm`` when writable), named by a hash of the task id; the directory is made
by the main process before the pool forks, so every child inherits its path. With a threads pool
the tasks run in the main process itself, so marks are two sets in its memory: a file operation
there costs more than the bookkeeping it serves (each releases and re-takes the GIL that the
consumer's loop and every pool thread share).

The module sits below ``worker``, ``backends`` and ``tasks`` (the three that write or read the
marks), so none of them imports another for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile

__all__ = ["clear", "finished", "handed_off", "mark", "mark_handoff", "setup", "take",
           "teardown"]


class _FileMarks:
    """Marks as empty files in ``dir`` (a prefork pool: children are other processes)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def _path(self, task_id: str) -> str:
        digest = hashlib.sha256(task_id.encode("utf-8", "replace")).hexdigest()
        return os.path.join(self.dir, digest)

    @staticmethod
    def _touch(path: str) -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))

    def mark(self, task_id: str) -> None:
        self._touch(self._path(task_id))

    def mark_handoff(self, task_id: str) -> None:
        self._touch(self._path(task_id) + ".handoff")

    def finished(self, task_id: str) -> bool:
        return os.path.exists(self._path(task_id))

    def handed_off(self, task_id: str) -> bool:
        return os.path.exists(self._path(task_id) + ".handoff")

    def clear(self, task_id: str) -> None:
        path = self._path(task_id)
        for each in (path, path + ".handoff"):
            with contextlib.suppress(OSError):
                os.unlink(each)

    def take(self, task_id: str) -> bool:
        path = self._path(task_id)
        try:
            os.unlink(path + ".handoff")
            handoff = True
        except FileNotFoundError:
            handoff = False
        except OSError:
            handoff = os.path.exists(path + ".handoff")
        with contextlib.suppress(OSError):
            os.unlink(path)
        return handoff

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class _MemoryMarks:
    """Marks as two sets (a threads pool: its tasks run in this process). Each operation is one
    set call, atomic under the GIL, so a mark made on a pool thread is seen or kept whole."""

    def __init__(self) -> None:
        self._finished: set[str] = set()
        self._handoffs: set[str] = set()

    def mark(self, task_id: str) -> None:
        self._finished.add(task_id)

    def mark_handoff(self, task_id: str) -> None:
        self._handoffs.add(task_id)

    def finished(self, task_id: str) -> bool:
        return task_id in self._finished

    def handed_off(self, task_id: str) -> bool:
        return task_id in self._handoffs

    def clear(self, task_id: str) -> None:
        self._finished.discard(task_id)
        self._handoffs.discard(task_id)

    def take(self, task_id: str) -> bool:
        self._finished.discard(task_id)
        try:
            self._handoffs.remove(task_id)
        except KeyError:
            return False
        return True

    def close(self) -> None:
        self._finished.clear()
        self._handoffs.clear()


#: This worker's marks (None outside a worker: marks are then ignored).
_marks: _FileMarks | _MemoryMarks | None = None


def setup(*, in_process: bool = False) -> str | None:
    """Make this worker's marks (main process, before the pool starts): sets in memory when the
    pool runs in this process, else a directory the pool's children inherit (its path)."""
    global _marks
    if in_process:
        teardown()
        _marks = _MemoryMarks()
        return None
    if isinstance(_marks, _FileMarks) and os.path.isdir(_marks.dir):
        return _marks.dir
    teardown()
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    _marks = _FileMarks(tempfile.mkdtemp(prefix=f"crawl-finishing-{os.getpid()}-", dir=root))
    return _marks.dir


def teardown() -> None:
    """Remove the marks (worker shutdown)."""
    global _marks
    marks, _marks = _marks, None
    if marks is not None:
        marks.close()


def mark(task_id: str) -> None:
    """The body of ``task_id`` returned; its result is about to be written (pool child)."""
    if _marks is not None:
        _marks.mark(task_id)


def finished(task_id: str) -> bool:
    return _marks is not None and _marks.finished(task_id)


def mark_handoff(task_id: str) -> None:
    """The run of ``task_id`` published the next run of its id (pool child)."""
    if _marks is not None:
        _marks.mark_handoff(task_id)


def handed_off(task_id: str) -> bool:
    return _marks is not None and _marks.handed_off(task_id)


def clear(task_id: str) -> None:
    if _marks is not None:
        _marks.clear(task_id)


def take(task_id: str) -> bool:
    """Whether the run of ``task_id`` handed its id on, clearing both of its marks: what every
    end of a delivery does (with files, two unlinks rather than a stat and two unlinks)."""
    return _marks is not None and _marks.take(task_id)
