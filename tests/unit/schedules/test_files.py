"""Schedule files: every error class, isolation of bad entries, duplicates, fuzzing."""

from __future__ import annotations

import string
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_crawl.errors import ScheduleFileError
from celery_crawl.schedules import (
    MAX_FILE_BYTES,
    EntrySpec,
    LoadResult,
    TzCron,
    check_duplicates_with_beat_schedule,
    load_schedule_files,
    parse_schedule_text,
)

ROOT = Path(__file__).resolve().parents[3]

GOOD = """
[defaults]
tz = "Asia/Shanghai"
queue = "crawl"

[entries.jd-prices]
task = "workers.crawler.crawl_site"
cron = "15 2 * * *"
args = ["https://www.jd.com/"]
kwargs = {}
overlap = "skip"
catchup = "latest"
catchup_window = "1h"
catchup_max = 10
gap = "shift"
fold = "first"
jitter = "30s"
expires = "10m"
priority = 7
paused = false
"""


def parse(text: str, file: str = "f.toml") -> LoadResult:
    return parse_schedule_text(text.encode(), file)


def one_error(text: str) -> ScheduleFileError:
    result = parse(text)
    assert len(result.errors) == 1, result.errors
    return result.errors[0]


def test_design_example_loads_with_every_field():
    result = parse(GOOD)
    assert result.errors == []
    spec = result.entries["jd-prices"]
    assert isinstance(spec, EntrySpec) and isinstance(spec.schedule, TzCron)
    assert spec.schedule.zone_name == "Asia/Shanghai" and spec.schedule.jitter == 30
    assert (spec.task, spec.args, spec.kwargs, spec.queue) == (
        "workers.crawler.crawl_site", ("https://www.jd.com/",), {}, "crawl")
    assert (spec.overlap, spec.catchup, spec.catchup_window_s, spec.catchup_max) == (
        "skip", "latest", 3600.0, 10)
    assert (spec.expires_s, spec.priority, spec.paused, spec.source) == (600.0, 7, False, "f.toml")
    assert spec.options() == {"queue": "crawl", "expires": 600.0, "priority": 7}
    assert result.sources == {"jd-prices": "f.toml"}


def test_defaults_apply_and_entries_override():
    result = parse("""
[defaults]
tz = "Europe/Berlin"
jitter = "5s"
[entries.a]
task = "t.a"
cron = "0 1 * * *"
[entries.b]
task = "t.b"
cron = "0 1 * * *"
tz = "America/New_York"
jitter = 0
""")
    assert result.errors == []
    a, b = result.entries["a"], result.entries["b"]
    assert (a.schedule.zone_name, a.schedule.jitter) == ("Europe/Berlin", 5.0)
    assert (b.schedule.zone_name, b.schedule.jitter) == ("America/New_York", 0.0)
    assert (a.catchup, a.overlap, a.catchup_max, a.expires_s, a.priority) == (
        "latest", "skip", 10, None, None)


def test_fingerprint_covers_runs_not_pause_or_source():
    base = parse(GOOD).entries["jd-prices"]
    paused = parse(GOOD.replace("paused = false", "paused = true"), "g.toml").entries["jd-prices"]
    assert paused.fingerprint() == base.fingerprint()
    for old, new in [("15 2", "16 2"), ('"30s"', '"31s"'), ('"10m"', '"11m"'),
                     ("priority = 7", "priority = 8"), ("jd.com/", "jd.com/x"),
                     ('kwargs = {}', 'kwargs = {a = 1}'), ('"crawl"', '"other"'),
                     ('overlap = "skip"', 'overlap = "allow"')]:
        changed = parse(GOOD.replace(old, new)).entries["jd-prices"]
        assert changed.fingerprint() != base.fingerprint(), old


ENTRY = '[entries.e]\ntask = "t.x"\ncron = "0 1 * * *"\ntz = "UTC"\n'


