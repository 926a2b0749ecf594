"""``celery -A proj crawl schedules check PATH...`` and ``celery -A proj crawl next NAME``.

Both work without a broker or a lease store: they only read files and the app's configuration.
Bad input ends with exit status 1 and a list of errors, never a traceback.
"""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime

import click

from ..cliapp import app_of
from ..errors import CrawlError, ScheduleFileError
from .entry import EntrySpec
from .files import check_duplicates_with_beat_schedule, load_app_schedule, load_schedule_files
from .ids import task_id_for

__all__ = ["register"]


def _fmt_local(instant: datetime, spec: EntrySpec) -> str:
    local = instant.astimezone(spec.schedule.tz)
    return f"{local:%Y-%m-%d %H:%M:%S %z} {local.tzname()}"


def _fmt_utc(instant: datetime) -> str:
    return f"{instant.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def _fires(spec: EntrySpec, after: datetime, count: int) -> list[tuple[datetime, datetime]]:
    out: list[tuple[datetime, datetime]] = []
    for slot, fire in spec.schedule.fires(after, datetime.max.replace(tzinfo=UTC)):
        out.append((slot, fire))
        if len(out) >= count:
            break
    return out


def _describe(spec: EntrySpec) -> str:
    s = spec.schedule
    parts = [f"cron {s.expr!r}", f"tz {s.zone_name}",
             "fixed-time" if s.is_fixed_time else "wildcard"]
    if s.is_fixed_time:
        parts.append(f"gap={s.gap} fold={s.fold}")
    if s.jitter:
        parts.append(f"jitter={s.jitter:g}s")
    if spec.queue:
        parts.append(f"queue={spec.queue}")
    if spec.paused:
        parts.append("PAUSED")
    return ", ".join(parts)


def _print_errors(errors: list[ScheduleFileError]) -> None:
    click.echo(f"{len(errors)} error(s):", err=True)
    for error in errors:
        click.echo(f"  {error}", err=True)


def _now(ctx: click.Context | None = None) -> datetime:
    # CRAWL_NOW pins "now" (ISO 8601, aware) for reproducible output in docs and tests.
    pinned = os.environ.get("CRAWL_NOW")
    if pinned:
        try:
            value = datetime.fromisoformat(pinned)
        except ValueError:
            raise click.UsageError(f"CRAWL_NOW={pinned!r} is not an ISO 8601 datetime") from None
        if value.tzinfo is None:
            raise click.UsageError(f"CRAWL_NOW={pinned!r} must include a UTC offset")
        return value.astimezone(UTC)
    return datetime.now(UTC)


@click.group(name="schedules", help="Validate and preview schedule files.")
def schedules() -> None:
    """The ``crawl schedules`` group."""


@schedules.command(name="check", short_help="Validate schedule files; show next fires.")
@click.argument("paths", nargs=-1, required=True)
@click.option("-n", "--count", default=5, show_default=True, type=click.IntRange(1, 1000),
              help="How many upcoming fires to show per entry.")
@click.pass_context
def check(ctx: click.Context, paths: tuple[str, ...], count: int) -> None:
    """Validate schedule files (paths, directories or globs) and show each entry's next fires.

    Exit status 1 when any file or entry is bad; the good entries are still shown.
    """
    try:
        result = load_schedule_files(list(paths), base_dir=".")
        # Names that clash with the app's beat_schedule are errors too (both places named).
        beat_schedule = app_of(ctx).conf.get("beat_schedule") or {}
        result.errors.extend(check_duplicates_with_beat_schedule(result, beat_schedule))
        now = _now()
        for name, spec in result.entries.items():
            click.echo(f"{name}  ({spec.source})  -> {spec.task}")
            click.echo(f"  {_describe(spec)}")
            for _slot, fire in _fires(spec, now, count):
                click.echo(f"    {_fmt_local(fire, spec):<35} {_fmt_utc(fire)}")
    except CrawlError as exc:  # a defect guard: the loader reports, it should not raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    click.echo(f"{len(result.entries)} entr{'y' if len(result.entries) == 1 else 'ies'} ok "
               f"in {len(result.files)} file(s)")
    if result.errors:
        _print_errors(result.errors)
        sys.exit(1)


@click.command(name="next", short_help="Next fires of one entry: zone, UTC, slot, task id.")
@click.argument("name")
@click.option("-n", "count", default=5, show_default=True, type=click.IntRange(1, 10000),
              help="How many upcoming fires to show.")
@click.pass_context
def next_(ctx: click.Context, name: str, count: int) -> None:
    """Show the next fires of one entry of the app's schedule (files and beat_schedule)."""
    app = app_of(ctx)
    result = load_app_schedule(app)
    spec = result.entries.get(name)
    other = (app.conf.get("beat_schedule") or {}).get(name)
    if spec is None and other is not None:
        schedule = other.get("schedule") if isinstance(other, dict) else other
        click.echo(f"error: entry {name!r} in beat_schedule has schedule {schedule!r}, not a "
                   "TzCron; `crawl next` shows TzCron entries and schedule files", err=True)
        sys.exit(1)
    if spec is None:
        known = ", ".join(sorted(result.entries)) or "none"
        click.echo(f"error: no entry {name!r} in the app's schedule (known: {known})", err=True)
        bad = [e for e in result.errors if e.entry == name or e.entry is None]
        if bad:
            _print_errors(bad)
        sys.exit(1)
    if result.errors:
        click.echo(f"warning: the app's schedule has {len(result.errors)} error(s); "
                   "see `celery crawl schedules check`", err=True)
    namespace = app.conf.get("crawl_namespace") or getattr(app, "main", None) or "celery_crawl"
    click.echo(f"{name}  ({spec.source})  -> {spec.task}")
    click.echo(f"  {_describe(spec)}")
    click.echo(f"    {'fire (' + spec.schedule.zone_name + ')':<35} {'fire (UTC)':<21} "
               f"{'slot (UTC)':<21} task id")
    try:
        for slot, fire in _fires(spec, _now(), count):
            click.echo(f"    {_fmt_local(fire, spec):<35} {_fmt_utc(fire):<21} "
                       f"{_fmt_utc(slot):<21} {task_id_for(namespace, name, slot)}")
    except CrawlError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


def register(group: click.Group) -> None:
    """Attach ``schedules check`` and ``next`` to the ``crawl`` group."""
    group.add_command(schedules)
    group.add_command(next_)
