"""The soak driver: bring the stack up, inject seeded faults, drain, account, print.

Also a script for long runs::

    .venv/bin/python -m tests.system.soak.run --store redis --seconds 1200 [--seed N]

Timeline of one run (epoch seconds)::

    ready ── window_start ──── faults ──── faults_end ── window_end ── +grace ── drain ── stop
             └──────────── slots counted ───────────────┘

Faults stop ``2 * ttl + 2`` seconds before ``window_end`` so the last one is healed and the
stack has recovered inside the window; slots after ``window_end`` run but are not counted;
the drain waits (bounded) until every counted slot is run or recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from celery_crawl import keys
from celery_crawl.leases import open_store
from celery_crawl.schedules.tzcron import TzCron
from tests.servers import wait_until

from .faults import FaultInjector, LeaderMonitor
from .ledger import SkipSpan, Summary, account, parse_slot
from .recorder import SINK_DONE, SINK_FENCED, SINK_STARTS, SINK_UNDONE
from .stack import ENTRIES, Stack, now

__all__ = ["missing_pieces", "run_soak"]

GRACE_S = 3.0
DRAIN_S = 20.0


def missing_pieces() -> list[str]:
    """The parts of the stack the soak needs that cannot be imported yet."""
    wanted = [
        ("celery_crawl.beat", "LeasedScheduler", "beat LeasedScheduler (issue C)"),
        ("celery_crawl.worker", "LeaseStep", "worker LeaseStep (issue D)"),
        ("celery_crawl.backends", "AuditedRedisBackend", "AuditedRedisBackend (issue E)"),
        ("celery_crawl.tasks", "IdempotentTask", "IdempotentTask (issue E)"),
    ]
    missing = []
    for module, name, label in wanted:
        try:
            mod = __import__(module, fromlist=[name])
            getattr(mod, name)
        except (ImportError, AttributeError):
            missing.append(label)
    return missing


class SkipCollector:
    """Keeps the union of every skip range the beat recorded (the beat keeps only the newest
    ranges per entry; a long soak outlives them)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.spans: set[SkipSpan] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="skip-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.collect()

    def collect(self) -> bool:
        try:
            records = self.store.get_many([keys.beat_skips(name) for name in ENTRIES])
        except Exception:
            return False
        for name, record in zip(ENTRIES, records, strict=True):
            for r in (record or {}).get("ranges", []):
                first, last = parse_slot(r.get("first")), parse_slot(r.get("last"))
                if first is None or last is None:
                    continue
                self.spans.add(SkipSpan(name, first, last, int(r.get("count", 0)),
                                        str(r.get("reason"))))
        return True


def due_slots(window: tuple[float, float]) -> dict[str, list[float]]:
    """Every slot of every soak entry in ``window`` (inclusive), by the entry's own TzCron."""
    start = datetime.fromtimestamp(window[0] - 1e-3, UTC)
    end = datetime.fromtimestamp(window[1], UTC)
    out: dict[str, list[float]] = {}
    for name, spec in ENTRIES.items():
        cron = TzCron(spec["cron"], spec["tz"], name=name)
        out[name] = [round(s.timestamp(), 3) for s in cron.slots(start, end)]
    return out


def _read(stack: Stack, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in stack.sink.client().lrange(key, 0, -1)]


def _audit(stack: Stack) -> tuple[bool, str] | None:
    try:
        out = stack.celery("crawl", "audit", "verify", timeout_s=120)
    except Exception as exc:
        return False, f"audit verify did not run: {exc!r}"
    text = (out.stdout + out.stderr).strip()
    if "No such command" in text:
        return None
    return out.returncode == 0, text


