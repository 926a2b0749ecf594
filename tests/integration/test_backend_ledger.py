"""Idempotency-key bookkeeping scripts and deadline headers, against a real Redis."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.signals import before_task_publish

from celery_crawl.backends.ledger import KeyLedger
from celery_crawl.errors import ConfigError
from celery_crawl.tasks import (
    DEADLINE_HEADER,
    ROLLBACK_PENDING,
    ROLLED_BACK,
    IdempotentTask,
    deadline_headers,
    parse_deadline,
)
from tests.clusters import RedisCluster3
from tests.servers import RedisServer, wait_until


@pytest.fixture(params=["standalone", "cluster"])
def app(request: pytest.FixtureRequest) -> Celery:
    """An app on the session's Redis, and on a 3-master Redis Cluster."""
    if request.param == "cluster":
        cluster: RedisCluster3 = request.getfixturevalue("redis_cluster")
        url = f"crawlredis+cluster://127.0.0.1:{cluster.nodes[0].port}/0"
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        url = f"crawlredis://127.0.0.1:{server.port}/0"
    app = Celery(f"l{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False,
                 backend=url)
    app.conf.update(crawl_namespace=f"ns{uuid.uuid4().hex[:8]}", redis_socket_timeout=5)
    return app


class _Ids(dict[str, str]):
    """Task ids unique to one test (fence records are per task id, on a shared server)."""

    def __missing__(self, name: str) -> str:
        self[name] = f"{name}-{uuid.uuid4().hex[:8]}"
        return self[name]


ids = _Ids()


@pytest.fixture(autouse=True)
def _fresh_ids() -> None:
    ids.clear()


def ledger(app: Celery, ttl_s: float = 30.0) -> KeyLedger:
    return KeyLedger(app.backend, app.backend.crawl_config.namespace, uuid.uuid4().hex, ttl_s)


def test_one_live_run_per_key(app) -> None:
    led = ledger(app)
    assert led.begin(ids["t1"], "", "run-a").kind == "run"
    assert led.begin(ids["t1"], "", "run-b").kind == "duplicate"
    assert led.begin(ids["t2"], "", "run-c").kind == "busy"
    assert led.touch("run-a") and not led.touch("run-b")
    assert led.release("run-a")
    assert led.begin(ids["t2"], "", "run-c").kind == "run"


def test_a_newer_claim_token_or_a_silent_owner_takes_the_key_over(app) -> None:
    led = ledger(app, ttl_s=0.3)
    assert led.begin(ids["t1"], "5", "old").kind == "run"
    assert led.begin(ids["t1"], "4", "older").kind == "duplicate"
    assert led.begin(ids["t1"], "6", "new").kind == "run"
    assert not led.touch("old")  # the frozen run finds itself fenced
    wait_until(lambda: led.begin(ids["t2"], "", "other").kind == "run", 10,
               what="heartbeat expiry hands the key over")


def test_a_takeover_names_the_dead_runs_to_roll_back_until_their_rollback_is_done(app) -> None:
    """The run taking a key from a dead, unfinished run is told that run's token (its effects
    may stick), and the tokens of earlier dead runs whose rollback never completed; not for a
    fresh key, and not once a token's rollback is done."""
    led = ledger(app, ttl_s=0.3)
    fresh = led.begin(ids["t1"], "5", "a")
    assert (fresh.kind, fresh.extra, fresh.abandoned) == ("run", "", ())
    taken = led.begin(ids["t1"], "6", "b")  # a newer claim: run "a" died
    assert (taken.kind, taken.extra, taken.abandoned) == ("run", "takeover", ("5",))
    assert led.rollback_begin("b", "5", final=False, failure="{}") == "go"
    # "b" is killed mid-rollback: the next run owes both (a killed rollback is retried)
    again = led.begin(ids["t1"], "7", "c")
    assert again.abandoned == ("5", "6")
    # "b"'s lock on token 5 lapses a heartbeat TTL after it was taken; then "c" takes it over.
    for tok in again.abandoned:
        wait_until(lambda t=tok: led.rollback_begin("c", t, final=False, failure="{}") == "go",
                   5, what=f"the rollback lock of token {tok}")
        led.rollback_end("c", tok, final=False, status="done")
    assert led.rollback_begin("c", "5", final=False, failure="{}") == "done"
    # "c" dies after those rollbacks, its own effects unknown: only "c" is named next.
    third = led.begin(ids["t1"], "8", "d")
    assert third.abandoned == ("7",)
    led.rollback_end("d", "7", final=False, status="done")
    led.rollback_end("d", "8", final=False, status="done")  # "d" was fenced and undid itself
    # A silent owner whose rollback is done: a plain run, even for another task id.
    wait_until(lambda: led.begin(ids["t2"], "", "e").kind == "run", 10,
               what="heartbeat expiry hands the key over")
    assert (led.record()["token"], led.record()["owed"]) == ("", "")


