"""Stock Celery canvas semantics survive the worker plugin and the audited backend.

Four real ``celery worker`` processes (stock | crawl) x (prefork | threads), Redis broker, one per
module; each canvas runs on every one of them and must return exactly what it returns on the
stock app, which is the reference (the same assertion runs on both). The crawl app is
``celery_crawl.install`` with the ``crawlredis://`` backend. The last tests freeze the crawl
threads worker beyond its lease: its stale run of a chain link or chord part must not be seen
by the chain or the chord.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain, chord, group, states

from celery_crawl._celery_compat import at_least
from tests.procs import Proc, worker_args
from tests.servers import RedisServer, wait_until

pytestmark = pytest.mark.system

TIMEOUT_S = float(os.environ.get("CANVAS_TEST_TIMEOUT") or 30)  # generous: a shared machine
MODES = ("stock", "crawl")
POOLS = ("prefork", "threads")
COMBOS = [(mode, pool) for mode in MODES for pool in POOLS]
IDS = [f"{mode}-{pool}" for mode, pool in COMBOS]


class Stack:
    def __init__(self, server: RedisServer, log_dir: Path) -> None:
        self.server = server
        self.log_dir = log_dir
        self.workers: dict[tuple[str, str], Proc] = {}
        self.hostnames: dict[tuple[str, str], str] = {}

    def side(self) -> redis.Redis:
        return self.server.client(db=2)

    def list(self, key: str) -> list[Any]:
        return [json.loads(v) for v in self.side().lrange(key, 0, -1)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory,
          monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Stack]:
    server = RedisServer().start()
    monkeypatch_module.setenv("CANVAS_REDIS_PORT", str(server.port))
    import importlib

    from tests.system import canvasapp

    importlib.reload(canvasapp)  # the apps point at this module's server
    log_dir = tmp_path_factory.mktemp("canvas")
    st = Stack(server, log_dir)
    try:
        for mode, pool in COMBOS:
            host = f"{mode}-{pool}-{uuid.uuid4().hex[:6]}@%h"
            st.hostnames[mode, pool] = host.replace("%h", _hostname())
            st.workers[mode, pool] = Proc(
                worker_args(f"tests.system.canvasapp:{mode}_{pool}", pool=pool,
                            concurrency=2 if pool == "prefork" else 4, hostname=host),
                env={"CANVAS_REDIS_PORT": str(server.port)},
                log_path=log_dir / f"{mode}-{pool}.log")
        for key, proc in st.workers.items():
            t = canvasapp.TASKS[key]
            assert t.add.delay(1, 2).get(timeout=90) == 3, proc.log()
        yield st
    finally:
        for proc in st.workers.values():
            proc.stop()
        server.cleanup()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _tasks(mode: str, pool: str) -> Any:
    from tests.system import canvasapp

    return canvasapp.TASKS[mode, pool]


# -- canvases: (build(tasks, key) -> signature, expected result) ------------------------------
Build = Callable[[Any, str], Any]
CANVASES: dict[str, tuple[Build, Any]] = {
    "replace": (lambda t, k: t.replace_with.s(4, "single"), 5),
    "replace-first-of-chain": (
        lambda t, k: chain(t.replace_with.s(4, "single"), t.mul.s(3)), 15),
    "replace-middle-of-chain": (
        lambda t, k: chain(t.add.s(1, 1), t.replace_with.s("single"), t.mul.s(3)), 9),
    "replace-last-of-chain": (
        lambda t, k: chain(t.add.s(1, 1), t.replace_with.s("chain")), 6),
    "replace-by-chain": (lambda t, k: t.replace_with.s(4, "chain"), 10),
    "replace-by-group": (lambda t, k: t.replace_with.s(4, "group"), [4, 5, 6]),
    "replace-by-chain-ending-in-group": (
        lambda t, k: t.replace_with.s(4, "chain_group"), [5, 10, 15]),
    "replace-second-order": (lambda t, k: t.replace_with.s(4, "second"), 41),
    "replace-in-a-chain-containing-a-group": (
        lambda t, k: chain(t.add.s(1, 1), t.replace_with.s("single"),
                           group(t.mul.s(1), t.mul.s(2))), [3, 6]),
    "retry-with-countdown": (lambda t, k: t.retry_then.s(7, k, 2), 7),
    "autoretry-for": (lambda t, k: t.autoretry.s(8, k, 2), 8),
    "chord-of-5": (lambda t, k: chord([t.add.s(i, i) for i in range(5)], t.tsum.s()), 20),
    "group": (lambda t, k: group(t.add.s(i, 1) for i in range(5)), [1, 2, 3, 4, 5]),
    "chain": (lambda t, k: chain(t.add.s(1, 2), t.mul.s(3), t.add.s(4)), 13),
    "countdown": (lambda t, k: t.add.s(1, 2).set(countdown=1), 3),
    "eta": (lambda t, k: t.add.s(2, 2).set(eta=datetime.now(UTC) + timedelta(seconds=1)), 4),
}


def _outcome(result: Any, deadline: float) -> Any:
    """What a canvas came to: its value, the name of the exception it raised, or "hangs"."""
    from celery.exceptions import TimeoutError as CeleryTimeout

    try:
        return ("value", result.get(timeout=max(1.0, deadline - time.monotonic())))
    except CeleryTimeout:
        return ("hangs", None)
    except Exception as exc:
        return ("raised", type(exc).__name__)


@pytest.mark.parametrize("canvas", list(CANVASES))
@pytest.mark.parametrize("pool", POOLS)
def test_canvas_returns_what_stock_returns(stack: Stack, pool: str, canvas: str) -> None:
    """The same canvas on the stock and the plugin worker of one pool, sent together: the
    plugin worker's outcome is exactly stock's on the installed Celery. On Celery 5.7 stock's is
    also the documented one (``CANVASES``); older releases have canvas bugs of their own (5.5
    never completes a task replaced by a chain ending in a group), which the plugins keep."""
    build, expected = CANVASES[canvas]
    keys = {mode: uuid.uuid4().hex[:10] for mode in MODES}
    results = {mode: build(_tasks(mode, pool), keys[mode]).apply_async() for mode in MODES}
    deadline = time.monotonic() + TIMEOUT_S
    outcomes = {mode: _outcome(results[mode], deadline) for mode in MODES}
    assert outcomes["crawl"] == outcomes["stock"], (
        outcomes, stack.workers["crawl", pool].log()[-3000:])
    if at_least("celery", (5, 7)):
        assert outcomes["stock"] == ("value", expected)
    for mode in MODES:
        if outcomes[mode][0] != "value":
            continue
        if canvas == "retry-with-countdown":
            assert stack.list(f"runs:{keys[mode]}") == [0, 1, 2]
        if canvas == "autoretry-for":
            assert int(stack.side().get(f"tries:{keys[mode]}") or 0) == 3


@pytest.mark.parametrize(("mode", "pool"), COMBOS, ids=IDS)
def test_replace_keeps_link_and_link_error(stack: Stack, mode: str, pool: str) -> None:
    t = _tasks(mode, pool)
    key = uuid.uuid4().hex[:10]
    ok = t.replace_with.s(4, "single").set(link=t.note.s(key=key)).apply_async()
    assert ok.get(timeout=TIMEOUT_S) == 5
    wait_until(lambda: stack.list(f"links:{key}"), TIMEOUT_S, what="the link callback")
    bad = t.replace_with.s(4, "boom").set(link_error=t.on_error.s(key=key)).apply_async()
    with pytest.raises(ValueError, match="boom"):
        bad.get(timeout=TIMEOUT_S)
    wait_until(lambda: stack.list(f"errbacks:{key}"), TIMEOUT_S, what="the errback")
    assert stack.list(f"links:{key}") == [5]
    assert stack.list(f"errbacks:{key}") == [[bad.id, "ValueError"]]


@pytest.mark.parametrize(("mode", "pool"), COMBOS, ids=IDS)
def test_a_failure_is_recorded_and_propagated_as_stock_does(stack: Stack, mode: str,
                                                              pool: str) -> None:
    """A failing task's ``.get()`` raises its exception, its ``link_error`` runs once, and a
    chain through it fails: its later links are recorded FAILURE with the same exception."""
    t = _tasks(mode, pool)
    key = uuid.uuid4().hex[:10]
    bad = t.boom.s().set(link_error=t.on_error.s(key=key)).apply_async()
    with pytest.raises(ValueError):
        bad.get(timeout=TIMEOUT_S)
    assert bad.state == states.FAILURE
    wait_until(lambda: stack.list(f"errbacks:{key}"), TIMEOUT_S, what="the errback")
    through = chain(t.add.s(1, 1), t.boom.s(), t.mul.s(3), t.add.s(4)).apply_async()
    with pytest.raises(ValueError):
        through.get(timeout=TIMEOUT_S)
    # ``get()`` raises as soon as a parent failed (``_maybe_reraise_parent_error``): the later
    # links' FAILURE is written right after, by the failed task's worker, in no set order.
    middle = through.parent
    assert middle is not None
    for link in (through, middle):
        wait_until(lambda link=link: link.state == states.FAILURE, TIMEOUT_S,
                   what="a later link recorded FAILURE")
    assert isinstance(through.result, ValueError)
    assert stack.list(f"errbacks:{key}") == [[bad.id, "ValueError"]]


@pytest.mark.parametrize(("mode", "pool"), COMBOS, ids=IDS)
def test_a_task_republishing_its_own_id_runs_again(stack: Stack, mode: str, pool: str) -> None:
    """``self.apply_async(task_id=self.request.id)`` from inside the run: the second run happens
    on both apps (the run handed its id on)."""
    t = _tasks(mode, pool)
    key = uuid.uuid4().hex[:10]
    result = t.record.apply_async((key,), {"again": True})
    wait_until(lambda: len(stack.list(f"runs:{key}")) == 2, TIMEOUT_S, what="the second run")
    assert stack.list(f"runs:{key}") == [result.id, result.id]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_finished_id_published_again_runs_only_as_a_new_publish(
        stack: Stack, pool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a run that handed nothing on, copies of its publish (its ``crawl_sent``) are
    duplicates, even with forged ``retries`` / ``replaced_task_nesting`` headers, and so are
    unmarked messages under its id (a producer without ``install``); a new publish of the id
    runs again, as on stock Celery (docs/worker.md, "Task ids used again")."""
    from celery_crawl import publishes

    t = _tasks("crawl", pool)
    key = uuid.uuid4().hex[:10]
    sent = {"crawl_sent": f"p-{key}"}
    first = t.record.apply_async((key,), headers=sent)
    assert first.get(timeout=TIMEOUT_S) == 1
    for options in ({}, {"retries": 5}, {"replaced_task_nesting": 3}):
        t.record.apply_async((key,), task_id=first.id, headers=sent, **options)
    with monkeypatch.context() as unmarked:
        unmarked.setattr(publishes, "_marking", False)
        t.record.apply_async((key,), task_id=first.id)
    marker = t.record.apply_async((f"{key}-after",))  # same queue, published after them
    assert marker.get(timeout=TIMEOUT_S) == 1
    host = stack.workers["crawl", pool]
    wait_until(lambda: host.log().count(f"canvas.record[{first.id}] already finished") == 4,
               TIMEOUT_S, what="four duplicates dropped")
    assert stack.list(f"runs:{key}") == [first.id]
    t.record.apply_async((key,), task_id=first.id)  # a new publish
    wait_until(lambda: len(stack.list(f"runs:{key}")) == 2, TIMEOUT_S, what="the new run")
    assert stack.list(f"runs:{key}") == [first.id, first.id]