def _unacked_task_ids(stack: Stack) -> list[str]:
    """Task ids left in kombu's ``unacked`` hash of the broker (stuck until the visibility
    timeout unless the reaper restores them)."""
    ids = []
    for raw in stack.broker_client().hvals("unacked"):
        try:
            ids.append(json.loads(raw)[0]["headers"]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            ids.append("<unparsable>")
    return ids


def _recoveries_logged(logs: Path) -> str:
    """How often the two last-resort recoveries acted, from the processes' own logs."""
    resent = taken = 0
    for path in logs.glob("*.log"):
        text = path.read_text(errors="replace")
        resent += text.count("published again")
        taken += text.count("took idempotency key")
    return (f"runs published again by the delivery check: {resent}; keys taken over from a "
            f"run that died unfinished (rolled back first): {taken}")


def _postmortem(stack: Stack, skips: SkipCollector, faults: list[Any],
                monitor: LeaderMonitor) -> None:
    """Everything the accounting used, as JSON beside the logs, to read a failed run."""
    data = {
        "starts": _read(stack, SINK_STARTS), "done": _read(stack, SINK_DONE),
        "fenced": _read(stack, SINK_FENCED), "undone": _read(stack, SINK_UNDONE),
        "skips": [vars(s) for s in skips.spans],
        "faults": [vars(f) for f in faults],
        "leader_samples": [vars(x) for x in monitor.samples],
        "unacked": _unacked_task_ids(stack),
    }
    (stack.workdir / "postmortem.json").write_text(json.dumps(data, indent=1, default=str))


def run_soak(store: str, seconds: float, seed: int, workdir: Path,
             log: Callable[[str], None] = print,
             kinds: Sequence[str] | None = None, fault_rounds: int | None = None,
             **stack_kw: Any) -> tuple[Summary, list[str]]:
    """One soak run on lease store ``store``; returns its summary and monitor violations.

    ``kinds``: inject only these fault kinds (default: every kind the store has);
    ``fault_rounds``: at most this many rounds of them (default: until the window's end);
    ``stack_kw``: ``Stack`` arguments (``beats``, ``workers``, ...).
    """
    stack = Stack(store, workdir, **stack_kw)
    log(f"soak: store={store} seconds={seconds:.0f} seed={seed} "
        f"(replay: CRAWL_SOAK_SEED={seed} CRAWL_SOAK_SECONDS={seconds:.0f})")
    phases: list[tuple[str, float]] = []
    t_phase = time.monotonic()

    def phase(name: str) -> None:
        nonlocal t_phase
        phases.append((name, time.monotonic() - t_phase))
        t_phase = time.monotonic()

    stack.start()
    log(stack.describe())
    mon_store = open_store(stack.lease_url, namespace=stack.namespace, timeout_s=1.0)
    monitor = LeaderMonitor(mon_store, stack)
    skips = SkipCollector(mon_store)
    injector = FaultInjector(stack, monitor, seed, log=log, kinds=kinds, rounds=fault_rounds)
    violations: list[str] = []
    try:
        monitor.start()
        skips.start()

        def first_run() -> bool:
            stack.check_exits()
            return any(r["entry"] == "sec-latest" for r in _read(stack, SINK_DONE))

        wait_until(first_run, 120, interval_s=0.25, what="the first scheduled run")
        phase("start-up")
        window_start = math.ceil(now()) + 1.0
        window_end = window_start + seconds
        faults_end = window_end - (2 * stack.ttl_s + 2)
        while now() < window_start:
            time.sleep(0.05)
        faults = injector.run(faults_end)
        while now() < window_end + GRACE_S:
            stack.check_exits()
            time.sleep(0.1)

        phase("window+grace")
        window = (window_start, window_end)
        slots = due_slots(window)

        def snapshot(audit: tuple[bool, str] | None) -> Summary:
            skips.collect()
            try:
                stuck = _unacked_task_ids(stack)
            except Exception:  # the broker may be the fault right now
                stuck = []
            return account(store=store, seed=seed, window=window, due_slots=slots,
                           starts=_read(stack, SINK_STARTS), done=_read(stack, SINK_DONE),
                           fenced=_read(stack, SINK_FENCED), undone=_read(stack, SINK_UNDONE),
                           skips=skips.spans, faults=faults,
                           beat_exits=stack.beat_exits(), audit=audit,
                           worker_exits=len(stack.unexpected_exits) - stack.beat_exits(),
                           stuck_task_ids=stuck, namespace=stack.namespace)

        drain_end = time.monotonic() + DRAIN_S
        summary = snapshot(None)
        while summary.unaccounted and time.monotonic() < drain_end:
            time.sleep(0.5)
            summary = snapshot(None)
        phase("drain")
        summary = snapshot(_audit(stack))
        phase("audit verify")
        violations = list(monitor.violations)
        stuck = _unacked_task_ids(stack)
        if stuck:
            summary.notes.append(f"{len(stuck)} message(s) left in the broker's unacked hash: "
                                 f"{', '.join(stuck[:5])}")
        try:
            _postmortem(stack, skips, faults, monitor)
        except Exception as exc:  # evidence only; never the reason a run fails
            summary.notes.append(f"post-mortem dump failed: {exc!r}")
    finally:
        monitor.stop()
        skips.stop()
        codes = stack.stop()
        mon_store.close()
        stack.cleanup()
        phase("shutdown")
    if summary.audit_ok is None:
        summary.notes.append("`celery crawl audit verify` is not available")
    summary.notes.append(_recoveries_logged(stack.workdir / "logs"))
    summary.notes.append(f"shutdown exit codes: {codes}")
    hangs = stack.term_hangs()
    if hangs:
        summary.notes.append(f"beat replicas that ignored SIGTERM for the grace period and were "
                             f"killed: {', '.join(hangs)}")
    summary.notes.append("phases: " + ", ".join(f"{n} {s:.1f}s" for n, s in phases))
    if stack.unexpected_exits:
        summary.notes.extend(f"unexpected exit: {e}" for e in stack.unexpected_exits)
    if not summary.ok and summary.audit_output:
        summary.notes.append(f"audit verify output: {summary.audit_output[-2000:]}")
    log(summary.render())
    for v in violations:
        log(f"  VIOLATION {v}")
    return summary, violations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["redis", "etcd", "sentinel", "both"],
                        default="both")
    parser.add_argument("--seconds", type=float,
                        default=float(os.environ.get("CRAWL_SOAK_SECONDS", "1200")))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep logs in the work dir")
    parser.add_argument("--kinds", default="",
                        help="comma-separated fault kinds to inject (default: all)")
    args = parser.parse_args(argv)
    missing = missing_pieces()
    if missing:
        print(f"soak cannot run, missing: {', '.join(missing)}")
        return 2
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    ok = True
    for store in (["redis", "etcd"] if args.store == "both" else [args.store]):
        workdir = Path(tempfile.mkdtemp(prefix=f"crawl-soak-{store}-"))
        kinds = [k for k in args.kinds.split(",") if k] or None
        summary, violations = run_soak(store, args.seconds, seed, workdir, kinds=kinds)
        ok = ok and summary.ok and not violations
        if args.keep or not summary.ok:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
