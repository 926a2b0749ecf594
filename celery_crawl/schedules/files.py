"""Schedule files: TOML tables of entries, loaded so that one bad entry never stops the others.

Format (DESIGN.md "Schedule file")::

    [defaults]                 # optional; any entry option except task, cron, args, kwargs
    tz = "Asia/Shanghai"

    [entries.jd-prices]
    task = "workers.crawler.crawl_site"
    cron = "15 2 * * *"
    args = ["https://www.jd.com/"]

Every problem becomes a :class:`~celery_crawl.errors.ScheduleFileError` naming the file, the
entry and the field. A file that cannot be read or parsed at all (missing, too big, not UTF-8,
not TOML, nested too deep) is a single error. When two files define the same entry name, the
first one (in the order of the patterns, then file names) is kept and the second is reported
with both places named.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Callable, Mapping, Sequence
from datetime import date, time
from pathlib import Path
from typing import Any, TypeVar

from ..config import DEFAULTS
from ..durations import parse_duration
from ..errors import ConfigError, ScheduleError, ScheduleFileError
from .cron import CronExpr
from .entry import EntrySpec
from .policies import DEFAULT_CATCHUP, DEFAULT_OVERLAP, Catchup, Fold, Gap, Overlap
from .root import schedule_base
from .tzcron import TzCron, jitter_seconds
from .zones import load_zone

__all__ = [
    "MAX_FILE_BYTES",
    "LoadResult",
    "check_duplicates_with_beat_schedule",
    "load_app_schedule",
    "load_schedule_files",
    "parse_schedule_text",
]

#: Files larger than this are refused unread: a schedule is a few kilobytes, a huge file is a
#: mistake (a log, a dump) and parsing it would stall the beat.
MAX_FILE_BYTES = 1024 * 1024
#: Deepest nesting of arrays/tables accepted in a file, counting the file itself, [entries] and
#: the entry: real task arguments are shallow, and deep nesting only serves to exhaust a parser.
MAX_DEPTH = 32

#: A policy enum that a file option names one member of.
_P = TypeVar("_P", bound=enum.StrEnum)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,199}")
_TASK = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_TOP_KEYS = ("defaults", "entries")
_OPTION_KEYS = (
    "tz", "queue", "overlap", "catchup", "catchup_window", "catchup_max", "gap", "fold",
    "jitter", "expires", "priority", "paused",
)
_ENTRY_KEYS = ("task", "cron", "args", "kwargs", *_OPTION_KEYS)
_GLOB_CHARS = set("*?[")


@dataclasses.dataclass
class LoadResult:
    """What a load produced: the good entries, every error, and where each entry came from.

    Attributes:
        entries: entry name -> spec, for every entry that validated.
        errors: one error per bad file, bad entry field, or duplicate name.
        sources: entry name -> the file that defines it (as shown in errors).
        files: the files that were read, in load order.
    """

    entries: dict[str, EntrySpec] = dataclasses.field(default_factory=dict)
    errors: list[ScheduleFileError] = dataclasses.field(default_factory=list)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    files: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when there were no errors."""
        return not self.errors


def _display(path: Path, base: Path) -> str:
    # abspath, not resolve(): a symlinked file is shown under the name it was found by.
    try:
        return str(Path(os.path.abspath(path)).relative_to(os.path.abspath(base)))
    except ValueError:
        return str(path)


def _expand(patterns: Sequence[str], base: Path, result: LoadResult) -> list[Path]:
    """Files named by the patterns, each once, in pattern order and sorted within a pattern."""
    seen: set[Path] = set()
    out: list[Path] = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            result.errors.append(ScheduleFileError(f"not a path or glob: {pattern!r}"))
            continue
        # The base directory is literal even if its name holds glob characters.
        literal = pattern if os.path.isabs(pattern) else str(base / pattern)
        full = pattern if os.path.isabs(pattern) else os.path.join(glob.escape(str(base)), pattern)
        if _GLOB_CHARS & set(pattern):
            matches = sorted(glob.glob(full))
        elif os.path.isdir(literal):
            matches = sorted(glob.glob(os.path.join(glob.escape(literal), "*.toml")))
        elif os.path.exists(literal):
            matches = [literal]
        else:
            result.errors.append(ScheduleFileError("no such file", file=pattern))
            continue
        for match in matches:
            path = Path(match)
            key = path.resolve()
            if key not in seen and not path.is_dir():
                seen.add(key)
                out.append(path)
    return out