def test_finished_once_the_owner_stored_a_ready_state(app) -> None:
    led = ledger(app)
    assert led.begin(ids["t-done"], "", "a").kind == "run"
    app.backend.store_result(ids["t-done"], 1, states.STARTED, request=Context())
    assert led.begin(ids["t-other"], "", "b").kind == "busy"
    app.backend.store_result(ids["t-done"], 7, states.SUCCESS, request=Context())
    decision = led.begin(ids["t-other"], "", "b")
    assert (decision.kind, decision.task_id) == ("finished", ids["t-done"])


def test_a_resumed_stale_run_cannot_finish_the_key_before_the_newer_run_writes(app) -> None:
    """A run frozen past its lease resumes, finds itself fenced and stores its failure in the
    instant before the redelivered run's first state write: refused, so the key is not
    finished by the stale run and the newer run's outcome stands."""
    backend = app.backend
    backend.client.set(backend.token_counter_key, 10**6)  # tokens up to here count as issued
    led = ledger(app, ttl_s=0.3)
    assert led.begin(ids["t1"], "5", "frozen").kind == "run"
    assert led.begin(ids["t1"], "6", "redelivered").kind == "run"
    backend.store_result(ids["t1"], ValueError("fenced"), states.FAILURE,
                         request=Context(crawl_claim_token=5, hostname="w0"))
    assert backend.get_task_meta(ids["t1"], cache=False)["status"] == states.PENDING
    # The redelivered run dies too: the next delivery runs the key, it is not "finished".
    assert led.begin(ids["t1"], "7", "third").kind == "run"
    backend.store_result(ids["t1"], 42, states.SUCCESS,
                         request=Context(crawl_claim_token=7, hostname="w1"))
    assert backend.get_task_meta(ids["t1"], cache=False)["result"] == 42
    # Without a token nothing was stored before the floor either: judged as it always was.
    assert ledger(app).begin(ids["t2"], "8", "a").kind == "run"
    backend.store_result(ids["t2"], 1, states.SUCCESS, request=Context(hostname="legacy"))
    assert backend.get_task_meta(ids["t2"], cache=False)["result"] == 1


def test_begin_raises_the_fence_floor_never_lowers_it_and_keeps_an_expiry_set(app) -> None:
    """The floor a run raises on its task's fence record (idem_begin.lua): set on a task's
    first run, with the record's expiry; raised, never lowered, by later runs; an expiry the
    record has is left alone, a record without one gets one."""
    client, fence = app.backend.client, app.backend.fence_key(ids["t1"])
    led = ledger(app)
    assert led.keep_s > 5000
    assert led.begin(ids["t1"], "5", "a").kind == "run"
    assert client.hget(fence, "token") == b"5"
    assert 5000 < client.ttl(fence) <= led.keep_s
    client.expire(fence, 5000)
    assert led.release("a") and led.begin(ids["t1"], "7", "b").kind == "run"
    assert client.hget(fence, "token") == b"7" and client.ttl(fence) <= 5000
    client.persist(fence)
    assert led.release("b") and led.begin(ids["t1"], "9", "c").kind == "run"
    assert client.hget(fence, "token") == b"9" and 5000 < client.ttl(fence) <= led.keep_s
    assert led.release("c") and led.begin(ids["t1"], "6", "d").kind == "run"
    assert client.hget(fence, "token") == b"9"


