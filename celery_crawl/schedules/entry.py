"""``EntrySpec``: one schedule entry, fully validated, whichever place it came from."""

from __future__ import annotations

import dataclasses
from typing import Any

from .fingerprint import fingerprint
from .policies import (
    CATCHUP_POLICIES,
    DEFAULT_CATCHUP,
    DEFAULT_OVERLAP,
    OVERLAP_POLICIES,
    Catchup,
    CatchupPolicy,
    Overlap,
)
from .tzcron import TzCron

__all__ = ["CATCHUP_POLICIES", "OVERLAP_POLICIES", "EntrySpec", "digest"]


def digest(definition: Any) -> str:
    """The whole fingerprint of a definition (:func:`~celery_crawl.schedules.fingerprint.
    fingerprint`), the form a schedule-file entry's records have always had."""
    return fingerprint(definition)


@dataclasses.dataclass(frozen=True)
class EntrySpec:
    """A periodic run definition: what to send, when, and how to treat overlaps and misses.

    ``source`` is where it was defined (``"beat_schedules/prices.toml"`` or ``"beat_schedule"``)
    so errors and ``status`` can point at it.
    """

    name: str
    task: str
    schedule: TzCron
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    queue: str | None = None
    overlap: Overlap = DEFAULT_OVERLAP
    catchup: Catchup = DEFAULT_CATCHUP.mode
    catchup_window_s: float = DEFAULT_CATCHUP.window_s
    catchup_max: int = DEFAULT_CATCHUP.max_runs
    expires_s: float | None = None
    priority: int | None = None
    paused: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        # A spelling from a file or a caller's string becomes the member (ValueError if none).
        object.__setattr__(self, "overlap", Overlap(self.overlap))
        object.__setattr__(self, "catchup", Catchup(self.catchup))

    def __hash__(self) -> int:
        # The generated hash would fail on the kwargs dict; name and fingerprint identify it.
        return hash((self.name, self.fingerprint()))

    def options(self) -> dict[str, Any]:
        """The publish options for ``apply_async`` (queue, expires, priority) that are set."""
        out: dict[str, Any] = {}
        if self.queue is not None:
            out["queue"] = self.queue
        if self.expires_s is not None:
            out["expires"] = self.expires_s
        if self.priority is not None:
            out["priority"] = self.priority
        return out

    def catchup_policy(self) -> CatchupPolicy:
        """The catch-up fields as the policy the beat plans with (the type a ``beat_schedule``
        entry's options become too).

        Raises:
            ValueError: ``catchup_max`` is below 1.
        """
        return CatchupPolicy(self.catchup, window_s=float(self.catchup_window_s),
                             max_runs=int(self.catchup_max))

    def fingerprint(self) -> str:
        """A stable digest of everything that defines the runs.

        Covers the schedule (cron, zone, gap, fold, jitter), the task, its arguments, the queue
        and the run options. ``paused`` and ``source`` are left out: pausing an entry or moving
        it to another file must not restart its history.
        """
        canon = {
            "schedule": self.schedule.fingerprint(),
            "task": self.task,
            "args": list(self.args),
            "kwargs": self.kwargs,
            "queue": self.queue,
            "overlap": self.overlap.value,
            "catchup": self.catchup.value,
            "catchup_window_s": self.catchup_window_s,
            "catchup_max": self.catchup_max,
            "expires_s": self.expires_s,
            "priority": self.priority,
        }
        return fingerprint(canon)
