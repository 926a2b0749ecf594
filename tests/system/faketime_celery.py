"""``celery`` for a process whose wall clock is set at run time by libfaketime.

The wall clock is faked with a changing offset (``FAKETIME_TIMESTAMP_FILE`` with
``FAKETIME_NO_CACHE=1``) and the monotonic clocks are left alone
(``FAKETIME_DONT_FAKE_MONOTONIC=1``), as a real ``date -s`` would. With those settings
libfaketime 0.9.10 hands ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` a negative time
(wolfcw/libfaketime#426), and Python 3.11's ``time.sleep`` uses exactly that call, so every
sleep raises EINVAL. Sleeping in ``select`` (a relative timeout, passed through untouched) is
the same sleep without the bug; nothing else of celery is changed.

``python -m tests.system.faketime_celery -A app beat ...``
"""

from __future__ import annotations

import select
import sys
import time


def _sleep(seconds: float) -> None:
    if seconds > 0:
        select.select([], [], [], seconds)


time.sleep = _sleep

if __name__ == "__main__":
    from celery.__main__ import main

    sys.argv[0] = "celery"
    main()
