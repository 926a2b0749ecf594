"""The leader's wall-clock step guard: no slot is decided on a wall clock set since it was
last compared with the reference clock.

The skew guard (``crawl_max_clock_skew``) compares the wall clock with the reference every
``SKEW_CHECK_S``. A clock *set* in between (``date -s``, an NTP step, a VM resumed from a
snapshot) would otherwise be trusted until the next comparison: a +2 h step makes every entry
look two hours late, so the leader publishes the newest slot two hours early, records the
slots in between as skipped, and leaves the entry silent for two hours once the clock is set
back. So every tick compares how far the wall clock and ``CLOCK_BOOTTIME`` advanced since the
last calibration (:meth:`Clock.step_s`); on a step beyond the tolerance nothing is dispatched
until the reference has been read again, and the skew guard then judges the new offset (a
clock still wrong blocks the replica, which steps down).

Without a reference clock there is nothing to tell which reading is right: the tick that sees
the step dispatches nothing and the new wall clock is taken from the next tick on.
"""

from __future__ import annotations

import enum
import logging

from ..clock import Clock

__all__ = ["RETRY_S", "Step", "StepGuard"]

log = logging.getLogger("celery_crawl.beat")

#: A failed re-measurement after a step is tried again this often (each try is bounded by
#: the store timeout; the leader's renewals go on meanwhile).
RETRY_S = 1.0


class Step(enum.Enum):
    """What :meth:`StepGuard.check` found."""

    #: The wall clock advanced with ``CLOCK_BOOTTIME``: it may be used.
    STEADY = "steady"
    #: It was set, and the reference was read again: the new offset must be judged now.
    REMEASURED = "remeasured"
    #: It was set and the offset is not known again yet: dispatch nothing.
    UNKNOWN = "unknown"


class StepGuard:
    """Finds wall-clock steps on every tick and re-measures the offset after one.

    Args:
        clock: the scheduler's clock (its reference, if any, is read again after a step).
        tolerance_s: a step up to this size is taken as drift (half ``crawl_max_clock_skew``).
    """

    def __init__(self, clock: Clock, tolerance_s: float) -> None:
        self.clock = clock
        self.tolerance_s = tolerance_s
        #: steps seen so far (tests and logs)
        self.steps = 0
        self._pending: float | None = None  # the step not yet re-measured
        self._next_try = 0.0

    def check(self, *, deadline: float | None = None) -> Step:
        """Compare the wall clock's advance with ``CLOCK_BOOTTIME``'s since the last
        calibration; after a step, read the reference again (no sample is started after
        ``deadline``, a ``CLOCK_BOOTTIME`` instant)."""
        clock = self.clock
        step = clock.step_s()
        if self._pending is None:
            if abs(step) <= self.tolerance_s:
                return Step.STEADY
            self.steps += 1
            self._pending = step
            self._next_try = 0.0
            log.error("beat: the wall clock was set by %+.3fs since it was last compared with "
                      "the reference clock; dispatching nothing until it is measured again",
                      step)
        if clock.reference is None:
            clock.accept_step()
            self._pending = None
            log.error("beat: no reference clock to check the new wall clock against; it is "
                      "taken as right from the next tick on")
            return Step.UNKNOWN
        now = clock.monotonic()
        if now < self._next_try:
            return Step.UNKNOWN
        self._next_try = now + RETRY_S
        if clock.calibrate(3, deadline=deadline) is None:
            log.warning("beat: the reference clock could not be read after a wall-clock step; "
                        "trying again in %gs", RETRY_S)
            return Step.UNKNOWN
        self._pending = None
        return Step.REMEASURED
