"""Real celery processes for system tests: each in its own session, whole group killed at end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CELERY = str(Path(sys.executable).with_name("celery"))


class Proc:
    """A child process in its own session, with its output in a log file."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None,
                 log_path: Path, cwd: Path | None = None, preload: str | None = None) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(cwd or ROOT), str(ROOT), full_env.get("PYTHONPATH", "")) if p)
        if preload:
            full_env["LD_PRELOAD"] = preload
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=full_env, cwd=str(cwd or ROOT),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill9(self) -> None:
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> int | None:
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                time.sleep(0.05)
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


def celery_args(app: str, *rest: str) -> list[str]:
    return [CELERY, "-A", app, *rest]


def worker_args(app: str, *, pool: str = "prefork", concurrency: int = 1, hostname: str,
                queues: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    args = celery_args(app, "worker", "--without-mingle", "--without-gossip", "-P", pool,
                       "-c", str(concurrency), "-n", hostname, "-l", "INFO")
    if queues:
        args += ["-Q", queues]
    return [*args, *extra]


def faketime_lib() -> str | None:
    for p in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
              "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
              "/usr/lib/faketime/libfaketime.so.1"):
        if os.path.exists(p):
            return p
    return None