def test_rollback_at_most_once_per_token_and_recovery_of_a_pending_one(app) -> None:
    led = ledger(app, ttl_s=0.3)
    failure = json.dumps({"exc_type": "ValueError", "exc_message": ["x"],
                          "exc_module": "builtins"})
    assert led.begin(ids["t1"], "3", "a").kind == "run"
    assert led.rollback_begin("a", "3", final=True, failure=failure) == "go"
    # run "a" is killed here; the next delivery (newer token) finishes the rollback
    decision = led.begin(ids["t1"], "4", "b")
    assert (decision.kind, decision.rollback_token, decision.extra) == ("rollback", "3", failure)
    # "a" holds the rollback lock until it expires (a heartbeat TTL after it was taken): "b"
    # waits, then takes the rollback over.
    wait_until(lambda: led.rollback_begin("b", "3", final=True, failure=failure) == "go", 5,
               what="the dead run's rollback lock to expire")
    led.rollback_end("b", "3", final=True, status="done")
    assert led.rollback_begin("b", "3", final=True, failure=failure) == "done"
    after = led.begin(ids["t1"], "5", "c")
    assert (after.kind, after.rollback_status) == ("finished-rb", "done")
    app.backend.store_result(ids["t1"], ValueError("x"), states.FAILURE, request=Context())
    assert led.begin(ids["t9"], "", "d").kind == "finished"


def test_a_fenced_run_rolls_back_its_own_token_only(app) -> None:
    led = ledger(app)
    assert led.begin(ids["t1"], "1", "a").kind == "run"
    assert led.begin(ids["t1"], "2", "b").kind == "run"
    assert led.rollback_begin("a", "1", final=True, failure="{}") == "fenced"
    assert led.rollback_begin("a", "1", final=False, failure="{}") == "go"
    led.rollback_end("a", "1", final=False, status="done")
    assert led.rollback_begin("a", "1", final=False, failure="{}") == "done"
    assert led.rollback_begin("b", "2", final=True, failure="{}") == "go"


def test_deadline_option_becomes_header_expires_and_time_limits(app) -> None:
    seen: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    @app.task(base=IdempotentTask, time_limit=3600, shared=False)  # one per app
    def job() -> None:
        pass

    before_task_publish.connect(capture, weak=False)
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=60)
        job.apply_async(deadline=deadline, idempotency_key="k1", expires=3600)
        later = datetime.now(UTC) + timedelta(hours=2)
        job.apply_async(headers=deadline_headers(later.isoformat()), expires=30)
    finally:
        before_task_publish.disconnect(capture)
    first, second = seen
    assert first[DEADLINE_HEADER] == deadline.isoformat()
    assert first["idempotency_key"] == "k1"
    assert datetime.fromisoformat(first["expires"]) == deadline  # the earlier of the two
    hard, soft = first["timelimit"]
    assert 50 < hard <= 60 and soft < hard
    assert datetime.fromisoformat(second["expires"]) < later  # the task's own expires is earlier
    assert second["timelimit"][0] == 3600


def test_deadlines_must_be_aware() -> None:
    with pytest.raises(ConfigError, match="naive"):
        parse_deadline(datetime(2030, 1, 1))
    with pytest.raises(ConfigError, match="ISO"):
        parse_deadline("tomorrow")
    assert parse_deadline(0) == datetime(1970, 1, 1, tzinfo=UTC)


def test_a_rollback_lock_lets_one_caller_run_and_the_other_wait_for_its_outcome(app) -> None:
    led = ledger(app, ttl_s=30.0)
    assert led.begin(ids["t1"], "5", "a").kind == "run"
    assert led.rollback_begin("a", "5", final=False, failure="{}") == "go"
    # A second caller in the pending window (a fenced run resumed while the run that took its
    # key over undoes the same token) must not run the same rollback at the same time.
    assert led.rollback_begin("b", "5", final=False, failure="{}") == "wait"
    assert led.rollback_touch("a", "5") and not led.rollback_touch("b", "5")
    assert led.rollback_begin("a", "5", final=False, failure="{}") == "go", "re-entrant"
    led.rollback_end("a", "5", final=False, status="failed")
    assert led.rollback_begin("b", "5", final=False, failure="{}", waited=True) == "failed"
    assert led.rollback_begin("b", "5", final=False, failure="{}") == "go", "a later retry"
    led.rollback_end("b", "5", final=False, status="done")
    assert led.rollback_begin("a", "5", final=False, failure="{}") == "done"


