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

_dir: str | None = None
#: The marks of a pool that runs in this process (``setup(in_process=True)``), else None.
_finished: set[str] | None = None
_handoffs: set[str] | None = None


def _path(task_id: str) -> str | None:
    if _dir is None:
        return None
    return os.path.join(_dir, hashlib.sha256(task_id.encode("utf-8", "replace")).hexdigest())


def setup(*, in_process: bool = False) -> str | None:
    """Make this worker's marks (main process, before the pool starts): sets in memory when the
    pool runs in this process, else a directory the pool's children inherit (its path)."""
    global _dir, _finished, _handoffs
    if in_process:
        _finished, _handoffs = set(), set()
        return None
    if _dir is None or not os.path.isdir(_dir):
        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        _dir = tempfile.mkdtemp(prefix=f"crawl-finishing-{os.getpid()}-", dir=root)
    return _dir


def teardown() -> None:
    """Remove the marks (worker shutdown)."""
    global _dir, _finished, _handoffs
    _finished = _handoffs = None
    path, _dir = _dir, None
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _touch(path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def mark(task_id: str) -> None:
    """The body of ``task_id`` returned; its result is about to be written (pool child)."""
    if _finished is not None:
        _finished.add(task_id)
        return
    path = _path(task_id)
    if path is not None:
        _touch(path)


def finished(task_id: str) -> bool:
    if _finished is not None:
        return task_id in _finished
    path = _path(task_id)
    return path is not None and os.path.exists(path)


def mark_handoff(task_id: str) -> None:
    """The run of ``task_id`` published the next run of its id (pool child)."""
    if _handoffs is not None:
        _handoffs.add(task_id)
        return
    path = _path(task_id)
    if path is not None:
        _touch(path + ".handoff")


def handed_off(task_id: str) -> bool:
    if _handoffs is not None:
        return task_id in _handoffs
    path = _path(task_id)
    return path is not None and os.path.exists(path + ".handoff")


def clear(task_id: str) -> None:
    if _finished is not None and _handoffs is not None:
        _finished.discard(task_id)
        _handoffs.discard(task_id)
        return
    path = _path(task_id)
    if path is not None:
        for each in (path, path + ".handoff"):
            with contextlib.suppress(OSError):
                os.unlink(each)


def take(task_id: str) -> bool:
    """Whether the run of ``task_id`` handed its id on, clearing both of its marks: what every
    end of a delivery does, in two file operations (a stat and two unlinks otherwise)."""
    if _finished is not None and _handoffs is not None:
        _finished.discard(task_id)
        try:
            _handoffs.remove(task_id)  # one step: a concurrent mark is either seen or kept
        except KeyError:
            return False
        return True
    path = _path(task_id)
    if path is None:
        return False
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