@pytest.mark.parametrize(("mode", "pool"), COMBOS, ids=IDS)
def test_revoke(stack: Stack, mode: str, pool: str) -> None:
    t = _tasks(mode, pool)
    result = t.add.apply_async((1, 1), countdown=2)
    result.revoke()
    wait_until(lambda: result.state == states.REVOKED, TIMEOUT_S, what="REVOKED")


# -- a stale (fenced) run inside a chain and a chord ---------------------------------------------
def _stale_run(stack: Stack, submit: Callable[[Any, str, str, str], Any], *,
               hold_chord: bool = False) -> tuple[Any, str, str, Any]:
    """Start ``fenced_part`` on the crawl threads worker (A), freeze A beyond its lease so the
    crawl prefork worker (B) runs it again with a newer token, let B's run write its result,
    then thaw A: A's thread ends its stale run, which fails (its fenced commit is refused) and
    whose FAILURE the audited backend refuses."""
    from tests.system import canvasapp

    a, b = ("crawl", "threads"), ("crawl", "prefork")
    key = uuid.uuid4().hex[:10]
    queue = f"stale-{key}"
    app = canvasapp.APPS[a]
    reply = app.control.add_consumer(queue, destination=[stack.hostnames[a]], reply=True,
                                     timeout=10)
    assert reply, "worker A did not add the queue"
    part = f"part-{key}"
    if hold_chord:  # B's run waits between its result write and its chord part
        stack.side().set(f"chord-hold:{part}", stack.hostnames[b])
    result = submit(canvasapp.TASKS[a], key, queue, part)
    wait_until(lambda: len(stack.list(f"runs:{key}")) == 1, TIMEOUT_S, what="A's run")
    assert stack.list(f"runs:{key}")[0]["host"] == stack.hostnames[a]
    worker_a = stack.workers[a]
    worker_a.signal_group(signal.SIGSTOP)
    try:
        assert app.control.add_consumer(queue, destination=[stack.hostnames[b]], reply=True,
                                        timeout=10)
        wait_until(lambda: len(stack.list(f"runs:{key}")) == 2, TIMEOUT_S, what="B's run")
        assert stack.list(f"runs:{key}")[1]["host"] == stack.hostnames[b]
        stack.side().set(f"gate:{key}", 1)
        written = app.AsyncResult(part)
        wait_until(lambda: written.state == states.SUCCESS, TIMEOUT_S, what="B's result")
    finally:
        worker_a.signal_group(signal.SIGCONT)
    wait_until(lambda: len(stack.list(f"ends:{key}")) == 2, TIMEOUT_S, what="A's stale end")
    fresh, stale = stack.list(f"runs:{key}")[1], stack.list(f"runs:{key}")[0]
    assert stack.list(f"ends:{key}") == [{"token": fresh["token"], "accepted": True},
                                         {"token": stale["token"], "accepted": False}]
    wait_until(lambda: "refused-stale" in worker_a.log(), TIMEOUT_S,
               what="the stale FAILURE refused")
    # Logged once the stale run's mark_as_failure (and whatever it set off) has returned.
    wait_until(lambda: f"ValueError('stale run of {key}" in worker_a.log(), TIMEOUT_S,
               what="the stale run's end")
    stack.side().set(f"chord-go:{part}", 1)
    return result, key, queue, canvasapp.TASKS[a]


