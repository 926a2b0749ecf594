"""The public names are exactly the intended ones (a removal or addition is a conscious change)."""

from __future__ import annotations

import celery_crawl

EXPECTED = {
    "AbandonedRun", "AuditedRedisBackend", "Claim", "ConfigError", "CrawlConfig", "CrawlError",
    "FencedError",
    "IdempotentTask", "Lease", "LeaseError", "LeaseLost", "LeaseStore", "LeasedScheduler",
    "NotLeader", "PoisonMessage", "ReplayError", "RollbackFailed",
    "ScheduleError", "ScheduleFileError", "SerializationRefused", "StoreDataError",
    "StoreError", "StoreTimeout", "StoreUnavailable", "TaskIdReused", "TzCron", "UnsupportedSetup",
    "__version__", "current_claim", "install", "open_store",
}


def test_all_is_pinned() -> None:
    assert set(celery_crawl.__all__) == EXPECTED


def test_every_exported_name_resolves() -> None:
    for name in celery_crawl.__all__:
        assert getattr(celery_crawl, name) is not None, name


def test_every_error_derives_from_the_root() -> None:
    for name in celery_crawl.__all__:
        obj = getattr(celery_crawl, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, celery_crawl.CrawlError), name


def test_install_is_idempotent_and_keeps_user_choices() -> None:
    from celery import Celery

    app = Celery("api-test", broker="memory://", backend="crawlredis://127.0.0.1:1/0")
    app.conf.task_acks_late = False
    app.conf.beat_scheduler = "celery.beat:PersistentScheduler"
    first = celery_crawl.install(app)
    second = celery_crawl.install(app)
    assert first == second
    assert app.conf.task_acks_late is False
    assert app.conf.beat_scheduler == "celery.beat:PersistentScheduler"
    lease_steps = [s for s in app.steps["worker"] if s.__name__ == "LeaseStep"]
    assert len(lease_steps) == 1


def test_install_defaults_the_beat_scheduler() -> None:
    from celery import Celery

    app = Celery("api-test2", broker="memory://", backend="crawlredis://127.0.0.1:1/0")
    celery_crawl.install(app)
    assert app.conf.beat_scheduler == "celery_crawl.beat:LeasedScheduler"
    assert app.conf.task_acks_late is True
