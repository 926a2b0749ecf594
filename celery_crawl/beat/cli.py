"""``celery -A proj crawl status|pause|resume|trigger|backfill``: operate the HA beat.

Commands are pushed onto the store's command queue and applied by the current leader within
about half a second; ``status`` reads the lease, presence and entry-state records directly.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

import click

from .. import keys
from ..cliapp import app_of
from ..config import CrawlConfig
from ..errors import CrawlError
from ..leases import store_for
from .commands import make_command
from .state import EntryState, format_slot

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


def _shown(value: object, limit: int = 120) -> str:
    """A store-supplied value made safe for a terminal: records are written by whoever can
    reach the store, so control characters are escaped and long values cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return text if len(text) <= limit else text[:limit] + "..."


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

    @group.command("status", help="Leader, token, lease left, replicas, next fires.")
    @click.option("-n", "limit", default=10, show_default=True, help="next fires to show")
    @click.pass_context
    def status(ctx: click.Context, limit: int) -> None:
        app = app_of(ctx)
        store = _store(ctx)
        try:
            _status(app, store, limit)
        except CrawlError as exc:
            raise click.ClickException(str(exc)) from exc
        finally:
            store.close()


def _status(app: Any, store: Any, limit: int) -> None:
    holder = store.holder(keys.BEAT_LEADER)
    left = store.lease_ttl_left(keys.BEAT_LEADER)
    if holder:
        click.echo(f"leader:   {_shown(holder[0])}  token {holder[1]}  lease left "
                   f"{left if left is not None else '?'}s")
    else:
        click.echo("leader:   none")
    presence = store.scan(keys.beat_presence(""))
    click.echo(f"replicas: {len(presence)}")
    for rec in sorted(presence.values(), key=lambda r: str(r.get("id"))):
        off = rec.get("clock_offset_s")
        off_s = f"{off:+.3f}s" if isinstance(off, int | float) else "n/a"
        blocked = f"  BLOCKED: {_shown(rec['blocked'])}" if rec.get("blocked") else ""
        click.echo(f"  {_shown(rec.get('id'))}  {_shown(rec.get('role'))}  clock offset "
                   f"{off_s}  last seen {_shown(rec.get('last_seen'))}{blocked}")
    _next_fires(app, store, limit)


def _next_fires(app: Any, store: Any, limit: int) -> None:
    from ..schedules import load_schedule_files
    from .entries import from_beat_schedule, from_spec

    now = datetime.now(UTC)
    entries = {}
    for name, raw in (app.conf.beat_schedule or {}).items():
        try:
            entries[name] = from_beat_schedule(name, raw, app)
        except CrawlError as exc:
            click.echo(f"  ! beat_schedule {name!r}: {exc}")
    config = CrawlConfig.from_app(app)
    result = load_schedule_files(list(config.schedule_paths), base_dir=os.getcwd())
    for spec in result.entries.values():
        entries.setdefault(spec.name, from_spec(spec))
    for err in result.errors:
        click.echo(f"  ! {_shown(err, 300)}")
    names = sorted(entries)
    records = store.get_many([keys.beat_entry(n) for n in names]) if names else []
    rows = []
    for name, rec in zip(names, records, strict=True):
        entry = entries[name]
        st = EntryState.from_record(rec, key=keys.beat_entry(name)) if rec else None
        start = max(now, st.last_slot) if st and st.last_slot else now
        nxt = entry.source.next_slot(start)
        paused = (st.paused if st and st.paused is not None else entry.paused)
        rows.append((nxt, name, st, paused))
    rows.sort(key=lambda r: (r[0] is None, r[0] or now))
    click.echo(f"entries:  {len(rows)}; next fires:")
    for nxt, name, st, paused in rows[:limit]:
        when = format_slot(nxt) if nxt else "never"
        runs = st.run_count if st else 0
        last = format_slot(st.last_run_slot) if st and st.last_run_slot else "-"
        flag = "  PAUSED" if paused else ""
        click.echo(f"  {when}  {name}  runs {runs}  last run {last}{flag}")

