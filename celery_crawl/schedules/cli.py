"""``celery -A proj crawl schedules check PATH...`` and ``celery -A proj crawl next NAME``.

Both work without a broker or a lease store: they only read files and the app's configuration,
assembled as the beat assembles them (:func:`celery_crawl.beat.assembly.assemble`), so what they
show is what the leader runs. Bad input ends with exit status 1 and a list of errors, never a
traceback.
"""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime

import click

from ..beat.assembly import AppSchedule, assemble
from ..beat.entries import BeatEntry
from ..cliapp import app_of
from ..errors import CrawlError
from .ids import task_id_for
from .tzcron import TzCron

__all__ = ["register"]


def _fmt_local(instant: datetime, schedule: TzCron) -> str:
    local = instant.astimezone(schedule.tz)
    return f"{local:%Y-%m-%d %H:%M:%S %z} {local.tzname()}"


def _fmt_utc(instant: datetime) -> str:
    return f"{instant.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def _fires(schedule: TzCron, after: datetime, count: int) -> list[tuple[datetime, datetime]]:
    out: list[tuple[datetime, datetime]] = []
    for slot, fire in schedule.fires(after, datetime.max.replace(tzinfo=UTC)):
        out.append((slot, fire))
        if len(out) >= count:
            break
    return out


def _describe(s: TzCron, queue: str | None, paused: bool) -> str:
    parts = [f"cron {s.expr!r}", f"tz {s.zone_name}",
             "fixed-time" if s.is_fixed_time else "wildcard"]
    if s.is_fixed_time:
        parts.append(f"gap={s.gap} fold={s.fold}")
    if s.jitter:
        parts.append(f"jitter={s.jitter:g}s")
    if queue:
        parts.append(f"queue={queue}")
    if paused:
        parts.append("PAUSED")
    return ", ".join(parts)


def _print_errors(errors: list[str]) -> None:
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
        schedule = assemble(app_of(ctx), paths=list(paths), base_dir=".")
        now = _now()
        for name, spec in schedule.specs.items():
            click.echo(f"{name}  ({spec.source})  -> {spec.task}")
            click.echo(f"  {_describe(spec.schedule, spec.queue, spec.paused)}")
            if not schedule.runs(name):
                click.echo(f"  not run: {_not_run(schedule, name)}")
            for _slot, fire in _fires(spec.schedule, now, count):
                click.echo(f"    {_fmt_local(fire, spec.schedule):<35} {_fmt_utc(fire)}")
    except CrawlError as exc:  # a defect guard: the loader reports, it should not raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    n = len(schedule.specs)
    click.echo(f"{n} entr{'y' if n == 1 else 'ies'} ok in {len(schedule.files)} file(s)")
    rows = [e for e in schedule.entries.values() if e.origin == "django_celery_beat"]
    if rows or schedule.source_errors:
        click.echo(f"{len(rows)} django-celery-beat row(s) run: "
                   f"{', '.join(sorted(e.name for e in rows)) or 'none'}")
    errors = [str(e) for e in (*schedule.file_errors, *schedule.duplicates)]
    errors += [f"entry {name!r}: {exc}" for name, exc in schedule.entry_errors.items()]
    errors += schedule.source_errors
    if errors:
        _print_errors(errors)
        sys.exit(1)


def _not_run(schedule: AppSchedule, name: str) -> str:
    """Why a validated file entry is not among the entries the beat runs."""
    source = schedule.sources.get(name, "")
    if source in schedule.broken:
        return (f"{source} has errors (a running beat keeps that file's previous entries; "
                "a starting one loads none of them)")
    if name in schedule.entry_errors:
        return str(schedule.entry_errors[name])
    return "app.conf.beat_schedule defines the same name (that definition runs)"


@click.command(name="next", short_help="Next fires of one entry: zone, UTC, slot, task id.")
@click.argument("name")
@click.option("-n", "count", default=5, show_default=True, type=click.IntRange(1, 10000),
              help="How many upcoming fires to show.")
