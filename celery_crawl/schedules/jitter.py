"""Deterministic jitter: the same (entry, slot) gets the same delay on every replica and restart.

Python's ``hash()`` is salted per process, so two beat replicas would disagree on when a run is
due; a SHA-256 of the entry name and the slot does not.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

__all__ = ["jitter_fraction", "jitter_offset_s"]

_SCALE = float(1 << 64)


def jitter_fraction(name: str | None, slot: datetime) -> float:
    """A stable number in ``[0, 1)`` for ``(name, slot)``; ``slot`` is an aware UTC instant."""
    key = f"{name or ''}|{slot:%Y-%m-%dT%H:%M:%SZ}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / _SCALE


def jitter_offset_s(name: str | None, slot: datetime, jitter_s: float, room_s: float) -> float:
    """Seconds to add to ``slot``: in ``[0, jitter_s]`` and strictly less than ``room_s``.

    ``room_s`` is the distance to the next slot. The spread is capped at half of it, so a run
    never moves past (or right up against) the next one and runs keep their order; with a room
    wider than twice the jitter the cap has no effect.
    """
    if jitter_s <= 0:
        return 0.0
    return jitter_fraction(name, slot) * min(jitter_s, room_s / 2)
