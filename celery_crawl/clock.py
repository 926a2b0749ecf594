"""Time for celery-crawl: ``CLOCK_BOOTTIME`` for deadlines, wall time calibrated to a reference.

Deadlines and lease validity use :func:`monotonic` (``CLOCK_BOOTTIME``): it never jumps with NTP
or an operator's ``date -s`` and, unlike ``CLOCK_MONOTONIC``, keeps counting while the machine is
suspended — a suspended holder must come back to an *expired* lease, not a fresh one.

Wall time is only needed to decide *which* cron slot is due. :class:`Clock` measures the offset
of the local wall clock from a reference clock (the lease store's, i.e. Redis ``TIME``; for etcd,
which has no clock, the broker's or result backend's Redis through :class:`RedisTimeReference`)
the way NTP does: for a sample sent at local ``t0`` and answered at ``t1`` with server time ``s``,
``offset = s - (t0 + t1) / 2`` with uncertainty ``(t1 - t0) / 2``; of ``k`` samples the one with
the smallest round trip wins, because queueing delay is what makes the midpoint wrong.

Between calibrations the wall clock may be *stepped* (``date -s``, a VM restored from a
snapshot, an NTP step): the offset measured before the step is then wrong by the step's size,
and a slot decided on it fires early or late by as much. :meth:`Clock.step_s` finds a step by
comparing how far the wall clock and ``CLOCK_BOOTTIME`` advanced since the last calibration;
both count suspend, so they advance together unless the wall clock was set.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .config import mask_url
from .errors import StoreError

__all__ = ["Clock", "RedisTimeReference", "ReferenceClock", "monotonic"]

log = logging.getLogger(__name__)


def monotonic() -> float:
    """Seconds on ``CLOCK_BOOTTIME`` (monotonic, counts suspend); for deadlines only."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@runtime_checkable
class ReferenceClock(Protocol):
    """Anything that can tell the time of a reference server (a ``LeaseStore`` is one)."""

    def server_time(self) -> float | None:
        """UNIX seconds on the reference, or None when it has no clock."""
        ...


class RedisTimeReference:
    """``TIME`` of a Redis server as a reference clock (for etcd lease stores).

    Args:
        url: ``redis://``/``rediss://`` URL, e.g. the broker or result backend.
        timeout_s: socket timeout of each ``TIME`` call.
    """

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from .leases.redis import parse_redis_url

        self.url = mask_url(url)
        self._redis = redis.Redis(**parse_redis_url(url), socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 0), protocol=2)

    def server_time(self) -> float | None:
        """Redis ``TIME`` in UNIX seconds; None when the server cannot be reached."""
        import redis

        try:
            sec, usec = self._redis.time()
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: TIME failed: %s", self.url, exc)
            return None
        return int(sec) + int(usec) / 1e6

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()