@pytest.mark.parametrize(
    ("extra", "field", "needle"),
    [
        ('crn = "x"\n', "crn", "unknown key"),
        ('overlap = "sometimes"\n', "overlap", "not one of"),
        ('catchup = "most"\n', "catchup", "not one of"),
        ('gap = "later"\n', "gap", "not one of"),
        ('fold = 2\n', "fold", "not one of"),
        ('jitter = "soon"\n', "jitter", "not a duration"),
        ('jitter = -5\n', "jitter", ">= 0"),
        ('jitter = "40d"\n', "jitter", "more than 31 days"),
        ('catchup_window = [1]\n', "catchup_window", "duration"),
        ('catchup_max = 0\n', "catchup_max", ">= 1"),
        ('catchup_max = true\n', "catchup_max", "integer"),
        ('expires = "0s"\n', "expires", "longer than zero"),
        ('priority = 300\n', "priority", "0-255"),
        ('paused = "no"\n', "paused", "true or false"),
        ('queue = ""\n', "queue", "queue name"),
        ('args = "x"\n', "args", "array"),
        ('args = [1979-05-27]\n', "args", "JSON"),
        ('args = [nan]\n', "args", "JSON"),
        ('kwargs = [1]\n', "kwargs", "table"),
        ('kwargs = {"not valid" = 1}\n', "kwargs", "identifier"),
    ],
)
def test_each_bad_field_is_named(extra, field, needle):
    error = one_error(ENTRY + extra)
    assert (error.file, error.entry, error.field) == ("f.toml", "e", field)
    assert needle in error.reason
    assert str(error).startswith("f.toml, entry 'e', field")


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ('cron = "0 1 * * *"\ntz = "UTC"\n', "task", "required"),
        ('task = "t.x"\ntz = "UTC"\n', "cron", "required"),
        ('task = "t.x"\ncron = "0 1 * * *"\n', "tz", "no implicit zone"),
        ('task = "t x"\ncron = "0 1 * * *"\ntz = "UTC"\n', "task", "dotted"),
        ('task = "t.x"\ncron = "0 25 * * *"\ntz = "UTC"\n', "cron", "0 25"),
        ('task = "t.x"\ncron = 5\ntz = "UTC"\n', "cron", "string"),
        ('task = "t.x"\ncron = "CRON_TZ=UTC 0 1 * * *"\ntz = "UTC"\n', "cron", "prefix"),
        ('task = "t.x"\ncron = "0 1 * * *"\ntz = "Local"\n', "tz", "local zone"),
        ('task = "t.x"\ncron = "0 1 * * *"\ntz = "TZ=UTC"\n', "tz", "prefix"),
        ('task = "t.x"\ncron = "0 1 * * *"\ntz = "Nowhere/City"\n', "tz", "unknown"),
    ],
)
def test_required_and_schedule_fields(body, field, needle):
    error = one_error("[entries.e]\n" + body)
    assert (error.entry, error.field) == ("e", field)
    assert needle in error.reason


def test_bad_default_is_attributed_to_defaults():
    result = parse('[defaults]\ntz = "Local"\ntask = "t.x"\n' + ENTRY.replace('tz = "UTC"\n', ""))
    fields = sorted((e.entry, e.field) for e in result.errors)
    assert fields == [("[defaults]", "task"), ("e", "tz")]
    assert "(value from [defaults])" in next(e.reason for e in result.errors if e.field == "tz")


def test_structure_errors():
    assert one_error('x = 1\n' + ENTRY).field == "x"
    assert one_error('entries = 1\n').field == "entries"
    assert one_error('defaults = 1\n' + ENTRY).field == "defaults"
    assert "table" in one_error('[entries]\ne = 1\n').reason
    assert "names" in one_error('[entries."bad name"]\ntask = "t.x"\n').reason


def test_one_bad_entry_does_not_stop_the_others():
    text = (ENTRY + '[entries.bad]\ntask = "t.x"\ncron = "0 99 * * *"\ntz = "UTC"\n'
            + ENTRY.replace("entries.e", "entries.f"))
    result = parse(text)
    assert sorted(result.entries) == ["e", "f"]
    assert [(e.entry, e.field) for e in result.errors] == [("bad", "cron")]


