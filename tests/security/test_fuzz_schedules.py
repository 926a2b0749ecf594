"""Hostile schedule files: random bytes, invalid UTF-8, deep nesting, huge files, absurd cron
fields and far-future or far-past dates never crash the loader or the schedule. Every problem
is a ``ScheduleFileError`` naming the file (and entry/field where there is one); the good
entries of the same file still load; computing fire times is bounded and raises only
``ScheduleError``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_crawl.errors import ScheduleError, ScheduleFileError
from celery_crawl.schedules import (
    MAX_FILE_BYTES,
    LoadResult,
    TzCron,
    load_schedule_files,
    parse_schedule_text,
)

FILE = "beat_schedules/hostile.toml"
GOOD_ENTRY = ('[entries.always-good]\ntask = "workers.crawler.crawl_site"\ncron = "15 2 * * *"\n'
              'tz = "Asia/Shanghai"\n')
#: Instants worth asking a schedule about: now, the ends of what datetime can hold, DST edges.
INSTANTS = [datetime.now(UTC), datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC),
            datetime(9999, 12, 1, tzinfo=UTC), datetime(1, 1, 1, 0, 0, tzinfo=UTC),
            datetime(2038, 1, 19, 3, 14, 8, tzinfo=UTC), datetime(2026, 3, 29, 1, 30, tzinfo=UTC),
            datetime(2026, 10, 25, 0, 59, 59, tzinfo=UTC)]
#: A single computation of a fire time on a loaded machine; the point is "not unbounded".
FIRE_BOUND_S = 5.0


def _check_result(result: LoadResult) -> None:
    assert isinstance(result, LoadResult)
    for err in result.errors:
        assert isinstance(err, ScheduleFileError), repr(err)
        assert err.file == FILE, f"error does not name the file: {err}"
        assert str(err)


def _exercise_schedule(schedule: TzCron) -> None:
    """Fire times at hostile instants: an aware datetime after the instant, or ScheduleError."""
    for instant in INSTANTS:
        t0 = time.monotonic()
        try:
            fire = schedule.next_fire(instant)
        except ScheduleError:
            pass
        else:
            assert fire.tzinfo is not None and fire > instant
        assert time.monotonic() - t0 < FIRE_BOUND_S, f"next_fire({instant}) took too long"


# -- raw bytes ---------------------------------------------------------------------------------
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(st.binary(max_size=400), st.text(max_size=400).map(str.encode)))
@example(data=b"\xff\xfe[entries.x]\n")
@example(data=GOOD_ENTRY.encode() + b"\n# \xc3\x28 trailing invalid UTF-8\n")
@example(data=b"a = " + b"[" * 50_000)
@example(data=b"a = " + b"{b = " * 20_000)
@example(data=b"[" + b"a." * 30_000 + b"b]\n")
@example(data=b"[entries." + b"x" * 100_000 + b"]\n")
def test_random_bytes_never_crash_the_loader(data: bytes) -> None:
    _check_result(parse_schedule_text(data, FILE))


# -- structured entries with hostile field values -----------------------------------------------
def _toml_value(value: Any) -> str:
    """Render a Python value as a TOML inline value (strings through JSON, which TOML reads)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, datetime | date | dtime):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(type(value))


cron_fields = st.one_of(
    st.sampled_from(["*", "*/0", "*/1", "0", "59", "60", "61", "-1", "99999999999999999999",
                     "1-0", "5-1", "5-5", "L", "W", "15W", "5#6", "1#0", "L-5", "H", "H(0-59)",
                     "H/0", "?", "0/0", "*/99999", "1,,3", "JAN-DEC", "MON-FRI", "SUN#5", "31",
                     "30", "29", "0x10", "\uff11", "\u0663", "1-31/0", "LW", "32W", "7L"]),
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6),
    st.integers(-(10**20), 10**20).map(str),
)
crons = st.one_of(
    st.lists(cron_fields, min_size=1, max_size=8).map(" ".join),
    st.sampled_from(["@daily", "@reboot", "@yearly", "@every 5m", "@hourly", "0 0 30 2 *",
                     "0 0 31 4 *", "0 0 29 2 1#5", "0 0 29 2 *", "59 59 23 31 12 *",
                     "0 0 L 2 *", "0 0 31 2,4,6,9,11 *", "CRON_TZ=UTC 0 0 * * *",
                     "0 2 * * *\n0 3 * * *", "0 0 29 2 MON#5", "* * * * * * *"]),
)
zones = st.one_of(
    st.sampled_from(["Asia/Shanghai", "Europe/Berlin", "America/New_York", "UTC", "Local",
                     "Etc/GMT+14", "Pacific/Kiritimati", "Australia/Lord_Howe", "../../etc/passwd",
                     "/etc/localtime", "Europe/Berlin\x00", "", "posixrules", "Factory",
                     "America/Argentina/../New_York"]),
    st.text(max_size=30),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(),
    st.text(max_size=20),
    st.dates(min_value=date(1, 1, 1), max_value=date(9999, 12, 31)),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
    st.times(),
    st.sampled_from(["30s", "10m", "1h", "-5s", "0s", "1e308s", "nan", "inf", "9" * 40 + "d",
                     "1 fortnight", "P1D", "skip", "all", "latest", "buffer_one", "shift"]),
)
values = st.recursive(scalars.filter(lambda v: v is not None),
                      lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                      max_leaves=12)
