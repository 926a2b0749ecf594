"""Human durations (``"30s"``, ``"10m"``, ``"1h30m"``, ``"2d"``) to float seconds."""

from __future__ import annotations

import re

from .errors import ConfigError

__all__ = ["format_duration", "parse_duration"]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_MAX_S = 100 * 365 * 86400.0


def parse_duration(value: object, *, what: str = "duration") -> float:
    """Seconds from a number or a string like ``"1h30m"``.

    Raises:
        ConfigError: naming ``what`` when the value is negative, malformed, absurdly large or of
            the wrong type. Callers that know the file/entry wrap it in their own error.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a duration like '30s', got a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().replace(" ", "")
        if not text:
            raise ConfigError(f"{what}: empty duration")
        pos, seconds = 0, 0.0
        for match in _PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNITS[match.group(2)]
            pos = match.end()
        if pos != len(text):
            raise ConfigError(
                f"{what}: {value!r} is not a duration (use e.g. '30s', '10m', '1h30m', '2d')"
            )
    else:
        raise ConfigError(f"{what}: expected a duration like '30s', got {type(value).__name__}")
    if seconds != seconds or seconds < 0:
        raise ConfigError(f"{what}: must not be negative, got {value!r}")
    if seconds > _MAX_S:
        raise ConfigError(f"{what}: {value!r} is longer than 100 years")
    return seconds


def format_duration(seconds: float) -> str:
    """Short human form, the inverse of ``parse_duration`` for whole units."""
    if seconds < 1 and seconds:
        return f"{seconds * 1000:.0f}ms"
    out, rest = [], round(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(out) or "0s"
