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
    assert summary.due > 0, report
    assert not summary.duplicates, report
    assert not summary.unaccounted, report
    assert summary.beat_exits == 0, report
    assert summary.audit_ok is not False, report
    assert not violations, report