FIELDS = ["task", "cron", "tz", "args", "kwargs", "queue", "overlap", "catchup",
          "catchup_window", "catchup_max", "gap", "fold", "jitter", "expires", "priority",
          "paused", "bogus"]


@st.composite
def entries(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"task": "workers.crawler.crawl_site", "cron": draw(crons),
                            "tz": draw(zones)}
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)):
        body[field] = draw(values)
    return body


def _render(name: str, body: dict[str, Any]) -> str:
    lines = [f"[entries.{json.dumps(name)}]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(body=entries(), name=st.one_of(st.just("hostile"), st.text(max_size=30)))
@example(body={"task": "t.x", "cron": "0 0 29 2 1#5", "tz": "UTC"}, name="leap-monday")
@example(body={"task": "t.x", "cron": "59 59 23 31 12 *", "tz": "Pacific/Kiritimati"},
         name="last-second")
@example(body={"task": "t.x", "cron": "* * * * *", "tz": "UTC", "jitter": "1e308s"},
         name="huge-jitter")
@example(body={"task": "t.x", "cron": "* * * * *", "tz": "UTC", "jitter": 2**63 - 1},
         name="int-jitter")
@example(body={"task": "t.x", "cron": "* * * * *", "tz": "UTC", "catchup_window": "9" * 40 + "d"},
         name="huge-window")
def test_hostile_entry_fields(body: dict[str, Any], name: str) -> None:
    """A hostile entry next to a good one: the hostile one loads or is reported (file, entry),
    the good one always loads, and every loaded schedule answers fire-time questions."""
    text = GOOD_ENTRY + _render(name, body)
    result = parse_schedule_text(text, FILE)
    _check_result(result)
    unparsable = any(e.entry is None and e.field is None for e in result.errors)
    if name != "always-good" and not unparsable:  # a file that is not TOML has no entries
        assert "always-good" in result.entries, [str(e) for e in result.errors]
    for err in result.errors:
        if name in result.entries:
            continue
        assert err.entry is not None or err.field is not None or "TOML" in err.reason
    for spec in result.entries.values():
        _exercise_schedule(spec.schedule)
        assert isinstance(spec.fingerprint(), str)
        json.dumps({"args": list(spec.args), "kwargs": spec.kwargs, **spec.options()},
                   allow_nan=False)


# -- TzCron directly (it is also a public BaseSchedule for stock beat) ---------------------------
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(expr=crons, tz=zones, jitter=st.one_of(st.floats(), st.integers(-(2**70), 2**70)),
       gap=st.sampled_from(["shift", "skip", "both", ""]),
       fold=st.sampled_from(["first", "last", "both", "none"]))
def test_tzcron_direct(expr: str, tz: str, jitter: float, gap: str, fold: str) -> None:
    try:
        schedule = TzCron(expr, tz, name="fuzz", gap=gap, fold=fold, jitter=jitter)
    except ScheduleError as exc:
        assert str(exc)
        return
    _exercise_schedule(schedule)
    for instant in INSTANTS[:1]:
        for slot, fire in zip(range(3), schedule.fires(instant, instant + timedelta(days=2)),
                              strict=False):
            del slot
            assert fire[1] > instant


# -- files on disk -----------------------------------------------------------------------------
def test_oversized_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.toml"
    with path.open("wb") as fh:
        fh.write(GOOD_ENTRY.encode())
        fh.write(b"#" * (MAX_FILE_BYTES + 1) + b"\n")
    (tmp_path / "fine.toml").write_text(GOOD_ENTRY.replace("always-good", "fine"))
    t0 = time.monotonic()
    result = load_schedule_files(["*.toml"], base_dir=tmp_path)
    assert time.monotonic() - t0 < 5
    assert "fine" in result.entries
    assert [e.file for e in result.errors] == ["huge.toml"]


def test_many_entries_just_under_the_cap_load_in_bounded_time(tmp_path: Path) -> None:
    body = "".join(
        f'[entries.e{i}]\ntask = "t.x"\ncron = "{i % 60} {i % 24} * * *"\ntz = "UTC"\n'
        for i in range(4_000)
    )
    assert len(body) < MAX_FILE_BYTES
    (tmp_path / "many.toml").write_text(body)
    t0 = time.monotonic()
    result = load_schedule_files([str(tmp_path / "many.toml")])
    elapsed = time.monotonic() - t0
    assert result.ok and len(result.entries) == 4_000
    assert elapsed < 15, f"4000 entries took {elapsed:.1f}s"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "dangling-link"])
def test_special_files_are_reported_not_hung_on(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "special.toml"
    if kind == "fifo":
        os.mkfifo(path)  # opening a FIFO for reading blocks until a writer appears
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # endless
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "missing")
    (tmp_path / "fine.toml").write_text(GOOD_ENTRY.replace("always-good", "fine"))
    results: list[LoadResult] = []
    loader = threading.Thread(target=lambda: results.append(
        load_schedule_files(["*.toml"], base_dir=tmp_path)), daemon=True)
    loader.start()
    loader.join(3)
    if loader.is_alive():
        if kind == "fifo":  # release the blocked open() so the thread ends
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            loader.join(5)
        pytest.fail(f"{kind}: the loader blocked for more than 3 s")
    result = results[0]
    assert "fine" in result.entries
    for err in result.errors:
        assert isinstance(err, ScheduleFileError) and err.file
