"""IANA zones and the mapping from wall-clock times to real instants.

``zoneinfo`` answers one question per call; this module turns it into the three cases the DST
rule needs: a wall time exists once (*normal*), twice (*fold*, clocks went back) or never (*gap*,
clocks jumped forward), plus the exact UTC instant of the transition behind a gap.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..errors import ScheduleError

__all__ = ["WallKind", "load_zone", "resolve_wall", "transition_between", "utc_naive"]

_LOCAL_NAMES = {"local", "localtime", "system"}
_SECOND = timedelta(seconds=1)


def load_zone(tz: object) -> ZoneInfo:
    """The ``ZoneInfo`` for an IANA zone name (or a keyed ``ZoneInfo``).

    Raises:
        ScheduleError: for ``"Local"`` (the host's zone differs between replicas, so a schedule in
            it is not one schedule), ``CRON_TZ=``/``TZ=`` prefixes, and unknown zones.
    """
    if isinstance(tz, ZoneInfo):
        if tz.key is None:
            raise ScheduleError("time zone: a ZoneInfo loaded from a file has no IANA name")
        return tz
    if not isinstance(tz, str):
        raise ScheduleError(
            f"time zone must be an IANA name such as 'Europe/Berlin', got {type(tz).__name__}"
        )
    name = tz.strip()
    if not name:
        raise ScheduleError("time zone is empty; name an IANA zone such as 'Europe/Berlin'")
    if name.upper().startswith(("CRON_TZ=", "TZ=")):
        bare = name.split("=", 1)[1].strip()
        raise ScheduleError(f"time zone {tz!r}: drop the prefix and write {bare!r}")
    if name.lower() in _LOCAL_NAMES:
        raise ScheduleError(
            f"time zone {tz!r}: the host's local zone is not allowed because replicas may differ; "
            "name an IANA zone such as 'Europe/Berlin'"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ScheduleError(
            f"time zone {tz!r}: unknown IANA zone (e.g. 'America/New_York', 'Asia/Shanghai')"
        ) from exc


class WallKind(enum.Enum):
    """How many real instants show a given wall-clock time."""

    NORMAL = "normal"
    FOLD = "fold"
    GAP = "gap"


def utc_naive(dt: datetime) -> datetime:
    """An aware datetime as naive UTC (the arithmetic domain of this module)."""
    return dt.astimezone(UTC).replace(tzinfo=None)


def _offset_at(instant: datetime, tz: ZoneInfo) -> timedelta:
    offset = tz.utcoffset(instant.replace(tzinfo=UTC).astimezone(tz))
    assert offset is not None
    return offset


def transition_between(lo: datetime, hi: datetime, tz: ZoneInfo) -> datetime:
    """The first naive-UTC instant in ``(lo, hi]`` whose offset differs from the one at ``lo``.

    Bisection to the second: tzdata transitions fall on whole seconds. The caller guarantees the
    offset at ``hi`` differs from the one at ``lo``.
    """
    before = _offset_at(lo, tz)
    lo = lo.replace(microsecond=0)
    hi_s = int((hi - lo).total_seconds() + 0.999999)
    lo_s = 0
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if _offset_at(lo + mid * _SECOND, tz) == before:
            lo_s = mid
        else:
            hi_s = mid
    return lo + hi_s * _SECOND


def resolve_wall(wall: datetime, tz: ZoneInfo) -> tuple[WallKind, datetime, datetime | None]:
    """The real instants (naive UTC) showing the naive wall time ``wall`` in ``tz``.

    Returns ``(kind, first, second)``: for a normal time its instant and ``None``; for a time in
    a fold the instant on the first pass and the one on the second pass; for a time in a gap the
    transition instant (the first real instant after the jump) and ``None``.
    """
    off0 = tz.utcoffset(wall.replace(tzinfo=tz, fold=0))
    off1 = tz.utcoffset(wall.replace(tzinfo=tz, fold=1))
    assert off0 is not None and off1 is not None
    if off0 == off1:
        return WallKind.NORMAL, wall - off0, None
    if off0 > off1:
        return WallKind.FOLD, wall - off0, wall - off1
    # In a gap: fold=0 applies the offset before the jump, fold=1 the one after, so the
    # transition lies in (wall - off1, wall - off0].
    return WallKind.GAP, transition_between(wall - off1, wall - off0, tz), None