def write(tmp_path: Path, name: str, content: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"[entries.e]\ntask = 'x\n", "invalid TOML"),
        (b"\xff\xfe[entries]", "not valid UTF-8"),
        (b"a = " + b"[" * 3000 + b"]" * 3000, "nested too deep"),
        (b"a = " + b"[" * 40 + b"]" * 40, "nested deeper than"),
        (b"# " + b"x" * MAX_FILE_BYTES + b"\n", "larger than"),
    ],
)
def test_a_bad_file_is_one_error(tmp_path, content, needle):
    write(tmp_path, "bad.toml", content)
    write(tmp_path, "good.toml", ENTRY)
    result = load_schedule_files(["*.toml"], base_dir=tmp_path)
    assert list(result.entries) == ["e"]
    assert len(result.errors) == 1
    assert result.errors[0].file == "bad.toml" and needle in result.errors[0].reason


def test_duplicates_across_files_first_wins_both_named(tmp_path):
    write(tmp_path, "a.toml", ENTRY)
    write(tmp_path, "b.toml", ENTRY.replace("0 1 * * *", "0 2 * * *"))
    result = load_schedule_files(["*.toml"], base_dir=tmp_path)
    assert result.entries["e"].schedule.expr == "0 1 * * *"
    assert result.entries["e"].source == "a.toml"
    (error,) = result.errors
    assert (error.file, error.entry) == ("b.toml", "e") and "a.toml" in error.reason


def test_duplicates_with_beat_schedule(tmp_path):
    write(tmp_path, "a.toml", ENTRY)
    result = load_schedule_files([str(tmp_path / "a.toml")])
    errors = check_duplicates_with_beat_schedule(result, {"e": {}, "other": {}})
    assert [(e.entry, "beat_schedule" in e.reason) for e in errors] == [("e", True)]
    assert errors[0].file is not None and errors[0].file.endswith("a.toml")


def test_paths_globs_and_directories(tmp_path):
    write(tmp_path, "a.toml", ENTRY)
    write(tmp_path, "notes.txt", "not toml")
    assert list(load_schedule_files([str(tmp_path)]).entries) == ["e"]
    assert load_schedule_files(["nothing-*.toml"], base_dir=tmp_path).errors == []
    (missing,) = load_schedule_files(["missing.toml"], base_dir=tmp_path).errors
    assert (missing.file, missing.reason) == ("missing.toml", "no such file")
    # the same file through two patterns is read once
    both = load_schedule_files(["a.toml", "*.toml"], base_dir=tmp_path)
    assert both.errors == [] and both.files == ["a.toml"]


def test_unreadable_file(tmp_path):
    # a dangling symlink matched by a glob cannot be opened, even by root
    (tmp_path / "a.toml").symlink_to(tmp_path / "gone.toml")
    write(tmp_path, "b.toml", ENTRY)
    result = load_schedule_files(["*.toml"], base_dir=tmp_path)
    assert list(result.entries) == ["e"]
    (error,) = result.errors
    assert error.file == "a.toml" and "cannot read" in error.reason


def test_shipped_example_files_load_cleanly():
    result = load_schedule_files(["beat_schedules/*.toml"], base_dir=ROOT)
    assert result.errors == []
    spec = result.entries["jd-prices"]
    assert (spec.task, spec.args, spec.schedule.expr, spec.schedule.zone_name) == (
        "workers.crawler.crawl_site", ("https://www.jd.com/",), "15 2 * * *", "Asia/Shanghai")
    zones = {s.schedule.zone_name for s in result.entries.values()}
    assert {"Asia/Shanghai", "America/New_York", "Europe/Berlin"} <= zones
    assert {s.task for s in result.entries.values()} == {
        "workers.crawler.crawl_site", "workers.crawler.crawl_listing"}


# -- fuzzing: the loader reports, it never raises -----------------------------------------------

_KEYS = ["task", "cron", "tz", "args", "kwargs", "queue", "overlap", "catchup",
         "catchup_window", "catchup_max", "gap", "fold", "jitter", "expires", "priority",
         "paused", "bogus"]
