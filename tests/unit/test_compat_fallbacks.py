"""The compatibility layer's fallbacks do what stock Celery of the installed version does.

Each test runs stock Celery's own code path and the layer's on the same installed release (CI
runs this module on Celery 5.4, 5.5, 5.6 and 5.7) and compares what they leave behind.
"""

from __future__ import annotations

import signal
from typing import Any

from celery import Celery, states
from celery.app.task import Context
from kombu.asynchronous.timer import Timer

from celery_crawl import _celery_compat as compat


def _app() -> Celery:
    app = Celery("fallbacks", set_as_current=False)
    app.conf.result_backend = "cache+memory://"
    app.conf.result_expires = 600
    return app


def _chain(app: Celery, prefix: str) -> list[dict[str, Any]]:
    return [app.signature("t.next", options={"task_id": f"{prefix}-{i}"}) for i in range(3)]


def _states(app: Celery, prefix: str) -> dict[str, str]:
    # Keyed by position: the memory cache is one per process, so each call uses its own ids.
    return {f"next-{i}": app.backend.get_state(f"{prefix}-{i}") for i in range(3)}


def test_fail_chain_marks_the_rest_of_the_chain_as_stock_does() -> None:
    exc = ValueError("boom")
    stock_app, ours_app = _app(), _app()
    request = Context(id="failed", chain=_chain(stock_app, "stock"), errbacks=None, chord=None)
    stock_app.backend.mark_as_failure("failed", exc, request=request)
    compat.fail_chain(ours_app.backend, _chain(ours_app, "ours"), exc, None, store_result=True,
                      state=states.FAILURE)
    assert _states(stock_app, "stock") == {f"next-{i}": states.FAILURE for i in range(3)}
    assert _states(ours_app, "ours") == _states(stock_app, "stock")
    assert isinstance(ours_app.backend.get_result("ours-2"), ValueError)


def test_fail_chain_stores_nothing_when_told_not_to() -> None:
    app = _app()
    compat.fail_chain(app.backend, _chain(app, "unstored"), ValueError("x"), None,
                      store_result=False, state=states.FAILURE)
    assert set(_states(app, "unstored").values()) == {states.PENDING}


def test_failure_expires_is_the_version_s_own() -> None:
    app = _app()
    app.conf.result_failure_expires = 30
    app.conf.result_backend = "redis://127.0.0.1:1/0"
    backend = app.backend
    if compat.at_least("celery", (5, 7)):
        assert compat.failure_expires(backend) == 30
    else:  # no result_failure_expires before 5.7: failures expire with every result
        assert compat.failure_expires(backend) == backend.expires == 600


class _Req:
    """Stands in for a worker request only as the timer's argument (identity matters)."""

    _already_cancelled = False


def test_cancel_quietly_cancels_a_scheduled_requests_timer_entry() -> None:
    timer = Timer()
    try:
        req, other = _Req(), _Req()
        ran: list[Any] = []
        timer.call_after(3600, ran.append, (req,))
        kept = timer.call_after(3600, ran.append, (other,))
        compat.cancel_quietly(req, timer)
        assert req._already_cancelled
        live = [item.entry for item in timer.queue if not item.entry.canceled]
        assert live == [kept]
    finally:
        timer.stop()


class _Pool:
    def __init__(self) -> None:
        self.terminated: list[tuple[int, int]] = []

    def terminate_job(self, pid: int, signum: int) -> None:
        self.terminated.append((pid, signum))


def test_cancel_request_terminates_without_announcing_a_retry() -> None:
    from celery.contrib.testing.mocks import TaskMessage
    from celery.worker.request import Request

    app = _app()

    @app.task(name="t.cancelled")
    def cancelled() -> None:
        return None

    req = Request(TaskMessage("t.cancelled", id="cancel-me"), app=app)
    req.time_start = 1.0
    req.worker_pid = 4242
    pool = _Pool()
    compat.cancel_request(req, pool, signal.SIGKILL)
    assert pool.terminated == [(4242, signal.SIGKILL)]
    assert app.backend.get_state("cancel-me") == states.PENDING  # no RETRY written
