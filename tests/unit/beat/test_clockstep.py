"""The wall-clock step guard and the undecided-slot blame, with fake clocks and slot sources."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from celery_crawl.beat.clockstep import Step, StepGuard
from celery_crawl.beat.slots import SkipRange, blame
from celery_crawl.clock import Clock
from tests.unit.beat.test_slots import Every

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


class Fake:
    """A wall clock and a CLOCK_BOOTTIME the test advances and sets; a reference that may
    fail."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.set_by = 0.0
        self.ref_ok = True
        self.reads = 0

    def wall(self) -> float:
        return T0.timestamp() + self.mono + self.set_by

    def boottime(self) -> float:
        return self.mono

    def server_time(self) -> float | None:
        self.reads += 1
        if not self.ref_ok:
            return None
        return T0.timestamp() + self.mono


def make() -> tuple[Fake, Clock, StepGuard]:
    fake = Fake()
    clock = Clock(fake, wall=fake.wall, mono=fake.boottime)
    assert clock.calibrate(1) is not None
    return fake, clock, StepGuard(clock, tolerance_s=0.5)


def test_drift_is_steady_and_a_step_is_measured_again() -> None:
    fake, clock, guard = make()
    fake.mono += 10.0
    fake.set_by = 0.4  # within tolerance: drift, and now() still does not run ahead
    assert guard.check() is Step.STEADY
    assert clock.now().timestamp() <= T0.timestamp() + fake.mono + 1e-6
    fake.set_by = 7200.0
    reads = fake.reads
    assert guard.check() is Step.REMEASURED and fake.reads > reads
    assert clock.offset_s is not None and abs(clock.offset_s + 7200.0) < 1e-6
    assert abs(clock.now().timestamp() - (T0.timestamp() + fake.mono)) < 1e-6
    fake.mono += 1.0
    assert guard.check() is Step.STEADY  # measured: the offset now accounts for the step


def test_a_step_that_cannot_be_measured_dispatches_nothing_until_it_is() -> None:
    fake, _clock, guard = make()
    fake.set_by, fake.ref_ok = -3600.0, False
    assert guard.check() is Step.UNKNOWN
    fake.mono += 0.1
    reads = fake.reads
    assert guard.check() is Step.UNKNOWN and fake.reads == reads  # retried after RETRY_S
    fake.mono += 1.0
    fake.ref_ok = True
    assert guard.check() is Step.REMEASURED and guard.steps == 1


def test_without_a_reference_the_tick_that_sees_a_step_is_refused_once() -> None:
    fake = Fake()
    clock = Clock(None, wall=fake.wall, mono=fake.boottime)
    guard = StepGuard(clock, tolerance_s=0.5)
    assert guard.check() is Step.STEADY  # takes the anchor
    fake.set_by = 60.0
    assert guard.check() is Step.UNKNOWN
    assert guard.check() is Step.STEADY


def test_blame_gives_the_undecided_slot_its_own_range() -> None:
    src = Every(60)
    s = [T0 + timedelta(minutes=i) for i in range(1, 6)]
    skipped = (SkipRange(s[0], s[4], 5, "superseded"),)
    assert blame(skipped, s[2], "store_error", src) == (
        SkipRange(s[0], s[1], 2, "superseded"),
        SkipRange(s[2], s[2], 1, "store_error"),
        SkipRange(s[3], s[4], 2, "superseded"),
    )
    assert blame(skipped, s[0], "store_error", src)[0] == SkipRange(s[0], s[0], 1, "store_error")
    assert blame((), s[0], "store_error", src) == ()
