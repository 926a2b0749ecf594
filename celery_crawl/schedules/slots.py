"""The DST rule: nominal slots of a wall-clock cron pattern in one IANA zone.

This is cronie's rule, stated in DESIGN.md ("DST rule") and in ``docs/schedules.md``:

* A job is *fixed-time* when neither its minute nor its hour field starts with ``*``; otherwise
  it is a *wildcard* job.
* Gap (clocks jump forward): a fixed-time job with one or more matching wall times inside the
  skipped interval fires **once**, at the transition instant (the first real instant after the
  jump); ``gap="skip"`` drops it. Wildcard jobs simply have no run at times that do not exist.
* Fold (clocks go back): a fixed-time job fires on the first pass only (``fold="last"``: the
  second pass only; ``fold="both"``: both). Wildcard jobs fire on both passes, so they keep
  their real-time spacing.

The *nominal slot* of a run is the UTC instant it fires at before jitter. Slots are strictly
increasing, and the calculator never imports Celery.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from ..errors import ScheduleError
from .cron import CronExpr, wall_next
from .policies import FOLD_POLICIES, GAP_POLICIES, Fold, Gap
from .zones import WallKind, resolve_wall, transition_between, utc_naive

__all__ = ["FOLD_POLICIES", "GAP_POLICIES", "SlotRule"]


# Guards against a pattern that only ever matches where the policy forbids a run; real
# schedules need at most a few thousand steps (every second through a one-hour fold).
_MAX_STEPS = 500_000
_TINY = timedelta(microseconds=1)
_MEMO_SIZE = 256


class SlotRule:
    """Nominal slots of ``cron`` in ``tz`` under a gap and a fold policy (no Celery here)."""

    __slots__ = ("_memo", "cron", "fold", "gap", "tz")

    def __init__(self, cron: CronExpr, tz: object, *, gap: Gap | str = Gap.SHIFT,
                 fold: Fold | str = Fold.FIRST):
        if gap not in GAP_POLICIES:
            raise ScheduleError(f"gap: {gap!r} must be one of {', '.join(GAP_POLICIES)}")
        if fold not in FOLD_POLICIES:
            raise ScheduleError(f"fold: {fold!r} must be one of {', '.join(FOLD_POLICIES)}")
        if not isinstance(tz, ZoneInfo):
            raise ScheduleError("SlotRule needs a ZoneInfo")
        self.cron = cron
        self.tz = tz
        self.gap = Gap(gap)
        self.fold = Fold(fold)
        # Recent answers: jitter and the scheduler ask for the same slots again and again
        # (a slot's successor is the next call's starting point). Bounded; safe to share.
        self._memo: dict[datetime, datetime] = {}

    def _allowed(
        self, kind: WallKind, first: datetime, second: datetime | None
    ) -> tuple[datetime, ...]:
        """The instants at which one matching wall time runs, per the rule."""
        fixed = self.cron.is_fixed_time
        if kind is WallKind.NORMAL:
            return (first,)
        if kind is WallKind.GAP:
            return (first,) if fixed and self.gap is Gap.SHIFT else ()
        assert second is not None
        if not fixed or self.fold is Fold.BOTH:
            return (first, second)
        return (first,) if self.fold is Fold.FIRST else (second,)

    def next_slot(self, after: datetime) -> datetime:
        """The first nominal slot strictly after the aware instant ``after``, aware UTC.

        Wall times are walked in order. Their *first* instants never decrease with the wall time
        (a gap's walls all map to its transition), so the walk stops as soon as a wall's first
        instant cannot beat the best candidate. Second-pass instants of a fold are the only ones
        that break the order, which is why a start inside a fold needs an extra look.

        Raises:
            ScheduleError: for a naive ``after`` or when no slot can be found.
        """
        if after.tzinfo is None or after.utcoffset() is None:
            raise ScheduleError(f"next_slot needs an aware datetime, got naive {after!r}")
        try:
            a = utc_naive(after)
            cached = self._memo.get(a)
            if cached is not None:
                return cached
            result = self._next_slot(a, after)
        except OverflowError as exc:
            raise ScheduleError(
                f"cron {self.cron.expr!r} in {self.tz.key}: cannot compute a run after "
                f"{after.isoformat()}: outside the dates Python can represent"
            ) from exc
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[a] = result
        return result

    def _next_slot(self, a: datetime, after: datetime) -> datetime:
        local = after.astimezone(self.tz)
        wall = local.replace(tzinfo=None)
        best: datetime | None = None
        fixed = self.cron.is_fixed_time
        second_pass = local.fold == 1
        off0 = local.utcoffset()
        off1 = local.replace(fold=1).utcoffset()
        assert off0 is not None and off1 is not None
        if not second_pass and off0 > off1 and (not fixed or self.fold is not Fold.FIRST):
            # ``after`` is on the first pass of a fold: wall times of the fold already passed
            # (from its start F0 up to ``wall``) come round again after the transition T.
            t = transition_between(a, a + (off0 - off1), self.tz)
            f0 = t + off1
            w = self.cron.next_wall(f0.replace(microsecond=0) - _TINY)
            if w <= wall:
                best = w - off1
        it = self.cron.iter_walls(wall)
        for _ in range(_MAX_STEPS):
            w = wall_next(it, self.cron.expr)
            kind, first, second = resolve_wall(w, self.tz)
            if best is not None and first >= best:
                break
            for x in self._allowed(kind, first, second):
                if x > a and (best is None or x < best):
                    best = x
            # Either this wall's first instant won (no later wall can beat it), or ``after`` is
            # on a second pass, where the remaining instants already come in wall order.
            if best is not None and (best == first or second_pass):
                break
            if kind is WallKind.GAP:
                # Every other wall time in this gap maps to the same transition and can add
                # nothing: continue from the end of the gap (an every-second job would otherwise
                # walk an hour of non-existent seconds).
                after_jump = self.tz.utcoffset(w.replace(tzinfo=self.tz, fold=1))
                assert after_jump is not None
                it.set_current(first + after_jump - _TINY, force=True)
        else:
            raise ScheduleError(
                f"cron {self.cron.expr!r} in {self.tz.key}: no run found after {after.isoformat()}"
            )
        assert best is not None
        return best.replace(tzinfo=UTC)

    def slots(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Nominal slots in ``(start, end]``, in order."""
        current = start
        try:
            end_utc = end.astimezone(UTC)
        except OverflowError:  # an end past what datetime holds: no end
            end_utc = datetime.max.replace(tzinfo=UTC)
        while True:
            current = self.next_slot(current)
            if current > end_utc:
                return
            yield current

