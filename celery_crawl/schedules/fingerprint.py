"""The one fingerprint of a schedule definition, for every kind of entry and schedule.

A stored entry state carries the fingerprint of the definition it was written for; a different
value starts the entry's history afresh. So the digest is computed in one place, the same way
for a schedule, a schedule-file entry and a ``beat_schedule`` entry, and its output never
changes for a definition that did not: policy enums are written as their string values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["SHORT", "fingerprint", "schedule_fingerprint"]

#: Hex digits kept for a ``beat_schedule`` entry: its stored records have always had 16.
SHORT = 16


def fingerprint(definition: Any, *, digits: int | None = None) -> str:
    """sha256 of ``definition``'s canonical JSON (sorted keys, compact; reprs for foreign
    objects), hex, cut to its first ``digits`` when given."""
    text = json.dumps(definition, sort_keys=True, separators=(",", ":"), default=repr)
    full = hashlib.sha256(text.encode()).hexdigest()
    return full if digits is None else full[:digits]


def schedule_fingerprint(entries: Mapping[str, str]) -> str:
    """The fingerprint of a whole schedule, from its entries' names and fingerprints: two beat
    replicas with the same value run the same schedule (the fleet records it, ``crawl status``
    compares replicas by it)."""
    return fingerprint(dict(entries), digits=SHORT)
