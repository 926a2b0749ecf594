"""One assembly of an app's schedule: its schedule files plus ``beat_schedule``.

The beat, ``crawl status``, ``crawl next`` and ``crawl schedules check`` all call
:func:`assemble`, so what the operator is shown is what the leader runs. The rules, in one place:

* every ``beat_schedule`` item becomes a :class:`~.entries.BeatEntry` (a bad one is an error and
  left out);
* every validated entry of the files becomes one too, unless ``beat_schedule`` has the name
  (the duplicate is an error naming both places; the ``beat_schedule`` definition is kept);
* a file with any error is *broken*: none of its entries are taken from this load; the entries
  it defined in ``previous`` (the beat's last load) are kept instead, so a typo saved into a
  running fleet's file never stops that file's other entries;
* ``crawl_schedule_sources`` says which of ``files``, ``beat_schedule`` and
  ``django_celery_beat`` are read; a django-celery-beat row whose name a file or
  ``beat_schedule`` already defines is an error naming both, and the row is left out; a row that
  cannot be run is an error naming the row (the other rows run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import DEFAULTS, schedule_sources
from ..errors import ConfigError, CrawlError, ScheduleFileError
from ..schedules import EntrySpec, check_duplicates_with_beat_schedule, load_schedule_files
from ..schedules.root import schedule_base
from .entries import BeatEntry, from_beat_schedule, from_spec

__all__ = ["AppSchedule", "assemble"]


@dataclasses.dataclass
class AppSchedule:
    """What an app schedules, and everything wrong with it.

    Attributes:
        entries: name -> entry the beat runs (``beat_schedule`` first, then file order).
        specs: every file entry that validated, broken files' included (``schedules check``
            shows them; ``entries`` says which of them run).
        sources: file entry name -> the file that defines it.
        files: the files read, in load order.
        broken: files with an error, whose entries come from ``previous``.
        kept: names taken from ``previous`` because their file is broken.
        file_errors: one per bad file or bad entry field (``ScheduleFileError``).
        duplicates: one per file entry whose name ``beat_schedule`` also defines.
        beat_schedule_errors: ``beat_schedule`` name -> why it was left out.
        entry_errors: file entry name -> why a validated spec could not become an entry.
        source_errors: problems of the other sources (a django-celery-beat row refused, a
            row's name defined twice, the database unreachable), one line each.
    """

    entries: dict[str, BeatEntry] = dataclasses.field(default_factory=dict)
    specs: dict[str, EntrySpec] = dataclasses.field(default_factory=dict)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    files: list[str] = dataclasses.field(default_factory=list)
    broken: set[str] = dataclasses.field(default_factory=set)
    kept: set[str] = dataclasses.field(default_factory=set)
    file_errors: list[ScheduleFileError] = dataclasses.field(default_factory=list)
    duplicates: list[ScheduleFileError] = dataclasses.field(default_factory=list)
    beat_schedule_errors: dict[str, CrawlError] = dataclasses.field(default_factory=dict)
    entry_errors: dict[str, Exception] = dataclasses.field(default_factory=dict)
    source_errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def files_ok(self) -> bool:
        """No file is broken (the beat garbage-collects removed entries' state only then)."""
        return not self.broken and not self.entry_errors

    def runs(self, name: str) -> bool:
        """Whether the file entry ``name`` (of ``specs``) is what the beat runs under that name."""
        entry, spec = self.entries.get(name), self.specs.get(name)
        return entry is not None and spec is not None and entry.origin == spec.source \
            and name not in self.kept

    @property
    def errors(self) -> list[str]:
        """Every problem, one line each, as ``status`` shows them."""
        out = [f"beat_schedule {name!r}: {exc}" for name, exc in self.beat_schedule_errors.items()]
        out += [str(err) for err in (*self.file_errors, *self.duplicates)]
        out += [f"entry {name!r}: {exc}" for name, exc in self.entry_errors.items()]
        return out + self.source_errors


def schedule_paths(app: Any) -> tuple[list[str], ScheduleFileError | None]:
    """The app's ``crawl_schedule_paths`` as a list, or the error saying why it is not one."""
    paths = app.conf.get("crawl_schedule_paths", DEFAULTS["crawl_schedule_paths"])
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list | tuple) or not all(isinstance(p, str) for p in paths):
        return [], ScheduleFileError(
            f"crawl_schedule_paths must be a list of globs, got {type(paths).__name__}")
    return list(paths), None


def assemble(app: Any, *, paths: Sequence[str] | None = None, base_dir: str | None = None,
             previous: Mapping[str, BeatEntry] | None = None,
             rows: Any = None) -> AppSchedule:
    """The app's schedule: ``beat_schedule`` plus the files of ``paths`` (default: the app's
    ``crawl_schedule_paths``) relative to ``base_dir`` (default: the app's project root,
    :func:`~celery_crawl.schedules.root.schedule_base`, whatever the working directory).

    ``previous`` is the last assembly's entries (the beat's reload); without it a broken file
    contributes nothing. ``rows`` is the beat's django-celery-beat source (its last good rows);
    without it, and with ``django_celery_beat`` in ``crawl_schedule_sources``, the rows are read
    once. Never raises for bad input: problems are in the result.
    """
    out = AppSchedule()
    try:
        names = schedule_sources(app.conf.get("crawl_schedule_sources",
                                              DEFAULTS["crawl_schedule_sources"]))
    except ConfigError as exc:
        out.source_errors.append(str(exc))
        names = tuple(DEFAULTS["crawl_schedule_sources"])
    beat_schedule: Mapping[str, Any] = (app.conf.get("beat_schedule") or {}) \
        if "beat_schedule" in names else {}
    for name, raw in beat_schedule.items():
        try:
            out.entries[name] = from_beat_schedule(name, raw, app)
        except CrawlError as exc:
            out.beat_schedule_errors[name] = exc
    if paths is None:
        paths, bad = schedule_paths(app)
        if bad is not None:
            out.file_errors.append(bad)
    if "files" not in names:
        paths = []
    loaded = load_schedule_files(list(paths), base_dir=base_dir or schedule_base(app).path)
    out.specs, out.sources, out.files = loaded.entries, loaded.sources, loaded.files
    out.file_errors += loaded.errors
    out.broken = {str(err.file or "") for err in loaded.errors}
    out.duplicates = check_duplicates_with_beat_schedule(loaded, beat_schedule)
    for name, spec in loaded.entries.items():
        if spec.source in out.broken or name in beat_schedule:
            continue
        try:
            out.entries[name] = from_spec(spec)
        except (CrawlError, ValueError) as exc:
            out.entry_errors[name] = exc
    for name, entry in (previous or {}).items():
        if entry.origin in out.broken and name not in out.entries:
            out.entries[name] = entry  # what that file defined before it broke
            out.kept.add(name)
    if "django_celery_beat" in names:
        _add_rows(app, out, rows)
    return out


def _add_rows(app: Any, out: AppSchedule, rows: Any) -> None:
    """The django-celery-beat rows, after the files and ``beat_schedule`` (those win a name)."""
    if rows is None:  # a one-off read: ``status``, ``schedules check``, ``next``
        from .sources import row_source

        try:
            rows = row_source(app)
            try:
                rows.poll()
            finally:
                rows.close()
        except CrawlError as exc:
            out.source_errors.append(f"django_celery_beat: {exc}")
            return
    out.source_errors += list(rows.errors.values())
    for name, entry in rows.entries.items():
        if name in out.entries or name in out.specs:
            where = out.sources.get(name) or "app.conf.beat_schedule"
            out.source_errors.append(
                f"entry {name!r} is defined by django-celery-beat (PeriodicTask {name!r}) and "
                f"by {where}; the {where} definition is kept and the row is ignored")
            continue
        out.entries[name] = entry