class Clock:
    """Local clocks plus the measured offset of the wall clock from a reference.

    Without a reference (or before the first successful calibration) ``now()`` is the local
    wall clock and ``offset_s`` is None.

    Args:
        reference: the clock to calibrate against, or None.
        wall: the local wall clock (``time.time``; tests inject one they can step).
        mono: ``CLOCK_BOOTTIME`` (tests may inject a fake, with a fake lease store only).
    """

    def __init__(self, reference: ReferenceClock | None = None, *,
                 wall: Callable[[], float] = time.time,
                 mono: Callable[[], float] | None = None) -> None:
        self.reference = reference
        self._wall = wall
        self._mono = mono or monotonic
        #: ``(mono, wall)`` read together at the last calibration (or the last accepted step).
        self._anchor: tuple[float, float] | None = None
        #: reference minus local wall clock, in seconds; None until calibrated.
        self.offset_s: float | None = None
        #: half the round trip of the sample the offset came from; None until calibrated.
        self.uncertainty_s: float | None = None
        #: ``monotonic()`` of the last successful calibration.
        self.calibrated_at: float | None = None

    def monotonic(self) -> float:
        """``CLOCK_BOOTTIME`` seconds (see the module function)."""
        return self._mono()

    def wall(self) -> float:
        """The local wall clock, uncorrected, in UNIX seconds."""
        return self._wall()

    def now(self) -> dt.datetime:
        """The reference's current time as an aware UTC datetime.

        The local wall clock plus the offset, but never later than the reference time at the
        last calibration plus the ``CLOCK_BOOTTIME`` elapsed since: a wall clock set ahead
        after the calibration cannot make the result run ahead of the reference (a clock set
        back makes it late, which :meth:`step_s` reports).
        """
        mono, wall = self._mono(), self._wall()
        offset = self.offset_s or 0.0
        stamp = wall + offset
        if self._anchor is not None and self.offset_s is not None:
            stamp = min(stamp, self._anchor[1] + offset + (mono - self._anchor[0]))
        return dt.datetime.fromtimestamp(stamp, dt.UTC)

    def step_s(self) -> float:
        """How far the wall clock was set (stepped) since the last calibration, in seconds.

        The wall clock's advance minus ``CLOCK_BOOTTIME``'s: 0 while nobody sets the clock
        (NTP slewing adds at most 0.5 ms/s); positive when it was set ahead. Without an anchor
        yet, the first call takes one and returns 0.
        """
        mono, wall = self._mono(), self._wall()
        if self._anchor is None:
            self._anchor = (mono, wall)
            return 0.0
        return (wall - self._anchor[1]) - (mono - self._anchor[0])

    def accept_step(self) -> None:
        """Take the wall clock as it is now as the new anchor (without a reference to tell
        which of the two readings was right, the newer one is kept, after a refused tick)."""
        self._anchor = (self._mono(), self._wall())

    def calibrate(self, k: int = 5, *, deadline: float | None = None) -> float | None:
        """Take ``k`` samples of the reference and keep the one with the smallest round trip.

        Args:
            k: samples to take.
            deadline: ``CLOCK_BOOTTIME`` instant after which no further sample is started (a
                caller holding a lease bounds the calibration by its validity).

        Returns:
            The new offset in seconds, or None when the reference has no clock or every sample
            failed (the previous calibration, if any, is kept).
        """
        if self.reference is None:
            return None
        best: tuple[float, float, float, float] | None = None  # (rtt, offset, mono, wall)
        for i in range(max(1, k)):
            if i and deadline is not None and self._mono() >= deadline:
                break
            t0_mono, t0_wall = self._mono(), self.wall()
            try:
                server = self.reference.server_time()
            except StoreError as exc:
                log.warning("clock calibration sample failed: %s", exc)
                continue
            rtt = self._mono() - t0_mono
            if server is None:
                return None
            # The wall clock is read once; the round trip is measured on the monotonic clock so
            # a wall-clock step during the sample cannot fake a tiny or negative delay.
            offset = server - (t0_wall + rtt / 2)
            if best is None or rtt < best[0]:
                best = (rtt, offset, t0_mono, t0_wall)
        if best is None:
            return None
        self.offset_s = best[1]
        self.uncertainty_s = best[0] / 2
        self.calibrated_at = self._mono()
        self._anchor = (best[2], best[3])
        return self.offset_s

    def maybe_recalibrate(self, interval_s: float, k: int = 5, *,
                          deadline: float | None = None) -> float | None:
        """Calibrate again if the last calibration is older than ``interval_s`` (or missing);
        ``deadline`` as for :meth:`calibrate`.

        Returns:
            The current offset (fresh or kept), or None when never calibrated.
        """
        if self.calibrated_at is None or self._mono() - self.calibrated_at >= interval_s:
            fresh = self.calibrate(k, deadline=deadline)
            if fresh is not None:
                return fresh
        return self.offset_s

    def __repr__(self) -> str:
        return f"Clock(offset_s={self.offset_s!r}, uncertainty_s={self.uncertainty_s!r})"
