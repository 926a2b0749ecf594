"""Start-up guards of a leased worker: pools and modes we refuse, and the cgroup memory limit.

A worker that cannot honour its lease must not start, because recovery of its tasks would then
depend on luck: the solo/gevent/eventlet pools block or share the thread that renews the lease,
and ``worker -B`` would embed a second, unleased beat next to the elected one. Memory is checked
because a cgroup limit silently lowered (the seeds' incident: a cron script reset it to 1 GB)
turns every large crawl into an OOM kill, which then looks like a poison message.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import UnsupportedSetup

__all__ = [
    "SMALL_MEMORY_BYTES",
    "SUPPORTED_POOLS",
    "cgroup_memory_limit",
    "check_beat",
    "check_memory",
    "check_pool",
    "pool_name",
]

logger = logging.getLogger(__name__)

#: Pools whose main process keeps its event loop and a renewal thread running while tasks run.
SUPPORTED_POOLS = ("prefork", "threads")
#: Below this cgroup limit a worker without ``worker_max_memory_per_child`` gets a warning.
SMALL_MEMORY_BYTES = 2 * 1024**3

_V2_FILE = "memory.max"
_V1_FILE = "memory/memory.limit_in_bytes"
#: cgroup v1 reports "no limit" as a huge page-aligned number.
_V1_UNLIMITED = 1 << 60


def pool_name(pool_cls: object) -> str:
    """The short name (``prefork``, ``threads``, ``solo``...) of a Celery pool class or alias."""
    if isinstance(pool_cls, str):
        name = pool_cls.rsplit(":", 1)[-1].rsplit(".", 1)[-1].lower()
        aliases = {"taskpool": "prefork", "processes": "prefork", "thread": "threads"}
        return aliases.get(name, name)
    module = getattr(pool_cls, "__module__", "") or ""
    tail = module.rsplit(".", 1)[-1]
    return {"prefork": "prefork", "thread": "threads", "solo": "solo", "gevent": "gevent",
            "eventlet": "eventlet", "processes": "prefork"}.get(tail, tail or str(pool_cls))


def check_pool(pool_cls: object) -> str:
    """Refuse pools the lease cannot protect; return the pool's short name.

    Raises:
        UnsupportedSetup: for solo, gevent, eventlet or any unknown pool.
    """
    name = pool_name(pool_cls)
    if name not in SUPPORTED_POOLS:
        raise UnsupportedSetup(
            f"celery-crawl worker lease: the {name!r} pool is not supported (use -P prefork or "
            f"-P threads). The {name} pool runs tasks on the thread that must renew the lease "
            "and cancel a fenced task, so a long task would silently lose its lease."
        )
    return name


def check_beat(beat: object) -> None:
    """Refuse ``celery worker -B``.

    Raises:
        UnsupportedSetup: when the worker was asked to embed beat.
    """
    if beat:
        raise UnsupportedSetup(
            "celery-crawl worker lease: 'celery worker -B' (embedded beat) is not supported: "
            "it would run an unleased scheduler in every worker. Run 'celery beat -S "
            "celery_crawl.beat:LeasedScheduler' as its own process (any number of replicas)."
        )


def cgroup_memory_limit(root: str | Path = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup memory limit in bytes, or None when unlimited or unknown.

    Reads cgroup v2 (``memory.max`` of the process's own group, walking up to the root) and
    falls back to cgroup v1 (``memory/memory.limit_in_bytes``).
    """
    base = Path(root)
    for group in _own_v2_groups(base):
        value = _read(group / _V2_FILE)
        if value is None:
            continue
        if value == "max":
            continue
        try:
            return int(value)
        except ValueError:
            return None
    value = _read(base / _V1_FILE)
    if value is not None:
        try:
            limit = int(value)
        except ValueError:
            return None
        return None if limit >= _V1_UNLIMITED else limit
    return None


def _own_v2_groups(base: Path) -> list[Path]:
    """The process's v2 cgroup and its ancestors, innermost first (only those under ``base``)."""
    rel = ""
    text = _read(Path("/proc/self/cgroup"))
    for line in (text or "").splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
    out: list[Path] = []
    path = base / rel if rel else base
    while True:
        out.append(path)
        if path == base or base not in path.parents:
            break
        path = path.parent
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def check_memory(
    min_memory_bytes: int | None,
    max_memory_per_child: object,
    *,
    limit_bytes: int | None = None,
    root: str | Path = "/sys/fs/cgroup",
) -> int | None:
    """Refuse to start below ``crawl_min_memory``; warn when small and unguarded.

    Args:
        min_memory_bytes: the ``crawl_min_memory`` setting (None: no floor).
        max_memory_per_child: the app's ``worker_max_memory_per_child`` (None: unset).
        limit_bytes: the limit to judge; read from the cgroup when None.
        root: cgroup mount point (for tests).

    Returns:
        The limit judged, or None when unlimited/unknown.

    Raises:
        UnsupportedSetup: naming ``crawl_min_memory`` and both sizes.
    """
    limit = cgroup_memory_limit(root) if limit_bytes is None else limit_bytes
    if limit is None:
        return None
    if min_memory_bytes is not None and limit < min_memory_bytes:
        raise UnsupportedSetup(
            f"crawl_min_memory: the cgroup memory limit of this worker is {_mib(limit)}, below "
            f"the required {_mib(min_memory_bytes)}; refusing to start (raise the container's "
            "memory limit, or lower crawl_min_memory)"
        )
    if limit < SMALL_MEMORY_BYTES and not max_memory_per_child:
        logger.warning(
            "celery-crawl: the cgroup memory limit is only %s and worker_max_memory_per_child "
            "is unset: a growing crawl will be OOM-killed (and redelivered up to "
            "crawl_max_deliveries times) instead of its child being recycled",
            _mib(limit),
        )
    return limit


def _mib(size: int) -> str:
    return f"{size / 1024**2:.0f} MiB"
