"""A chord on a result backend without native join: Celery's ``celery.chord_unlock`` retries
itself under one task id until the header is ready. The worker plugin must take each retry for
what it is (the run handed its id on), not for a duplicate of a finished task; stock Celery on
the same canvas, in the same module, is the reference."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import chord

from tests.procs import Proc, worker_args
from tests.servers import RedisServer

pytestmark = pytest.mark.system

MODES = ("stock", "crawl")


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    server = RedisServer().start()
    results = tmp_path_factory.mktemp("unlock-results")
    env = {"UNLOCK_REDIS_PORT": str(server.port), "UNLOCK_RESULTS": str(results)}
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    import importlib

    from tests.system import unlockapp

    importlib.reload(unlockapp)  # the apps point at this module's server and folder
    logs = tmp_path_factory.mktemp("unlock-logs")
    procs: dict[str, Proc] = {}
    try:
        for mode in MODES:
            procs[mode] = Proc(
                worker_args(f"tests.system.unlockapp:{mode}", pool="prefork", concurrency=2,
                            hostname=f"unlock-{mode}-{uuid.uuid4().hex[:6]}@%h"),
                env=env, log_path=Path(logs) / f"{mode}.log")
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()
        mp.undo()
        server.cleanup()


@pytest.mark.parametrize("mode", MODES)
def test_chord_unlock_retries_run_and_the_chord_completes(workers: dict[str, Proc],
                                                          mode: str) -> None:
    from tests.system import unlockapp

    app = unlockapp.APPS[mode]
    add, tsum = app.tasks["unlock.slow_add"], app.tasks["unlock.tsum"]
    # Parts of 2.5 s on two pool processes: the header takes >= 5 s, chord_unlock polls every
    # second, so it retries (re-publishes its own id) several times.
    result = chord([add.s(i, i, 2.5) for i in range(5)], tsum.s()).apply_async()
    log = workers[mode]
    assert result.get(timeout=120) == 20, log.log()[-4000:]
    unlock_retries = re.findall(r"celery\.chord_unlock\[[0-9a-f-]+\] retry", log.log())
    assert len(unlock_retries) >= 2, log.log()[-4000:]
    assert "dropping this delivery" not in log.log()
