"""The policy names of a schedule entry, defined once.

Each is a ``StrEnum``: a member *is* its string (``Overlap.SKIP == "skip"``), so TOML values,
``beat_schedule`` options and records written before these enums existed compare equal to
them, and error messages list the same words the docs do. The tuples are the spellings a
file or option may use, in the order the docs give them.
"""

from __future__ import annotations

import enum

__all__ = ["CATCHUP_POLICIES", "FOLD_POLICIES", "GAP_POLICIES", "OVERLAP_POLICIES", "Catchup",
           "Fold", "Gap", "Overlap"]


class Overlap(enum.StrEnum):
    """What the leader does with a slot whose previous run is still in flight."""

    SKIP = "skip"
    BUFFER_ONE = "buffer_one"
    ALLOW = "allow"
    CANCEL_OTHER = "cancel_other"


class Catchup(enum.StrEnum):
    """Which missed slots run when the schedule resumes (after a downtime or a failover)."""

    NONE = "none"
    LATEST = "latest"
    ALL = "all"


class Gap(enum.StrEnum):
    """A fixed-time slot that falls into a DST gap: moved past the gap, or skipped."""

    SHIFT = "shift"
    SKIP = "skip"


class Fold(enum.StrEnum):
    """A fixed-time slot that occurs twice in a DST fold: the first, the last, or both."""

    FIRST = "first"
    LAST = "last"
    BOTH = "both"


OVERLAP_POLICIES: tuple[str, ...] = tuple(p.value for p in Overlap)
CATCHUP_POLICIES: tuple[str, ...] = tuple(p.value for p in Catchup)
GAP_POLICIES: tuple[str, ...] = tuple(p.value for p in Gap)
FOLD_POLICIES: tuple[str, ...] = tuple(p.value for p in Fold)
