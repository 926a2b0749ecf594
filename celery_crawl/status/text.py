"""The status view as the lines ``celery -A proj crawl status`` prints."""

from __future__ import annotations

from typing import Any

__all__ = ["shown", "text_lines"]


def shown(value: object, limit: int = 120) -> str:
    """A store-supplied value made safe for a terminal: records are written by whoever can
    reach the store, so control characters are escaped and long values cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return text if len(text) <= limit else text[:limit] + "..."


def _skips(totals: dict[str, int]) -> str:
    return ", ".join(f"{shown(reason)} {count}" for reason, count in totals.items())


def text_lines(view: dict[str, Any]) -> list[str]:
    """``view`` (:func:`celery_crawl.status.gather`) as terminal lines."""
    lines = []
    leader = view["leader"]
    if leader:
        left = leader["lease_time_left_s"]
        lines.append(f"leader:   {shown(leader['holder'])}  token {leader['token']}  lease left "
                     f"{left if left is not None else '?'}s")
    else:
        lines.append("leader:   none")
    fleet = view.get("schedule")
    if fleet:
        lines.append(f"schedule: {shown(fleet['fingerprint'])} ({shown(fleet['entries'])} "
                     f"entries), the one the fleet runs since {shown(fleet['since'])}")
    lines.append(f"replicas: {len(view['replicas'])}")
    for rec in view["replicas"]:
        off = rec["clock_offset_s"]
        off_s = f"{off:+.3f}s" if off is not None else "n/a"
        blocked = f"  BLOCKED: {shown(rec['blocked'])}" if rec["blocked"] else ""
        differs = "  SCHEDULE DIFFERS FROM THE LEADER'S" if rec.get("schedule_differs") else ""
        lines.append(f"  {shown(rec['id'])}  {shown(rec['role'])}  schedule "
                     f"{shown(rec.get('schedule') or '?')} ({shown(rec.get('entries'))} entries)"
                     f"  clock offset {off_s}  last seen {shown(rec['last_seen'])}"
                     f"{differs}{blocked}")
    lines.extend(f"  ! {shown(err, 300)}" for err in view["errors"])
    lines.append(f"entries:  {view['entries_total']}; next fires:")
    for row in view["next_fires"]:
        flag = "  PAUSED" if row["paused"] else ""
        skipped = f"  skipped {_skips(row['skipped'])}" if row["skipped"] else ""
        local = f" ({shown(row['next_fire_local'])})" if row.get("next_fire_local") else ""
        lines.append(f"  {row['next_fire'] or 'never'}{local}  {shown(row['name'])}  runs "
                     f"{row['runs']}"
                     f"  last run {row['last_run'] or '-'}{flag}{skipped}")
    lines.append(f"skipped:  {_skips(view['skipped']) or 'none'}")
    return lines
