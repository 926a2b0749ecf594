"""What the distribution ships: every subpackage of celery_crawl, and one top-level package."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.procs import ROOT


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed_for_the_wheel() -> None:
    """``packages`` is an explicit list (the crawler app is mapped in): none may be forgotten."""
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "celery_crawl").rglob("__init__.py")
    }
    listed = set(_setuptools()["packages"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"


def test_only_celery_crawl_is_installed_at_the_top_level() -> None:
    listed = _setuptools()["packages"]
    assert {name.split(".", 1)[0] for name in listed} == {"celery_crawl"}
    mapped = _setuptools()["package-dir"]
    assert mapped == {"celery_crawl._demo": "workers",
                      "celery_crawl._demo.schedules": "beat_schedules"}
    for directory in mapped.values():
        assert (Path(ROOT) / directory / "__init__.py").is_file()
