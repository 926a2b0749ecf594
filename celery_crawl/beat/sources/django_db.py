"""django-celery-beat's tables as a schedule source: rows read on change, runs written back fenced.

Only imported when ``crawl_schedule_sources`` names ``django_celery_beat``; Django itself is
imported only inside the source's database thread, so the package never needs it otherwise
(``pip install 'celery-crawl[django]'``).

* **Change detection.** django-celery-beat bumps ``PeriodicTasks.last_update`` (one row) on
  every save or delete made through the ORM or the admin. The beat reads that one row every
  poll and reads the enabled ``PeriodicTask`` rows only when it moved, so a tick never reads the
  whole table. The marker is read *before* the rows: an edit made in between moves it again and
  is read at the next poll. (A bulk ``QuerySet.update()`` sends no signal: call
  ``PeriodicTasks.update_changed()`` after one, as django-celery-beat asks of its own users.)
* **A failing database is a store error for this source.** Every call runs on one thread of
  its own and is waited for at most ``crawl_store_timeout``; a call that fails or does not
  answer keeps the last good rows (the beat keeps running them) and is tried again at the next
  poll.
* **Fenced write-back.** The leader writes ``last_run_at`` and ``total_run_count`` back (so the
  admin still shows them) in one transaction that first raises a fence row
  (``celery_crawl_beat_fence``, created on first use) to its lease token and is refused if the
  row holds a newer one: a deposed leader's late write is rolled back. The beat's own slot state
  stays in the lease store; the database copy is informative. These writes use
  ``QuerySet.update``, which moves no change marker, so they cause no reload.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar

from ...errors import ConfigError, FencedError, StoreTimeout, StoreUnavailable
from ..entries import BeatEntry
from .rows import ORIGIN, RowError, entry_from_row

__all__ = ["FENCE_TABLE", "DjangoBeatSource"]

log = logging.getLogger("celery_crawl.beat")

#: The table whose one row per namespace holds the newest lease token that wrote back.
FENCE_TABLE = "celery_crawl_beat_fence"

_T = TypeVar("_T")

_ROW_FIELDS = (
    "id", "name", "task", "args", "kwargs", "queue", "exchange", "routing_key", "headers",
    "priority", "expires", "expire_seconds", "one_off", "start_time",
    "crontab__minute", "crontab__hour", "crontab__day_of_month", "crontab__month_of_year",
    "crontab__day_of_week", "crontab__timezone_text", "interval__every", "interval__period",
    "clocked__clocked_time", "solar__event", "solar__latitude", "solar__longitude",
    "crontab_id", "interval_id", "clocked_id", "solar_id",
)


class _DbThread:
    """One daemon thread running the source's database calls in order.

    A daemon, not a ``ThreadPoolExecutor`` worker: a call stuck on an unreachable database must
    not hold up the beat's exit (the executor's threads are joined at interpreter exit).
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[cf.Future[Any], Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="crawl-django", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], _T]) -> cf.Future[_T]:
        future: cf.Future[_T] = cf.Future()
        self._calls.put((future, fn))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)


class _Refused(Exception):
    def __init__(self, stored: int) -> None:
        super().__init__(stored)
        self.stored = stored


@dataclasses.dataclass
class _Run:
    last_run_at: datetime
    count: int
    one_off: bool


def _plain(row: Mapping[str, Any]) -> dict[str, Any]:
    """One ``values()`` row as :func:`~.rows.entry_from_row` reads it."""
    out = {k: v for k, v in row.items() if "__" not in k and not k.endswith("_id")}
    for kind in ("crontab", "interval", "clocked", "solar"):
        if row.get(f"{kind}_id") is not None:
            out["kind"] = kind
            prefix = f"{kind}__"
            out.update({k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)})
            break
    if "timezone_text" in out:
        out["timezone"] = out.pop("timezone_text")
    return out