@click.pass_context
def next_(ctx: click.Context, name: str, count: int) -> None:
    """Show the next fires of one entry of the app's schedule (files and beat_schedule)."""
    app = app_of(ctx)
    schedule = assemble(app)
    entry: BeatEntry | None = schedule.entries.get(name)
    if name in schedule.beat_schedule_errors:
        click.echo(f"error: beat_schedule {name!r}: {schedule.beat_schedule_errors[name]}",
                   err=True)
        sys.exit(1)
    if entry is not None and not isinstance(entry.source, TzCron):
        raw = (app.conf.get("beat_schedule") or {}).get(name)
        shown = raw.get("schedule") if isinstance(raw, dict) else raw
        click.echo(f"error: entry {name!r} in beat_schedule has schedule {shown!r}, not a "
                   "TzCron; `crawl next` shows TzCron entries and schedule files", err=True)
        sys.exit(1)
    if entry is None:
        known = ", ".join(sorted(schedule.entries)) or "none"
        if name in schedule.specs:
            click.echo(f"error: entry {name!r} is not run: {_not_run(schedule, name)}", err=True)
        else:
            click.echo(f"error: no entry {name!r} in the app's schedule (known: {known})",
                       err=True)
        bad = [str(e) for e in (*schedule.file_errors, *schedule.duplicates)
               if e.entry == name or e.entry is None]
        if bad:
            _print_errors(bad)
        sys.exit(1)
    if schedule.errors:
        click.echo(f"warning: the app's schedule has {len(schedule.errors)} error(s); "
                   "see `celery crawl schedules check`", err=True)
    tz: TzCron = entry.source
    namespace = app.conf.get("crawl_namespace") or getattr(app, "main", None) or "celery_crawl"
    click.echo(f"{name}  ({entry.origin})  -> {entry.task}")
    click.echo(f"  {_describe(tz, entry.options.get('queue'), entry.paused)}")
    click.echo(f"    {'fire (' + tz.zone_name + ')':<35} {'fire (UTC)':<21} "
               f"{'slot (UTC)':<21} task id")
    try:
        for slot, fire in _fires(tz, _now(), count):
            click.echo(f"    {_fmt_local(fire, tz):<35} {_fmt_utc(fire):<21} "
                       f"{_fmt_utc(slot):<21} {task_id_for(namespace, name, slot)}")
    except CrawlError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@schedules.group(name="import", short_help="Write a schedule file from another scheduler.")
def import_() -> None:
    """The ``crawl schedules import`` group."""


@import_.command(name="redbeat", short_help="RedBeat's entries as a schedule file.")
@click.option("--url", default=None,
              help="RedBeat's Redis (default: redbeat_redis_url, else the broker URL).")
@click.option("--prefix", default=None,
              help="RedBeat's key prefix (default: redbeat_key_prefix, else 'redbeat:').")
@click.option("-o", "--output", default="beat_schedules/redbeat.toml", show_default=True,
              help="The schedule file to write.")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.pass_context
def import_redbeat(ctx: click.Context, url: str | None, prefix: str | None, output: str,
                   force: bool) -> None:
    """Read RedBeat's entries from its Redis and write them as a schedule file, each with an
    explicit tz (the app's timezone, which RedBeat's crontabs ran in); then list the entries
    whose DST nights change and run `schedules check` on the file."""
    import redis

    from .redbeat import dst_changes, read_redbeat, render_file

    app = app_of(ctx)
    url = url or app.conf.get("redbeat_redis_url") or app.conf.broker_url
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise click.UsageError(f"--url: {url!r} is not a Redis URL (redis://host:port/db)")
    prefix = prefix or app.conf.get("redbeat_key_prefix") or "redbeat:"
    zone = app.conf.timezone or "UTC"
    tz = str(getattr(zone, "key", zone))
    if os.path.exists(output) and not force:
        raise click.UsageError(f"{output} exists; pass --force to overwrite it")
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        converted = read_redbeat(client, prefix, tz)
    except CrawlError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        client.close()
    if not converted:
        click.echo(f"error: no RedBeat entries under {prefix!r} ({prefix}:schedule is empty)",
                   err=True)
        sys.exit(1)
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    with open(output, "w", encoding="utf-8") as fh:
        fh.write(render_file(converted, tz=tz, source=f"{prefix}* keys"))
    written = [c for c in converted if c.refused is None]
    click.echo(f"wrote {len(written)} of {len(converted)} RedBeat entries to {output} "
               f"(tz {tz}, the app's timezone)")
    for conv in converted:
        if conv.refused is not None:
            click.echo(f"  not imported: {conv.name} ({conv.key}): {conv.refused}")
        for note in conv.notes:
            click.echo(f"  {conv.name}: {note}")
    now = _now()
    changes = [(c.name, line) for c in written
               for line in dst_changes(TzCron(c.fields["cron"], tz, name=c.name), start=now)]
    click.echo(f"DST nights that change in the coming year: {len(changes) or 'none'}")
    for name, line in changes:
        click.echo(f"  {name}: {line}")
    click.echo(f"--- schedules check {output}")
    ctx.invoke(check, paths=(output,), count=1)


def register(group: click.Group) -> None:
    """Attach ``schedules check`` and ``next`` to the ``crawl`` group."""
    group.add_command(schedules)
    group.add_command(next_)
