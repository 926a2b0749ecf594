"""The wheel a user installs: built from this checkout, installed into a fresh venv outside it.

It must hold exactly one top-level package, ``celery_crawl`` (no ``workers`` package to collide
with a user's own), and ``celery-crawl up`` from that venv, run from a directory that is not the
checkout and without the checkout on ``PYTHONPATH``, must run the demo fleet to a clean exit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ROOT
from tests.system.test_up import Up, assert_clean, runs_per_entry, summary_of

pytestmark = [pytest.mark.system, pytest.mark.slow]

#: Building the wheel and installing it with its dependencies (from pip's cache or the index).
_INSTALL_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, timeout=_INSTALL_TIMEOUT_S, capture_output=True)
    (built,) = out.glob("celery_crawl-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv (no system site-packages, not the checkout's) with the wheel installed."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    pip = env_dir / "bin" / "pip"
    result = subprocess.run([str(pip), "install", "-q", str(wheel)], capture_output=True,
                            text=True, timeout=_INSTALL_TIMEOUT_S,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stdout + result.stderr
    yield env_dir


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert whl.read(top_level).decode().split() == ["celery_crawl"]
    roots = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert roots == {"celery_crawl"}, roots
    # The crawler app and its schedule files ride inside the package.
    assert "celery_crawl/_demo/crawler.py" in names
    assert "celery_crawl/_demo/schedules/demo/local-site.toml" in names


def test_up_from_the_installed_wheel_runs_the_demo_fleet(installed: Path,
                                                         tmp_path: Path) -> None:
    python = installed / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import workers"], cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'workers'" in probe.stderr
    up = Up(tmp_path, "--duration", "20", "--no-flower",
            exe=str(installed / "bin" / "celery-crawl"), checkout=False)
    try:
        out = up.finish()
    finally:
        up.kill()
    assert_clean(out, up.proc.returncode)
    assert str(ROOT) not in re.sub(r"^\s*up \| status .*$", "", out, flags=re.M), out[-3000:]
    assert "site-packages/celery_crawl/_demo/schedules/demo/*.toml" in out, out[:3000]
    runs = runs_per_entry(summary_of(out))
    assert runs.get("demo-news", (0, 0, 0))[1] >= 2, summary_of(out)
    assert all(dups == 0 for _, _, dups in runs.values()), summary_of(out)