class DjangoBeatSource:
    """The enabled ``PeriodicTask`` rows of the app's Django database, kept as beat entries.

    Args:
        app: the Celery app (its ``timezone`` and ``solar`` need it).
        namespace: ``crawl_namespace``; the fence row's key.
        timeout_s: bound of every database call (``crawl_store_timeout``).

    Raises:
        ConfigError: Django or django-celery-beat is not installed.
    """

    name = ORIGIN

    def __init__(self, app: Any, *, namespace: str, timeout_s: float) -> None:
        try:
            import django  # noqa: F401
            import django_celery_beat  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"crawl_schedule_sources: 'django_celery_beat' needs Django and "
                f"django-celery-beat ({exc}); pip install 'celery-crawl[django]'") from None
        self.app = app
        self.namespace = namespace
        self.timeout_s = timeout_s
        #: the last good rows as entries, and the rows refused (name -> reason)
        self.entries: dict[str, BeatEntry] = {}
        self.errors: dict[str, str] = {}
        #: whether the rows were read once
        self.loaded = False
        self._marker: Any = None
        self._pending: dict[str, _Run] = {}
        self._one_off: set[str] = set()
        self._fence_ready = False
        self._pool = _DbThread()
        self._busy: cf.Future[Any] | None = None

    # -- the database thread -------------------------------------------------------------------
    def _call(self, fn: Callable[[], _T], what: str) -> _T:
        """Run ``fn`` on the database thread; its errors and its silence become store errors.

        While an earlier call is still stuck (a database that stopped answering), nothing more
        is queued behind it: the caller is told at once.
        """
        if self._busy is not None and not self._busy.done():
            raise StoreTimeout(f"django_celery_beat: {what}: an earlier database call has not "
                               "returned yet")
        future: cf.Future[_T] = self._pool.submit(lambda: self._guarded(fn))
        self._busy = future
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise StoreTimeout(f"django_celery_beat: {what} did not answer within "
                               f"{self.timeout_s:g}s") from None

    def _guarded(self, fn: Callable[[], _T]) -> _T:
        from django.core.exceptions import ImproperlyConfigured
        from django.db import Error, connections

        try:
            _setup_django()
            return fn()
        except ImproperlyConfigured as exc:
            raise ConfigError(f"crawl_schedule_sources: 'django_celery_beat': {exc}") from None
        except Error as exc:
            for conn in connections.all(initialized_only=True):
                with contextlib.suppress(Error):
                    conn.close()  # the next call connects again
            raise StoreUnavailable(f"django_celery_beat: database error: {exc}") from exc

    # -- reading -------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Read the change marker, and the rows when it moved (or were never read).

        Returns:
            Whether ``entries``/``errors`` changed (the beat assembles its schedule again).

        Raises:
            StoreError: the database failed; the last good rows are kept.
            ConfigError: Django is not configured for this app.
        """
        marker = self._call(_last_change, "reading PeriodicTasks.last_update")
        if self.loaded and marker == self._marker:
            return False
        rows = self._call(_enabled_rows, "reading the enabled PeriodicTask rows")
        entries: dict[str, BeatEntry] = {}
        errors: dict[str, str] = {}
        for row in rows:
            try:
                entries[str(row["name"])] = entry_from_row(row, self.app)
            except RowError as exc:
                errors[str(row.get("name"))] = str(exc)
        for name, reason in errors.items():
            if self.errors.get(name) != reason:
                log.error("beat: skipping django-celery-beat row %r: %s", name, reason)
        changed = (not self.loaded or errors != self.errors
                   or {n: e.fingerprint for n, e in entries.items()}
                   != {n: e.fingerprint for n, e in self.entries.items()})
        self.entries, self.errors = entries, errors
        self._one_off = {str(row["name"]) for row in rows if row.get("one_off")}
        self._marker, self.loaded = marker, True
        return changed

    # -- writing back --------------------------------------------------------------------------
    def ran(self, entry: BeatEntry, when: datetime) -> None:
        """Remember a published run of a row's entry, for the next :meth:`write_back`."""
        if entry.origin != ORIGIN:
            return
        run = self._pending.get(entry.name)
        one_off = entry.name in self._one_off
        if run is None:
            self._pending[entry.name] = _Run(when, 1, one_off)
        else:
            run.last_run_at, run.count = max(run.last_run_at, when), run.count + 1

    @property
    def pending(self) -> int:
        """Rows whose runs are not yet written back."""
        return len(self._pending)

    def write_back(self, token: int) -> None:
        """Write ``last_run_at``/``total_run_count`` of the runs since the last write, fenced.

        Raises:
            FencedError: a newer leader wrote back already (the runs are dropped: it owns them).
            StoreError: the database failed (the runs are kept for the next call).
        """
        if not self._pending:
            return
        runs = dict(self._pending)
        if not self._fence_ready:
            self._call(_create_fence, f"creating {FENCE_TABLE}")
            self._fence_ready = True
        try:
            self._call(lambda: _write(self.namespace, token, runs), "writing back runs")
        except _Refused as exc:
            self._pending.clear()
            raise FencedError(f"django_celery_beat: write-back with token {token} refused: "
                              f"{FENCE_TABLE} holds token {exc.stored}") from None
        for name, run in runs.items():
            if self._pending.get(name) is run:
                del self._pending[name]

    def forget_runs(self) -> int:
        """Drop the runs not written back (a deposed leader's: the next leader owns them)."""
        dropped = len(self._pending)
        self._pending.clear()
        return dropped

    def close(self) -> None:
        """Close the database connection of the source's thread and stop the thread."""
        def _close() -> None:
            from django.db import connections

            connections.close_all()

        if self._busy is None or self._busy.done():
            with contextlib.suppress(Exception):  # closing only; the source is done
                self._pool.submit(_close).result(timeout=self.timeout_s)
        self._pool.stop()


