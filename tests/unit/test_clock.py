"""Clock calibration against stub references with known offsets and delays."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from celery_crawl.clock import Clock, ReferenceClock, monotonic
from celery_crawl.errors import StoreTimeout


class StubReference:
    """A server whose clock runs ``offset_s`` ahead; each call's delays are scripted.

    ``delays`` is a list of ``(to_server_s, from_server_s)`` per call; the server reads its clock
    after the first delay, so an asymmetric delay shifts the midpoint estimate by half the
    asymmetry (NTP's known error) and a large one is what the min-RTT choice avoids.
    """

    def __init__(self, offset_s: float, delays: list[tuple[float, float]]) -> None:
        self.offset_s = offset_s
        self.delays = list(delays)
        self.calls = 0

    def server_time(self) -> float | None:
        to_server, from_server = self.delays[self.calls % len(self.delays)]
        self.calls += 1
        time.sleep(to_server)
        stamp = time.time() + self.offset_s
        time.sleep(from_server)
        return stamp


class NoClock:
    def server_time(self) -> float | None:
        return None


class Flaky:
    def __init__(self, inner: ReferenceClock, failures: int) -> None:
        self.inner, self.failures = inner, failures

    def server_time(self) -> float | None:
        if self.failures:
            self.failures -= 1
            raise StoreTimeout("redis://stub: TIME did not answer within 0.1s")
        return self.inner.server_time()


def test_monotonic_is_boottime() -> None:
    a = monotonic()
    assert abs(a - time.clock_gettime(time.CLOCK_BOOTTIME)) < 0.5
    assert monotonic() >= a


def test_uncalibrated_clock_is_local_aware_utc() -> None:
    clock = Clock()
    now = clock.now()
    assert now.tzinfo is dt.UTC
    assert abs(now.timestamp() - time.time()) < 1
    assert clock.offset_s is None and clock.calibrate() is None


def test_calibration_recovers_offset_within_its_uncertainty() -> None:
    ref = StubReference(offset_s=42.0, delays=[(0.002, 0.002)])
    clock = Clock(ref)
    offset = clock.calibrate(k=3)
    assert offset is not None
    assert clock.uncertainty_s is not None
    assert abs(offset - 42.0) <= clock.uncertainty_s + 0.01
    assert abs(clock.now().timestamp() - (time.time() + 42.0)) < clock.uncertainty_s + 0.05
    assert ref.calls == 3


def test_sample_with_smallest_round_trip_wins() -> None:
    # Samples 1 and 3 sit in a one-sided queue (slow request leg): their midpoints are off by
    # about 0.15 s. Sample 2 is quick and symmetric, so its estimate is close (half of any
    # scheduling asymmetry on a loaded machine).
    ref = StubReference(offset_s=-3.0, delays=[(0.3, 0.0), (0.001, 0.001), (0.3, 0.0)])
    clock = Clock(ref)
    offset = clock.calibrate(k=3)
    assert offset is not None and abs(offset - -3.0) < 0.075
    assert clock.uncertainty_s is not None and clock.uncertainty_s < 0.1


def test_reference_without_clock_leaves_calibration_unset() -> None:
    clock = Clock(NoClock())
    assert clock.calibrate() is None
    assert clock.offset_s is None and clock.uncertainty_s is None


def test_failed_samples_are_skipped_and_all_failing_keeps_previous() -> None:
    good = StubReference(offset_s=5.0, delays=[(0.001, 0.001)])
    clock = Clock(Flaky(good, failures=2))
    assert clock.calibrate(k=3) == pytest.approx(5.0, abs=0.02)
    clock.reference = Flaky(good, failures=10)
    assert clock.calibrate(k=3) is None
    assert clock.offset_s == pytest.approx(5.0, abs=0.02)


def test_maybe_recalibrate_respects_the_interval() -> None:
    ref = StubReference(offset_s=1.0, delays=[(0.0, 0.0)])
    clock = Clock(ref)
    clock.maybe_recalibrate(interval_s=3600, k=2)
    assert ref.calls == 2
    clock.maybe_recalibrate(interval_s=3600, k=2)
    assert ref.calls == 2, "fresh calibration must not be repeated"
    clock.maybe_recalibrate(interval_s=0, k=2)
    assert ref.calls == 4
