"""Headless Chromium (Debian's ``chromium``) for the tests that read rendered pages.

No DevTools protocol: ``--dump-dom`` gives the DOM after the page's scripts ran, and
``--enable-logging=stderr`` puts every console message (an uncaught error, a CSP violation) on
stderr as a ``CONSOLE`` line, which :func:`render` returns for the test to judge.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

from tests.servers import missing_tool

__all__ = ["Rendered", "cells", "chromium", "render", "screenshot"]

#: Screenshots go here when set (``CRAWL_SCREENSHOTS=docs/img`` refreshes the docs' ones).
SCREENSHOT_DIR = os.environ.get("CRAWL_SCREENSHOTS")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    missing_tool("chromium not installed (apt-get install chromium)")
    raise AssertionError("unreachable")


def _args(profile: str, *more: str) -> list[str]:
    return [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
            "--enable-logging=stderr", "--v=0", *more]


@dataclasses.dataclass
class Rendered:
    dom: str
    console: list[str]  #: console messages the page produced (none expected)


def render(url: str, *, timeout_s: float = 90, budget_ms: int = 5000) -> Rendered:
    """The DOM of ``url`` after its scripts ran, and its console messages."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        out = subprocess.run(
            _args(profile, f"--virtual-time-budget={budget_ms}", "--dump-dom", url),
            capture_output=True, text=True, timeout=timeout_s, start_new_session=True,
            check=False)
    assert out.returncode == 0 and "<html" in out.stdout, out.stderr[-3000:]
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    return Rendered(out.stdout, console)


def screenshot(url: str, name: str, *, size: str = "1280,900",
               timeout_s: float = 90) -> Path | None:
    """A PNG of ``url`` in ``$CRAWL_SCREENSHOTS`` (the docs' are made with
    ``CRAWL_SCREENSHOTS=docs/img``); nothing when it is unset, to keep CI time down."""
    if not SCREENSHOT_DIR:
        return None
    target = Path(SCREENSHOT_DIR) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        out = subprocess.run(
            _args(profile, "--hide-scrollbars", f"--window-size={size}",
                  "--virtual-time-budget=3000", f"--screenshot={target}", url),
            capture_output=True, text=True, timeout=timeout_s, start_new_session=True,
            check=False)
    assert out.returncode == 0 and target.stat().st_size > 1000, out.stderr[-3000:]
    return target


class _Cells(HTMLParser):
    def __init__(self, table_id: str | None, caption: str | None) -> None:
        super().__init__()
        self.table_id = table_id
        self.caption = caption
        self.depth = 0  # >0 while inside the wanted table
        self.in_caption = False
        self.caption_text = ""
        self.rows: list[list[tuple[str | None, str]]] = []
        self.cell: list[str] | None = None
        self.field: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            if self.depth:
                self.depth += 1
            elif self.table_id is not None and a.get("id") == self.table_id:
                self.depth = 1
            elif self.caption is not None:
                self.depth = 1
                self.caption_text = ""
        elif self.depth and tag == "caption":
            self.in_caption = True
        elif self.depth and tag == "tr":
            self.rows.append([])
        elif self.depth and tag == "td":
            self.cell, self.field = [], a.get("data-field")

    def handle_endtag(self, tag: str) -> None:
        if tag == "caption":
            self.in_caption = False
        elif self.depth and tag == "td" and self.cell is not None:
            self.rows[-1].append((self.field, " ".join("".join(self.cell).split())))
            self.cell = None
        elif self.depth and tag == "table":
            self.depth -= 1
            if (not self.depth and self.caption is not None
                    and self.caption not in self.caption_text):
                self.rows = []  # not the table with that caption: keep looking
            elif not self.depth:
                self.table_id = self.caption = None  # found: stop at this one

    def handle_data(self, data: str) -> None:
        if self.in_caption:
            self.caption_text += data
        elif self.cell is not None:
            self.cell.append(data)


def cells(dom: str, *, table_id: str | None = None,
          caption: str | None = None) -> list[list[tuple[str | None, str]]]:
    """Rows of the table with ``id`` ``table_id`` (or whose caption holds ``caption``): each a
    list of ``(data-field, text)`` of its ``<td>`` cells (a header row of ``<th>`` is none)."""
    parser = _Cells(table_id, caption)
    parser.feed(dom)
    return [row for row in parser.rows if row]
