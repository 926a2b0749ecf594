"""``/status`` (HTML) and ``/status.json`` beside ``/metrics``, in every beat and worker.

The page is read-only (the metrics server refuses every method but GET and HEAD), escapes every
value it shows (store records are written by whoever can reach the store), masks credentials in
any URL, and runs only its own two inline scripts (a Content-Security-Policy with their hashes):
one records script errors into ``data-errors`` on ``<body>``, the other ticks the page's age.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from .. import metrics
from ..clock import monotonic
from ..config import CrawlConfig
from ..errors import CrawlError
from ..leases import driver_class, store_for
from .view import gather, preload, scrub

__all__ = ["StatusSource", "install", "render_html"]

log = logging.getLogger("celery_crawl.status")

#: A view is gathered at most this often; a page reloaded in a loop costs the store nothing more.
CACHE_S = 1.0
#: Next fires listed on the page.
PAGE_LIMIT = 50

_ERRORS_JS = ("window.addEventListener('error',function(e){var b=document.body||"
              "document.documentElement;var o=b.getAttribute('data-errors');"
              "b.setAttribute('data-errors',(o?o+'\\n':'')+String(e.message));});")
_AGE_JS = ("(function(){var s=document.getElementById('age');var t0=Date.now();"
           "function tick(){s.textContent=Math.round((Date.now()-t0)/1000)+' s ago';}"
           "tick();setInterval(tick,1000);document.body.setAttribute('data-ready','1');})();")
_CSS = ("body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}"
        "table{border-collapse:collapse;margin:.4em 0 1.2em}"
        "th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}"
        "th{background:#f2f2f2}td.n{text-align:right}.bad{color:#b00020;font-weight:600}"
        "h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.2em}small{color:#666}")


def _sha(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CSP = (f"default-src 'none'; script-src {_sha(_ERRORS_JS)} {_sha(_AGE_JS)}; "
       f"style-src {_sha(_CSS)}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _e(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return html.escape(f"{value:g}")
    if isinstance(value, dict | list):
        return html.escape(json.dumps(value, sort_keys=True, default=str))
    return html.escape(str(value), quote=True)


def _table(head: list[str], rows: list[list[tuple[str, Any]]], *, id_: str) -> str:
    """A table; each cell is ``(field, value)`` and carries ``data-field`` for scripts/tests."""
    out = [f'<table id="{id_}">']
    if head:
        out.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(
            f'<td data-field="{html.escape(field)}"'
            + (' class="n"' if isinstance(v, int | float) and not isinstance(v, bool) else "")
            + f">{_e(v)}</td>" for field, v in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _kv(items: dict[str, Any], *, id_: str) -> str:
    return _table([], [[("key", k), (k, v)] for k, v in items.items()], id_=id_)


def render_html(view: dict[str, Any]) -> str:
    """The page for ``view`` (:func:`gather`, or ``{"error": ..., "process": ...}``)."""
    view = scrub(view)
    process = view.get("process") or {}
    who = " ".join(str(process.get(k)) for k in ("kind", "id") if process.get(k))
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta http-equiv='refresh' content='10'>",
        f"<title>celery-crawl status · {_e(who)}</title>",
        f"<script>{_ERRORS_JS}</script><style>{_CSS}</style></head><body>",
        f"<h1>celery-crawl status <small id='who'>{_e(who)}</small></h1>",
        f"<p><small>gathered <span id='generated'>{_e(view.get('generated'))}</span> "
        f"(<span id='age'></span>); namespace <span id='namespace'>"
        f"{_e(view.get('namespace'))}</span>; store <span id='store'>{_e(view.get('store'))}"
        "</span>; also <a href='status.json'>status.json</a>, <a href='metrics'>metrics</a>"
        "</small></p>",
    ]
    if view.get("error"):
        parts.append(f"<p class='bad' id='error'>{_e(view['error'])}</p>")
    # A worker's page is opened for the worker's own figures: they come first.
    own_first = process.get("kind") == "worker"
    if process and own_first:
        parts.append("<h2>This process</h2>" + _kv(process, id_="process"))
    if "leader" in view:
        parts.extend(_fleet(view))
    if process and not own_first:
        parts.append("<h2>This process</h2>" + _kv(process, id_="process"))
    parts.append(f"<script>{_AGE_JS}</script></body></html>")
    return "".join(parts)


def _fleet(view: dict[str, Any]) -> list[str]:
    """The beat fleet's sections: leader, replicas, next fires, skipped slots, errors."""
    parts = []
    leader = view["leader"]
    parts.append("<h2>Leader</h2>")
    if leader:
        parts.append(_kv({"holder": leader["holder"], "token": leader["token"],
                          "lease_time_left_s": leader["lease_time_left_s"]}, id_="leader"))
    else:
        parts.append("<p class='bad' id='leader'>no leader</p>")
    fleet = view.get("schedule")
    if fleet:
        parts.append(f"<p id='fleet-schedule'>The fleet runs schedule <code>"
                     f"{_e(fleet.get('fingerprint'))}</code> ({_e(fleet.get('entries'))} "
                     f"entries) since {_e(fleet.get('since'))}.</p>")
    parts.append(f"<h2>Beat replicas ({len(view['replicas'])})</h2>")
    parts.append(_table(
        ["replica", "host", "role", "token", "schedule", "entries", "clock offset (s)",
         "last seen", "blocked: why it may not lead"],
        [[("id", r["id"]), ("host", r["host"]), ("role", r["role"]),
          ("token", r["token"]),
          ("schedule", (f"{r.get('schedule') or '?'} DIFFERS" if r.get("schedule_differs")
                        else r.get("schedule"))),
          ("entries", r.get("entries")),
          ("clock_offset_s", None if r["clock_offset_s"] is None
           else f"{r['clock_offset_s']:+.3f}"),
          ("last_seen", r["last_seen"]), ("blocked", r["blocked"] or "no")]
         for r in view["replicas"]], id_="replicas"))
    parts.append("<p id='blocked-help'><small>A blocked replica keeps running as a standby but "
                 "does not take the lead, for the reason shown: its wall clock is off the "
                 "store's by more than crawl_max_clock_skew, the store may evict keys, or its "
                 "schedule differs from the one the fleet runs (crawl_beat_schedule_mismatch)."
                 " DIFFERS marks a schedule fingerprint other than the leader's.</small></p>")
    parts.append(f"<h2>Next fires ({len(view['next_fires'])} of "
                 f"{view['entries_total']} entries)</h2>")
    parts.append(_table(
        ["next fire (UTC)", "entry", "next fire (entry's zone)", "runs", "last run (UTC)",
         "last run (entry's zone)", "paused", "skipped slots"],
        [[("next_fire", r["next_fire"] or "never"), ("name", r["name"]),
          ("next_fire_local", r.get("next_fire_local") or ""),
          ("runs", r["runs"]), ("last_run", r["last_run"]),
          ("last_run_local", r.get("last_run_local")),
          ("paused", "PAUSED" if r["paused"] else ""),
          ("skipped", ", ".join(f"{k} {v}" for k, v in r["skipped"].items()))]
         for r in view["next_fires"]], id_="entries"))
    parts.append("<h2>Skipped slots by reason</h2>")
    rows: list[list[tuple[str, Any]]] = [[("reason", k), ("count", v)]
                                         for k, v in view["skipped"].items()]
    parts.append(_table(["reason", "slots"], rows or [[("reason", "none"), ("count", "")]],
                        id_="skipped"))
    if view["errors"]:
        parts.append("<h2>Errors</h2><ul id='errors'>"
                     + "".join(f"<li>{_e(err)}</li>" for err in view["errors"]) + "</ul>")
    return parts


