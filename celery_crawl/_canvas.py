"""Which canvas a task message belongs to, as a short key (Celery-free).

A finished task id is remembered (``crawl_done_ttl``) and a later message under it is dropped as
a duplicate. When that message belongs to the very canvas the finished run belonged to (the same
delivery again, at least once), the canvas already has the run's outcome. When it belongs to
another one - a frozen signature applied twice, one frozen signature placed in two chords, a
re-send with a fixed ``task_id`` and other callbacks - that canvas waits on it. The audited
backend stores the finished run's key in its result (``META_FIELD``); the worker compares the
dropped message's key with it (``celery_crawl.worker.replay``).

The key covers what decides who waits on the message: its group and place in it, its chord, its
callbacks and errbacks, its parent and root. The rest of its chain is left out: Celery 5.4 pops
the chain's next link off the request before the result is stored, so the stored and the
received chain differ by one link for the same delivery.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

__all__ = ["META_FIELD", "canvas_key"]

#: Result meta field holding the canvas key of the run that wrote the result.
META_FIELD = "crawl_canvas"

_FIELDS = ("group", "group_index", "chord", "callbacks", "errbacks", "parent_id", "root_id")
#: What makes a message part of a canvas that waits on its outcome through the message itself
#: (a group without a chord reads its members' results by id, which a dropped copy has).
_WAITING = ("chord", "callbacks", "errbacks", "chain")


def canvas_key(get: Callable[[str], Any]) -> str | None:
    """The key of the canvas ``get`` (a request's or message's field reader) belongs to.

    Returns None for a message nothing waits on through its fields (no chord, chain,
    callbacks or errbacks).
    """
    if not any(get(name) for name in _WAITING):
        return None
    parts = [get(name) for name in _FIELDS]
    text = json.dumps(parts, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()
