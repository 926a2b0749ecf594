"""Where crawled pages land: SQLite in WAL mode, every write fenced by a token.

Why fenced: a worker that was paused (GC, SIGSTOP, a VM migration) can wake up after its task
was handed to another worker and finish its stale run. Each run carries a fencing token that
grows with every hand-over (the worker plugin's claim token); an upsert whose token is older
than the one already stored for that URL is refused and logged, so the stale run cannot
overwrite newer data. Equal tokens are accepted: that is the same run retrying its own write.

Why WAL: several pool processes and workers write concurrently; WAL lets readers (the summary,
tests) read while one writer commits, and ``busy_timeout`` serialises the writers.

Tables: ``pages`` (one row per URL, with ``writes`` counting accepted upserts), ``events`` (every
accepted or refused write), ``runs`` (one row per scheduled (entry, slot); a second run of the
same slot is recorded as a prevented duplicate).
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from celery_crawl.errors import ConfigError, FencedError

__all__ = ["PageRecord", "Sink"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages (
    url TEXT PRIMARY KEY,
    token INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    status INTEGER,
    content_type TEXT,
    bytes INTEGER,
    sha256 TEXT,
    title TEXT,
    task_id TEXT,
    entry TEXT,
    fetched_at TEXT NOT NULL,
    writes INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    url TEXT NOT NULL,
    token INTEGER NOT NULL,
    task_id TEXT,
    pid INTEGER,
    accepted INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    entry TEXT NOT NULL,
    slot TEXT NOT NULL,
    task_id TEXT,
    token INTEGER,
    at TEXT NOT NULL,
    duplicates INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (entry, slot)
);
"""

_UPSERT = """
INSERT INTO pages (url, token, outcome, status, content_type, bytes, sha256, title, task_id,
                   entry, fetched_at)
VALUES (:url, :token, :outcome, :status, :content_type, :bytes, :sha256, :title, :task_id,
        :entry, :fetched_at)
ON CONFLICT (url) DO UPDATE SET
    token = excluded.token, outcome = excluded.outcome, status = excluded.status,
    content_type = excluded.content_type, bytes = excluded.bytes, sha256 = excluded.sha256,
    title = excluded.title, task_id = excluded.task_id, entry = excluded.entry,
    fetched_at = excluded.fetched_at, writes = pages.writes + 1
WHERE excluded.token >= pages.token
"""


@dataclasses.dataclass(frozen=True)
class PageRecord:
    """One page outcome to upsert.

    Attributes:
        url: the requested URL (the row key).
        outcome: ``ok`` or ``failed:<reason>``.
        status, content_type, bytes, sha256, title: what was fetched (None on failure).
        task_id: the Celery task that fetched it.
        entry: the schedule entry of the crawl it belongs to, when known.
    """

    url: str
    outcome: str
    status: int | None = None
    content_type: str | None = None
    bytes: int | None = None
    sha256: str | None = None
    title: str | None = None
    task_id: str | None = None
    entry: str | None = None


class Sink:
    """A fenced SQLite sink. One connection per process (re-opened after a fork).

    Args:
        path: database file; its directory is created. ``:memory:`` is refused (workers in
            different processes must see one database).

    Raises:
        ConfigError: naming ``CRAWL_SINK`` when the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        if path == ":memory:":
            raise ConfigError("CRAWL_SINK: ':memory:' cannot be shared by worker processes")
        self.path = path
        self._local: threading.local = threading.local()
        self._pid = -1
        self._conn()  # fail at start, naming the setting, not at the first page

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or self._pid != os.getpid():
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA busy_timeout=30000")
                conn.executescript(_SCHEMA)
            except (sqlite3.Error, OSError) as exc:
                raise ConfigError(f"CRAWL_SINK: cannot open {self.path!r}: {exc}") from exc
            self._local.conn = conn
            self._pid = os.getpid()
        return conn

    def upsert(self, record: PageRecord, token: int) -> None:
        """Insert or update the row of ``record.url`` unless it holds a newer token.

        Raises:
            FencedError: the stored row carries a token greater than ``token``.
        """
        now = datetime.now(UTC).isoformat()
        params: dict[str, Any] = {**dataclasses.asdict(record), "token": token, "fetched_at": now}
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            accepted = conn.execute(_UPSERT, params).rowcount == 1
            conn.execute(
                "INSERT INTO events (at, url, token, task_id, pid, accepted) VALUES (?,?,?,?,?,?)",
                (now, record.url, token, record.task_id, os.getpid(), int(accepted)))
            stored = None if accepted else conn.execute(
                "SELECT token FROM pages WHERE url = ?", (record.url,)).fetchone()
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if not accepted:
            raise FencedError(
                f"sink: write of {record.url} with token {token} refused, the row holds "
                f"token {stored[0] if stored else '?'}")

    def record_run(self, entry: str, slot: str, task_id: str, token: int) -> bool:
        """Record the run of ``(entry, slot)``; False (and a counted duplicate) if it ran."""
        conn = self._conn()
        cur = conn.execute(
            "INSERT INTO runs (entry, slot, task_id, token, at) VALUES (?,?,?,?,?) "
            "ON CONFLICT (entry, slot) DO UPDATE SET duplicates = runs.duplicates + 1 "
            "WHERE runs.task_id IS NOT excluded.task_id",
            (entry, slot, task_id, token, datetime.now(UTC).isoformat()))
        if cur.rowcount == 0:
            return True  # the same task id again: its own retry or redelivery, not a duplicate
        row = conn.execute("SELECT task_id FROM runs WHERE entry = ? AND slot = ?",
                           (entry, slot)).fetchone()
        return bool(row and row[0] == task_id)

    def page(self, url: str) -> dict[str, Any] | None:
        """The stored row of ``url``, or None."""
        conn = self._conn()
        conn.row_factory = sqlite3.Row
        try:
            row = conn.execute("SELECT * FROM pages WHERE url = ?", (url,)).fetchone()
        finally:
            conn.row_factory = None
        return dict(row) if row else None

    def summary(self) -> dict[str, Any]:
        """Counts for the end-of-run summary: runs and duplicates per entry, pages, refusals."""
        conn = self._conn()
        runs = {entry: (count, dups) for entry, count, dups in conn.execute(
            "SELECT entry, COUNT(*), SUM(duplicates) FROM runs GROUP BY entry ORDER BY entry")}
        pages = dict(conn.execute("SELECT outcome, COUNT(*) FROM pages GROUP BY outcome"))
        refused = conn.execute("SELECT COUNT(*) FROM events WHERE accepted = 0").fetchone()[0]
        return {"runs": runs, "pages": pages, "refused_writes": refused}

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._pid == os.getpid():
            conn.close()
        self._local.conn = None
