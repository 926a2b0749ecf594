"""Human durations: parsing, errors naming the setting, and the round trip with formatting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_crawl.durations import format_duration, parse_duration
from celery_crawl.errors import ConfigError


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30.0), ("10m", 600.0), ("1h30m", 5400.0), ("2d", 172800.0), ("1w", 604800.0),
    ("250ms", 0.25), ("1.5s", 1.5), (" 1h 30m ", 5400.0), (0, 0.0), (2.5, 2.5), (7, 7.0),
])
def test_parse(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "abc", "10", "10x", "1h-5m", "s30", -1, "-1s", float("nan"),
                                 True, None, [1], "101000d"])
def test_bad_durations_name_what(bad: object) -> None:
    with pytest.raises(ConfigError, match="crawl_done_ttl"):
        parse_duration(bad, what="crawl_done_ttl")


@settings(max_examples=100)
@given(st.integers(min_value=1, max_value=400 * 86400))
def test_format_then_parse_is_identity_for_whole_seconds(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_format_small_values() -> None:
    assert format_duration(0) == "0s"
    assert format_duration(0.25) == "250ms"
    assert format_duration(3661) == "1h1m1s"
