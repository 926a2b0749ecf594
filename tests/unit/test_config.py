"""``CrawlConfig`` validation: every bad value raises one ``ConfigError`` naming its setting."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_crawl.config import DEFAULTS, CrawlConfig, mask_url, plain_redis_url
from celery_crawl.errors import ConfigError

#: ``from_mapping`` takes no app, so the app-derived defaults (namespace, done ttl) are given.
GOOD = {"crawl_lease_url": "redis://127.0.0.1:6399/0", "crawl_namespace": "shop",
        "crawl_done_ttl": "1d"}

BAD: list[tuple[str, Any]] = [
    ("crawl_lease_url", "memcached://127.0.0.1:11211"),
    ("crawl_lease_url", "127.0.0.1:6379"),
    ("crawl_lease_url", ""),
    ("crawl_namespace", ""),
    ("crawl_namespace", "has space"),
    ("crawl_namespace", "{braces}"),
    ("crawl_namespace", 7),
    ("crawl_beat_lease_ttl", -1),
    ("crawl_beat_lease_ttl", "ten seconds"),
    ("crawl_beat_lease_ttl", 0.1),  # too short to renew every ttl/3
    ("crawl_beat_lease_ttl", True),
    ("crawl_worker_lease_ttl", "-5s"),
    ("crawl_worker_lease_ttl", 0.2),
    ("crawl_worker_lease_ttl", [15]),
    ("crawl_reaper_interval", 0),
    ("crawl_reaper_interval", "-1s"),
    ("crawl_max_clock_skew", -0.5),
    ("crawl_max_clock_skew", "fast"),
    ("crawl_schedule_paths", 42),
    ("crawl_schedule_paths", ["ok/*.toml", 3]),
    ("crawl_metrics_port", 70000),
    ("crawl_metrics_port", -1),
    ("crawl_metrics_port", "9100"),
    ("crawl_metrics_port", True),
    ("crawl_metrics_addr", ""),
    ("crawl_metrics_addr", 9100),
    ("crawl_metrics_addr", "0.0.0.0 1"),
    ("crawl_on_lease_loss", "explode"),
    ("crawl_max_deliveries", 0),
    ("crawl_max_deliveries", 2.5),
    ("crawl_done_ttl", "-1h"),
    ("crawl_done_ttl", "forever"),
    ("crawl_min_memory", "lots"),
    ("crawl_min_memory", -1),
    ("crawl_min_memory", "0MiB"),
    ("crawl_redis_wait_replicas", -1),
    ("crawl_redis_wait_replicas", "1"),
    ("crawl_audit_maxlen", 0),
    ("crawl_audit_maxlen", None),
    ("crawl_store_timeout", 0),
    ("crawl_store_timeout", "-2s"),
    ("crawl_beat_verify_delivery", "-1s"),
    ("crawl_beat_verify_delivery", 0.5),
    ("crawl_schedule_sources", ["files", "django"]),
    ("crawl_schedule_sources", ["files", "files"]),
    ("crawl_schedule_sources", 3),
    ("crawl_beat_schedule_mismatch", "ignore"),
]


@pytest.mark.parametrize(("setting", "value"), BAD, ids=[f"{s}={v!r}" for s, v in BAD])
def test_bad_value_names_the_setting(setting: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=setting):
        CrawlConfig.from_mapping({**GOOD, setting: value})


def test_every_setting_has_a_bad_value_case() -> None:
    assert {s for s, _ in BAD} == set(DEFAULTS)


def test_etcd_lease_ttls_below_the_floor_are_refused() -> None:
    for setting in ("crawl_beat_lease_ttl", "crawl_worker_lease_ttl"):
        with pytest.raises(ConfigError, match=f"{setting}.*floor"):
            CrawlConfig.from_mapping({**GOOD, "crawl_lease_url": "etcd://127.0.0.1:2379",
                                      setting: 1.5})
    ok = CrawlConfig.from_mapping({**GOOD, "crawl_lease_url": "etcd://127.0.0.1:2379",
                                   "crawl_beat_lease_ttl": 2, "crawl_worker_lease_ttl": "3s",
                                   "crawl_store_timeout": 1})
    assert (ok.beat_lease_ttl_s, ok.worker_lease_ttl_s) == (2.0, 3.0)


def test_store_timeout_must_be_shorter_than_each_lease_ttl() -> None:
    for setting in ("crawl_beat_lease_ttl", "crawl_worker_lease_ttl"):
        with pytest.raises(ConfigError, match=f"crawl_store_timeout.*{setting}"):
            CrawlConfig.from_mapping({**GOOD, setting: 2, "crawl_store_timeout": 2})
    ok = CrawlConfig.from_mapping({**GOOD, "crawl_beat_lease_ttl": 1.5,
                                   "crawl_store_timeout": 1})
    assert ok.store_timeout_s == 1.0


@pytest.mark.parametrize("tz", ["Nowhere/City", "", 5, "../../etc/passwd"])
def test_an_unknown_celery_timezone_names_the_setting(tz: Any) -> None:
    app = Celery("shop", set_as_current=False)
    app.conf.update(crawl_lease_url="redis://127.0.0.1:6379/0", timezone=tz)
    with pytest.raises(ConfigError, match="timezone"):
        CrawlConfig.from_app(app)


def test_a_known_celery_timezone_is_accepted() -> None:
    app = Celery("shop", set_as_current=False)
    app.conf.update(crawl_lease_url="redis://127.0.0.1:6379/0", timezone="Asia/Shanghai")
    assert CrawlConfig.from_app(app).namespace == "shop"


def test_unknown_crawl_setting_is_named() -> None:
    with pytest.raises(ConfigError, match="crawl_lease_ttl"):
        CrawlConfig.from_mapping({**GOOD, "crawl_lease_ttl": 10})


def test_defaults_and_human_durations() -> None:
    cfg = CrawlConfig.from_mapping({**GOOD, "crawl_worker_lease_ttl": "15s",
                                    "crawl_min_memory": "2GiB"})
    assert cfg.namespace == "shop"
    assert cfg.beat_lease_ttl_s == 10.0
    assert cfg.reaper_interval_s == pytest.approx(5.0)  # worker ttl / 3
    assert cfg.done_ttl_s == 86400.0
    assert cfg.min_memory_bytes == 2 * 1024**3
    assert cfg.store_timeout_s == 2.0
    assert cfg.schedule_paths == ("beat_schedules/*.toml",)


def test_from_app_falls_back_to_a_redis_result_backend_and_app_name() -> None:
    app = Celery("shop", set_as_current=False)
    app.conf.result_backend = "crawlredis://:secret@127.0.0.1:6399/3"
    cfg = CrawlConfig.from_app(app)
    assert cfg.lease_url == "redis://:secret@127.0.0.1:6399/3"
    assert cfg.namespace == "shop"


def test_from_app_without_a_redis_backend_asks_for_crawl_lease_url() -> None:
    app = Celery("shop", set_as_current=False)
    app.conf.result_backend = "rpc://"
    with pytest.raises(ConfigError, match="crawl_lease_url"):
        CrawlConfig.from_app(app)


def test_mask_url_hides_passwords_only() -> None:
    assert mask_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert mask_url("redis://host:6379/0") == "redis://host:6379/0"
    assert "pw" not in mask_url("etcd+https://root:pw@10.0.0.1:2379")


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://h:1/0", "redis://h:1/0"),
    ("rediss://h:1/0", "rediss://h:1/0"),
    ("crawlredis://h:1/2", "redis://h:1/2"),
    ("crawlrediss://u:p@h:1/0", "rediss://u:p@h:1/0"),
    ("celery_crawl.backends:AuditedRedisBackend+redis://h:1/0", "redis://h:1/0"),
    ("amqp://guest@h//", None),
    ("etcd://h:2379", None),
    (None, None),
])
def test_plain_redis_url_keeps_tls_only_where_asked(url: object, expected: str | None) -> None:
    assert plain_redis_url(url) == expected
