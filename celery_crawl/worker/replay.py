"""A dropped duplicate's canvas gets the outcome of the run that finished under its id.

A message whose task id already finished is dropped (``claims.py``: the done tombstone). Its
chord, chain, callbacks and errbacks were waiting on it through the message itself, so
dropping it alone would leave a canvas other than the finished run's waiting for ever. Before
the drop is acked, the canvas the message belongs to (``_canvas.canvas_key``) is compared with
the one the finished run's result went to (the audited backend stores it beside the result):

* the same canvas (the same delivery again): it had the outcome; nothing is sent;
* another canvas, the run's recorded SUCCESS: it is counted into the message's chord and passed
  to its callbacks and the next link of its chain, as Celery's tracer does after a run;
* another canvas, a recorded FAILURE or REVOKED: its chord part, the rest of its chain (marked
  FAILURE) and its errbacks get it, as Celery's ``mark_as_failure`` / ``mark_as_revoked`` give
  them;
* no outcome recorded (expired, a run that never stored one): the message's canvas fails with
  ``TaskIdReused``, naming the id, instead of waiting. A task that ignores its result records
  none by design: a redelivery of it cannot be told from a reuse, so nothing is sent (logged).

``plan`` is the decision, Celery-free; ``replay_dropped`` carries it out through the task's
result backend and the app's producer. A backend other than the audited one stores no canvas
key, so every copy that belongs to a canvas is then given the outcome, a redelivery included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery import group, signature, states
from celery.app.task import Context

from .._canvas import META_FIELD, canvas_key
from .._celery_compat import call_task_errbacks, fail_chain
from ..errors import TaskIdReused

__all__ = ["FAILED", "NOTHING", "REUSED", "SUCCEEDED", "plan", "replay_dropped", "then_ack"]

logger = logging.getLogger("celery_crawl.worker")

#: What a dropped duplicate's canvas gets (``plan``).
NOTHING = "nothing"
SUCCEEDED = "success"
FAILED = "failure"
REUSED = "reused"


def plan(dropped_canvas: str | None, meta: Mapping[str, Any] | None) -> str:
    """What the canvas of a dropped duplicate gets.

    Args:
        dropped_canvas: the dropped message's canvas key (None: nothing waits on it through
            the message).
        meta: the finished run's stored result meta (None or a non-ready one: none recorded).
    """
    if dropped_canvas is None:
        return NOTHING
    status = meta.get("status") if meta else None
    if meta and meta.get(META_FIELD) == dropped_canvas and status in states.READY_STATES:
        return NOTHING
    if status == states.SUCCESS:
        return SUCCEEDED
    if status in (states.FAILURE, states.REVOKED):
        return FAILED
    return REUSED


def request_of(message: Any, hostname: str) -> Context:
    """The request Celery would have built for ``message`` (task protocol 2)."""
    args: Any = ()
    kwargs: Any = {}
    embed: Any = {}
    payload = message.decode()
    if isinstance(payload, list | tuple) and len(payload) == 3:
        args, kwargs, embed = payload
    properties = message.properties or {}
    return Context({**message.headers, **(embed or {}), "args": args, "kwargs": kwargs,
                    "hostname": hostname, "delivery_info": message.delivery_info,
                    "reply_to": properties.get("reply_to"),
                    "correlation_id": properties.get("correlation_id")})


def replay_dropped(app: Any, task_name: str, task_id: str, message: Any, hostname: str) -> str:
    """Give the canvas of a dropped duplicate of ``task_id`` its outcome; returns the plan.

    Raises:
        Whatever the result backend or the producer raise (the caller logs it).
    """
    ctx = request_of(message, hostname)
    dropped_canvas = canvas_key(lambda name: getattr(ctx, name, None))
    if dropped_canvas is None:
        return NOTHING
    task = app.tasks.get(task_name)
    backend = task.backend if task is not None else app.backend
    meta = backend.get_task_meta(task_id, cache=False)
    action = plan(dropped_canvas, meta)
    if action == REUSED and (ctx.ignore_result or getattr(task, "ignore_result", False)):
        # Its runs record no outcome, so a redelivery cannot be told from a reuse: failing a
        # canvas that already had the outcome would be worse than leaving a reuse waiting.
        logger.warning("celery-crawl: %s[%s] ignores its result: its dropped duplicate's "
                       "canvas gets nothing (use a new id to run it again)", task_name, task_id)
        return NOTHING
    if action == SUCCEEDED:
        _succeed(app, backend, ctx, task_id, meta.get("result"))
    elif action == FAILED:
        exc = backend.exception_to_python(meta.get("result"))
        if meta.get("status") == states.REVOKED:
            if ctx.chord:
                backend.on_chord_part_return(ctx, states.REVOKED, exc)
        else:
            _fail(backend, ctx, exc, meta.get("traceback"))
    elif action == REUSED:
        exc = TaskIdReused(
            f"{task_name}[{task_id}]: this id already ran (a message under it finished) and "
            "its outcome is not recorded, so this message under the same id was dropped as a "
            "duplicate without one to pass on (task ids are reused only within crawl_done_ttl "
            "by design: give each canvas its own ids)")
        backend.mark_as_failure(task_id, exc, request=ctx, store_result=True)
    return action


def _fail(backend: Any, ctx: Context, exc: BaseException, traceback: Any) -> None:
    """What Celery's ``mark_as_failure`` does after a failed run, except storing the failure
    again under the task's own id (the finished run's is there): the chord part, the rest of
    the chain marked FAILURE (so a caller waiting on its last task sees it), the errbacks."""
    if ctx.chord:
        backend.on_chord_part_return(ctx, states.FAILURE, exc)
    fail_chain(backend, getattr(ctx, "chain", None), exc, traceback, store_result=True,
               state=states.FAILURE)
    if ctx.errbacks:
        call_task_errbacks(backend, ctx, exc, traceback)


def _succeed(app: Any, backend: Any, ctx: Context, task_id: str, retval: Any) -> None:
    """What Celery's tracer does after a successful run, with the recorded return value."""
    if ctx.chord:
        backend.on_chord_part_return(ctx, states.SUCCESS, retval)
    root_id = ctx.root_id or task_id
    callbacks = ctx.callbacks or []
    sigs = [signature(cb, app=app) for cb in callbacks]
    for sig in sigs:
        if isinstance(sig, group) or len(sigs) == 1:
            sig.apply_async((retval,), parent_id=task_id, root_id=root_id)
    plain = [s for s in sigs if not isinstance(s, group)]
    if len(sigs) > 1 and plain:
        group(plain, app=app).apply_async((retval,), parent_id=task_id, root_id=root_id)
    chain = list(ctx.chain or [])
    if chain:
        nxt = signature(chain[-1], app=app)
        nxt.apply_async((retval,), chain=chain[:-1], parent_id=task_id, root_id=root_id)


def then_ack(app: Any, task_name: str, task_id: str, message: Any, hostname: str,
             ack: Callable[[], Any],
             offload: Callable[[Callable[[], Callable[[], Any] | None]], None] | None) -> None:
    """Replay to a dropped duplicate's canvas, then ``ack`` it.

    ``offload`` runs the replay off the consumer's loop (its store calls and publishes) and
    the ack back on it; None: both here. A replay that fails is logged and the message acked
    all the same: sent again, it could count a chord part twice.
    """

    def job() -> Callable[[], Any]:
        try:
            action = replay_dropped(app, task_name, task_id, message, hostname)
        except Exception:
            logger.exception("celery-crawl: %s[%s]: giving the finished run's outcome to the "
                             "dropped duplicate's canvas failed", task_name, task_id)
        else:
            if action != NOTHING:
                logger.warning("celery-crawl: %s[%s]: the dropped duplicate belongs to another "
                               "canvas than the finished run; its canvas got %s",
                               task_name, task_id,
                               "a TaskIdReused failure (no outcome recorded)"
                               if action == REUSED else f"the recorded {action}")
        return ack

    if offload is None:
        job()()
    else:
        offload(job)