def _setup_django() -> None:
    from django.apps import apps

    if not apps.ready:
        import django

        django.setup()
    if not apps.is_installed("django_celery_beat"):
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured("django_celery_beat is not in INSTALLED_APPS")


def _last_change() -> Any:
    from django_celery_beat.models import PeriodicTasks

    return PeriodicTasks.last_change()


def _enabled_rows() -> list[dict[str, Any]]:
    from django.db.models import CharField
    from django.db.models.functions import Cast
    from django_celery_beat.models import PeriodicTask

    # The zone is read as text: the field's own conversion raises for a zone this machine's
    # tz database does not know, which must refuse that row only, not the whole read.
    rows = (PeriodicTask.objects.filter(enabled=True).order_by("id")
            .annotate(crontab__timezone_text=Cast("crontab__timezone", CharField()))
            .values(*_ROW_FIELDS))
    return [_plain(r) for r in rows]


def _create_fence() -> None:
    from django.db import connection

    table = connection.ops.quote_name(FENCE_TABLE)
    with connection.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {table} "
                    "(namespace VARCHAR(200) PRIMARY KEY, token BIGINT NOT NULL)")


def _write(namespace: str, token: int, runs: Mapping[str, _Run]) -> None:
    from django.db import connection, transaction
    from django.db.models import F
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    table = connection.ops.quote_name(FENCE_TABLE)
    with transaction.atomic():
        with connection.cursor() as cur:
            # The UPDATE locks the fence row until commit, so a deposed leader's write waits
            # for the newer one and then finds its token too old.
            cur.execute(f"UPDATE {table} SET token = %s WHERE namespace = %s AND token <= %s",
                        [token, namespace, token])
            if cur.rowcount == 0:
                cur.execute(f"SELECT token FROM {table} WHERE namespace = %s", [namespace])
                got = cur.fetchone()
                if got is not None:
                    raise _Refused(int(got[0]))
                cur.execute(f"INSERT INTO {table} (namespace, token) VALUES (%s, %s)",
                            [namespace, token])
        for name, run in runs.items():
            fields: dict[str, Any] = {"last_run_at": run.last_run_at,
                                      "total_run_count": F("total_run_count") + run.count}
            if run.one_off:  # as django-celery-beat does once a one-off row ran
                fields.update(enabled=False, total_run_count=0)
            PeriodicTask.objects.filter(name=name).update(**fields)
    if any(run.one_off for run in runs.values()):
        PeriodicTasks.update_changed()  # every replica drops the row
