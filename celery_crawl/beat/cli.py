"""``celery -A proj crawl status|pause|resume|trigger|backfill``: operate the HA beat.

Commands are pushed onto the store's command queue and applied by the current leader within
about half a second; ``status`` reads the lease, presence and entry-state records directly
(the view every beat and worker serves at ``/status``: :mod:`celery_crawl.status`).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click

from .. import keys
from ..cliapp import app_of
from ..config import CrawlConfig
from ..errors import CrawlError
from ..leases import store_for
from ..status import gather, text_lines
from .commands import make_command

__all__ = ["register"]


def _store(ctx: click.Context) -> Any:
    try:
        return store_for(CrawlConfig.from_app(app_of(ctx)))
    except CrawlError as exc:
        raise click.ClickException(str(exc)) from exc


def _when(text: str, what: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not an ISO-8601 instant", param_hint=what) from exc
    if value.tzinfo is None:
        raise click.BadParameter(f"{text!r} has no time zone (add Z or +08:00)", param_hint=what)
    try:
        return value.astimezone(UTC)
    except OverflowError as exc:
        raise click.BadParameter(f"{text!r} is out of range", param_hint=what) from exc


def _push(ctx: click.Context, op: str, name: str, **kw: Any) -> None:
    store = _store(ctx)
    try:
        store.push(keys.BEAT_COMMANDS, make_command(op, name, **kw))
        holder = store.holder(keys.BEAT_LEADER)
    except CrawlError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    who = f"leader {holder[0]} (token {holder[1]})" if holder else "no leader yet; queued"
    click.echo(f"{op} {name}: sent to {who}")


def register(group: click.Group) -> None:
    """Attach this plugin's subcommands to the ``crawl`` group."""

    @group.command("pause", help="Stop dispatching entry NAME (slots are recorded as skipped).")
    @click.argument("name")
    @click.pass_context
    def pause(ctx: click.Context, name: str) -> None:
        _push(ctx, "pause", name)

    @group.command("resume", help="Dispatch entry NAME again from its next slot.")
    @click.argument("name")
    @click.pass_context
    def resume(ctx: click.Context, name: str) -> None:
        _push(ctx, "resume", name)

    @group.command("trigger", help="Run entry NAME now (slot = the instant the command was "
                   "issued, marked crawl_manual).")
    @click.argument("name")
    @click.pass_context
    def trigger(ctx: click.Context, name: str) -> None:
        _push(ctx, "trigger", name)

    @group.command("backfill", help="Run every slot of NAME in [--start, --end] (ISO, with TZ).")
    @click.argument("name")
    @click.option("--start", required=True, help="first instant, e.g. 2026-03-01T00:00:00Z")
    @click.option("--end", required=True, help="last instant (inclusive)")
    @click.pass_context
    def backfill(ctx: click.Context, name: str, start: str, end: str) -> None:
        s, e = _when(start, "--start"), _when(end, "--end")
        if e < s:
            raise click.BadParameter("--end is before --start", param_hint="--end")
        _push(ctx, "backfill", name, start=s, end=e)

    @group.command("status", help="Leader, token, lease left, replicas, next fires, skips.")
    @click.option("-n", "limit", default=10, show_default=True, help="next fires to show")
    @click.option("--json", "as_json", is_flag=True, help="the view /status.json serves")
    @click.pass_context
    def status(ctx: click.Context, limit: int, as_json: bool) -> None:
        app = app_of(ctx)
        store = _store(ctx)
        try:
            view = gather(app, store, limit=limit)
        except CrawlError as exc:
            raise click.ClickException(str(exc)) from exc
        finally:
            store.close()
        if as_json:
            click.echo(json.dumps(view, indent=1, sort_keys=True, default=str))
        else:
            for line in text_lines(view):
                click.echo(line)
