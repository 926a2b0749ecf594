"""One contender in the mutual-exclusion race of the lease contract suite.

Run as ``python -m tests.integration.leases_racer URL NAMESPACE LOG SECONDS [ABANDON]``. It
races for one lease until SECONDS have passed and appends one JSON line per holding to LOG:
``{"holder", "token", "start", "end"}`` where ``start`` is the ``CLOCK_BOOTTIME`` instant the
acquisition reply arrived and ``end`` the last instant the holder believed the lease valid (its
``valid_until``, or the moment it sent the release if that came first). ``CLOCK_BOOTTIME`` is
machine-wide, so windows of different processes compare directly. With ABANDON = n > 0 the
n-th holding is abandoned as a crashed process would leave it (not released), so the next
holder has to wait for the server to expire it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from celery_crawl.errors import LeaseLost, StoreError
from celery_crawl.leases import make_holder, open_store

NAME = "race"
TTL_S = 3.0  # about 3 s: etcd rounds up to whole seconds and has a floor of 2 s


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def main(url: str, namespace: str, log_path: str, seconds: float, abandon: int = 0) -> int:
    store = open_store(url, namespace=namespace, timeout_s=2.0)
    holder = make_holder()
    rng = random.Random(os.getpid())
    stop = now() + seconds
    held = 0
    with open(log_path, "a", encoding="utf-8") as log:
        while now() < stop:
            try:
                lease = store.acquire(NAME, TTL_S, holder)
            except StoreError:
                continue
            if lease is None:
                time.sleep(rng.uniform(0.0, 0.02))
                continue
            start = now()
            held += 1
            end = lease.valid_until
            try:
                for _ in range(rng.randint(0, 2)):  # hold briefly, renewing
                    time.sleep(rng.uniform(0.0, 0.05))
                    lease = store.renew(lease)
                    end = lease.valid_until
                if held == abandon:
                    holder = make_holder()  # "restarted": a new holder from now on
                else:
                    end = min(end, now())
                    store.release(lease)
            except (LeaseLost, StoreError):
                pass
            log.write(json.dumps({"holder": holder, "token": lease.token, "start": start,
                                  "end": end}) + "\n")
            log.flush()
    store.close()
    print(held)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]),
                  int(sys.argv[5]) if len(sys.argv) > 5 else 0))
