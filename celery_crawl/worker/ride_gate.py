"""Whether claims and ends may ride in the broker's own round trips (``riding.py``).

Riding replaces kombu's Redis ``QoS.append``/``QoS.ack`` round trips with scripts that make
kombu's writes first, so it depends on how the installed kombu writes them (checked byte for
byte against the real ``QoS.append`` by ``tests/integration/test_worker_riding.py``) and on
redis-py's client; it is on only for the versions it was tested with. And a ridden write is
made on the consumer's loop with kombu's own client: the overlap bound (docs/design.md, "Worker
lease loss") holds only if that client's socket timeout is no longer than
``crawl_store_timeout`` (a worker cut off inside the write must get its loop back in time to
kill its task). Anything else: the claims and ends take the default path, said once in the log.
Pure functions of the versions and settings, so a version table can call them.
"""

from __future__ import annotations

from .._celery_compat import TESTED as _COMPAT_TESTED

__all__ = ["TESTED", "installed_versions", "ride_refusal"]

#: ``package -> (first, last)`` minors riding was tested with: the compatibility layer's range
#: (``.ci/run`` runs the riding tests, the byte-for-byte one included, on every minor of it).
TESTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "kombu": _COMPAT_TESTED["kombu"], "redis": _COMPAT_TESTED["redis"]}
_NAMES = {"kombu": "kombu", "redis": "redis-py"}


def _untested(dist: str, version: str) -> str | None:
    first, last = TESTED[dist]
    try:
        got = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        got = ()
    if len(got) == 2 and first <= got <= last:
        return None
    return (f"{_NAMES[dist]} {version} is not a version riding was tested with "
            f"({first[0]}.{first[1]}-{last[0]}.{last[1]})")


def ride_refusal(kombu_version: str, redis_version: str, *,
                 socket_timeout_s: float | None, store_timeout_s: float) -> str | None:
    """Why riding stays off (a log line's reason), or None when it may ride.

    Args:
        kombu_version, redis_version: the installed versions (``installed_versions``).
        socket_timeout_s: the broker channel's client socket timeout (kombu's
            ``socket_timeout`` transport option; None: kombu waits forever).
        store_timeout_s: ``crawl_store_timeout``.
    """
    why = _untested("kombu", kombu_version) or _untested("redis", redis_version)
    if why is not None:
        return why
    if socket_timeout_s is None or socket_timeout_s > store_timeout_s:
        return (f"the broker's socket_timeout ({socket_timeout_s}) is not bounded by "
                f"crawl_store_timeout ({store_timeout_s}s): a worker cut off from Redis inside "
                "a ridden write would block its loop past the overlap bound")
    return None


def installed_versions() -> tuple[str, str]:
    """``(kombu, redis-py)`` versions of this process."""
    import kombu
    import redis

    return str(kombu.__version__), str(redis.__version__)
