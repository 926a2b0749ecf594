"""Failover under load: a fleet configured only with Sentinel addresses goes through the three
ways a Sentinel-managed master changes.

One master, two replicas, three sentinels (``redis-server --sentinel``, loopback, ports of
their own; ``down-after-milliseconds`` 1000); two ``LeasedScheduler`` beats and two prefork
workers of the soak's app (every-second and every-few-seconds entries), whose broker is kombu's
``sentinel://``, result backend ``crawlredis+sentinel://`` and lease store ``redis+sentinel://``.
The soak's injector runs the Sentinel fault kinds once each, in a seeded order:

(a) ``kill -9`` of the master (restarted afterwards: Sentinel makes it a replica);
(b) ``SENTINEL FAILOVER`` (planned);
(c) SIGSTOP of the master past ``down-after-milliseconds``, SIGCONT after the failover (the old
    master comes back as a master and is demoted by Sentinel seconds later).

After each, the fleet goes on within one lease TTL of the sentinels naming the new master
(plus the master recheck, the reaper's orphan grace and a beat tick: ``SLACK_S``), the same
bound for each kind; leader tokens never go back (the soak's
monitor); and the soak's ledger holds: every slot due in the window ran once or is recorded
skipped with a reason, no slot ran twice at once, nothing is unaccounted — except what a
failover's asynchronous replication lost (a run whose finish only the old master acknowledged,
run again; a run in flight whose redelivery only the old master got), which the ledger counts
apart ("lost to a failover", docs/durability.md). The summary printed gives the measured
interruption per fault kind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.system.soak.faults import SENTINEL_FAULT_KINDS
from tests.system.soak.run import run_soak

pytestmark = [pytest.mark.system, pytest.mark.slow]

#: Counted window: three failovers (each waits for a replica linked again before the next),
#: then the soak's quiet tail of 2 * TTL + 2 s.
WINDOW_S = 50.0
TTL_S = 3.0
#: On top of the TTL (a lease whose renewals the failover lost is gone one TTL after its last
#: surviving one): the store's recheck of the master (0.5 s), the reaper's orphan grace before
#: it hands a dead lease's runs back (store timeout + 0.5 s, stretched by drift), its interval
#: (TTL / 3) and a beat tick. Measured at most 6.2 s after the new master in five runs.
SLACK_S = 5.0
#: The same bound for the three kinds: the worker and the beat make their broker connection
#: anew as soon as their lease store sees the master move (``_broker.sentinel_master``), so
#: kombu does not stay on the old master until Sentinel demotes it; and the store drops each of
#: its connections still open to the old master at its next call after the move, however it
#: learnt of it, so none (a batch lane idle through a pause, for one) writes to the old master
#: when it comes back from a pause and answers as a master until Sentinel demotes it.
BOUND_S = TTL_S + SLACK_S


@pytest.mark.timeout(300)
def test_fleet_goes_on_through_each_kind_of_sentinel_failover(
        capsys: pytest.CaptureFixture[str]) -> None:
    env = os.environ.get("CRAWL_SOAK_SEED")
    seed = int(env) if env else int(time.time() * 1000) % 1_000_000
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        with capsys.disabled():
            print(line, flush=True)

    workdir = Path(tempfile.mkdtemp(prefix=f"crawl-sentinel-{seed}-"))
    summary, violations = run_soak("sentinel", WINDOW_S, seed, workdir, log=log,
                                   kinds=SENTINEL_FAULT_KINDS, fault_rounds=1, beats=2,
                                   workers=2)
    # The fleet went on after each failover within one TTL (+ slack) of the new master.
    by_kind: dict[str, float] = {}
    for kind, seconds in summary.recoveries:
        by_kind[kind] = max(by_kind.get(kind, 0.0), seconds)
    log("fleet going on per fault kind (new master named -> next run started): "
        + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(by_kind.items())))
    # The worker's one decision: behind Sentinel, claims and ends do not ride in the broker's
    # round trips (said once per worker start).
    told = [p for p in (workdir / "logs").glob("w*.log")
            if "claims and ends do not ride" in p.read_text(errors="replace")]
    failed = [
        what for what, bad in (
            ("not every kind injected", set(summary.faults) != set(SENTINEL_FAULT_KINDS)),
            ("a kind without a measured recovery", set(by_kind) != set(SENTINEL_FAULT_KINDS)),
            ("a worker did not say claims do not ride", len(told) < 2),
            ("the fleet did not go on within a TTL (+ slack) of the new master",
             any(s > BOUND_S for s in by_kind.values())),
            ("leader tokens went back or a skewed replica led", bool(violations)),
            ("no slot due or a beat exited", summary.due == 0 or summary.beat_exits != 0),
            ("two runs of a slot at once", bool(summary.concurrent_duplicates)),
            ("audit diverged", summary.audit_ok is False),
            ("a slot ran twice (not explained by a failover)", bool(summary.duplicates)),
            ("a slot neither ran nor was skipped", bool(summary.unaccounted)),
        ) if bad]
    if failed:
        log(f"FAILED: {'; '.join(failed)}; logs and post-mortem kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    assert not failed, "\n".join([*failed, *lines])


def test_ledger_counts_a_run_repeated_after_a_failover_apart() -> None:
    """A slot whose first run ended inside a failover's loss window and ran again later is
    "lost to a failover", not a duplicate; the same outside any window is a duplicate."""
    from datetime import UTC, datetime

    from tests.system.soak.ledger import LOSS_TAIL_S, Fault, account

    base = 1_800_000_000.0

    def iso(i: int) -> str:
        return datetime.fromtimestamp(base + i, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def rec(i: int, worker: str, token: int, t: float) -> dict[str, object]:
        return {"entry": "e", "slot": iso(i), "worker": worker, "pid": 1, "claim_token": token,
                "leader_token": 7, "task_id": f"t{i}", "t": base + t}

    far = int(3 + LOSS_TAIL_S + 10)
    starts = [rec(1, "w0", 10, 1.1), rec(1, "w1", 11, 6.0), rec(far, "w0", 12, far + .1),
              rec(far, "w1", 13, far + 2)]
    done = [rec(1, "w0", 10, 1.3), rec(1, "w1", 11, 6.5), rec(far, "w0", 12, far + .3),
            rec(far, "w1", 13, far + 2.5)]
    # Slot 2 came due during the failover and never started (its message was lost with the
    # old master); slot far + 1 came due long after it and never started either.
    summary = account(
        store="sentinel", seed=1, window=(base + 1, base + far + 1),
        due_slots={"e": [base + 1, base + 2, base + far, base + far + 1]}, starts=starts,
        done=done, fenced=[], skips=[],
        faults=[Fault("sentinel_failover", "master:1", base + 1.0, base + 3.0)],
        beat_exits=0, audit=(True, "clean"))
    assert [x.split(" ")[0] for x in summary.failover_losses] == [
        f"e@{iso(1)[11:19]}", f"e@{iso(2)[11:19]}"]
    assert [x.split(" ")[0] for x in summary.duplicates] == [f"e@{iso(far)[11:19]}"]
    assert [x.split(" ")[0] for x in summary.unaccounted] == [f"e@{iso(far + 1)[11:19]}"]
    # From the fault (t=1.0) to the first run after the new master (t=6.0): one run at 1.1.
    assert summary.interruptions == [("sentinel_failover", pytest.approx(4.9))]
