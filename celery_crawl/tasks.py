"""``IdempotentTask`` (idempotency keys, rollback) and deadline propagation.

Idempotency: a task's key (``idempotency_key``; by default its task id) may run once. A key whose
run reached a ready state replays that outcome without running again (returns the result, or
re-raises the stored failure; a late duplicate of the same task id is dropped with ``Ignore``);
a key running elsewhere is not run concurrently: the delivery is retried later (``self.retry``,
not counted against ``max_retries``) - after the heartbeat TTL for a second delivery of the same
task id (by then the other copy has finished or is known dead), after
``idempotency_busy_countdown_s`` for another task id holding the key. The bookkeeping lives on
the result backend's Redis (``celery_crawl.backends.ledger``), which must be
``AuditedRedisBackend``.

Rollback: ``rollback(self, exc, task_id, args, kwargs)`` completes at most once per
(key, claim token), after a final failure (not on retries), when the run was fenced (a newer
run took the key over while this one was frozen), or, for a run that died unfinished, by the
run that takes its key over, before that run starts (``exc`` is ``AbandonedRun``). One run at a
time rolls a token back: it holds the token's rollback lock (expiring a heartbeat TTL after its
last extension, so a dead holder releases it); a second caller waits for the outcome, bounded
by ``rollback_wait_s``, and reports ``ROLLBACK_PENDING`` if the holder is still at it. A failing
rollback is retried with backoff in process; a killed one is finished by the next delivery of
the task. Rollbacks must therefore be idempotent. The outcome (``ROLLED_BACK`` /
``ROLLBACK_FAILED``) is stored in the result meta (``crawl_rollback``) and in the audit record.

Deadlines: a task may carry an absolute UTC deadline (``deadline=`` call option on
``IdempotentTask``, the ``crawl_deadline`` message header on any task, or inherited from the task
that publishes it). ``self.remaining()`` gives the time left. Every task published from inside a
task with a deadline (``apply_async``, chains, groups, chords) gets the deadline header, an
``expires`` no later than the deadline and time limits (``timelimit``; enforced by the prefork
pool, ignored by others) no longer than the time left, so a chain never outlives its caller.
The task messages of an app given to ``install`` (and any carrying a deadline) are published
without the broker's per-message TTL (AMQP ``expiration``, which Celery derives from
``expires``): an expired task is revoked by the worker that receives it, so it always ends in a
recorded ``REVOKED`` instead of vanishing from a RabbitMQ queue.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time
import weakref
from datetime import UTC, datetime
from typing import Any

from celery import Task, current_task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import before_task_publish

from . import _finishing as finishing
from ._celery_compat import task_registry
from .backends.audited import (
    GUARD_ATTR,
    MARKED_ATTR,
    AuditedRedisBackend,
    _claim_token,
    parse_token,
)
from .backends.ledger import Decision, Heartbeat, KeyLedger
from .errors import (
    AbandonedRun,
    ConfigError,
    CrawlError,
    FencedError,
    PoisonMessage,
    ReplayError,
    RollbackFailed,
)

__all__ = [
    "DEADLINE_HEADER",
    "IDEMPOTENCY_HEADER",
    "ROLLBACK_FAILED",
    "ROLLBACK_PENDING",
    "ROLLED_BACK",
    "IdempotentTask",
    "current_deadline",
    "deadline_headers",
    "parse_deadline",
    "remaining",
]

logger = logging.getLogger(__name__)

#: Message header holding a task's absolute deadline (ISO 8601, UTC).
DEADLINE_HEADER = "crawl_deadline"
#: Message header holding an explicit idempotency key.
IDEMPOTENCY_HEADER = "idempotency_key"
#: Rollback outcomes, as stored in the result meta (``crawl_rollback``) and the audit stream.
ROLLED_BACK = "ROLLED_BACK"
ROLLBACK_FAILED = "ROLLBACK_FAILED"
#: Another run still held the token's rollback lock when this one stopped waiting for it; that
#: run records the outcome in the key's ledger.
ROLLBACK_PENDING = "ROLLBACK_PENDING"

#: Fraction of the time left given to a subtask's soft time limit (the hard one gets all of it).
_SOFT_FRACTION = 0.9
_MIN_LIMIT_S = 0.01


def _new_run_seq() -> tuple[str, itertools.count[int]]:
    return os.urandom(8).hex(), itertools.count()


#: Run ids (``KeyLedger``: the owner of a key) are unique per run: a random prefix per process
#: (drawn again in a forked child) and a counter. A uuid4 per run cost a system call.
_run_seq = _new_run_seq()


def _reseed_run_ids() -> None:
    global _run_seq
    _run_seq = _new_run_seq()


os.register_at_fork(after_in_child=_reseed_run_ids)


def _new_run_id() -> str:
    prefix, counter = _run_seq
    return f"{prefix}{next(counter):016x}"


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


# -- deadlines -------------------------------------------------------------------------------
def parse_deadline(value: object) -> datetime:
    """An aware UTC datetime from a datetime, an ISO 8601 string or epoch seconds.

    Raises:
        ConfigError: naming ``deadline`` for a naive datetime or an unreadable value.
    """
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ConfigError(f"deadline: {value!r} is naive; give an aware UTC datetime")
        try:
            return value.astimezone(UTC)
        except (OverflowError, ValueError) as exc:
            raise ConfigError(f"deadline: {value!r} is out of range") from exc
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(float(value), UTC)
        except (OverflowError, ValueError, OSError) as exc:
            raise ConfigError(f"deadline: {value!r} is not a usable epoch time") from exc
    if isinstance(value, str) and len(value) <= 64:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError as exc:
            raise ConfigError(f"deadline: {value!r} is not an ISO 8601 time") from exc
        return parse_deadline(parsed)
    raise ConfigError(
        f"deadline: expected a datetime, ISO string or epoch seconds, got {value!r:.60}")


def deadline_headers(deadline: object) -> dict[str, str]:
    """Message headers giving any task a deadline: ``apply_async(headers=deadline_headers(d))``."""
    return {DEADLINE_HEADER: parse_deadline(deadline).isoformat()}


def _request_deadline(request: Any) -> datetime | None:
    raw = getattr(request, DEADLINE_HEADER, None) if request is not None else None
    return _header_deadline(raw)


def _header_deadline(raw: object) -> datetime | None:
    if raw is None:
        return None
    try:
        return parse_deadline(raw)
    except ConfigError:
        logger.warning("ignoring malformed %s header %.60r", DEADLINE_HEADER, raw)
        return None


def current_deadline() -> datetime | None:
    """The deadline of the task running in this thread, if it has one."""
    task = current_task
    if task is None or not getattr(task, "request", None):
        return None
    return _request_deadline(task.request)


def remaining(request: Any = None) -> float | None:
    """Seconds left before the deadline of ``request`` (default: the current task's), or None.

    Inside ``IdempotentTask`` the deadline is pinned to ``CLOCK_BOOTTIME`` when the run starts,
    so a wall-clock step during the run does not change the answer.
    """
    if request is None:
        task = current_task
        request = getattr(task, "request", None) if task is not None else None
    if request is None:
        return None
    pinned = getattr(request, "crawl_deadline_boot", None)
    if pinned is not None:
        return float(pinned) - _boottime()
    deadline = _request_deadline(request)
    if deadline is None:
        return None
    return (deadline - datetime.now(UTC)).total_seconds()


def _apply_deadline(headers: dict[str, Any], deadline: datetime) -> None:
    headers[DEADLINE_HEADER] = deadline.isoformat()
    expires = headers.get("expires")
    current = None
    if expires:
        try:
            current = parse_deadline(expires)
        except ConfigError:
            current = None
    if current is None or current > deadline:
        headers["expires"] = deadline.isoformat()
    left = max((deadline - datetime.now(UTC)).total_seconds(), _MIN_LIMIT_S)
    hard, soft = [*(headers.get("timelimit") or ()), None, None][:2]
    hard = left if hard is None else min(float(hard), left)
    soft_cap = max(left * _SOFT_FRACTION, _MIN_LIMIT_S)
    soft = soft_cap if soft is None else min(float(soft), soft_cap)
    headers["timelimit"] = [hard, soft]


def _propagate_deadline(sender: Any = None, headers: dict[str, Any] | None = None,
                        **_: Any) -> None:
    """Give every published task its own or its publisher's deadline as expires/time limits."""
    if headers is None or "task" not in headers:  # protocol 1 or not a task message
        return
    own = _header_deadline(headers.get(DEADLINE_HEADER))
    inherited = current_deadline()
    deadline = min((d for d in (own, inherited) if d is not None), default=None)
    if deadline is not None:
        _apply_deadline(headers, deadline)


before_task_publish.connect(_propagate_deadline, weak=False,
                            dispatch_uid="celery_crawl.tasks.propagate_deadline")


#: Apps whose task messages go out without the broker's per-message TTL (``install``).
_KEEP_EXPIRING: weakref.WeakSet[Any] = weakref.WeakSet()


def keep_expiring_messages(app: Any) -> None:
    """Publish ``app``'s tasks with ``expires`` without the broker's TTL (``install`` does).

    The signal Celery offers has no app: a message is judged by its task's name (registered on
    such an app) or by its crawl deadline header; another app in the same process keeps
    Celery's behaviour.
    """
    _KEEP_EXPIRING.add(app)


def _keep_expiring_messages(sender: Any = None, headers: dict[str, Any] | None = None,
                            properties: dict[str, Any] | None = None, **_: Any) -> None:
    """Publish a task with ``expires`` without the broker's per-message TTL.

    Celery turns ``expires`` into AMQP's ``expiration`` property as well. RabbitMQ then discards
    the message once it expires in the queue - which, with ``task_acks_late`` filling the
    prefetch window with running tasks, is before any worker saw it: nothing records it, and a
    caller, chain or chord waiting on it waits for ever. Without the property the message stays
    queued until a worker takes it, and the worker revokes it as expired (the ``expires``
    header), recording ``REVOKED`` and counting it into its chord, on every broker.
    """
    if properties is None or headers is None or "task" not in headers:
        return
    if "expiration" not in properties:
        return
    if DEADLINE_HEADER not in headers and not any(
            sender in (task_registry(app) or ()) for app in list(_KEEP_EXPIRING)):
        return
    properties.pop("expiration", None)


before_task_publish.connect(_keep_expiring_messages, weak=False,
                            dispatch_uid="celery_crawl.tasks.keep_expiring_messages")


# -- the task base ---------------------------------------------------------------------------
class IdempotentTask(Task):  # type: ignore[misc]
    """Task base with idempotency keys, at-most-once rollback and deadlines.

    Use as ``@app.task(base=IdempotentTask)``. Requires ``AuditedRedisBackend``
    (``result_backend = "crawlredis://..."``) and stored results (not ``ignore_result``).

    Attributes:
        idempotency_heartbeat_ttl_s: a run that has not beaten for this long counts as dead
            (default ``crawl_worker_lease_ttl``).
        idempotency_busy_countdown_s: retry delay when another task holds the key.
        rollback_max_attempts: in-process attempts of a failing rollback.
        rollback_backoff_s: first backoff between attempts (doubling, capped).
        rollback_backoff_max_s: cap of the backoff.
        rollback_wait_s: how long a run waits for another run's rollback of the same token
            (default: that run's whole backoff budget plus two heartbeat TTLs).
    """

    idempotency_heartbeat_ttl_s: float | None = None
    idempotency_busy_countdown_s: float = 1.0
    rollback_max_attempts: int = 5
    rollback_backoff_s: float = 0.5
    rollback_backoff_max_s: float = 10.0
    rollback_wait_s: float | None = None

    # -- hooks ----------------------------------------------------------------------------------
    def idempotency_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The key of this run: the ``idempotency_key`` option/header, else the task id.

        Override to derive it from the arguments (e.g. ``f"crawl:{url}:{day}"``).
        """
        explicit = getattr(self.request, IDEMPOTENCY_HEADER, None)
        return str(explicit) if explicit else str(self.request.id)

    def rollback(self, exc: BaseException, task_id: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        """Undo a run's side effects. Must be idempotent: a killed rollback is run again.

        Called after a final failure (not on retries), when the run was fenced, and before a
        run that takes the key over from a run that died unfinished (``exc`` is then
        ``AbandonedRun``): at most once per (key, claim token). The token of the run whose
        effects are undone is ``self.request.crawl_rollback_token`` (None without the worker
        plugin); ``self.request.crawl_claim_token`` is the token of the run calling it. The
        default does nothing and is not recorded.
        """

    # -- calling --------------------------------------------------------------------------------
    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: str | None = None, **options: Any) -> Any:
        """``Task.apply_async`` with two more options.

        Args:
            deadline: absolute deadline (aware datetime, ISO string or epoch seconds).
            idempotency_key: explicit key for this call.
        """
        deadline = options.pop("deadline", None)
        key = options.pop("idempotency_key", None)
        if deadline is not None or key is not None:
            headers = dict(options.pop("headers", None) or {})
            if deadline is not None:
                headers.update(deadline_headers(deadline))
            if key is not None:
                headers[IDEMPOTENCY_HEADER] = str(key)
            options["headers"] = headers
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow,
                                   **options)

    def signature_from_request(self, request: Any = None, args: Any = None, kwargs: Any = None,
                               queue: str | None = None, **extra_options: Any) -> Any:
        """Celery's, plus the idempotency key and deadline headers, so a retry keeps both."""
        sig = super().signature_from_request(request, args, kwargs, queue, **extra_options)
        request = self.request if request is None else request
        carried = {h: getattr(request, h, None) for h in (IDEMPOTENCY_HEADER, DEADLINE_HEADER)}
        carried = {k: v for k, v in carried.items() if v is not None}
        if carried:
            # Headers given to retry() explicitly win over the carried ones.
            sig.options["headers"] = {**carried, **(sig.options.get("headers") or {})}
        return sig

    def remaining(self) -> float | None:
        """Seconds left before this run's deadline (None without one)."""
        return remaining(self.request)

    # -- running --------------------------------------------------------------------------------
    def _audited_backend(self) -> AuditedRedisBackend:
        backend = self.backend
        if not isinstance(backend, AuditedRedisBackend):
            raise ConfigError(
                f"result_backend: IdempotentTask {self.name} needs AuditedRedisBackend "
                f"(crawlredis://...), got {type(backend).__name__}")
        return backend

    def _ledger(self, key: str) -> KeyLedger:
        backend = self._audited_backend()
        config = backend.crawl_config
        ttl = self.idempotency_heartbeat_ttl_s or config.worker_lease_ttl_s
        return KeyLedger(backend, config.namespace, key, ttl)

    def _has_rollback(self) -> bool:
        return type(self).rollback is not IdempotentTask.rollback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        deadline = _request_deadline(request)
        if deadline is not None:
            request.crawl_deadline_boot = (
                _boottime() + (deadline - datetime.now(UTC)).total_seconds())
        if request.called_directly or request.is_eager:
            return self.run(*args, **kwargs)
        ledger = self._ledger(self.idempotency_key(args, kwargs))
        token = _claim_token(request)
        tok = "" if token is None else str(token)
        run_id = _new_run_id()
        decision = ledger.begin(str(request.id), tok, run_id)
        if decision.kind != "run":
            return self._not_run(decision, ledger, run_id, args, kwargs)

        heartbeat = Heartbeat(ledger, run_id).start()
        try:
            if decision.extra == "takeover":
                self._undo_abandoned(ledger, run_id, decision, args, kwargs)
            try:
                result = self.run(*args, **kwargs)
            except (Retry, Ignore, Reject):
                ledger.release(run_id)
                raise
            except Exception as exc:
                outcome = self._roll_back(ledger, run_id, tok, exc, args, kwargs, final=True)
                if outcome:
                    request.crawl_rollback = outcome
                raise
            # The body has returned: what is left is bookkeeping on the result backend, so a
            # lease loss from here on keeps this run instead of killing it (_finishing.py).
            task_id = str(request.id)
            finishing.mark(task_id)
            setattr(request, MARKED_ATTR, task_id)  # the result write need not mark it again
            if heartbeat.fenced:
                raise self._fenced(ledger, run_id, tok, args, kwargs)
            if self._write_checks_key(request):
                # Nothing is published before the result write: it checks the key itself.
                setattr(request, GUARD_ATTR, _Guard(self, ledger, run_id, tok, args, kwargs))
            elif not ledger.touch(run_id):
                raise self._fenced(ledger, run_id, tok, args, kwargs)
            return result
        finally:
            heartbeat.stop()

    def _write_checks_key(self, request: Any) -> bool:
        """Whether the SUCCESS write can be this run's last check that it owns its key.

        Celery publishes a run's callbacks and the rest of its chain after the body, before
        it writes the result; a run with either checks first (``ledger.touch``), so that a
        fenced run publishes nothing. Without them the write is the next thing the run does,
        and ``store.lua`` checks ownership atomically with it (one round trip fewer).
        """
        return not (request.callbacks or request.chain or self.ignore_result
                    or getattr(request, "ignore_result", False))

    def _fenced(self, ledger: KeyLedger, run_id: str, tok: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> FencedError:
        """This run lost its key to a newer one: roll its own effects back (at most once);
        the error it fails with."""
        request = self.request
        fenced = FencedError(
            f"task {request.id}: idempotency key {ledger.key!r} was taken over by a "
            "newer run while this one ran; its result is discarded")
        outcome = self._roll_back(ledger, run_id, tok, fenced, args, kwargs, final=False)
        if outcome:
            request.crawl_rollback = outcome
        return fenced

    def _undo_abandoned(self, ledger: KeyLedger, run_id: str, decision: Decision,
                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Roll back a dead run's effects before this run redoes them (once per its token).

        A worker killed after the body's external write but before the result was stored
        leaves an effect the next delivery would repeat; rolling it back first keeps the key's
        effect single. If that rollback fails, the body does not run over what is left.
        """
        if not self._has_rollback():
            return
        request = self.request
        for dead in decision.abandoned:
            abandoned = AbandonedRun(
                f"task {decision.task_id}: the run holding idempotency key {ledger.key!r} "
                f"under claim token {dead or '(none)'} stopped before it finished; task "
                f"{request.id} takes the key over")
            outcome = self._roll_back(ledger, run_id, dead, abandoned, args, kwargs,
                                      final=False)
            logger.warning("task %s: took idempotency key %r over from a run (claim token %s) "
                           "that died unfinished; its rollback: %s", request.id, ledger.key,
                           dead or "(none)", outcome)
            if outcome == ROLLBACK_PENDING:
                # Another run still rolls these effects back: come back once it is done (the
                # key's record keeps the token owed until then).
                raise self.retry(countdown=ledger.heartbeat_ttl_ms / 1000.0,
                                 max_retries=math.inf)
            if outcome == ROLLBACK_FAILED:
                request.crawl_rollback = outcome
                raise RollbackFailed(
                    f"task {request.id}: the effects of the abandoned run (claim token "
                    f"{dead or '(none)'}) of idempotency key {ledger.key!r} could not be "
                    f"rolled back after {self.rollback_max_attempts} attempts; not running "
                    "again over them") from abandoned

    def _not_run(self, decision: Any, ledger: KeyLedger, run_id: str,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        kind = decision.kind
        if kind == "finished":
            if decision.task_id == request.id:
                raise Ignore()  # a late duplicate: the stored result stands
            return self._replay(decision.task_id)
        if kind == "finished-rb":
            request.crawl_rollback = _outcome_label(decision.rollback_status)
            if decision.task_id != request.id:
                meta = self.backend.get_task_meta(decision.task_id, cache=False)
                if meta.get("status") in self.backend.READY_STATES:
                    return self._replay(decision.task_id)
            raise self._failure_from_json(decision.extra)
        if kind == "rollback":
            exc = self._failure_from_json(decision.extra)
            heartbeat = Heartbeat(ledger, run_id).start()
            try:
                outcome = self._roll_back(ledger, run_id, decision.rollback_token, exc, args,
                                          kwargs, final=True)
            finally:
                heartbeat.stop()
            if outcome:
                request.crawl_rollback = outcome
            raise exc
        if kind == "duplicate":
            # Not dropped: the copy running elsewhere may be dead with its heartbeat not yet
            # lapsed. Come back once it would have lapsed; by then it has finished (replay)
            # or is known dead (take over).
            logger.info("task %s: already running elsewhere; retrying this delivery later",
                        request.id)
            raise self.retry(countdown=ledger.heartbeat_ttl_ms / 1000.0, max_retries=math.inf)
        # busy: another task id holds the key and is alive.
        raise self.retry(countdown=self.idempotency_busy_countdown_s, max_retries=math.inf)

    def _replay(self, task_id: str) -> Any:
        meta = self.backend.get_task_meta(task_id, cache=False)
        status = meta.get("status")
        if meta.get("crawl_rollback"):
            self.request.crawl_rollback = meta["crawl_rollback"]
        if status == "SUCCESS":
            return meta.get("result")
        result = meta.get("result")
        if isinstance(result, BaseException):
            raise result
        raise ReplayError(f"replayed task {task_id} ended {status} without a stored exception")

    def _failure_json(self, exc: BaseException) -> str:
        return json.dumps(self.backend.prepare_exception(exc, "json"), default=repr)

    def _failure_from_json(self, text: str) -> BaseException:
        try:
            exc = self.backend.exception_to_python(json.loads(text))
        except Exception as err:  # an unreadable record must still fail the task clearly
            return ReplayError(f"stored failure could not be restored ({err}): {text[:200]}")
        return exc if isinstance(exc, BaseException) else ReplayError(str(text)[:200])

    def _roll_back(self, ledger: KeyLedger, run_id: str, token: str, exc: BaseException,
                   args: tuple[Any, ...], kwargs: dict[str, Any], *, final: bool,
                   wait_s: float | None = None) -> str | None:
        """Run ``rollback`` at most once per (key, token); returns the outcome label.

        ``wait_s`` bounds the wait for another run holding the token's rollback lock (default:
        ``_rollback_wait_bound_s``)."""
        if not self._has_rollback():
            return None
        failure = self._failure_json(exc)
        bound_s = self._rollback_wait_bound_s(ledger) if wait_s is None else wait_s
        status, final = self._rollback_lock(ledger, run_id, token, failure, final, bound_s)
        if status == "done":
            return ROLLED_BACK
        if status == "failed":
            return ROLLBACK_FAILED
        if status == "wait":
            return ROLLBACK_PENDING
        delay = self.rollback_backoff_s
        task_id = str(self.request.id)
        # Which run's effects to undo: this run's own, or a dead run's (takeover, or a
        # final-failure rollback it left pending). A rollback that can tell its writes apart
        # by token undoes only those.
        self.request.crawl_rollback_token = parse_token(token) if token else None
        lock = Heartbeat(ledger, run_id, beat=lambda: ledger.rollback_touch(run_id, token))
        lock.start()
        try:
            for attempt in range(1, max(1, self.rollback_max_attempts) + 1):
                if attempt > 1 and (lock.fenced or not ledger.rollback_touch(run_id, token)):
                    # Frozen past the lock's expiry: another run took the rollback over.
                    logger.warning("task %s: lost the rollback lock of token %s; the run "
                                   "that took it over finishes the rollback", task_id,
                                   token or "(none)")
                    return ROLLBACK_PENDING
                try:
                    self.rollback(exc, task_id, args, kwargs)
                except Exception:
                    logger.exception("task %s: rollback attempt %d failed", task_id, attempt)
                    if attempt < self.rollback_max_attempts:
                        time.sleep(delay)
                        delay = min(delay * 2, self.rollback_backoff_max_s)
                    continue
                ledger.rollback_end(run_id, token, final=final, status="done")
                return ROLLED_BACK
            ledger.rollback_end(run_id, token, final=final, status="failed")
            return ROLLBACK_FAILED
        finally:
            lock.stop()
            self.request.crawl_rollback_token = None  # the body after a takeover must not see it

    def _rollback_wait_bound_s(self, ledger: KeyLedger) -> float:
        """How long a caller waits for another run's rollback of the same token: what that
        run may spend on it in process (every attempt's backoff) plus two lock TTLs (a holder
        that died is taken over once its lock expires)."""
        if self.rollback_wait_s is not None:
            return float(self.rollback_wait_s)
        backoff, delay = 0.0, self.rollback_backoff_s
        for _ in range(max(1, self.rollback_max_attempts) - 1):
            backoff += delay
            delay = min(delay * 2, self.rollback_backoff_max_s)
        return backoff + 2 * ledger.heartbeat_ttl_ms / 1000.0

    def _rollback_lock(self, ledger: KeyLedger, run_id: str, token: str, failure: str,
                       final: bool, bound_s: float) -> tuple[str, bool]:
        """Take the rollback lock of ``token``, waiting (bounded) while another run holds it.

        Returns the ledger's answer (``go``, ``done``, ``failed``; ``wait`` once the bound
        passed with the other run still holding the lock) and whether the rollback is still
        the final-failure one (a fenced run rolls back its own effects only).
        """
        deadline = _boottime() + bound_s
        waited = False
        poll = min(0.2, ledger.heartbeat_ttl_ms / 3000.0)
        while True:
            status = ledger.rollback_begin(run_id, token, final=final, failure=failure,
                                           waited=waited)
            if status == "fenced":  # no longer the owner: roll back our own effects only
                final = False
                continue
            left = deadline - _boottime()
            if status != "wait" or left <= 0:
                if status == "wait":
                    logger.warning("task %s: the rollback of token %s is still running in "
                                   "another run after %.1fs; not running it here",
                                   self.request.id, token or "(none)", bound_s)
                return status, final
            if not waited:
                logger.info("task %s: the rollback of token %s is running in another run; "
                            "waiting for its outcome", self.request.id, token or "(none)")
            waited = True
            time.sleep(min(poll, left))

    # -- the worker plugin's poison hook ----------------------------------------------------------
    def crawl_on_poison(self, task_id: str, args: Any, kwargs: Any, reason: str, *,
                        token: int | None = None, hostname: str | None = None) -> str | None:
        """Fail a task the worker gave up on (delivered ``crawl_max_deliveries`` times).

        Runs in the worker's main process: rolls the key back (at most once), then stores
        FAILURE with ``reason`` and the rollback outcome, audited like any other write.

        Returns:
            The rollback outcome label, or None when there was nothing to roll back.
        """
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        backend = self._audited_backend()
        if token is None:
            with backend.translate_errors("reading a fence record"):
                stored = backend.client.hget(backend.fence_key(task_id), "token")
            token = parse_token(stored)
        else:
            token = parse_token(token)
        tok = "" if token is None else str(token)
        exc = _poison_error(reason)
        self.push_request(id=task_id, args=args, kwargs=kwargs, called_directly=False,
                          crawl_claim_token=token, hostname=hostname)
        outcome: str | None = None
        try:
            ledger = self._ledger(self.idempotency_key(args, kwargs))
            run_id = _new_run_id()
            decision = ledger.begin(task_id, tok, run_id, force=True)
            if decision.kind in ("finished", "finished-rb"):
                outcome = _outcome_label(decision.rollback_status) or decision.extra or None
            else:
                rb_token = decision.rollback_token if decision.kind == "rollback" else tok
                # The worker's consumer runs this: it does not wait for another run's
                # rollback of the token (that run records the outcome; here it is PENDING).
                outcome = self._roll_back(ledger, run_id, rb_token, exc, args, kwargs,
                                          final=True, wait_s=0.0)
        finally:
            self.pop_request()
        request = Context(id=task_id, task=self.name, args=args, kwargs=kwargs,
                          crawl_claim_token=token, crawl_rollback=outcome, hostname=hostname)
        backend.mark_as_failure(task_id, exc, request=request)
        return outcome


class _Guard:
    """``WriteGuard`` of one run (``IdempotentTask._write_checks_key``)."""

    def __init__(self, task: IdempotentTask, ledger: KeyLedger, run_id: str, tok: str,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.record_key = ledger.record_key
        self.run_id = run_id
        self._fail = lambda: task._fenced(ledger, run_id, tok, args, kwargs)

    def fenced(self) -> BaseException:
        return self._fail()


def _poison_error(reason: str) -> CrawlError:
    return PoisonMessage(reason)


def _outcome_label(status: str) -> str:
    return {"done": ROLLED_BACK, "failed": ROLLBACK_FAILED}.get(status, "")