_TOML_SCALARS = st.one_of(
    st.sampled_from(['"0 1 * * *"', '"*/5 * * * * *"', '"UTC"', '"Local"', '"30s"', '"skip"',
                     '"first"', '"t.x"', "true", "7", "-1", "1.5", "nan", "inf", "[1, [2]]",
                     "{a = 1}", "1979-05-27T07:32:00Z", '"H 2 * * *"', '"@daily"', '""',
                     '"61 * * * *"', '"Asia/Shanghai"', '"both"', '"all"', "[]", "{}"]),
    st.text(alphabet=string.printable, max_size=12).map(lambda s: '"' + s.replace("\\", "")
                                                        .replace('"', "") + '"'),
)


@st.composite
def toml_like(draw: st.DrawFn) -> str:
    lines = []
    if draw(st.booleans()):
        lines.append("[defaults]")
        for key in draw(st.lists(st.sampled_from(_KEYS), max_size=4, unique=True)):
            lines.append(f"{key} = {draw(_TOML_SCALARS)}")
    for i in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(["a", "b", "c-1", '"x y"', '"a.b"']))
        lines.append(f"[entries.{name}{i % 2}]")
        for key in draw(st.lists(st.sampled_from(_KEYS), max_size=8, unique=True)):
            lines.append(f"{key} = {draw(_TOML_SCALARS)}")
    return "\n".join(lines) + "\n"


FUZZ_NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _never_raises(data: bytes) -> None:
    result = parse_schedule_text(data, "fuzz.toml")
    for error in result.errors:
        assert isinstance(error, ScheduleFileError) and error.file == "fuzz.toml"
    for spec in result.entries.values():
        spec.fingerprint()
        assert spec.schedule.next_fire(FUZZ_NOW) > FUZZ_NOW


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(text=toml_like())
def test_fuzzed_toml_never_crashes(text):
    _never_raises(text.encode())


@settings(max_examples=200)
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzzed_bytes_never_crash(data):
    _never_raises(data)


def test_load_app_schedule_merges_files_and_tzcron_beat_entries(tmp_path):
    from celery import Celery

    from celery_crawl.schedules import load_app_schedule

    write(tmp_path, "a.toml", ENTRY + ENTRY.replace("entries.e", "entries.code"))
    app = Celery("x", set_as_current=False)
    app.conf.crawl_schedule_paths = ["*.toml"]
    app.conf.beat_schedule = {
        "code": {"task": "t.code", "schedule": TzCron("0 5 * * *", "UTC", name="code"),
                 "args": [1], "options": {"queue": "q", "expires": 60, "priority": 3}},
        "stock": {"task": "t.stock", "schedule": 60.0},
    }
    result = load_app_schedule(app, base_dir=tmp_path)
    assert sorted(result.entries) == ["code", "e"]
    code = result.entries["code"]
    assert (code.source, code.task, code.args, code.options()) == (
        "beat_schedule", "t.code", (1,), {"queue": "q", "expires": 60.0, "priority": 3})
    assert [(e.entry, e.file) for e in result.errors] == [("code", "a.toml")]
    app.conf.crawl_schedule_paths = 5
    assert "crawl_schedule_paths" in str(load_app_schedule(app, base_dir=tmp_path).errors[0])


def test_base_dir_with_glob_characters_is_literal(tmp_path):
    base = tmp_path / "ops[prod]"
    base.mkdir()
    write(base, "a.toml", ENTRY)
    result = load_schedule_files(["*.toml", "a.toml"], base_dir=base)
    assert result.errors == [] and list(result.entries) == ["e"] and result.files == ["a.toml"]


def test_special_files_are_refused_without_blocking(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo.toml")  # a blocking open() would hang here
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    write(tmp_path, "good.toml", ENTRY)
    result = load_schedule_files(["*.toml"], base_dir=tmp_path)
    assert list(result.entries) == ["e"]
    assert sorted((e.file, e.reason) for e in result.errors) == [
        ("fifo.toml", "not a regular file"), ("zero.toml", "not a regular file")]
