"""Schedules benchmark: cost of ``TzCron.next_fire`` and of finding the next due entry.

Run: ``.venv/bin/python benchmarks/schedules.py [--entries 100000]``. Prints a table.

* ``next_fire`` per call, 5- and 6-field expressions, with and without jitter, next to
  croniter alone (tz-aware) and stock Celery's ``crontab.remaining_estimate`` for scale.
* The next due entry among N entries: a ``DueHeap`` of cached next fires (peek, and pop + push
  of the entries that came due) against a scan of all cached fires on every tick.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from celery import Celery
from celery.schedules import crontab
from croniter import croniter

from celery_crawl.schedules import DueHeap, TzCron

START = datetime(2026, 3, 1, tzinfo=UTC)
ZONES = ["Asia/Shanghai", "America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "UTC"]
EXPRS = ["15 2 * * *", "*/5 * * * *", "0 */4 * * *", "30 1 * * 1-5", "0 3 L * *",
         "*/30 * * * * *", "0 30 2 * * *", "H 4 * * *", "7,37 * * * *", "0 0 1 */3 *"]


def per_call_us(fn: Callable[[datetime], object], n: int) -> float:
    """Median over 5 rounds of the per-call time of ``fn`` on advancing instants, in µs."""
    rounds = []
    for r in range(5):
        instants = [START + timedelta(seconds=7919 * i + r) for i in range(n)]
        t0 = time.perf_counter()
        for instant in instants:
            fn(instant)
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(rounds)


def bench_next_fire(n: int) -> list[tuple[str, str]]:
    rows = []
    cases = [
        ("TzCron 5-field '15 2 * * *' Asia/Shanghai", TzCron("15 2 * * *", "Asia/Shanghai")),
        ("TzCron 5-field '*/5 * * * *' America/New_York",
         TzCron("*/5 * * * *", "America/New_York")),
        ("TzCron 5-field '15 2 * * *' + jitter 30s",
         TzCron("15 2 * * *", "Asia/Shanghai", name="jd-prices", jitter=30)),
        ("TzCron 5-field '*/5 * * * *' + jitter 600s (> interval)",
         TzCron("*/5 * * * *", "Europe/Berlin", name="e", jitter=600)),
        ("TzCron 6-field '*/10 * * * * *' Europe/Berlin",
         TzCron("*/10 * * * * *", "Europe/Berlin")),
        ("TzCron 6-field '0 30 2 * * *' America/New_York",
         TzCron("0 30 2 * * *", "America/New_York")),
        ("TzCron 6-field '*/10 * * * * *' + jitter 5s",
         TzCron("*/10 * * * * *", "Europe/Berlin", name="s", jitter=5)),
    ]
    for label, cron in cases:
        rows.append((label, f"{per_call_us(cron.next_fire, n):8.1f}"))
    shanghai = ZoneInfo("Asia/Shanghai")
    rows.append(("croniter alone '15 2 * * *' (aware, new iterator per call)",
                 f"{per_call_us(lambda t: croniter('15 2 * * *', t.astimezone(shanghai)).get_next(datetime), n):8.1f}"))  # noqa: E501
    app = Celery("bench", set_as_current=False)
    app.conf.timezone = "Asia/Shanghai"
    stock = crontab(minute="15", hour="2", app=app, nowfun=lambda: START)
    rows.append(("celery crontab '15 2 * * *' remaining_estimate",
                 f"{per_call_us(stock.remaining_estimate, n):8.1f}"))
    return rows


def bench_due(entries: int, ticks: int) -> list[tuple[str, str]]:
    rng = random.Random(7)
    schedules = {}
    t0 = time.perf_counter()
    for i in range(entries):
        expr = rng.choice(EXPRS)
        zone = rng.choice(ZONES)
        schedules[f"entry-{i}"] = TzCron(expr, zone, name=f"entry-{i}",
                                         jitter=rng.choice([0, 0, 30, 300]))
    build_s = time.perf_counter() - t0

    heap = DueHeap()
    cached: dict[str, datetime] = {}
    t0 = time.perf_counter()
    for name, cron in schedules.items():
        when = cron.next_fire(START)
        cached[name] = when
        heap.push(name, when)
    fill_s = time.perf_counter() - t0

    # Ticks one second apart from the earliest fire: pop what is due, reschedule it.
    now = min(cached.values())
    peek_ns, pop_ns, popped, resched_ns = [], [], 0, []
    for _ in range(ticks):
        a = time.perf_counter_ns()
        heap.peek()
        b = time.perf_counter_ns()
        due = heap.pop_due(now)
        c = time.perf_counter_ns()
        for name, when in due:
            nxt = schedules[name].next_fire(when)
            cached[name] = nxt
            heap.push(name, nxt)
        d = time.perf_counter_ns()
        peek_ns.append(b - a)
        pop_ns.append(c - b)
        if due:
            resched_ns.append((d - c) / len(due))
        popped += len(due)
        now += timedelta(seconds=1)

    scan_ns = []
    for _ in range(min(ticks, 50)):
        a = time.perf_counter_ns()
        min(cached.items(), key=lambda kv: kv[1])
        scan_ns.append(time.perf_counter_ns() - a)

    return [
        (f"build {entries} TzCron entries (total)", f"{build_s * 1e3:8.0f} ms"),
        (f"initial next_fire for {entries} entries + heap push (total)",
         f"{fill_s * 1e3:8.0f} ms"),
        (f"DueHeap.peek: next due among {entries} (median per tick)",
         f"{statistics.median(peek_ns) / 1e3:8.2f} µs"),
        (f"DueHeap.pop_due per tick ({popped} due over {ticks} ticks, median)",
         f"{statistics.median(pop_ns) / 1e3:8.2f} µs"),
        ("reschedule one due entry (next_fire + push, mean)",
         f"{statistics.mean(resched_ns) / 1e3 if resched_ns else 0:8.1f} µs"),
        (f"scan all {entries} cached fires for the minimum (median per tick)",
         f"{statistics.median(scan_ns) / 1e3:8.0f} µs"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--ticks", type=int, default=600)
    args = parser.parse_args()
    rows = [("next_fire per call", "µs"), *bench_next_fire(args.calls), ("", ""),
            ("next due entry", ""), *bench_due(args.entries, args.ticks)]
    width = max(len(label) for label, _ in rows)
    print(f"{'case':<{width}}  value")
    print("-" * (width + 14))
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


if __name__ == "__main__":
    main()
