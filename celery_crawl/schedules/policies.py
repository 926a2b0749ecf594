"""The policy names of a schedule entry, defined once.

Each is a ``StrEnum``: a member *is* its string (``Overlap.SKIP == "skip"``), so TOML values,
``beat_schedule`` options and records written before these enums existed compare equal to
them, and error messages list the same words the docs do. The tuples are the spellings a
file or option may use, in the order the docs give them.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "CATCHUP_POLICIES",
    "DEFAULT_CATCHUP",
    "DEFAULT_OVERLAP",
    "FOLD_POLICIES",
    "GAP_POLICIES",
    "OVERLAP_POLICIES",
    "Catchup",
    "CatchupPolicy",
    "Fold",
    "Gap",
    "Overlap",
]


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


@dataclasses.dataclass(frozen=True, slots=True)
class CatchupPolicy:
    """How missed slots are handled: the catch-up fields of an entry of either origin (a
    schedule file's ``catchup*`` keys, a ``beat_schedule`` entry's ``crawl_catchup*`` options),
    with their defaults, in one place.

    Attributes:
        mode: ``Catchup.NONE`` | ``LATEST`` | ``ALL`` (a spelling of one is accepted).
        window_s: slots older than this (relative to now) are never run.
        max_runs: most slots run at once under ``all``.
        grace_s: how late a slot may be and still count as on time.
    """

    mode: Catchup = Catchup.LATEST
    window_s: float = 3600.0
    max_runs: int = 10
    grace_s: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in CATCHUP_POLICIES:
            raise ValueError(f"catchup mode {self.mode!r} is not one of {CATCHUP_POLICIES}")
        object.__setattr__(self, "mode", Catchup(self.mode))
        if self.max_runs < 1:
            raise ValueError("catchup max_runs must be >= 1")


#: The policies of an entry that names none, whichever its origin.
DEFAULT_OVERLAP = Overlap.SKIP
DEFAULT_CATCHUP = CatchupPolicy()
