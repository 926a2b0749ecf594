"""``TzCron``: a Celery schedule with an explicit IANA zone and an exact DST rule.

Thin glue: the wall-time pattern lives in :mod:`.cron`, the DST rule in :mod:`.slots`, the
jitter in :mod:`.jitter`. This class adds option validation, serialisation (pickle for stock
beat's shelve, JSON for stores) and the ``BaseSchedule`` interface (``is_due``,
``remaining_estimate``) so stock ``celery beat`` can use it as well as the leased scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import BaseSchedule, schedstate

from ..durations import parse_duration
from ..errors import ConfigError, ScheduleError
from .cron import cron_expr
from .fingerprint import fingerprint
from .jitter import jitter_offset_s
from .policies import Fold, Gap
from .slots import SlotRule
from .zones import load_zone

__all__ = ["MAX_JITTER_S", "TzCron", "jitter_seconds"]

#: Upper bound of ``jitter``: it spreads runs within their interval; a month is already generous.
MAX_JITTER_S = 31 * 86400.0
_DICT_KEYS = ("expr", "tz", "name", "gap", "fold", "jitter")
_KIND = "tzcron"


def jitter_seconds(value: object) -> float:
    """Validate a jitter (seconds, or a duration string such as ``"30s"``) as float seconds.

    Raises:
        ScheduleError: for a negative, non-finite, non-numeric or over-31-day value.
    """
    if isinstance(value, str):
        try:
            seconds = parse_duration(value, what="jitter")
        except ConfigError as exc:
            raise ScheduleError(str(exc)) from exc
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ScheduleError(f"jitter: expected seconds (a number), got {type(value).__name__}")
    else:
        try:
            seconds = float(value)
        except OverflowError as exc:
            raise ScheduleError(f"jitter: {value!r} is far too large") from exc
    if not math.isfinite(seconds) or seconds < 0:
        raise ScheduleError(f"jitter: must be a finite number of seconds >= 0, got {value!r}")
    if seconds > MAX_JITTER_S:
        raise ScheduleError(
            f"jitter: {value!r} is more than 31 days; jitter spreads runs within their "
            "interval, it is not a schedule of its own"
        )
    return seconds


def _aware_utc(dt: datetime, what: str) -> datetime:
    if not isinstance(dt, datetime):
        raise ScheduleError(f"{what}: expected a datetime, got {type(dt).__name__}")
    # Naive datetimes are UTC, as in celery.schedules.crontab (maybe_make_aware, naive_as_utc).
    if dt.tzinfo is None or dt.utcoffset() is None:
        return dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC)


class TzCron(BaseSchedule):  # type: ignore[misc]
    """A cron schedule in an explicit IANA zone, with cronie's DST rule and optional jitter.

    Args:
        expr: 5 fields, or 6 with seconds first; croniter syntax (``L``, ``W``, ``#``,
            ``@daily``; ``H`` hashes on ``name``).
        tz: an IANA zone name such as ``"Asia/Shanghai"`` (or a keyed ``ZoneInfo``).
        name: the entry name; seeds ``H`` fields and the jitter hash.
        gap: ``"shift"`` (a fixed-time run skipped by a spring-forward jump fires once at the
            jump) or ``"skip"``.
        fold: ``"first"``, ``"last"`` or ``"both"`` passes of a repeated hour, for fixed-time
            jobs (wildcard jobs always fire on both passes).
        jitter: seconds (or a duration string); each run is delayed by a deterministic amount in
            ``[0, jitter]``, capped at half the distance to the next slot.

    Raises:
        ScheduleError: naming the expression or zone and the reason.
    """

    def __init__(
        self,
        expr: str,
        tz: str | ZoneInfo,
        *,
        name: str | None = None,
        gap: Gap | str = Gap.SHIFT,
        fold: Fold | str = Fold.FIRST,
        jitter: float = 0,
        nowfun: Callable[[], datetime] | None = None,
        app: Any = None,
    ) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise ScheduleError(f"name: expected a non-empty string, got {name!r}")
        self._name = name
        self._cron = cron_expr(expr, hash_id=name)
        self._zone = load_zone(tz)
        self._rule = SlotRule(self._cron, self._zone, gap=gap, fold=fold)
        self._jitter_s = jitter_seconds(jitter)
        super().__init__(nowfun=nowfun, app=app)

    # -- description ---------------------------------------------------------------------------

    @property
    def expr(self) -> str:
        """The cron expression as given (surrounding whitespace removed)."""
        return self._cron.expr

    @property  # type: ignore[override]
    def tz(self) -> ZoneInfo:
        """The entry's zone (overrides ``BaseSchedule.tz``, which is the app's zone)."""
        return self._zone

    @property
    def zone_name(self) -> str:
        """The IANA name of the zone."""
        key = self._zone.key
        assert key is not None
        return key

    @property
    def name(self) -> str | None:
        """The entry name that seeds ``H`` fields and jitter."""
        return self._name

    @property
    def gap(self) -> Gap:
        """The gap policy: ``"shift"`` or ``"skip"``."""
        return self._rule.gap

    @property
    def fold(self) -> Fold:
        """The fold policy: ``"first"``, ``"last"`` or ``"both"``."""
        return self._rule.fold

    @property
    def jitter(self) -> float:
        """Maximum jitter in seconds."""
        return self._jitter_s

    @property
    def is_fixed_time(self) -> bool:
        """True when neither minute nor hour starts with ``*`` (cronie's fixed-time test)."""
        return self._cron.is_fixed_time

    # -- slots and fires -----------------------------------------------------------------------

    def next_slot(self, after: datetime) -> datetime:
        """The first nominal slot strictly after ``after`` (aware), as aware UTC."""
        if not isinstance(after, datetime) or after.tzinfo is None:
            raise ScheduleError(f"next_slot: expected an aware datetime, got {after!r}")
        return self._rule.next_slot(after)

    def slots(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Nominal slots in ``(start, end]`` (both aware), in order."""
        if start.tzinfo is None or end.tzinfo is None:
            raise ScheduleError("slots: start and end must be aware datetimes")
        return self._rule.slots(start, end)

    def fire_time(self, slot: datetime) -> datetime:
        """When the run of ``slot`` fires: the slot plus its deterministic jitter (aware UTC)."""
        slot = _aware_utc(slot, "slot")
        if self._jitter_s <= 0:
            return slot
        try:
            return self._fire_between(slot, self._rule.next_slot(slot))
        except OverflowError as exc:
            raise ScheduleError(f"{self!r}: cannot compute the fire time of {slot.isoformat()}: "
                                "outside the dates Python can represent") from exc

    def _around(self, a: datetime) -> tuple[datetime | None, datetime]:
        """The last slot at or before ``a`` if it is within ``jitter`` of it, and the first
        slot after ``a``.

        A slot's fire never reaches the next slot, so among slots at or before ``a`` only the
        last can still fire after ``a``. When several slots fit in the jitter, the last is found
        by looking back one slot interval from ``a``, then twice as far, and so on: a handful of
        ``next_slot`` calls even when the jitter spans thousands of slots.
        """
        slot = self._rule.next_slot(a - timedelta(seconds=self._jitter_s))
        if slot > a:  # the usual case: no slot within the jitter before ``a``
            return None, slot
        following = self._rule.next_slot(slot)
        # Slots are usually evenly spaced: look back one interval first, then twice as far.
        look_back_s = max(1.0, (following - slot).total_seconds())
        while following <= a:
            # Several slots fit in the jitter: jump close to ``a`` instead of stepping.
            span_s = min(look_back_s, self._jitter_s)
            probe = self._rule.next_slot(a - timedelta(seconds=span_s))
            if probe <= a:
                slot = max(slot, probe)
                following = self._rule.next_slot(slot)
                while following <= a:
                    slot, following = following, self._rule.next_slot(following)
                break
            look_back_s *= 2
        return slot, following

    def _fire_between(self, slot: datetime, following: datetime) -> datetime:
        room_s = (following - slot).total_seconds()
        return slot + timedelta(seconds=jitter_offset_s(self._name, slot, self._jitter_s, room_s))

    def next_fire(self, after: datetime) -> datetime:
        """The first fire instant strictly after ``after`` (aware), as aware UTC.

        With jitter, the last slot at or before ``after`` may still fire after it.
        """
        if not isinstance(after, datetime) or after.tzinfo is None:
            raise ScheduleError(f"next_fire: expected an aware datetime, got {after!r}")
        if self._jitter_s <= 0:
            return self._rule.next_slot(after)
        try:
            a = after.astimezone(UTC)
            previous, slot = self._around(a)
            if previous is not None:
                fire = self._fire_between(previous, slot)
                if fire > a:
                    return fire
            return self._fire_between(slot, self._rule.next_slot(slot))
        except OverflowError as exc:
            raise ScheduleError(f"{self!r}: cannot compute a fire after {after.isoformat()}: "
                                "outside the dates Python can represent") from exc

    def fires(self, start: datetime, end: datetime) -> Iterator[tuple[datetime, datetime]]:
        """``(slot, fire instant)`` pairs for the fires in ``(start, end]``, in order."""
        current = start
        try:
            end_utc = end.astimezone(UTC)
        except OverflowError:  # an end past what datetime holds: no end
            end_utc = datetime.max.replace(tzinfo=UTC)
        while True:
            fire = self.next_fire(current)
            if fire > end_utc:
                return
            # a fire lies in [its slot, the next slot): its slot is the last one <= fire
            slot = fire if self._jitter_s <= 0 else self._around(fire)[0]
            assert slot is not None
            yield slot, fire
            current = fire

    # -- BaseSchedule --------------------------------------------------------------------------

    def _now_utc(self) -> datetime:
        return _aware_utc(self.now(), "now")

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        """Time from now until the first fire after ``last_run_at`` (negative when overdue)."""
        last = _aware_utc(last_run_at, "last_run_at")
        return self.next_fire(last) - self._now_utc()

    def is_due(self, last_run_at: datetime) -> schedstate:
        """Stock beat's question: is a fire due since ``last_run_at``, and when to ask again.

        A beat that was down over several slots runs the entry once (as ``crontab`` does); the
        leased scheduler has its own catch-up policy on top of ``next_fire``.
        """
        now = self._now_utc()
        due_at = self.next_fire(_aware_utc(last_run_at, "last_run_at"))
        if due_at <= now:
            return schedstate(True, max(0.0, (self.next_fire(now) - now).total_seconds()))
        return schedstate(False, max(0.0, (due_at - now).total_seconds()))

    # -- identity and serialisation ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description; ``from_dict`` restores an equal schedule."""
        return {
            "kind": _KIND,
            "expr": self.expr,
            "tz": self.zone_name,
            "name": self._name,
            "gap": self.gap.value,
            "fold": self.fold.value,
            "jitter": self._jitter_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TzCron:
        """Rebuild from ``to_dict()`` output.

        Raises:
            ScheduleError: for a mapping that is not a TzCron description.
        """
        if not isinstance(data, Mapping):
            raise ScheduleError(f"TzCron.from_dict: expected a mapping, got {type(data).__name__}")
        if data.get("kind", _KIND) != _KIND:
            raise ScheduleError(f"TzCron.from_dict: kind {data.get('kind')!r} is not {_KIND!r}")
        unknown = sorted(set(data) - {*_DICT_KEYS, "kind"})
        if unknown:
            raise ScheduleError(f"TzCron.from_dict: unknown key {unknown[0]!r}")
        if "expr" not in data or "tz" not in data:
            raise ScheduleError("TzCron.from_dict: 'expr' and 'tz' are required")
        return cls(
            data["expr"],
            data["tz"],
            name=data.get("name"),
            gap=data.get("gap", "shift"),
            fold=data.get("fold", "first"),
            jitter=data.get("jitter", 0),
        )

    def fingerprint(self) -> str:
        """A stable digest of what defines the slots and fires: expr, zone, gap, fold, jitter."""
        canon = {
            "expr": " ".join(self._cron.fields),
            "tz": self.zone_name,
            "gap": self.gap.value,
            "fold": self.fold.value,
            "jitter": self._jitter_s,
        }
        return fingerprint(canon)

    def __reduce__(self) -> tuple[Any, ...]:
        # The app and nowfun are process-local; like celery's crontab, they are not pickled.
        return (_from_dict, (self.to_dict(),))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TzCron):
            return self.to_dict() == other.to_dict()
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.expr, self.zone_name, self._name, self.gap, self.fold, self._jitter_s))

    def __repr__(self) -> str:
        extra = "".join(
            f", {k}={v!r}"
            for k, v, default in (
                ("name", self._name, None),
                ("gap", self.gap.value, Gap.SHIFT.value),
                ("fold", self.fold.value, Fold.FIRST.value),
                ("jitter", self._jitter_s, 0.0),
            )
            if v != default
        )
        return f"<TzCron {self.expr!r} {self.zone_name}{extra}>"


def _from_dict(data: Mapping[str, Any]) -> TzCron:
    return TzCron.from_dict(data)
