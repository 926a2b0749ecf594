"""Start-up guards read real cgroup files (a fake cgroup tree in a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_crawl.errors import UnsupportedSetup
from celery_crawl.worker.guards import cgroup_memory_limit, check_beat, check_memory, pool_name


def test_cgroup_v2_root_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("1073741824\n")
    assert cgroup_memory_limit(tmp_path) == 1024**3


def test_cgroup_v2_unlimited_and_v1(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(512 * 1024**2))
    assert cgroup_memory_limit(v1) == 512 * 1024**2
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))
    assert cgroup_memory_limit(v1) is None


def test_memory_floor_refuses_and_small_limit_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / "memory.max").write_text(str(1024**3))
    with pytest.raises(UnsupportedSetup, match=r"crawl_min_memory: .*1024 MiB.*2048 MiB"):
        check_memory(2 * 1024**3, None, root=tmp_path)
    with caplog.at_level("WARNING"):
        assert check_memory(None, None, root=tmp_path) == 1024**3
    assert "worker_max_memory_per_child is unset" in caplog.text


def test_pool_names_and_beat() -> None:
    from celery.concurrency import get_implementation

    assert pool_name(get_implementation("prefork")) == "prefork"
    assert pool_name(get_implementation("threads")) == "threads"
    assert pool_name(get_implementation("solo")) == "solo"
    check_beat(False)
    with pytest.raises(UnsupportedSetup, match="-B"):
        check_beat(True)


def test_install_worker_sets_only_what_the_app_left_unset() -> None:
    from celery import Celery

    from celery_crawl.worker import install_worker

    app = Celery("t-install")
    app.conf.update(crawl_lease_url="redis://127.0.0.1:1/0", crawl_worker_lease_ttl=10,
                    task_acks_late=False)
    install_worker(app)
    install_worker(app)  # idempotent
    assert app.conf.task_acks_late is False
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.broker_heartbeat == 5
    names = [getattr(s, "name", "") for s in app.steps["worker"]]
    assert names.count("celery_crawl.worker.steps.LeaseStep") == 1
    assert [getattr(s, "name", "") for s in app.steps["consumer"]].count(
        "celery_crawl.worker.steps.ClaimStep") == 1