class StatusSource:
    """Gathers the view for the page: its own store (the page is served on the metrics
    server's threads, never sharing the process's store), one gathering at a time, cached."""

    def __init__(self, app: Any, local: Callable[[], dict[str, Any]]) -> None:
        self.app = app
        self.local = local
        self._lock = threading.Lock()
        self._store: Any = None
        self._cached: tuple[float, int, dict[str, Any]] | None = None

    def view(self) -> tuple[int, dict[str, Any]]:
        """``(http status, view)``: 503 with the error when the store cannot be read."""
        with self._lock:
            now = monotonic()
            if self._cached is not None and now - self._cached[0] < CACHE_S:
                return self._cached[1], self._cached[2]
            try:
                if self._store is None:
                    self._store = store_for(CrawlConfig.from_app(self.app))
                code, view = 200, gather(self.app, self._store, limit=PAGE_LIMIT,
                                         local=self.local)
            except CrawlError as exc:
                code, view = 503, {"error": f"cannot read the store: {exc}",
                                   "process": self._local()}
            self._cached = (now, code, view)
            return code, view

    def _local(self) -> dict[str, Any]:
        try:
            return self.local()
        except Exception as exc:  # the page must still say what it can
            return {"error": str(exc)}

    def html(self) -> metrics.Response:
        code, view = self.view()
        return metrics.Response(code, "text/html; charset=utf-8",
                                render_html(view).encode(), (("Content-Security-Policy", CSP),))

    def json(self) -> metrics.Response:
        code, view = self.view()
        body = json.dumps(scrub(view), indent=1, sort_keys=True, default=str)
        return metrics.Response(code, "application/json", body.encode())


def install(app: Any, local: Callable[[], dict[str, Any]]) -> StatusSource:
    """Serve ``/status`` and ``/status.json`` on this process's metrics server (if it runs,
    or when it starts later: a crawler that starts its own metrics server gets them too)."""
    source = StatusSource(app, local)
    # Whatever the page imports on first use is imported here, on the installing thread: an
    # import first made on a server thread while the main thread imports the same modules can
    # hand one of them a half-initialized module (importlib's deadlock guard).
    preload()
    with contextlib.suppress(CrawlError):  # a bad setting is the page's to report, on view
        driver_class(CrawlConfig.from_app(app).lease_url)
    metrics.add_page("/status", source.html)
    metrics.add_page("/status.json", source.json)
    return source
