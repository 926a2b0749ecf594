"""Schedules: cron in an explicit IANA zone with an exact DST rule, and schedule files.

Public names::

    TzCron                 a celery BaseSchedule: cron + zone + gap/fold policy + jitter
    EntrySpec              one validated schedule entry
    load_schedule_files    TOML schedule files -> LoadResult (good entries + every error)
    load_app_schedule      an app's files (crawl_schedule_paths) + TzCron beat_schedule entries
    task_id_for            the deterministic task id of a run (entry, slot)
    DueHeap                next due entry among many, O(log n)
"""

from __future__ import annotations

from ..errors import ScheduleError, ScheduleFileError
from .entry import CATCHUP_POLICIES, OVERLAP_POLICIES, EntrySpec
from .files import (
    MAX_FILE_BYTES,
    LoadResult,
    check_duplicates_with_beat_schedule,
    load_app_schedule,
    load_schedule_files,
    parse_schedule_text,
)
from .heap import DueHeap
from .ids import format_slot, task_id_for
from .slots import FOLD_POLICIES, GAP_POLICIES
from .tzcron import TzCron

__all__ = [
    "CATCHUP_POLICIES",
    "FOLD_POLICIES",
    "GAP_POLICIES",
    "MAX_FILE_BYTES",
    "OVERLAP_POLICIES",
    "DueHeap",
    "EntrySpec",
    "LoadResult",
    "ScheduleError",
    "ScheduleFileError",
    "TzCron",
    "check_duplicates_with_beat_schedule",
    "format_slot",
    "load_app_schedule",
    "load_schedule_files",
    "parse_schedule_text",
    "task_id_for",
]
