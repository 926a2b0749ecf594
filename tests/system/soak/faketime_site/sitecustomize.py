"""Loaded (via PYTHONPATH) only into the beat replica the soak runs under libfaketime.

libfaketime 0.9.10 with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` makes the absolute
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` that Python 3.11's ``time.sleep`` uses fail
with EINVAL, so every ``time.sleep`` raises ``OSError(22)`` and ``celery beat`` dies at its first
sleep. ``select`` with a relative timeout is not affected; sleeping through it changes nothing
else about the process (the wall clock stays skewed, the monotonic clocks stay real).
"""

from __future__ import annotations

import select
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], seconds)


time.sleep = _sleep
