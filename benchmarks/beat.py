"""HA beat benchmark: LeasedScheduler vs celery-redbeat vs stock beat, side by side in one run.

    .venv/bin/python benchmarks/beat.py [--quick]

Every contender is a real ``celery beat`` process on private redis-servers started here:

* **failover** after ``kill -9`` and after SIGTERM of the leader, two replicas each: ours
  (``crawl_beat_lease_ttl`` 3 s and the default 10 s), RedBeat with its defaults (lock timeout
  5 x ``beat_max_loop_interval`` = 1500 s) and RedBeat tuned (lock timeout 3 s, loop 1 s). The
  clock runs from the signal until another replica holds the lease/lock. A wait longer than
  ``--cap`` seconds is reported as "> cap" together with the lock's remaining TTL.
* **burst**: N entries (2000, 10 000) due in the same second (a Celery interval, created at
  start-up, so every scheduler sees them due together); time from the first to the N-th message
  in the broker's queue (no worker consumes; best of ``--repeat`` interleaved runs for ours
  and raw, because the machine is shared), and the rate, against raw ``app.send_task`` in a
  loop on one producer in its own process, timed the same way (the ceiling): once from a bare
  app (send_task's cheapest path) and once from the beat's own app (task registered). Stock beat is
  stopped after ``--cap`` s and its rate is extrapolated.
* **idle**: CPU (utime+stime over 30 s, from ``/proc``) and RSS of our leader holding 100 000
  entries whose next run is far away.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_crawl import keys
from celery_crawl.leases import open_store
from tests.procs import Proc, celery_args
from tests.servers import RedisServer, wait_until

LOGS = Path(tempfile.mkdtemp(prefix="crawl-beat-bench-"))
OURS = "celery_crawl.beat:LeasedScheduler"
REDBEAT = "redbeat.RedBeatScheduler"
STOCK = "celery.beat:PersistentScheduler"
_n = 0


def beat(scheduler: str, env: dict[str, str], tag: str) -> Proc:
    global _n
    _n += 1
    return Proc(celery_args("tests.system.beatapp", "beat", "-S", scheduler, "-l", "INFO",
                            "-s", str(LOGS / f"schedule-{_n}")),
                env=env,
                log_path=LOGS / f"{tag}-{_n}.log")


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        p.signal_group(signal.SIGTERM)
    for p in procs:
        p.stop(grace_s=5)


# -- failover -------------------------------------------------------------------------------
def failover_ours(sig: int, ttl_s: float, cap_s: float) -> str:
    with_server = RedisServer().start()
    ns = f"bf-{uuid.uuid4().hex[:6]}"
    env = {"CRAWL_B_BROKER": with_server.url_db(1), "CRAWL_B_LEASE": with_server.url,
           "CRAWL_B_NS": ns, "CRAWL_B_TTL": str(ttl_s)}
    store = open_store(with_server.url, namespace=ns)
    procs = [beat(OURS, env, "ours") for _ in range(2)]
    try:
        holder = wait_until(lambda: store.holder(keys.BEAT_LEADER), 60, what="a leader")
        time.sleep(ttl_s)  # let the standby settle into its polling
        pid = int(holder[0].split(":")[1])
        leader = next(p for p in procs if p.pid == pid)
        leader.signal_group(sig)
        t0 = time.monotonic()
        try:
            wait_until(lambda: (h := store.holder(keys.BEAT_LEADER)) and h[1] > holder[1],
                       cap_s, interval_s=0.01, what="takeover")
        except AssertionError:
            return f"> {cap_s:.0f}"
        return f"{time.monotonic() - t0:.2f}"
    finally:
        store.close()
        stop_all(procs)
        with_server.cleanup()


def failover_redbeat(sig: int, lock_s: int | None, loop_s: float | None, cap_s: float) -> str:
    server = RedisServer().start()
    env = {"CRAWL_B_BROKER": server.url_db(1), "CRAWL_B_LEASE": server.url,
           "CRAWL_B_REDBEAT_URL": server.url, "CRAWL_B_INTERVAL": "1"}
    if lock_s:
        env["CRAWL_B_REDBEAT_LOCK"] = str(lock_s)
    if loop_s:
        env["CRAWL_B_MAX_LOOP"] = str(loop_s)
    client = server.client()
    lock_key = "redbeat::lock"
    procs = [beat(REDBEAT, env, "redbeat")]
    try:
        wait_until(lambda: client.get(lock_key), 60, what="redbeat lock")
        procs.append(beat(REDBEAT, env, "redbeat"))
        time.sleep(3)  # the second replica is now blocked on the lock
        owner = client.get(lock_key)
        leader = next(p for p in procs if "Acquired lock" in p.log())
        leader.signal_group(sig)
        t0 = time.monotonic()
        try:
            wait_until(lambda: (v := client.get(lock_key)) and v != owner, cap_s,
                       interval_s=0.01, what="takeover")
        except AssertionError:
            pttl = client.pttl(lock_key)
            if pttl < 0:  # released, but the standby sleeps beat_max_loop_interval between tries
                return f"> {cap_s:.0f} (lock free; standby re-polls every {loop_s or 300:.0f} s)"
            return f"> {cap_s:.0f} (lock TTL left {pttl / 1000:.0f} s)"
        return f"{time.monotonic() - t0:.2f}"
    finally:
        stop_all(procs)
        server.cleanup()


# -- burst ----------------------------------------------------------------------------------
def burst(scheduler: str, n: int, cap_s: float,
          interval_s: float = 20.0) -> tuple[float, bool, float]:
    """Wall seconds from the first to the n-th message (extrapolated when capped), whether it
    was capped, and the CPU seconds the scheduler process spent meanwhile."""
    server = RedisServer().start()
    ns = f"bb-{uuid.uuid4().hex[:6]}"
    env = {"CRAWL_B_BROKER": server.url_db(1), "CRAWL_B_LEASE": server.url, "CRAWL_B_NS": ns,
           "CRAWL_B_ENTRIES": str(n), "CRAWL_B_INTERVAL": str(interval_s),
           "CRAWL_B_TTL": "10"}
    if scheduler == REDBEAT:
        env["CRAWL_B_REDBEAT_URL"] = server.url
    client = server.client(1)
    proc = beat(scheduler, env, "burst")
    try:
        wait_until(lambda: client.llen("celery") > 0, 180, interval_s=0.002,
                   what="first message")
        t0, c0 = time.monotonic(), _cpu_s(proc.pid)
        deadline = t0 + cap_s
        while time.monotonic() < deadline:
            if client.llen("celery") >= n:
                return time.monotonic() - t0, False, _cpu_s(proc.pid) - c0
            time.sleep(0.002)
        done = client.llen("celery")
        return cap_s * n / max(done, 1), True, (_cpu_s(proc.pid) - c0) * n / max(done, 1)
    finally:
        stop_all([proc])
        server.cleanup()


_RAW = """
import os, sys, uuid
from celery import Celery
if sys.argv[3] == "app":  # the beat's own app, where the task is registered
    os.environ["CRAWL_B_BROKER"] = sys.argv[1]
    from tests.system.beatapp import app
