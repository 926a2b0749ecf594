"""The public names of celery_crawl.schedules are exactly these (others code against them)."""

import celery_crawl.schedules as schedules


def test_public_names():
    assert sorted(schedules.__all__) == sorted([
        "CATCHUP_POLICIES", "FOLD_POLICIES", "GAP_POLICIES", "MAX_FILE_BYTES",
        "OVERLAP_POLICIES", "DueHeap", "EntrySpec", "LoadResult", "ScheduleError",
        "ScheduleFileError", "TzCron", "check_duplicates_with_beat_schedule", "format_slot",
        "load_app_schedule", "load_schedule_files", "parse_schedule_text", "task_id_for",
    ])
    for name in schedules.__all__:
        assert getattr(schedules, name) is not None
