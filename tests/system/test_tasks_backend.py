"""IdempotentTask and AuditedRedisBackend with real celery workers (prefork) on a real Redis."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path

import pytest
import redis
from celery import chain, chord, group
from celery.app.task import Context

from celery_crawl.backends.audit import history, verify
from celery_crawl.errors import FencedError
from celery_crawl.tasks import ROLLBACK_FAILED, ROLLED_BACK, deadline_headers
from tests.procs import Proc, worker_args
from tests.servers import Monitor, RedisServer, wait_until
from tests.system import tasksapp

pytestmark = pytest.mark.system

APP = "tests.system.tasksapp"
TIMEOUT_S = 30  # generous: the machine is small and shared


def _start_worker(port: int, log_dir: Path, name: str, concurrency: int = 2,
                  queues: str | None = None, plugin: bool = False,
                  max_deliveries: int = 5) -> Proc:
    hostname = f"{name}-{uuid.uuid4().hex[:6]}@%h"
    env = {"TASKSAPP_REDIS_PORT": str(port), "TASKSAPP_WORKER_PLUGIN": "1" if plugin else "0",
           "TASKSAPP_MAX_DELIVERIES": str(max_deliveries)}
    return Proc(worker_args(APP, concurrency=concurrency, hostname=hostname, queues=queues),
                env=env, log_path=log_dir / f"{name}.log")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Proc]]:
    server = RedisServer().start()
    tasksapp.configure(server.port)
    log_dir = tmp_path_factory.mktemp("tasks-worker")
    worker = _start_worker(server.port, log_dir, "main")
    try:
        assert tasksapp.add.delay(1, 2).get(timeout=60) == 3, worker.log()
        yield server, worker
    finally:
        worker.stop()
        server.cleanup()


def _side(server: RedisServer) -> redis.Redis:
    return server.client(db=2)


def _list(server: RedisServer, key: str) -> list[str]:
    return [v.decode() for v in _side(server).lrange(key, 0, -1)]


def _name() -> str:
    return uuid.uuid4().hex[:10]


def test_rollback_runs_once_after_the_final_failure_not_on_retries(stack) -> None:
    server, _ = stack
    name = _name()
    result = tasksapp.flaky.apply_async((name, 2), idempotency_key=f"flaky:{name}")
    with pytest.raises(ValueError, match="failed for good"):
        result.get(timeout=TIMEOUT_S)
    assert len(_list(server, f"runs:{name}")) == 3
    assert _list(server, f"rollbacks:{name}") == [result.id]
    meta = tasksapp.app.backend.get_task_meta(result.id, cache=False)
    assert meta["crawl_rollback"] == ROLLED_BACK
    states = [(r.state, r.outcome, r.rollback) for r in history(tasksapp.app.backend, result.id)]
    assert ("FAILURE", "written", ROLLED_BACK) in states
    assert [s for s, _, _ in states].count("RETRY") == 2
    # The key travelled with the retries: a new call with it replays the failure, unrun.
    again = tasksapp.flaky.apply_async((name, 2), idempotency_key=f"flaky:{name}")
    with pytest.raises(ValueError, match="failed for good"):
        again.get(timeout=TIMEOUT_S)
    assert len(_list(server, f"runs:{name}")) == 3
    assert _list(server, f"rollbacks:{name}") == [result.id]


def test_a_rollback_that_keeps_failing_is_retried_with_backoff_then_recorded_failed(
        stack) -> None:
    """Every rollback attempt fails: it is tried ``rollback_max_attempts`` times in process, the
    waits doubling from ``rollback_backoff_s``; then ROLLBACK_FAILED is stored in the result
    meta and the audit record, and a replay of the key neither runs nor rolls back again."""
    server, worker = stack
    name = _name()
    _side(server).set(f"rollback-fails:{name}", 1000)
    result = tasksapp.flaky.apply_async((name, 0), idempotency_key=f"flaky:{name}")
    with pytest.raises(ValueError, match="failed for good"):
        result.get(timeout=TIMEOUT_S)
    task = tasksapp.flaky
    attempts = task.rollback_max_attempts
    assert attempts > 2
    assert _list(server, f"rollback-start:{name}") == [result.id] * attempts
    assert _list(server, f"rollbacks:{name}") == []  # never completed
    at = [float(t) for t in _list(server, f"rollback-at:{name}")]
    waits = [b - a for a, b in pairwise(at)]
    backoff = [min(task.rollback_backoff_s * 2**i, task.rollback_backoff_max_s)
               for i in range(attempts - 1)]
    # Sleeps are never shorter than asked; a fixed or missing backoff would fail the later ones.
    assert all(w >= b - 0.005 for w, b in zip(waits, backoff, strict=True)), (waits, backoff)
    assert sum(waits) >= sum(backoff) - 0.01
    wait_until(lambda: f"rollback attempt {attempts} failed" in worker.log(), TIMEOUT_S,
               what="the last attempt's log line")

    backend = tasksapp.app.backend
    meta = backend.get_task_meta(result.id, cache=False)
    assert (meta["status"], meta["crawl_rollback"]) == ("FAILURE", ROLLBACK_FAILED)
    last = history(backend, result.id)[-1]
    assert (last.state, last.outcome, last.rollback) == ("FAILURE", "written", ROLLBACK_FAILED)
    record = server.client().hgetall(backend.idempotency_key("tasksapp", f"flaky:{name}"))
    assert record[b"fin"] == b"failed"

    again = tasksapp.flaky.apply_async((name, 0), idempotency_key=f"flaky:{name}")
    with pytest.raises(ValueError, match="failed for good"):
        again.get(timeout=TIMEOUT_S)
    assert backend.get_task_meta(again.id, cache=False)["crawl_rollback"] == ROLLBACK_FAILED
    assert _list(server, f"runs:{name}") == [result.id]
    assert len(_list(server, f"rollback-start:{name}")) == attempts


def test_duplicate_deliveries_run_and_roll_back_once(stack) -> None:
    server, _ = stack
    name = _name()
    task_id = str(uuid.uuid4())
    first = tasksapp.slow.apply_async((name, 1.5, True), task_id=task_id)
    wait_until(lambda: _list(server, f"runs:{name}"), TIMEOUT_S, what="first delivery running")
    tasksapp.slow.apply_async((name, 1.5, True), task_id=task_id)  # delivered while it runs
    with pytest.raises(ValueError):
        first.get(timeout=TIMEOUT_S)
    tasksapp.slow.apply_async((name, 1.5, True), task_id=task_id)  # delivered after it ended
    backend = tasksapp.app.backend
    # Each late copy announces STARTED (refused: FAILURE is stored) and is then dropped; the
    # copy that came while the task ran was retried once its owner's heartbeat could lapse.
    wait_until(lambda: [(r.state, r.outcome) for r in history(backend, task_id)].count(
        ("STARTED", "refused-regression")) >= 2, TIMEOUT_S, what="both duplicates handled")
    assert backend.get_task_meta(task_id, cache=False)["status"] == "FAILURE"
    assert _list(server, f"runs:{name}") == [task_id]
    assert _list(server, f"rollbacks:{name}") == [task_id]


def test_finished_key_replays_result_and_failure_without_running(stack) -> None:
    server, _ = stack
    name = _name()
    first = tasksapp.keyed.delay(name).get(timeout=TIMEOUT_S)
    second = tasksapp.keyed.delay(name).get(timeout=TIMEOUT_S)
    assert first == second
    assert _list(server, f"runs:{name}") == [first["by"]]

    bad = _name()
    one = tasksapp.keyed.delay(bad, True)
    with pytest.raises(KeyError, match="is broken"):
        one.get(timeout=TIMEOUT_S)
    two = tasksapp.keyed.delay(bad, True)
    with pytest.raises(KeyError, match="is broken"):
        two.get(timeout=TIMEOUT_S)
    assert _list(server, f"runs:{bad}") == [one.id]
    assert _list(server, f"rollbacks:{bad}") == [one.id]
    assert tasksapp.app.backend.get_task_meta(two.id, cache=False)["crawl_rollback"] == ROLLED_BACK


def test_deadline_propagates_through_a_chain(stack) -> None:
    deadline = datetime.now(UTC) + timedelta(seconds=120)
    flow = chain(tasksapp.probe.s(), tasksapp.stock_probe.s(), tasksapp.probe.s())
    seen = flow.apply_async(headers=deadline_headers(deadline)).get(timeout=TIMEOUT_S)
    assert len(seen) == 3
    for link in seen:
        assert datetime.fromisoformat(link["deadline"]) == deadline
        assert datetime.fromisoformat(link["expires"]) <= deadline
        assert 0 < link["remaining"] <= 120
        hard, soft = link["timelimit"]
        assert hard is not None and soft is not None
        assert soft <= hard <= 120


def test_groups_and_chords_on_the_audited_backend(stack) -> None:
    assert group(tasksapp.add.s(i, i) for i in range(5))().get(timeout=TIMEOUT_S) == [
        0, 2, 4, 6, 8]
    assert chord(tasksapp.add.s(i, 1) for i in range(4))(tasksapp.total.s()).get(
        timeout=TIMEOUT_S) == 10
    names = [_name() for _ in range(3)]
    keyed = group(tasksapp.keyed.s(n) for n in names)().get(timeout=TIMEOUT_S)
    assert [k["name"] for k in keyed] == names


def test_late_started_after_success_from_a_real_worker_is_refused(stack) -> None:
    backend = tasksapp.app.backend
    result = tasksapp.add.delay(20, 22)
    assert result.get(timeout=TIMEOUT_S) == 42
    late = Context(id=result.id, hostname="paused@host")
    backend.store_result(result.id, {"pid": 1}, "STARTED", request=late)
    assert backend.get_task_meta(result.id, cache=False)["status"] == "SUCCESS"
    assert history(backend, result.id)[-1].outcome == "refused-regression"
    assert verify(backend).clean


@pytest.mark.parametrize("plugin", [False, True], ids=["visibility-timeout", "worker-plugin"])
def test_worker_killed_during_rollback_rollback_completes_once_after_recovery(
        stack, tmp_path: Path, plugin: bool) -> None:
    """kill -9 mid-rollback; the task comes back (broker visibility timeout, or the worker
    plugin's reaper once the victim's lease expired, with a newer claim token) and the next run
    finishes the pending rollback instead of running the body again."""
    server, _ = stack
    name = _name()
    task_id = str(uuid.uuid4())
    queue = f"kill-{name}"
    _side(server).set(f"rollback-hang:{name}", 1)  # the first rollback attempt hangs
    victim = _start_worker(server.port, tmp_path, "victim", concurrency=1, queues=queue,
                           plugin=plugin)
    rescuer: Proc | None = None
    try:
        result = tasksapp.slow.apply_async((name, 0.0, True), task_id=task_id, queue=queue)
        wait_until(lambda: _list(server, f"rollback-start:{name}"), TIMEOUT_S,
                   what=f"rollback started\n{victim.log()}")
        victim.kill9()
        assert _list(server, f"rollbacks:{name}") == []
        # The message was not acked (acks_late): the broker's visibility timeout redelivers it
        # to the next worker, which finds the dead run's rollback pending and finishes it.
        rescuer = _start_worker(server.port, tmp_path, "rescuer", concurrency=1, queues=queue,
                                plugin=plugin)
        with pytest.raises(ValueError, match="failed"):
            result.get(timeout=TIMEOUT_S)
        assert _list(server, f"rollbacks:{name}") == [task_id]
        assert _list(server, f"runs:{name}") == [task_id]  # the body never ran again
        meta = tasksapp.app.backend.get_task_meta(task_id, cache=False)
        assert meta["crawl_rollback"] == ROLLED_BACK
        assert len(_list(server, f"rollback-start:{name}")) == 2
        records = history(tasksapp.app.backend, task_id)
        assert (records[-1].state, records[-1].outcome, records[-1].rollback) == (
            "FAILURE", "written", ROLLED_BACK)
        if plugin:  # the rescuing delivery carried a newer claim token
            tokens = [r.token for r in records]
            assert None not in tokens and tokens[-1] > tokens[0]
    finally:
        victim.stop()
        if rescuer is not None:
            rescuer.stop()


def test_worker_plugin_tokens_and_poison_rollback(stack, tmp_path: Path) -> None:
    """With the worker plugin every write carries an issued claim token; a task that kills its
    pool process on every delivery ends, after crawl_max_deliveries, as an audited FAILURE
    whose rollback ran once (``crawl_on_poison``)."""
    server, _ = stack
    queue = f"plug-{_name()}"
    worker = _start_worker(server.port, tmp_path, "plug", concurrency=1, queues=queue,
                           plugin=True, max_deliveries=2)
    try:
        token = tasksapp.claim_token.apply_async(queue=queue).get(timeout=60)
        assert isinstance(token, int)
        name = _name()
        result = tasksapp.suicide.apply_async((name,), queue=queue)
        with pytest.raises(Exception, match="delivered"):
            result.get(timeout=60)
        meta = tasksapp.app.backend.get_task_meta(result.id, cache=False)
        assert meta["crawl_rollback"] == ROLLED_BACK
        assert _list(server, f"rollbacks:{name}") == [result.id]
        assert 1 <= len(_list(server, f"runs:{name}")) <= 2  # the poison delivery does not run
        last = history(tasksapp.app.backend, result.id)[-1]
        assert (last.state, last.outcome, last.rollback) == ("FAILURE", "written", ROLLED_BACK)
        assert last.token is not None and last.token > token
    finally:
        worker.stop()


def test_a_plugin_worker_writes_results_without_reading_the_token_counter(
        stack, tmp_path: Path) -> None:
    """The lease store shares the backend's server, so the backend checks that result tokens
    were issued. A worker with the plugins sets every request's token from an issued claim
    (``_issued.py``): its writes need no read of the counter, while a write from elsewhere
    still gets one, and a forged token from elsewhere is still refused."""
    server, _ = stack
    backend = tasksapp.app.backend
    assert backend.checks_token_issuance
    counter = backend.token_counter_key
    queue = f"vouch-{_name()}"
    worker = _start_worker(server.port, tmp_path, "vouch", concurrency=2, queues=queue,
                           plugin=True)
    probe = server.client()
    mon = Monitor(server).start(probe)
    try:
        results = [tasksapp.claim_token.apply_async(queue=queue) for _ in range(6)]
        tokens = [r.get(timeout=60) for r in results]
        assert all(isinstance(t, int) for t in tokens), tokens
        mon.sync(probe)
        reads_by_worker = [x for x in mon.lines if _reads(x, counter)]
        # A write from this (unvouched) process reads the counter, and refuses a forged token.
        forged = f"forged-{_name()}"
        backend.store_result(forged, 1, "SUCCESS",
                             request=Context(crawl_claim_token=max(tokens) + 10**6))
    finally:
        mon.stop(probe)
        worker.stop()
    assert reads_by_worker == [], reads_by_worker[:3]
    assert any(_reads(x, counter) for x in mon.lines)
    assert history(backend, forged)[-1].outcome == "refused-unissued"
    written = [history(backend, r.id)[-1] for r in results]
    assert [(w.outcome, w.token) for w in written] == [("written", t) for t in tokens], written


def _reads(monitor_line: str, key: str) -> bool:
    """A client's own GET of ``key`` (not one a script makes: the claim script reads the
    counter it increments)."""
    return f'"GET" "{key}"' in monitor_line and " lua]" not in monitor_line


@pytest.mark.parametrize("plugin", [False, True], ids=["visibility-timeout", "worker-plugin"])
def test_a_run_killed_after_its_effect_is_rolled_back_before_the_key_runs_again(
        stack, tmp_path: Path, plugin: bool) -> None:
    """kill -9 while the body runs (its effect, ``runs:<name>``, already written): the
    delivery that takes the key over first rolls the dead run back (once, with AbandonedRun
    and the dead run's claim token), then runs the body and stores SUCCESS."""
    server, _ = stack
    name = _name()
    task_id = str(uuid.uuid4())
    queue = f"abandon-{name}"
    victim = _start_worker(server.port, tmp_path, "victim", concurrency=1, queues=queue,
                           plugin=plugin)
    rescuer: Proc | None = None
    try:
        result = tasksapp.slow.apply_async((name, 60.0, False, True), task_id=task_id,
                                           queue=queue)
        wait_until(lambda: _list(server, f"runs:{name}"), TIMEOUT_S,
                   what=f"run started\n{victim.log()}")
        victim.kill9()
        _side(server).set(f"gate:{name}", 1)  # the next run may finish at once
        rescuer = _start_worker(server.port, tmp_path, "rescuer", concurrency=1, queues=queue,
                                plugin=plugin)
        assert result.get(timeout=TIMEOUT_S) == f"done:{name}"
        events = _list(server, f"events:{name}")
        first_token = events[0].split(":", 1)[1]
        assert [e.split(":")[0] for e in events] == ["run", "rollback", "run"], events
        assert events[1] == f"rollback:AbandonedRun:{first_token}", events
        assert _list(server, f"rollbacks:{name}") == [task_id]
        if plugin:  # the rescuing run carried a newer claim token than the one it undid
            assert int(events[2].split(":")[1]) > int(first_token), events
        meta = tasksapp.app.backend.get_task_meta(task_id, cache=False)
        assert meta["status"] == "SUCCESS" and not meta.get("crawl_rollback")
        assert verify(tasksapp.app.backend).clean
    finally:
        victim.stop()
        if rescuer is not None:
            rescuer.stop()


@pytest.mark.parametrize("callback", [False, True], ids=["checked-by-the-write", "touched"])
def test_a_run_whose_key_was_taken_after_its_body_fails_and_rolls_back(
        stack, callback: bool) -> None:
    """The key changes owner between the body's return and the result write. Without
    callbacks the SUCCESS write itself finds it (``refused-fenced``, no round trip of the run's
    own); with a link callback the run checks before Celery publishes it, and publishes
    nothing. Either way the run fails with ``FencedError`` after rolling its effects back once."""
    server, _ = stack
    name = _name()
    link = tasksapp.linked.s(name) if callback else None
    result = tasksapp.usurped.apply_async((name,), link=link)
    with pytest.raises(FencedError, match="taken over by a newer run"):
        result.get(timeout=TIMEOUT_S)
    assert _list(server, f"rollbacks:{name}") == [result.id]
    assert tasksapp.app.backend.get_task_meta(result.id, cache=False)["crawl_rollback"] == (
        ROLLED_BACK)
    audited = [(r.state, r.outcome) for r in history(tasksapp.app.backend, result.id)
               if r.state != "STARTED"]
    if callback:
        assert audited == [("FAILURE", "written")], audited
    else:
        assert audited == [("SUCCESS", "refused-fenced"), ("FAILURE", "written")], audited
    assert _list(server, f"linked:{name}") == []


def test_an_idempotent_run_without_callbacks_makes_no_touch_round_trip(stack) -> None:
    """The ownership check of a run that publishes nothing after its body rides in its
    result write: the run's only own round trip is its begin."""
    server, _ = stack
    probe = server.client()
    mon = Monitor(server).start(probe)
    try:
        results = [tasksapp.keyed.apply_async((_name(),)) for _ in range(4)]
        for r in results:
            r.get(timeout=TIMEOUT_S)
    finally:
        mon.stop(probe)
    touches = [x for x in mon.lines if '"EVALSHA"' in x and '"touch"' in x]
    assert touches == [], touches[:2]
    assert sum('"EVALSHA"' in x for x in mon.lines) >= 8  # each run's begin and its write


def test_a_frozen_run_is_fenced_and_rolls_back_its_own_effects(stack, tmp_path: Path) -> None:
    """SIGSTOP a worker mid-task; another worker takes the key over, rolls the frozen run's
    effects back first (once) and stores SUCCESS; the frozen run, resumed, finds itself fenced:
    its rollback is already done, so it does not run again, and its late write is refused."""
    server, _ = stack
    name = _name()
    task_id = str(uuid.uuid4())
    queue = f"freeze-{name}"
    victim = _start_worker(server.port, tmp_path, "frozen", concurrency=1, queues=queue)
    rescuer: Proc | None = None
    backend = tasksapp.app.backend
    try:
        result = tasksapp.slow.apply_async((name, 60.0, False, True), task_id=task_id,
                                           queue=queue)
        wait_until(lambda: _list(server, f"runs:{name}"), TIMEOUT_S, what="run started")
        victim.signal_group(signal.SIGSTOP)
        record = backend.idempotency_key("tasksapp", task_id)
        client = server.client()

        def heartbeat_expired() -> bool:
            seconds, micros = client.time()
            return int(client.hget(record, "hb") or 0) < seconds * 1000 + micros // 1000

        wait_until(heartbeat_expired, TIMEOUT_S, what="the frozen run's heartbeat to lapse")
        _side(server).set(f"gate:{name}", 1)  # both runs may finish their body now
        rescuer = _start_worker(server.port, tmp_path, "rescuer", concurrency=1, queues=queue)
        assert result.get(timeout=TIMEOUT_S) == f"done:{name}"
        assert len(_list(server, f"runs:{name}")) == 2
        events = _list(server, f"events:{name}")
        assert [e.split(":")[0] for e in events] == ["run", "rollback", "run"], events
        assert events[1].startswith("rollback:AbandonedRun:"), events
        victim.signal_group(signal.SIGCONT)
        wait_until(lambda: history(backend, task_id)[-1].state == "FAILURE", TIMEOUT_S,
                   what=f"the fenced run's write\n{victim.log()}")
        assert _list(server, f"rollbacks:{name}") == [task_id]  # not again by the stale run
        last = history(backend, task_id)[-1]
        assert (last.outcome, last.rollback) == ("refused-stale", ROLLED_BACK)
        assert backend.get_task_meta(task_id, cache=False)["result"] == f"done:{name}"
        assert verify(backend).clean
    finally:
        victim.signal_group(signal.SIGCONT)
        victim.stop()
        if rescuer is not None:
            rescuer.stop()