def test_a_stale_run_in_a_chain_is_not_seen_by_the_chain(stack: Stack) -> None:
    """Stock reference: ``fenced_part | gated_add`` returns 100 + 1 and calls no errback."""

    def submit(t: Any, key: str, queue: str, part: str) -> Any:
        return chain(t.fenced_part.s(key).set(queue=queue, task_id=part,
                                              link_error=t.on_error.s(key=key)),
                     t.gated_add.s(1, f"{key}-next")).apply_async()

    result, key, _, _ = _stale_run(stack, submit)
    try:
        # The stale FAILURE did not fail the rest of the chain: the last link still runs.
        assert result.state in (states.PENDING, states.STARTED), result.state
    finally:
        stack.side().set(f"gate:{key}-next", 1)  # never leave a worker process blocked
    assert result.get(timeout=TIMEOUT_S) == 101
    assert stack.list(f"errbacks:{key}") == []


def test_a_stale_run_in_a_chord_is_not_counted_by_the_chord(stack: Stack) -> None:
    """Stock reference: the chord ``[fenced_part, add(1, 1), gated_add(2, 2)] | tsum`` returns
    106 and calls no errback. Here the newer run is held between its result write and its
    chord part while the stale run ends: Celery's chord keeps the first part returned for a
    member, so a counted stale FAILURE would make the chord fail with it."""

    def submit(t: Any, key: str, queue: str, part: str) -> Any:
        b_queue = "canvas-crawl-prefork"
        header = [t.fenced_part.s(key).set(queue=queue, task_id=part),
                  t.add.s(1, 1).set(queue=b_queue),
                  t.gated_add.s(2, 2, f"{key}-part").set(queue=b_queue)]
        return chord(header, t.tsum.s().on_error(t.on_error.s(key=key))).apply_async()

    result, key, _, _ = _stale_run(stack, submit, hold_chord=True)
    try:
        assert result.state == states.PENDING, result.state
    finally:
        stack.side().set(f"gate:{key}-part", 1)
    assert result.get(timeout=TIMEOUT_S) == 106
    assert stack.list(f"errbacks:{key}") == []


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_the_stale_canvases_on_stock(stack: Stack, pool: str) -> None:
    """The reference for the two tests above: the same canvases on stock Celery, no fault."""
    t = _tasks("stock", pool)
    key = uuid.uuid4().hex[:10]
    for gate in (key, f"{key}-next"):
        stack.side().set(f"gate:{gate}", 1)
    in_chain = chain(t.fenced_part.s(key).set(link_error=t.on_error.s(key=key)),
                     t.gated_add.s(1, f"{key}-next")).apply_async()
    assert in_chain.get(timeout=TIMEOUT_S) == 101
    key2 = uuid.uuid4().hex[:10]
    for gate in (key2, f"{key2}-part"):
        stack.side().set(f"gate:{gate}", 1)
    header = [t.fenced_part.s(key2), t.add.s(1, 1), t.gated_add.s(2, 2, f"{key2}-part")]
    in_chord = chord(header, t.tsum.s().on_error(t.on_error.s(key=key))).apply_async()
    assert in_chord.get(timeout=TIMEOUT_S) == 106
    assert stack.list(f"errbacks:{key}") == []
