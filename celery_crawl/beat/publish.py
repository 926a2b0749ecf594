"""Publishing one run: deterministic task id, crawl headers, retries capped by lease validity.

Every run of ``(entry, slot)`` gets the task id of DESIGN.md, so a run published twice (a crash
between publish and state write, or a leader frozen right after its validity check) is the same
task twice, and the worker's claim on ``task:<id>`` lets only one of them run.

The common path builds the message with Celery's own ``amqp.create_task_message`` and sends it
with ``amqp.send_task_message`` (so ``before/after_task_publish`` signals fire as usual), with
the entry's routing resolved once per entry definition instead of once per message. That is
what ``app.send_task`` does, minus the per-call registry lookup, routing and result-backend
subscription that a beat never needs again for the same entry (measured in
``benchmarks/beat.py``). A failed first attempt is retried through ``app.send_task`` (kombu
revives the connection) while another attempt fits in the lease's remaining validity.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import datetime
from typing import Any

from .._celery_compat import exec_options, task_registry
from ..clock import monotonic
from ..publishes import SENT_HEADER
from ..schedules import task_id_for
from ..schedules.ids import task_id_for_text
from .entries import BeatEntry
from .state import format_slot

__all__ = ["RETRY_INTERVAL_S", "Publisher", "task_id_for"]

log = logging.getLogger("celery_crawl.beat")

#: Pause between publish retries; retries go on while another attempt fits in the validity.
RETRY_INTERVAL_S = 0.2
#: Publish options the scheduler sets itself; an entry cannot override them.
_RESERVED = ("task_id", "producer", "serializer", "retry", "retry_policy")
#: Keys the fast path passes to ``send_task_message`` itself; routing of a registered task
#: returns some of them (its ``serializer``, say) and they must not be passed twice.
_PASSED = frozenset((*_RESERVED, "headers"))


@dataclasses.dataclass(frozen=True, slots=True)
class _Prepared:
    """What does not change between runs of one entry definition."""

    entry: BeatEntry
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    user_headers: dict[str, Any]
    options: dict[str, Any]  # the entry's options as given (for the fallback path)
    routed: dict[str, Any]  # after routing, for send_task_message
    expires: Any
    time_limit: Any
    soft_time_limit: Any
    ignore_result: Any


class Publisher:
    """Sends runs through one producer (one broker connection for a whole burst).

    Args:
        app: the Celery app.
        namespace: the crawl namespace (part of every task id).
    """

    def __init__(self, app: Any, namespace: str) -> None:
        self.app = app
        self.namespace = namespace
        self._prepared: dict[str, _Prepared] = {}
        self._slot_key: datetime | None = None
        self._slot_text = ""
        self._fallback_logged: set[type[BaseException]] = set()

    def _prepare(self, entry: BeatEntry) -> _Prepared:
        cached = self._prepared.get(entry.name)
        if cached is not None and cached.entry is entry:
            return cached
        app = self.app
        options = dict(entry.options)
        for reserved in _RESERVED:
            options.pop(reserved, None)
        user_headers = dict(options.pop("headers", None) or {})
        # As app.send_task does: a registered task's execution options are the defaults.
        # The registry itself, as send_task reads it, so the app is not finalized for this.
        registry = task_registry(app)
        task = registry.get(entry.task) if registry is not None else None
        defaults = {k: v for k, v in exec_options(task).items() if v is not None}
        merged = dict(defaults, **options)
        expires = merged.pop("expires", None)
        time_limit = merged.pop("time_limit", None)
        soft_time_limit = merged.pop("soft_time_limit", None)
        ignore_result = merged.pop("ignore_result", None)
        args, kwargs = tuple(entry.args), dict(entry.kwargs)
        routed = app.amqp.router.route(merged, entry.task, list(args), kwargs, task)
        routed = {k: v for k, v in routed.items() if k not in _PASSED}
        prepared = _Prepared(entry, args, kwargs, user_headers, options, routed, expires,
                             time_limit, soft_time_limit, ignore_result)
        self._prepared[entry.name] = prepared
        return prepared

    def _retry(self, p: _Prepared, entry: BeatEntry, task_id: str, headers: dict[str, Any],
               producer: Any, first_error: Exception, *, deadline: float,
               first_took: float) -> None:
        """Retry through ``send_task`` (kombu revives the connection) while another attempt
        fits in the lease's validity.

        Each attempt can block for the broker's socket timeout, so the budget is time, not a
        count: an attempt is made only if the last one's duration plus the pause still ends
        before ``deadline``. A retry after an error that struck once the broker had the
        message publishes it twice under the same task id; the worker's claim makes that
        harmless.
        """
        took, error = first_took, first_error
        while True:
            if monotonic() + RETRY_INTERVAL_S + took >= deadline:
                raise error  # the scheduler records the slot as publish_failed
            time.sleep(RETRY_INTERVAL_S)
            t0 = monotonic()
            try:
                self.app.send_task(
                    entry.task, list(p.args), dict(p.kwargs), task_id=task_id,
                    producer=producer, headers=headers, serializer="json", retry=True,
                    retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0,
                                  "interval_max": 0},
                    **p.options,
                )
                return
            except Exception as exc:  # kombu raises many types; the budget decides
                took, error = max(took, monotonic() - t0), exc
                log.info("beat: entry %r: publish attempt failed after %.2fs: %s",
                         entry.name, took, exc)

    def queue_names(self, entry: BeatEntry) -> list[str]:
        """The broker queue an entry's runs are routed to (the app's default if none)."""
        queue = self._prepare(entry).routed.get("queue")
        name = getattr(queue, "name", queue) or self.app.conf.task_default_queue
        return [str(name)]

    def forget(self, names: set[str]) -> None:
        """Drop cached preparations of entries that no longer exist."""
        for name in names:
            self._prepared.pop(name, None)

    def publish(
        self,
        entry: BeatEntry,
        slot: datetime,
        *,
        token: int,
        remaining_s: float,
        producer: Any,
        manual: bool = False,
    ) -> str:
        """Publish one run and return its task id.

        Args:
            entry: what to run.
            slot: the run's nominal slot (manual runs: the trigger instant).
            token: the leader token, sent as ``crawl_leader_token``.
            remaining_s: validity left on the leader lease; bounds the retries.
            producer: the scheduler's producer.
            manual: mark the run ``crawl_manual`` (``trigger``/``backfill``).

        Raises:
            Exception: what kombu raised last, once no further attempt fits in the validity.
        """
        p = self._prepare(entry)
        if slot != self._slot_key:  # a burst shares one slot: format it once
            self._slot_key, self._slot_text = slot, format_slot(slot)
        task_id = task_id_for_text(self.namespace, entry.name, self._slot_text)
        headers: dict[str, Any] = {
            **p.user_headers,
            "crawl_entry": entry.name,
            "crawl_slot": self._slot_text,
            "crawl_leader_token": token,
            # One publish per slot, whichever leader sends it (publishes.py).
            SENT_HEADER: task_id,
        }
        if manual:
            headers["crawl_manual"] = True
        app = self.app
        amqp = app.amqp
        started = monotonic()
        try:
            message = amqp.create_task_message(
                task_id, entry.task, list(p.args), dict(p.kwargs), None, None, None, None,
                p.expires, 0, None, None, None, app.thread_oid, p.time_limit,
                p.soft_time_limit, app.conf.task_send_sent_event, None, None, None, None,
                ignore_result=p.ignore_result,
            )
            amqp.send_task_message(producer, entry.task, message, headers=headers,
                                   serializer="json", retry=False, **p.routed)
        except Exception as exc:
            if type(exc) not in self._fallback_logged:
                # Broker errors are expected here; anything else means the fast path is
                # broken for this app and every run pays for send_task: say so once a kind.
                self._fallback_logged.add(type(exc))
                log.warning("beat: publishing %r through send_task after %s: %s",
                            entry.name, type(exc).__name__, exc)
            self._retry(p, entry, task_id, headers, producer, exc,
                        deadline=started + remaining_s, first_took=monotonic() - started)
        return task_id