def load_schedule_files(patterns: Sequence[str], *, base_dir: str | Path = ".") -> LoadResult:
    """Load every entry of the files matched by ``patterns`` (globs, files or directories).

    Relative patterns are taken from ``base_dir``. A glob matching nothing is not an error (the
    default ``beat_schedules/*.toml`` in an app without files); a plain path that does not exist
    is. Never raises for bad input: problems are in ``LoadResult.errors``.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    base = Path(base_dir)
    result = LoadResult()
    for path in _expand(patterns, base, result):
        shown = _display(path, base)
        result.files.append(shown)
        try:
            data = _read_bytes(path, shown)
        except ScheduleFileError as exc:
            result.errors.append(exc)
            continue
        parse_schedule_text(data, shown, into=result)
    return result


def _read_bytes(path: Path, shown: str) -> bytes:
    """The file's bytes, refusing anything but a regular file of at most ``MAX_FILE_BYTES``.

    Opened non-blocking and checked with ``fstat`` on the open descriptor: a FIFO would block
    the beat forever on ``open``, and ``/dev/zero`` never ends.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ScheduleFileError(f"cannot read: {exc.strerror or exc}", file=shown) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ScheduleFileError("not a regular file", file=shown)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ScheduleFileError(f"cannot read: {exc.strerror or exc}", file=shown) from exc
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ScheduleFileError(
            f"larger than {MAX_FILE_BYTES} bytes; a schedule file should be small", file=shown
        )
    return data


