"""`celery crawl audit verify|show|export`: the audit stream of ``AuditedRedisBackend``."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta

import click

from ..cliapp import app_of
from ..durations import parse_duration
from ..errors import ConfigError, CrawlError
from . import audit as audit_log
from .audited import AuditedRedisBackend

__all__ = ["register"]


def _backend(ctx: click.Context) -> AuditedRedisBackend:
    backend = app_of(ctx).backend
    if not isinstance(backend, AuditedRedisBackend):
        raise click.ClickException(
            f"result_backend is {type(backend).__name__}; `crawl audit` needs AuditedRedisBackend "
            "(result_backend = 'crawlredis://...')")
    return backend


def _since(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        try:
            return datetime.now(UTC) - timedelta(seconds=parse_duration(value, what="--since"))
        except ConfigError as exc:
            raise click.BadParameter(
                f"{value!r:.60}: give an ISO time (2026-01-31T00:00:00Z) or a duration (24h)",
                param_hint="--since") from exc
    if parsed.tzinfo is None:
        raise click.BadParameter(f"{value!r:.60} has no time zone; add Z or +00:00",
                                 param_hint="--since")
    return parsed


@click.group(name="audit", help="Audit log of the AuditedRedisBackend result backend.")
def audit() -> None:
    pass


@audit.command(name="verify")
@click.pass_context
def verify_cmd(ctx: click.Context) -> None:
    """Compare each task's last audited write with its stored result; exit 1 on divergence."""
    try:
        report = audit_log.verify(_backend(ctx))
    except CrawlError as exc:
        raise click.ClickException(str(exc)) from exc
    for task_id, why in report.missing:
        click.echo(f"MISSING   {task_id}  {why}")
    for task_id, why in report.diverging:
        click.echo(f"DIVERGING {task_id}  {why}")
    click.echo(f"{report.records} records, {report.tasks} tasks: {report.ok} ok, "
               f"{report.expired} expired, {report.forgotten} forgotten, "
               f"{len(report.missing)} missing, {len(report.diverging)} diverging")
    if not report.clean:
        sys.exit(1)


@audit.command(name="show")
@click.argument("task_id")
@click.pass_context
def show_cmd(ctx: click.Context, task_id: str) -> None:
    """Print one task's state history as a table."""
    try:
        records = audit_log.history(_backend(ctx), task_id)
    except CrawlError as exc:
        raise click.ClickException(str(exc)) from exc
    if not records:
        raise click.ClickException(f"no audit records for task {task_id:.200}")
    header = ("time (UTC)", "state", "token", "worker", "outcome", "rollback", "digest")
    rows = [(f"{r.time:%Y-%m-%d %H:%M:%S}.{r.time.microsecond // 1000:03d}", r.state,
             "" if r.token is None else str(r.token), r.worker, r.outcome, r.rollback,
             r.digest) for r in records]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@audit.command(name="export")
@click.option("--since", default=None,
              help="ISO time with zone (2026-01-31T00:00:00Z) or a duration back from now (24h).")
@click.pass_context
def export_cmd(ctx: click.Context, since: str | None) -> None:
    """Write audit records as JSON lines to stdout (for retention)."""
    try:
        out = sys.stdout
        count = audit_log.export(_backend(ctx), out, since=_since(since))
    except CrawlError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"exported {count} records", err=True)


def register(group: click.Group) -> None:
    """Attach ``audit`` to the `crawl` group."""
    group.add_command(audit)