class _Answers(KeyLedger):
    """The real ledger, remembering each ``rollback_begin`` answer per run (the test waits on
    them to know a caller is inside the pending window)."""

    answers: dict[str, list[str]]

    def rollback_begin(self, run_id: str, token: str, **kw: Any) -> str:
        answer = super().rollback_begin(run_id, token, **kw)
        self.answers.setdefault(run_id, []).append(answer)
        return answer


def test_two_callers_in_the_pending_window_roll_back_once(app) -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    class Undo(IdempotentTask):  # type: ignore[misc]
        name = f"undo-{uuid.uuid4().hex[:6]}"
        rollback_max_attempts = 1

        def run(self) -> None:
            return None

        def rollback(self, exc: BaseException, task_id: str, args: Any, kwargs: Any) -> None:
            calls.append(task_id)
            entered.set()
            assert release.wait(30), "the test never let the first rollback finish"

    task = app.register_task(Undo())
    led = _Answers(app.backend, app.backend.crawl_config.namespace, uuid.uuid4().hex, 2.0)
    led.answers = {}
    outcomes: dict[str, str | None] = {}

    def caller(run_id: str) -> None:
        task.push_request(id=ids[run_id], called_directly=False)
        try:
            outcomes[run_id] = task._roll_back(led, run_id, "9", ValueError("x"), (), {},
                                               final=False)
        finally:
            task.pop_request()

    first = threading.Thread(target=caller, args=("run-a",), daemon=True)
    first.start()
    assert entered.wait(30), "the first rollback did not start"
    second = threading.Thread(target=caller, args=("run-b",), daemon=True)
    second.start()
    wait_until(lambda: "wait" in led.answers.get("run-b", []) or len(calls) > 1, 30,
               what="the second caller to reach the pending rollback")
    assert calls == [ids["run-a"]], "the second caller ran the same rollback concurrently"
    # The first holder outlives its lock TTL (2 s) while it rolls back: its lock is extended.
    wait_until(lambda: led.answers["run-b"].count("wait") >= 15, 30,
               what="the second caller to keep waiting past one lock TTL")
    release.set()
    first.join(30)
    second.join(30)
    assert outcomes == {"run-a": ROLLED_BACK, "run-b": ROLLED_BACK}
    assert calls == [ids["run-a"]]


def test_the_poison_hook_does_not_run_or_wait_for_a_rollback_held_elsewhere(app) -> None:
    calls: list[str] = []

    class Undo(IdempotentTask):  # type: ignore[misc]
        name = f"undo-{uuid.uuid4().hex[:6]}"
        idempotency_heartbeat_ttl_s = 30.0

        def run(self) -> None:
            return None

        def rollback(self, exc: BaseException, task_id: str, args: Any, kwargs: Any) -> None:
            calls.append(task_id)

    task = app.register_task(Undo())
    app.backend.client.set(app.backend.token_counter_key, 10**6)  # token 5 counts as issued
    tid = ids["t1"]
    led = KeyLedger(app.backend, app.backend.crawl_config.namespace, tid, 30.0)
    assert led.begin(tid, "5", "run-a").kind == "run"
    assert led.rollback_begin("run-a", "5", final=False, failure="{}") == "go"  # run-a rolls back
    t0 = time.monotonic()
    outcome = task.crawl_on_poison(tid, (), {}, "delivered 5 times", token=5, hostname="w")
    assert outcome == ROLLBACK_PENDING and calls == []
    assert time.monotonic() - t0 < 5, "the consumer must not wait for run-a's rollback"
    assert app.backend.get_task_meta(tid, cache=False)["status"] == states.FAILURE
