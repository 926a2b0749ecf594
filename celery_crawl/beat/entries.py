"""The beat's view of one periodic entry, from ``beat_schedule`` or from a schedule file.

Both origins become a :class:`BeatEntry`: a slot source, a catch-up policy, an overlap policy,
the publish options, and a fingerprint of the definition (a changed fingerprint starts the
entry's durable state afresh). ``TzCron`` schedules keep full slot semantics (DST rule, jitter);
Celery's ``schedule``/``crontab``/``solar`` are adapted so that the slot is their due instant,
truncated to the second (the task-id format has second resolution).

Celery-specific options of a ``beat_schedule`` entry stay where Celery users put them
(``options={"queue": ..., "priority": ..., "expires": ...}``); the crawl policies may be given in
the same ``options`` mapping as ``crawl_overlap``, ``crawl_catchup``, ``crawl_catchup_window``
and ``crawl_catchup_max`` and are removed before publishing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from ..durations import parse_duration
from ..errors import ConfigError, ScheduleError
from ..schedules.fingerprint import SHORT, fingerprint
from ..schedules.policies import (
    DEFAULT_CATCHUP,
    DEFAULT_OVERLAP,
    OVERLAP_POLICIES,
    CatchupPolicy,
    Overlap,
)
from .crontab_slots import CrontabSlots

__all__ = ["OVERLAP_POLICIES", "BeatEntry", "CelerySlotSource", "from_beat_schedule",
           "from_spec", "zone_name", "zoned"]

_CRAWL_OPTION_KEYS = ("crawl_overlap", "crawl_catchup", "crawl_catchup_window",
                      "crawl_catchup_max")


@dataclasses.dataclass(frozen=True, slots=True)
class BeatEntry:
    """Everything the leader needs to run one entry.

    Attributes:
        name: entry name (the run identity is ``(name, slot)``).
        task: registered task name.
        source: yields slots (``next_slot(after)``).
        fire_time: slot -> instant to publish at (jitter; identity for Celery schedules).
        args: positional arguments of the task.
        kwargs: keyword arguments of the task.
        options: publish options (``queue``, ``priority``, ``expires`` ...).
        overlap: ``skip`` | ``buffer_one`` | ``allow`` | ``cancel_other``.
        catchup: the catch-up policy.
        paused: paused by its definition (an operator override is kept in the entry state).
        fingerprint: digest of the definition.
        origin: ``"beat_schedule"`` or the schedule file it came from.
        expires_s: the message expiry, if any (also bounds the "still queued" guess).
    """

    name: str
    task: str
    source: Any
    fire_time: Callable[[datetime], datetime]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    options: Mapping[str, Any]
    overlap: Overlap
    catchup: CatchupPolicy
    paused: bool
    fingerprint: str
    origin: str
    expires_s: float | None

    def period_s(self, slot: datetime) -> float:
        """Seconds from ``slot`` to the slot after it (the "one period" of overlap rules)."""
        nxt = self.source.next_slot(slot)
        return (nxt - slot).total_seconds() if nxt is not None else 86400.0


def _identity(slot: datetime) -> datetime:
    return slot


def _floor_s(when: datetime) -> datetime:
    return when.astimezone(UTC).replace(microsecond=0)


class CelerySlotSource:
    """Slots of a Celery ``schedule``/``crontab``/``solar``: each due instant, to the second.

    A plain interval is computed directly so consecutive slots are exactly ``run_every`` apart;
    a plain ``crontab`` by :class:`CrontabSlots`, the same on every Celery version. Other
    schedules (``solar``, a subclass): ``next_slot(after) = now + remaining_estimate(after)``,
    ``after``'s next due instant whatever ``now`` is (rounded to the second, because the two
    reads of ``now`` differ by microseconds).
    """

    def __init__(self, schedule: Any) -> None:
        from celery.schedules import crontab, solar
        from celery.schedules import schedule as interval

        self.schedule = schedule
        self._interval_s: float | None = None
        self._crontab: CrontabSlots | None = None
        if type(schedule) is crontab:
            self._crontab = CrontabSlots(schedule)
        elif type(schedule) is interval:
            self._interval_s = schedule.run_every.total_seconds()
            if self._interval_s <= 0:
                raise ScheduleError(f"schedule {schedule!r}: interval must be positive")
        elif not isinstance(schedule, crontab | solar | interval) and not hasattr(
            schedule, "remaining_estimate"
        ):
            raise ScheduleError(f"{schedule!r} is not a Celery schedule")

    def next_slot(self, after: datetime) -> datetime | None:
        if self._interval_s is not None:
            nxt = _floor_s(after + timedelta(seconds=self._interval_s))
            return nxt if nxt > after else nxt + timedelta(seconds=1)
        if self._crontab is not None:
            return self._crontab.next_slot(after)
        now = self.schedule.now()
        if now.tzinfo is None:
            now = now.replace(tzinfo=UTC)
        rem = self.schedule.remaining_estimate(after)
        if rem is None:
            return None
        # ``now`` here and the one inside remaining_estimate differ by microseconds: round.
        nxt = _floor_s(now + rem + timedelta(milliseconds=500))
        if nxt <= after:
            nxt = _floor_s(after) + timedelta(seconds=1)
        return nxt

    def __repr__(self) -> str:
        return f"CelerySlotSource({self.schedule!r})"


def _policy_from_options(name: str, options: dict[str, Any]) -> tuple[Overlap, CatchupPolicy]:
    where = f"beat_schedule[{name!r}].options"
    raw = options.pop("crawl_overlap", DEFAULT_OVERLAP)
    if raw not in OVERLAP_POLICIES:
        raise ConfigError(f"{where}.crawl_overlap: {raw!r} must be one of "
                          f"{', '.join(OVERLAP_POLICIES)}")
    overlap = Overlap(raw)
    mode = options.pop("crawl_catchup", DEFAULT_CATCHUP.mode)
    window = parse_duration(options.pop("crawl_catchup_window", DEFAULT_CATCHUP.window_s),
                            what=f"{where}.crawl_catchup_window")
    cmax = options.pop("crawl_catchup_max", DEFAULT_CATCHUP.max_runs)
    try:
        policy = CatchupPolicy(mode, window_s=window, max_runs=int(cmax))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return overlap, policy


def from_beat_schedule(name: str, raw: Mapping[str, Any], app: Any) -> BeatEntry:
    """Adapt one ``app.conf.beat_schedule`` item.

    Raises:
        ConfigError: naming the entry and the field that is wrong.
    """
    from celery.schedules import maybe_schedule

    if not isinstance(raw, Mapping) or "task" not in raw or "schedule" not in raw:
        raise ConfigError(f"beat_schedule[{name!r}]: needs 'task' and 'schedule'")
    sched = maybe_schedule(raw["schedule"], raw.get("relative", False), app=app)
    options = dict(raw.get("options") or {})
    overlap, policy = _policy_from_options(name, options)
    args = tuple(raw.get("args") or ())
    kwargs = dict(raw.get("kwargs") or {})
    expires = options.get("expires")
    expires_s = float(expires.total_seconds() if isinstance(expires, timedelta) else expires) \
        if isinstance(expires, int | float | timedelta) else None
    if hasattr(sched, "next_slot") and hasattr(sched, "fire_time"):  # a TzCron
        source: Any = sched
        fire_time = sched.fire_time
        fp_sched = sched.fingerprint() if hasattr(sched, "fingerprint") else repr(sched)
    else:
        try:
            source = CelerySlotSource(sched)
        except ScheduleError as exc:
            raise ConfigError(f"beat_schedule[{name!r}].schedule: {exc}") from exc
        fire_time = _identity
        fp_sched = repr(sched)
    fp = fingerprint({"task": raw["task"], "schedule": fp_sched, "args": list(args),
                      "kwargs": kwargs, "options": options, "overlap": overlap.value,
                      "catchup": {**dataclasses.asdict(policy), "mode": policy.mode.value}},
                     digits=SHORT)
    return BeatEntry(name=name, task=str(raw["task"]), source=source, fire_time=fire_time,
                     args=args, kwargs=kwargs, options=options, overlap=overlap,
                     catchup=policy, paused=False, fingerprint=fp, origin="beat_schedule",
                     expires_s=expires_s)


def from_spec(spec: Any) -> BeatEntry:
    """Adapt a schedule-file ``EntrySpec`` (``celery_crawl.schedules``)."""
    options: dict[str, Any] = {}
    if getattr(spec, "queue", None):
        options["queue"] = spec.queue
    if getattr(spec, "priority", None) is not None:
        options["priority"] = spec.priority
    expires_s = getattr(spec, "expires_s", None)
    if expires_s is not None:
        options["expires"] = expires_s
    policy = spec.catchup_policy()
    sched = spec.schedule
    return BeatEntry(name=spec.name, task=spec.task, source=sched, fire_time=sched.fire_time,
                     args=tuple(spec.args or ()), kwargs=dict(spec.kwargs or {}),
                     options=options, overlap=spec.overlap, catchup=policy,
                     paused=bool(spec.paused), fingerprint=str(spec.fingerprint()),
                     origin=str(getattr(spec, "source", "") or "schedule file"),
                     expires_s=expires_s)


def zone_name(entry: BeatEntry) -> str:
    """The IANA zone the entry's cron is written in (``UTC`` for Celery's own schedules)."""
    name = getattr(entry.source, "zone_name", None)
    return str(name) if isinstance(name, str) and name else "UTC"


def zoned(entry: BeatEntry, slot: datetime) -> str:
    """``slot`` as wall time in the entry's zone, e.g. ``2026-03-08 02:15:00 CST``: an
    operator reads a cron written for Shanghai in Shanghai time, beside the UTC slot."""
    zone = getattr(entry.source, "tz", None)
    local = slot.astimezone(zone) if zone is not None and zone_name(entry) != "UTC" else \
        slot.astimezone(UTC)
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or zone_name(entry)}"