else:  # a bare app: send_task's cheapest path
    app = Celery("raw", broker=sys.argv[1], set_as_current=False)
    app.conf.update(task_serializer="json", task_ignore_result=True)
with app.producer_or_acquire() as producer:
    for _ in range(int(sys.argv[2])):
        app.send_task("beatapp.record", task_id=str(uuid.uuid4()), producer=producer)
"""


def burst_raw(n: int, kind: str = "bare") -> tuple[float, float]:
    """Raw ``send_task`` in a loop, in its own process, timed like the schedulers: wall and
    CPU seconds from the first to the n-th message."""
    server = RedisServer().start()
    client = server.client(1)
    proc = Proc([sys.executable, "-c", _RAW, server.url_db(1), str(n), kind],
                log_path=LOGS / "raw.log")
    try:
        wait_until(lambda: client.llen("celery") > 0, 60, interval_s=0.002,
                   what="first message")
        t0, c0 = time.monotonic(), _cpu_s(proc.pid)
        c1 = c0
        while client.llen("celery") < n:
            c1 = _cpu_s(proc.pid)  # the process exits right after its last message
            if time.monotonic() - t0 > 120:
                raise AssertionError("raw send_task did not finish")
            time.sleep(0.002)
        return time.monotonic() - t0, c1 - c0
    finally:
        stop_all([proc])
        server.cleanup()


# -- idle -----------------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def idle(n: int, window_s: float) -> tuple[float, float, float]:
    server = RedisServer().start()
    ns = f"bi-{uuid.uuid4().hex[:6]}"
    env = {"CRAWL_B_BROKER": server.url_db(1), "CRAWL_B_LEASE": server.url, "CRAWL_B_NS": ns,
           "CRAWL_B_ENTRIES": str(n), "CRAWL_B_CRON": "0 0 1 1 *", "CRAWL_B_TTL": "10"}
    proc = beat(OURS, env, "idle")
    try:
        t0 = time.monotonic()
        wait_until(lambda: f"leading {n} entries" in proc.log(), 600, interval_s=0.5,
                   what="leader with all entries")
        startup = time.monotonic() - t0
        time.sleep(2)
        c0, w0 = _cpu_s(proc.pid), time.monotonic()
        time.sleep(window_s)
        cpu = (_cpu_s(proc.pid) - c0) / (time.monotonic() - w0)
        return cpu * 100, _rss_mb(proc.pid), startup
    finally:
        stop_all([proc])
        server.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2000-entry burst only, short idle")
    ap.add_argument("--cap", type=float, default=30.0, help="longest wait per measurement")
    ap.add_argument("--repeat", type=int, default=5, help="runs of ours and raw per burst size")
    args = ap.parse_args()
    rows: list[tuple[str, str, str, str]] = []

    def row(what: str, ours: str, other: str, ratio: str) -> None:
        rows.append((what, ours, other, ratio))
        print(f"  {what}: ours {ours} | {other} | {ratio}", flush=True)

    print(f"logs in {LOGS}", flush=True)
    for sig, label in ((signal.SIGKILL, "kill -9"), (signal.SIGTERM, "SIGTERM")):
        ours3 = failover_ours(sig, 3.0, args.cap)
        ours10 = failover_ours(sig, 10.0, args.cap)
        rb_def = failover_redbeat(sig, None, None, args.cap)
        rb_tuned = failover_redbeat(sig, 3, 1.0, args.cap)
        row(f"failover after {label} (s)", f"{ours3} (ttl 3) / {ours10} (ttl 10)",
            f"RedBeat default {rb_def}; RedBeat lock 3 s {rb_tuned}",
            f"target <= {'ttl+1' if sig == signal.SIGKILL else '1'} s")

    sizes = (2000,) if args.quick else (2000, 10_000)
    for n in sizes:
        # The machine is shared: ours and raw are interleaved, the best of several is kept, and
        # the CPU time of the publishing process is reported too (less sensitive to contention).
        raws, raw_apps, ourss = [], [], []
        for _ in range(args.repeat):
            raws.append(burst_raw(n))
            raw_apps.append(burst_raw(n, "app"))
            wall, _capped, cpu = burst(OURS, n, args.cap * 4)
            ourss.append((wall, cpu))
        raw_wall, raw_cpu = min(r[0] for r in raws), min(r[1] for r in raws)
        app_wall, app_cpu = min(r[0] for r in raw_apps), min(r[1] for r in raw_apps)
        our_wall, our_cpu = min(o[0] for o in ourss), min(o[1] for o in ourss)
        others = {name: burst(sched, n, args.cap)
                  for name, sched in (("RedBeat", REDBEAT), ("stock", STOCK))}
        print(f"  burst {n}: raw wall/cpu {[(round(a, 2), round(b, 2)) for a, b in raws]}, "
              f"ours {[(round(a, 2), round(b, 2)) for a, b in ourss]}", flush=True)

        def fmt(name: str, others: dict[str, tuple[float, bool, float]] = others,
                n: int = n) -> str:
            secs, capped, _ = others[name]
            extra = " (extrapolated)" if capped else ""
            return f"{name} {secs:.2f} s{extra} ({n / secs:.0f}/s)"

        row(f"burst {n} due together",
            f"{our_wall:.2f} s ({n / our_wall:.0f}/s); CPU {our_cpu:.2f} s",
            f"raw send_task, bare app {raw_wall:.2f} s ({n / raw_wall:.0f}/s), CPU "
            f"{raw_cpu:.2f} s; same app {app_wall:.2f} s ({n / app_wall:.0f}/s), CPU "
            f"{app_cpu:.2f} s; "
            f"{fmt('RedBeat')}; {fmt('stock')}",
            f"ours/raw(bare) rate: wall {raw_wall / our_wall:.2f}, CPU {raw_cpu / our_cpu:.2f}; "
            f"ours/raw(same app): wall {app_wall / our_wall:.2f}, CPU {app_cpu / our_cpu:.2f}; "
            f"vs RedBeat {others['RedBeat'][0] / our_wall:.1f}x; "
            f"vs stock {others['stock'][0] / our_wall:.1f}x")

    n_idle = 20_000 if args.quick else 100_000
    cpu, rss, startup = idle(n_idle, 10.0 if args.quick else 30.0)
    row(f"idle leader, {n_idle} entries", f"{cpu:.2f}% of a core, RSS {rss:.0f} MiB",
        f"start-up to leading: {startup:.1f} s", "target <= 2% core")

    print("\n| measurement | ours | others | ratio / target |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
