"""The Celery side of a delivery: its strategy, its request, its ack.

Every call the consumer's claims make on Celery's objects for one delivery lives here (the
lifecycle itself is Celery-free, ``desk.py``): the wrapped strategy that hands a message to the
claims first, the strategy run with ack/reject callbacks that record the end before settling,
whether Celery still runs a request, and cancelling one on a lease loss.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal as _signal
from collections.abc import Callable
from typing import Any

from celery.exceptions import InvalidTaskError
from celery.worker import state as worker_state
from kombu.exceptions import ContentDisallowed, DecodeError

from .. import _celery_compat as compat
from ..publishes import SENT_HEADER
from . import replay
from .claims import Arrival, Held, lenient_int, message_digest
from .context import CLAIM_HEADER
from .delivery import Delivery
from .unforged import strip_claim_token

__all__ = ["Settle", "ack", "ack_dropped", "apply_or_refuse", "cancel_request",
           "claimed_strategy", "delivery_of", "held_for", "held_or_none", "run",
           "settle_unless_fenced", "will_run"]

logger = logging.getLogger("celery_crawl.worker")

#: ``settle()``: ack or reject the message (after its end was recorded or sent with it).
Settle = Callable[[], Any]


def claimed_strategy(task_name: str, original: Callable[..., Any], *,
                     consumer: Callable[[], Any], unprotected: set[str],
                     arrive: Callable[[Any, str, Delivery], None]) -> Callable[..., Any]:
    """``original`` (a task's strategy) with every protocol-2 message handed to ``arrive``
    first: it runs only once its claim says so (``run``)."""

    def crawl_claimed_strategy(message: Any, body: Any, ack: Callable[..., Any],
                               reject: Callable[..., Any], callbacks: Any, **kwargs: Any) -> Any:
        headers = message.headers if isinstance(message.headers, dict) else None
        if headers is None or "id" not in headers:
            # Task protocol 1: headers carry no id; run unprotected (logged once per task),
            # and without a claim token: Celery builds its request from the body and the
            # headers, so neither may bring one in.
            strip(message)
            if isinstance(body, dict):
                body.pop(CLAIM_HEADER, None)
            if task_name not in unprotected:
                unprotected.add(task_name)
                logger.warning("celery-crawl: %s arrived in task protocol 1; it runs without "
                               "a claim (set task_protocol = 2 on the producers)", task_name)
            return original(message, body, ack, reject, callbacks, **kwargs)
        arrive(message, task_name, Delivery(original, body, ack, reject, callbacks, kwargs,
                                            consumer=consumer()))
        return None

    crawl_claimed_strategy.__wrapped__ = original  # type: ignore[attr-defined]
    return crawl_claimed_strategy


def held_for(message: Any, task_name: str) -> Held:
    """A hold for a task message (protocol 2) just received."""
    headers = message.headers
    # Never trust a producer's value, wherever it put one: the token is the claim's.
    strip(message)
    info = message.delivery_info or {}
    retries = lenient_int(headers.get("retries"))
    return Held(Arrival(
        task_id=str(headers["id"]), delivery_tag=message.delivery_tag,
        queue=info.get("routing_key"), retries=retries,
        generation=(lenient_int(headers.get("replaced_task_nesting")), retries),
        digest_source=functools.partial(_digest_of, message), message=message,
        task_name=task_name, exchange=info.get("exchange"),
        routing_key=info.get("routing_key"), sent=str(headers.get(SENT_HEADER) or ""),
    ))


def held_or_none(message: Any, task_name: str) -> Held | None:
    """``held_for``, or None for a message its strategy will refuse."""
    try:
        return held_for(message, task_name)
    except InvalidTaskError:
        return None


def run(held: Held, end: Callable[[Held, str, bool, Settle], Any],
        refused: Callable[[Held], None]) -> None:
    """Run ``held``'s strategy under its claim; each ack/reject of the run goes to ``end``
    (which records the end, then settles). ``refused``: Celery refused the message itself."""
    delivery = delivery_of(held)
    held.arrival.message.headers[CLAIM_HEADER] = held.token

    def on_ack(*args: Any, **kw: Any) -> Any:
        if held.fenced:
            return None
        return end(held, "done", False, _settler(held, delivery.ack, args, kw))

    def on_reject(*args: Any, **kw: Any) -> Any:
        if held.fenced:
            return None
        requeue = bool(kw.get("requeue", args[2] if len(args) > 2 else False))
        return end(held, "rejected", requeue, _settler(held, delivery.reject, args, kw))

    try:
        delivery.strategy(held.arrival.message, delivery.body, on_ack, on_reject,
                          delivery.callbacks, **delivery.kwargs)
    except BaseException:
        # Celery refuses the message itself (undecodable body, content type not accepted,
        # invalid task): it rejects it outside our callbacks, so the claim goes here.
        refused(held)
        raise


def apply_or_refuse(consumer: Any, held: Held, apply: Callable[[], None]) -> None:
    """``apply()`` on the loop, refusing the message as Celery's ``on_task_received`` does when
    the strategy raises."""
    try:
        apply()
    except (InvalidTaskError, ContentDisallowed) as exc:
        consumer.on_invalid_task(None, held.arrival.message, exc)
    except DecodeError as exc:
        consumer.on_decode_error(held.arrival.message, exc)


def ack(held: Held, consumer: Any) -> None:
    """Ack ``held``'s message without running it (a duplicate, a poison message)."""
    _settler(held, delivery_of(held).ack,
             (logger, getattr(consumer, "connection_errors", ())), {})()


def ack_dropped(app: Any, held: Held, hostname: str, ack: Settle,
                offload: Callable[[Callable[[], Callable[[], Any] | None]], None] | None) -> None:
    """Ack a delivery dropped as a duplicate of a finished run, after its canvas (when it is
    another one than the finished run's) got that run's recorded outcome (``replay.py``)."""
    arrival = held.arrival
    replay.then_ack(app, arrival.task_name, arrival.task_id, arrival.message, hostname, ack,
                    offload)


def settle_unless_fenced(held: Held, settle: Settle) -> None:
    """Settle a message whose end was recorded, unless a lease loss released it meanwhile."""
    if not held.fenced:
        settle()


def will_run(held: Held, pool_name: str) -> bool:
    """Whether Celery still runs ``held`` (active, or queued in a pool that will run it)."""
    req = worker_state.requests.get(held.arrival.task_id)
    if req is None or compat.request_message(req) is not held.arrival.message:
        return False
    if req in worker_state.active_requests or req.time_start:
        return True
    if pool_name == "threads":
        future = compat.threads_pool_future(req)
        return future is not None and not future.done()
    return False


def cancel_request(held: Held, *, pool: Any, pool_name: str, timer: Any) -> int:
    """Cancel ``held``'s request (a lease loss): 1 if it will not run or was killed."""
    req = worker_state.requests.get(held.arrival.task_id)
    if req is None or compat.request_message(req) is not held.arrival.message:
        return 0
    # Not announced as revoked/retried: the task is not over, it runs elsewhere.
    compat.cancel_quietly(req, timer)
    if pool_name == "prefork":
        with contextlib.suppress(Exception):
            compat.cancel_request(req, pool, _signal.SIGKILL)
        if not req.time_start:
            worker_state.task_ready(req)
        return 1
    # threads pool: a running thread cannot be interrupted; only fencing protects it.
    future = compat.threads_pool_future(req)
    if future is not None and future.cancel():
        worker_state.task_ready(req)
        return 1
    if req.time_start:
        logger.error("celery-crawl: %s[%s] keeps running on the threads pool after the "
                     "lease loss; its writes are fenced by its claim token %s",
                     req.name, req.id, held.token)
    return 0


def delivery_of(held: Held) -> Delivery:
    """The strategy's arguments of a hold made by ``claimed_strategy`` (every hold is)."""
    assert held.delivery is not None, f"hold of {held.arrival.task_id} carries no delivery"
    return held.delivery


def strip(message: Any) -> None:
    """``strip_claim_token``; a body it cannot write back is left for Celery to refuse (its
    embed then still carries the key: the message must not run)."""
    try:
        strip_claim_token(message)
    except Exception as exc:
        logger.error("celery-crawl: cannot remove a forged claim token from a message (%s); "
                     "refusing it", exc)
        raise InvalidTaskError(f"a {CLAIM_HEADER} in the body that cannot be removed") from exc


def _settler(held: Held, settle: Callable[..., Any], args: tuple[Any, ...],
             kw: dict[str, Any]) -> Settle:
    """Ack or reject ``held``, unless its channel is gone (then the end is already recorded:
    the tombstone drops the redelivery, or the claim's drop lets it run again)."""

    def call() -> Any:
        if compat.channel_gone(held.arrival.message):
            logger.warning("celery-crawl: %s[%s]: its broker connection is gone; not acking "
                           "on it (kombu's visibility timeout redelivers the message later, and "
                           "the done tombstone drops that copy)", held.arrival.task_name,
                           held.arrival.task_id)
            return None
        return settle(*args, **kw)

    return call


def _digest_of(message: Any) -> str:
    """The digest of a task message as published (its claim-token header is the worker's)."""
    return message_digest(message.headers, message.body, without=CLAIM_HEADER)