def _too_deep(value: object, limit: int) -> bool:
    """Whether lists/tables nest more than ``limit`` levels (iterative: no recursion to blow)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Sequence[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if level > limit:
            return True
        stack.extend((child, level + 1) for child in children)
    return False


def parse_schedule_text(
    data: bytes | str, file: str, *, into: LoadResult | None = None
) -> LoadResult:
    """Parse one schedule file's content (as read from ``file``) into ``into``.

    Entries whose names are already in ``into`` are reported as duplicates and skipped.
    """
    result = into if into is not None else LoadResult()
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        result.errors.append(
            ScheduleFileError(f"not valid UTF-8 (byte {exc.start})", file=file)
        )
        return result
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        result.errors.append(ScheduleFileError(f"invalid TOML: {exc}", file=file))
        return result
    except RecursionError:
        result.errors.append(ScheduleFileError("nested too deep to parse", file=file))
        return result
    if _too_deep(doc, MAX_DEPTH):
        result.errors.append(
            ScheduleFileError(f"nested deeper than {MAX_DEPTH} levels", file=file)
        )
        return result
    for key in doc:
        if key not in _TOP_KEYS:
            result.errors.append(
                ScheduleFileError(
                    "unknown top-level key (expected [defaults] and [entries.NAME] tables)",
                    file=file, field=key,
                )
            )
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        result.errors.append(ScheduleFileError("must be a table", file=file, field="defaults"))
        defaults = {}
    for key in defaults:
        if key not in _OPTION_KEYS:
            hint = " (set it per entry)" if key in _ENTRY_KEYS else ""
            result.errors.append(
                ScheduleFileError(
                    f"unknown key in [defaults]{hint}; allowed: {', '.join(_OPTION_KEYS)}",
                    file=file, entry="[defaults]", field=key,
                )
            )
    defaults = {k: v for k, v in defaults.items() if k in _OPTION_KEYS}
    entries = doc.get("entries", {})
    if not isinstance(entries, dict):
        result.errors.append(ScheduleFileError("must be a table", file=file, field="entries"))
        return result
    for name, body in entries.items():
        if name in result.entries:
            result.errors.append(
                ScheduleFileError(
                    f"entry {name!r} is already defined in {result.sources[name]}; "
                    "this second definition is ignored",
                    file=file, entry=name,
                )
            )
            continue
        errors: list[ScheduleFileError] = []
        spec = _build_entry(name, body, defaults, file, errors)
        result.errors.extend(errors)
        if spec is not None:
            result.entries[name] = spec
            result.sources[name] = file
    return result


def _build_entry(
    name: str,
    body: object,
    defaults: Mapping[str, Any],
    file: str,
    errors: list[ScheduleFileError],
) -> EntrySpec | None:
    """Validate one entry; append every problem to ``errors`` and return None if any."""

    def fail(field: str | None, reason: str) -> None:
        if field is not None and field in defaults and field not in body_keys:
            reason += " (value from [defaults])"
        errors.append(ScheduleFileError(reason, file=file, entry=name, field=field))

    body_keys: set[str] = set()
    if not _NAME.fullmatch(name):
        fail(None, "entry names are 1-200 characters of letters, digits and _ . : @ - "
                   "(starting with a letter or digit)")
        return None
    if not isinstance(body, dict):
        fail(None, "must be a table ([entries.NAME] with task, cron, ...)")
        return None
    body_keys = set(body)
    for key in body:
        if key not in _ENTRY_KEYS:
            fail(key, f"unknown key; allowed: {', '.join(_ENTRY_KEYS)}")
    merged = {**defaults, **{k: v for k, v in body.items() if k in _ENTRY_KEYS}}
    values: dict[str, Any] = {}

    def take(field: str, convert: Callable[[Any], Any], default: Any) -> None:
        if field not in merged:
            values[field] = default
            return
        try:
            values[field] = convert(merged[field])
        except (ScheduleError, ConfigError, ValueError, TypeError) as exc:
            reason = exc.reason if isinstance(exc, ScheduleFileError) else str(exc)
            fail(field, reason)

    take("task", _task, None)
    if "task" not in merged:
        fail("task", "required: the dotted task name, e.g. 'workers.crawler.crawl_site'")
    if "cron" not in merged:
        fail("cron", "required: a 5- or 6-field cron expression, e.g. '15 2 * * *'")
    else:
        take("cron", lambda v: _cron(v, name), None)
    if "tz" not in merged:
        fail("tz", "required (here or in [defaults]): there is no implicit zone; "
                   "use an IANA name such as 'Europe/Berlin'")
    else:
        take("tz", _zone, None)
    take("gap", _choice(Gap), Gap.SHIFT)
    take("fold", _choice(Fold), Fold.FIRST)
    take("jitter", _jitter, 0.0)
    take("args", _args, ())
    take("kwargs", _kwargs, {})
    take("queue", _queue, None)
    take("overlap", _choice(Overlap), DEFAULT_OVERLAP)
    take("catchup", _choice(Catchup), DEFAULT_CATCHUP.mode)
    take("catchup_window", _duration("catchup_window"), DEFAULT_CATCHUP.window_s)
    take("catchup_max", _count, DEFAULT_CATCHUP.max_runs)
    take("expires", _expires, None)
    take("priority", _priority, None)
    take("paused", _bool, False)
    if errors:
        return None
    try:
        schedule = TzCron(
            merged["cron"], values["tz"], name=name, gap=values["gap"], fold=values["fold"],
            jitter=values["jitter"],
        )
    except ScheduleError as exc:
        fail("cron", str(exc))
        return None
    return EntrySpec(
        name=name,
        task=values["task"],
        schedule=schedule,
        args=values["args"],
        kwargs=values["kwargs"],
        queue=values["queue"],
        overlap=values["overlap"],
        catchup=values["catchup"],
        catchup_window_s=values["catchup_window"],
        catchup_max=values["catchup_max"],
        expires_s=values["expires"],
        priority=values["priority"],
        paused=values["paused"],
        source=file,
    )


# -- field converters (raise ValueError/ScheduleError with a reason; the caller locates it) ----


def _tname(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, date | time):
        return "a TOML date/time"
    kind = type(value).__name__
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _task(value: object) -> str:
    if not isinstance(value, str) or not _TASK.fullmatch(value):
        raise ValueError(f"expected a dotted task name like 'workers.crawler.crawl_site', "
                         f"got {value!r}" if isinstance(value, str) else
                         f"expected a string, got {_tname(value)}")
    return value


def _cron(value: object, name: str) -> CronExpr:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_tname(value)}")
    return CronExpr(value, hash_id=name)


def _zone(value: object) -> str:
    zone = load_zone(value)
    assert zone.key is not None
    return zone.key


def _choice(policy: type[_P]) -> Callable[[object], _P]:
    allowed = [p.value for p in policy]

    def convert(value: object) -> _P:
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return policy(value)

    return convert


def _duration(field: str) -> Callable[[object], float]:
    def convert(value: object) -> float:
        if isinstance(value, date | time | list | dict):
            raise ValueError(f"expected a duration like '30s' or '10m', got {_tname(value)}")
        seconds = parse_duration(value, what=field)
        if not math.isfinite(seconds):
            raise ValueError(f"expected a finite duration, got {value!r}")
        return seconds

    return convert


def _jitter(value: object) -> float:
    if isinstance(value, date | time | list | dict):
        raise ValueError(f"expected a duration like '30s', got {_tname(value)}")
    return jitter_seconds(value)


def _json_safe(value: object, where: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{where} must be JSON-serialisable (Celery sends them as JSON); dates and times "
            f"must be written as ISO strings, and NaN/inf are not allowed ({exc})"
        ) from exc


def _args(value: object) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected an array, got {_tname(value)}")
    _json_safe(value, "args")
    return tuple(value)


def _kwargs(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a table, got {_tname(value)}")
    for key in value:
        if not key.isidentifier():
            raise ValueError(f"keyword {key!r} is not a Python identifier")
    _json_safe(value, "kwargs")
    return dict(value)


def _queue(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty queue name, got {value!r}")
    return value


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {value!r}")
    if value > 100_000:
        raise ValueError(f"{value} is too many runs to catch up at once (at most 100000)")
    return value


def _expires(value: object) -> float:
    seconds = _duration("expires")(value)
    if seconds <= 0:
        raise ValueError("must be longer than zero (leave it out for no expiry)")
    return seconds


def _priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"expected an integer 0-255, got {value!r}")
    return value


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_tname(value)}")
    return value


def check_duplicates_with_beat_schedule(
    result: LoadResult, beat_schedule: Mapping[str, Any]
) -> list[ScheduleFileError]:
    """Errors for entry names defined both in a file and in ``app.conf.beat_schedule``.

    Only reports; it does not change ``result``. The caller keeps the ``beat_schedule`` copy
    (Celery already owns it) and ignores the file's, as documented in the schedules guide.
    """
    errors = []
    for name in beat_schedule or {}:
        if name in result.entries:
            errors.append(
                ScheduleFileError(
                    f"entry {name!r} is also defined in app.conf.beat_schedule; "
                    "the beat_schedule definition is kept and this one is ignored",
                    file=result.sources.get(name), entry=name,
                )
            )
    return errors


def load_app_schedule(app: Any, *, base_dir: str | Path | None = None) -> LoadResult:
    """A Celery app's whole TzCron schedule: its files plus ``TzCron`` entries of
    ``beat_schedule``.

    Files come from ``crawl_schedule_paths`` (default ``beat_schedules/*.toml``), relative to
    ``base_dir`` (default: the app's project root, as the beat resolves them). A file entry
    whose name is also in ``beat_schedule`` is reported and dropped: the ``beat_schedule``
    definition is kept. ``beat_schedule`` entries with another schedule
    type (``crontab``, intervals) are left to Celery and not included. Never raises for bad
    input.
    """
    paths = app.conf.get("crawl_schedule_paths", DEFAULTS["crawl_schedule_paths"])
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list | tuple):
        result = LoadResult()
        result.errors.append(ScheduleFileError(
            f"crawl_schedule_paths must be a list of globs, got {_tname(paths)}"))
        return result
    if base_dir is None:
        base_dir = schedule_base(app).path
    result = load_schedule_files(list(paths), base_dir=base_dir)
    beat_schedule: Mapping[str, Any] = app.conf.get("beat_schedule") or {}
    duplicates = check_duplicates_with_beat_schedule(result, beat_schedule)
    result.errors.extend(duplicates)
    for error in duplicates:
        if error.entry is not None:
            result.entries.pop(error.entry, None)
            result.sources.pop(error.entry, None)
    for name, entry in beat_schedule.items():
        schedule = entry.get("schedule") if isinstance(entry, Mapping) else None
        if not isinstance(schedule, TzCron):
            continue
        options = dict(entry.get("options") or {})
        expires = options.get("expires")
        priority = options.get("priority")
        result.entries[name] = EntrySpec(
            name=name,
            task=str(entry.get("task")),
            schedule=schedule,
            args=tuple(entry.get("args") or ()),
            kwargs=dict(entry.get("kwargs") or {}),
            queue=options.get("queue"),
            expires_s=float(expires) if isinstance(expires, int | float) else None,
            priority=priority if isinstance(priority, int) else None,
            source="beat_schedule",
        )
        result.sources[name] = "beat_schedule"
    return result
