"""``inspect stats`` rows of the worker plugin: flat, scalar, every field kept."""

from __future__ import annotations

from celery_crawl.worker.stats import STATS_KEYS, flat_stats


def test_rows_are_flat_scalars_and_no_field_is_dropped() -> None:
    status = {"holder": "h:1:ab", "token": 7, "lease_time_left_s": 2.5, "consuming": True,
              "last_loss": None, "reaper_recovered": 3, "future_field": {"nested": [1]}}
    rows = flat_stats(status)
    assert rows == {"crawl_lease_holder": "h:1:ab", "crawl_lease_token": 7,
                    "crawl_lease_time_left_s": 2.5, "crawl_consuming": True,
                    "crawl_last_loss": None,
                    "crawl_recoveries": 3, "crawl_future_field": "{'nested': [1]}"}
    assert list(rows)[:3] == ["crawl_lease_holder", "crawl_lease_token", "crawl_lease_time_left_s"]
    assert all(v.startswith("crawl_") for v in STATS_KEYS.values())
    assert len(set(STATS_KEYS.values())) == len(STATS_KEYS)
