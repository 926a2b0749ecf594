"""Chaos soak: every fault leaves each scheduled slot run exactly once or skipped with a reason.

Three ``LeasedScheduler`` beat replicas and two prefork workers with the lease step run the
soak's schedule (every-second and every-few-seconds ``TzCron`` entries, mixed overlap and
catch-up policies) on a private Redis with AOF on — once with leases in that Redis, once with
leases in a 3-member etcd cluster. A seeded injector (seed printed; replay with
``CRAWL_SOAK_SEED``) kills, freezes and terminates beats and workers, skews one replica's clock
with libfaketime, restarts Redis and makes the store unreachable past the TTL.

CI runs a short window per store; ``CRAWL_SOAK_SECONDS=1200`` runs a long one (or
``python -m tests.system.soak.run``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.system.soak.run import missing_pieces, run_soak

pytestmark = [pytest.mark.system, pytest.mark.soak, pytest.mark.slow]

#: Counted window per store in CI (the whole run adds start-up, grace, drain and shutdown).
SHORT_S = 20.0


def _seconds() -> float:
    return float(os.environ.get("CRAWL_SOAK_SECONDS", SHORT_S))


def _seed(store: str) -> int:
    env = os.environ.get("CRAWL_SOAK_SEED")
    return int(env) if env else (int(time.time() * 1000) % 1_000_000)


# Start-up, grace, drain, audit and shutdown come on top of the window (about 40 s in CI);
# without this a long run would be cut by the suite's 300 s default.
@pytest.mark.timeout(int(_seconds() * 1.5) + 300)
@pytest.mark.parametrize("store", ["redis", "etcd"])
def test_soak_every_slot_runs_once_or_is_skipped(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = missing_pieces()
    if missing:
        pytest.skip(f"the soak needs the whole stack; not available yet: {', '.join(missing)}")
    if store == "etcd":
        from tests.servers import etcd_binary

        if etcd_binary() is None:
            if os.environ.get("CRAWL_REQUIRE_ETCD") == "1":
                pytest.fail("etcd binary not found and CRAWL_REQUIRE_ETCD=1")
            pytest.skip("etcd binary not found")
    seed = _seed(store)
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        with capsys.disabled():
            print(line, flush=True)

    # Not pytest's tmp_path: its retention would delete a failed run's logs and post-mortem
    # while other test sessions on the machine run.
    workdir = Path(tempfile.mkdtemp(prefix=f"crawl-soak-{store}-{seed}-"))
    summary, violations = run_soak(store, _seconds(), seed, workdir, log=log)
    if summary.ok and not violations:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        log(f"logs and post-mortem kept in {workdir}")
    report = "\n".join(lines)
    # Enforced:
    assert summary.due > 0, report
    assert not summary.concurrent_duplicates, report  # never two live runs of one slot
    assert summary.beat_exits == 0, report
    assert summary.audit_ok is not False, report
    assert not violations, report  # no skewed leader, leader tokens never went back
    # The full claim: every slot due in the window ran exactly once or is recorded skipped
    # (the summary names any slot that did not, the work dir keeps the logs and a post-mortem).
    assert not summary.duplicates, report
    assert not summary.unaccounted, report
    assert summary.ok, report


def test_ledger_classifies_every_slot() -> None:
    """The accounting itself, on made-up records: one slot of each kind."""
    from datetime import UTC, datetime

    from tests.system.soak.ledger import Fault, SkipSpan, account

    base = 1_800_000_000.0

    def iso(i: int) -> str:
        return datetime.fromtimestamp(base + i, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def rec(i: int, worker: str, token: int, t: float, task: str | None = None) -> dict:
        return {"entry": "e", "slot": iso(i), "worker": worker, "pid": 1, "claim_token": token,
                "leader_token": 7, "task_id": task or f"t{i}", "t": base + t}

    starts = [rec(1, "w0", 10, 1.1), rec(2, "w0", 11, 2.1), rec(2, "w1", 12, 6.0),
              rec(5, "w0", 13, 5.1)]
    # slot 1 was first written by a run (token 9) that died before its result; the run that
    # took the key over (token 10) undid that write, then wrote its own.
    done = [rec(1, "w1", 9, 1.2), rec(1, "w0", 10, 1.3), rec(2, "w0", 11, 4.0),
            rec(2, "w1", 12, 6.5), rec(5, "w0", 13, 5.3)]
    undone = [{"entry": "e", "slot": iso(1), "claim_token": 9, "by_token": 10}]
    summary = account(
        store="redis", seed=1, window=(base + 1, base + 5),
        due_slots={"e": [base + i for i in range(1, 6)]},
        starts=starts, done=done, fenced=[], undone=undone,
        skips=[SkipSpan("e", base + 3, base + 3, 1, "missed"),
               SkipSpan("e", base + 5, base + 5, 1, "superseded")],
        faults=[Fault("worker_kill9", "w0", base + 2.5, worker_host="w0")],
        beat_exits=0, audit=(True, "clean"))
    assert summary.due == 5
    assert summary.run_once == 2  # slot 1, and slot 5 (which is also, wrongly, recorded skipped)
    assert summary.undone == 1
    assert [d.split(" ")[0] for d in summary.duplicates] == [f"e@{iso(2)[11:19]}"]
    assert summary.skipped == {"missed": 1}
    assert [u.split(" ")[0] for u in summary.unaccounted] == [f"e@{iso(4)[11:19]}"]
    assert len(summary.contradictions) == 1
    assert summary.recoveries == [("worker_kill9", 3.5)]
    assert not summary.concurrent_duplicates  # the second run of slot 2 began after the first
    assert not summary.ok
