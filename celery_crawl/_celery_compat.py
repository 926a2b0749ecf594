"""Every private or version-specific Celery, kombu and redis-py name the package uses, behind
small named functions, with the versions each variant was checked against.

Checked against celery 5.4.0, 5.5.3, 5.6.3 and 5.7.0; kombu 5.4.2, 5.5.4, 5.6.2 and 5.7.0; redis-py
5.2.1, 6.4.0 and 8.2.0 (what each of those kombu releases pulls in), billiard 4.2 and 4.3. These
names are not public API, so an upgrade may remove or change them without notice; keeping them in
one module makes the exposure visible and testable: tests/unit/test_celery_compat.py asserts, on
the installed versions, that each name in ``PRIVATE_NAMES`` exists exactly where ``SINCE`` says it
does, that each fallback keeps that version's stock behaviour, and that no other module of the
package touches one of them (an override extending its base through ``super()`` is the one allowed
use). ``.ci/run`` runs those tests on every supported minor.

Where a name exists only from some version on (``SINCE``), the function below has a fallback
for the versions before it that does what stock Celery of that version does. A Celery, kombu or
redis-py outside ``TESTED`` gets one warning at worker and beat start (``warn_untested``), and the
fast paths tied to internals (``fast_paths_ok``) turn themselves off: the worker then uses its
default path, which needs only the names above.

Imports nothing of the package, so every part may use it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, cast

__all__ = [
    "BACKEND_OVERRIDES",
    "CHECKED_AGAINST",
    "KOMBU_ERROR",
    "PRIVATE_NAMES",
    "SENT",
    "SINCE",
    "TESTED",
    "at_least",
    "call_task_errbacks",
    "cancel_quietly",
    "cancel_request",
    "channel_gone",
    "config_source",
    "exec_options",
    "fail_chain",
    "failure_expires",
    "fast_paths_ok",
    "forget_unacked_locally",
    "guard_connection_close",
    "installed_versions",
    "max_value_size",
    "pool_connection",
    "priority_queue_key",
    "redis_channel_server",
    "redis_socket",
    "remove_unacked",
    "request_message",
    "restore_unacked",
    "result_meta",
    "task_registry",
    "threads_pool_future",
    "untested_versions",
    "warn_untested",
]

logger = logging.getLogger("celery_crawl.worker")

#: The releases every name and fallback below was checked against (``.ci/run`` tests each).
CHECKED_AGAINST: dict[str, tuple[str, ...]] = {
    "celery": ("5.4.0", "5.5.3", "5.6.3", "5.7.0"),
    "kombu": ("5.4.2", "5.5.4", "5.6.2", "5.7.0"),
    "redis": ("5.2.1", "6.4.0", "8.2.0"),
}

#: The tested range per distribution, as (first, last) ``major.minor``, both included.
TESTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "celery": ((5, 4), (5, 7)),
    "kombu": ((5, 4), (5, 7)),
    "redis": ((5, 2), (8, 2)),
}

#: Private names that exist only from a release on: ``module:Class.name`` -> (distribution,
#: first ``major.minor`` that has it). Before it, the function using the name falls back to
#: what stock Celery of that version does.
SINCE: dict[str, tuple[str, tuple[int, int]]] = {
    "celery.worker.request:Request._eta_timer_entry": ("celery", (5, 7)),
    "celery.backends.redis:RedisBackend._fail_chain": ("celery", (5, 7)),
    "celery.backends.redis:RedisBackend.failure_expires": ("celery", (5, 7)),
}

#: ``module:Class`` -> the private names of it used below (class or instance attributes).
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "celery.app.base:Celery": ("_tasks", "_config_source"),
    "celery.app.task:Task": ("_get_exec_options",),
    "celery.worker.request:Request": (
        "_message", "_apply_result", "_already_cancelled", "_eta_timer_entry"),
    "kombu.message:Message": ("_state",),
    "kombu.transport.virtual.base:Message": ("_raw",),
    "kombu.transport.redis:Channel": ("_q_for_pri", "_create_client"),
    "kombu.transport.redis:QoS": ("_remove_from_indices",),
    "celery.backends.redis:RedisBackend": (
        "_fail_chain", "_call_task_errbacks", "_get_result_meta", "_MAX_STR_VALUE_SIZE",
        "failure_expires"),
    "redis.connection:Connection": ("_sock",),
}

#: Private methods of ``celery.backends.redis:RedisBackend`` that ``AuditedRedisBackend``
#: overrides: the hooks Celery offers for the URL, the client, the result meta and the writes
#: have no public names.
BACKEND_OVERRIDES: tuple[str, ...] = (
    "_params_from_url", "_create_client", "_get_result_meta", "_store_result", "_forget")

# Our own marker on a consumer whose connection close is guarded (see guard_connection_close).
_CLOSE_GUARD = "_crawl_close_guard"

#: One script call to make instead of kombu's own MULTI/EXEC round trip, and what to do with
#: its reply (the reply; the error the server answered; None: the round trip failed and its
#: error is being raised). The script makes kombu's writes first, from the keys and arguments
#: the hook was given (``ridden_append``, ``ridden_ack``).
Ride = tuple[tuple[Any, ...], Callable[[Any], None]]

#: What an ack hook returns when it sent the script itself (it reads the reply later): kombu's
#: local bookkeeping of the ack is all that is left to do.
SENT = object()

#: Prefix of the error a ridden script answers when kombu's own writes in it failed (nothing
#: else in it ran): raised to kombu's caller without the prefix, as kombu would have raised it.
KOMBU_ERROR = "KOMBU "


# -- versions --------------------------------------------------------------------------------
def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


@functools.cache
def installed_versions() -> dict[str, str]:
    """The installed release of each distribution in ``TESTED`` ("" when not installed)."""
    found: dict[str, str] = {}
    for dist in TESTED:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = ""
    return found


def at_least(dist: str, minor: tuple[int, int]) -> bool:
    """Whether the installed ``dist`` is at least release ``minor`` (False when unknown)."""
    got = _minor(installed_versions()[dist])
    return got is not None and got >= minor


def untested_versions(versions: Mapping[str, str] | None = None) -> list[str]:
    """``"celery 5.8.0 (tested: 5.4-5.7)"`` for each installed release outside ``TESTED``."""
    versions = installed_versions() if versions is None else versions
    out = []
    for dist, (first, last) in TESTED.items():
        got = _minor(versions.get(dist, ""))
        if got is None or not first <= got <= last:
            out.append(f"{dist} {versions.get(dist) or '(unknown)'} (tested: "
                       f"{first[0]}.{first[1]}-{last[0]}.{last[1]})")
    return out


_warned: set[str] = set()


def warn_untested(what: str, versions: Mapping[str, str] | None = None) -> bool:
    """Log one warning per process and component when a release outside ``TESTED`` is
    installed; True when every release is tested.

    Nothing degrades silently: the warning names the releases, and ``fast_paths_ok`` is then
    False, so the worker keeps to its default path.
    """
    untested = untested_versions(versions)
    if untested and what not in _warned:
        _warned.add(what)
        logging.getLogger("celery_crawl.compat").warning(
            "celery-crawl %s: %s outside the tested range; the fast paths tied to their "
            "internals are off, and private names are reached through fallbacks that keep "
            "stock behaviour where one exists (see docs/design.md, \"Supported versions\")",
            what, ", ".join(untested))
    return not untested


def fast_paths_ok(versions: Mapping[str, str] | None = None) -> bool:
    """Whether the paths tied to kombu's and redis-py's internals (claims riding kombu's round
    trips, the claim and ack lines) may run: only on tested releases."""
    return not untested_versions(versions)


# -- app and tasks ---------------------------------------------------------------------------
def task_registry(app: Any) -> Mapping[str, Any] | None:
    """The app's task registry as ``send_task`` reads it (``app.tasks`` would finalize the app)."""
    registry: Mapping[str, Any] | None = getattr(app, "_tasks", None)
    return registry


def exec_options(task: Any) -> dict[str, Any]:
    """A registered task's execution options (the defaults ``send_task`` applies)."""
    get_exec = getattr(task, "_get_exec_options", None)
    if not callable(get_exec):
        return {}
    return dict(get_exec() or {})


def config_source(app: Any) -> Any:
    """What ``app.config_from_object`` was given (None if nothing), without loading it."""
    return getattr(app, "_config_source", None)


# -- worker requests -------------------------------------------------------------------------
def request_message(req: Any) -> Any:
    """The kombu message a worker request was built from."""
    return getattr(req, "_message", None)


def threads_pool_future(req: Any) -> Any:
    """The ``concurrent.futures.Future`` of a request handed to the threads pool, or None."""
    if req._apply_result is None:
        return None
    return getattr(req._apply_result(), "f", None)


def cancel_quietly(req: Any, timer: Any = None) -> None:
    """Keep Celery from announcing a request as revoked or retried (its task runs elsewhere)
    and cancel its ETA timer, before the request is cancelled.

    Celery 5.7 keeps a scheduled request's timer entry on the request; before it, the entry is
    found in the consumer's ``timer`` by the request it was given (``strategy`` calls
    ``call_at(eta, apply_eta_task, (req,))`` on 5.4-5.6).
    """
    req._already_cancelled = True
    entry = getattr(req, "_eta_timer_entry", None)
    if entry is None and timer is not None:
        with contextlib.suppress(Exception):
            # ``Timer.queue`` lists ``scheduled(eta, priority, entry)`` tuples.
            entries = (getattr(item, "entry", item) for item in timer.queue)
            entry = next((e for e in entries
                          if tuple(getattr(e, "args", ()) or ())[:1] == (req,)), None)
    if entry is None:
        return
    with contextlib.suppress(Exception):
        if timer is not None:
            timer.cancel(entry)
        else:
            entry.cancel()


def cancel_request(req: Any, pool: Any, signum: int) -> None:
    """Terminate a running request's job without announcing a retry (its task runs elsewhere).

    Celery 5.4 and 5.6+ take ``emit_retry=False``; 5.5's ``cancel`` has no such argument and
    always writes RETRY, so there the job is terminated as ``cancel`` would, without the
    announcement.
    """
    import inspect

    if "emit_retry" in inspect.signature(req.cancel).parameters:
        req.cancel(pool, signal=signum, emit_retry=False)
        return
    from celery.worker.state import task_ready

    if req.time_start:
        pool.terminate_job(req.worker_pid, signum)
        task_ready(req)
        req.send_event("task-cancelled")
    if req._apply_result is not None:
        obj = req._apply_result()
        if obj is not None:
            obj.terminate(signum)


# -- kombu messages and channels -------------------------------------------------------------
def forget_unacked_locally(message: Any, tag: Any) -> None:
    """Drop a Redis delivery from the channel's unacked bookkeeping without touching the broker's
    copy (the base ``QoS.ack``, not the Redis one that deletes it), and mark the message settled
    so closing the channel does not restore it."""
    from kombu.transport.virtual.base import QoS as VirtualQoS

    VirtualQoS.ack(message.channel.qos, tag)
    message._state = "REJECTED"


def channel_gone(message: Any) -> bool:
    """Whether the kombu virtual channel a message came on belongs to a collected connection.

    Celery 5.7 collects a broken broker connection (which clears its transport's ``client``)
    and then closes it; on the Redis transport every later use of that channel - acking a
    message that was running, or the close itself restoring unacked messages - raises
    ``AttributeError`` instead of a connection error, and the worker stops with
    "Unrecoverable error". py-amqp channels have no such attribute and are never "gone" here.
    """
    transport = getattr(getattr(message, "channel", None), "connection", None)
    return transport is not None and hasattr(transport, "client") and transport.client is None


def priority_queue_key(chan: Any, queue: str, pri: int) -> str:
    """The Redis list kombu keeps ``queue``'s messages of priority ``pri`` in (unprefixed)."""
    key: str = chan._q_for_pri(queue, pri)
    return key


def restore_unacked(chan: Any, tag: Any, *, leftmost: bool) -> None:
    """Put one unacked Redis delivery back on its queue (kombu's ``QoS.restore_by_tag``, an
    undocumented method; atomic and idempotent)."""
    chan.qos.restore_by_tag(tag, leftmost=leftmost)


def redis_channel_server(channel: Any) -> dict[str, Any] | None:
    """Where the client of a kombu Redis channel connects (``host``, ``port``, ``db``,
    ``path``); None for another transport, a channel with a ``global_keyprefix`` (kombu would
    prefix the keys of commands sent in its pipelines), or a client not bound to one server."""
    transport = getattr(channel, "connection", None)
    if getattr(transport, "driver_type", None) != "redis":
        return None
    if getattr(channel, "global_keyprefix", ""):
        return None
    try:
        kwargs = channel.client.connection_pool.connection_kwargs
    except Exception:  # a transport variant without a plain connection pool
        return None
    if not isinstance(kwargs, Mapping) or not (kwargs.get("host") or kwargs.get("path")):
        return None
    return {k: kwargs.get(k) for k in ("host", "port", "db", "path")}


def pool_connection(pool: Any) -> Any:
    """A connection from a redis-py pool: redis-py 5.3 and later take no command name, and
    warn when given one; earlier releases (5.2.1, which kombu 5.5 pins) require it."""
    if at_least("redis", (5, 3)):
        return pool.get_connection()
    return pool.get_connection("_")


def pool_connections(pool: Any) -> list[Any]:
    """Every connection a redis-py pool made and still holds, idle or taken (its private
    ``_available_connections`` and ``_in_use_connections``), as a list taken under its lock."""
    lock = getattr(pool, "_lock", None)
    with lock if lock is not None else contextlib.nullcontext():
        return [*getattr(pool, "_available_connections", ()),
                *getattr(pool, "_in_use_connections", ())]


def redis_socket(conn: Any) -> Any:
    """The socket of a connected redis-py connection (None when it has none): a loop that
    reads the replies of commands sent without waiting watches it for readability."""
    return getattr(conn, "_sock", None)


def remove_unacked(channel: Any, tag: Any) -> None:
    """kombu's own ack writes for one Redis delivery (its ``ZREM``/``HDEL``), without its local
    bookkeeping: for an ack whose ridden script the server did not know."""
    channel.qos._remove_from_indices(tag).execute()


def guard_connection_close(c: Any) -> None:
    """Keep a Redis broker restart from stopping the worker (Celery 5.7 with kombu 5).

    The consumer's connection-loss handler collects the broken connection, then closes it; the
    close makes kombu's Redis channel restore its unacked messages through the collected
    transport and raise ``AttributeError``, which Celery does not expect there. The close is
    made to swallow exactly that; the messages it could not restore are restored by the
    reconnected consumer or the reaper.
    """
    if getattr(c, _CLOSE_GUARD, False):
        return
    original = c.on_connection_error_after_connected

    def on_connection_error_after_connected(exc: BaseException) -> Any:
        conn = getattr(c, "connection", None)
        if conn is not None and getattr(conn.transport, "driver_type", None) == "redis":
            close = conn.close

            def close_collected() -> None:
                try:
                    close()
                except AttributeError as err:
                    logger.warning("celery-crawl: closing the lost broker connection: %s "
                                   "(its unacked messages are restored on reconnection)", err)

            conn.close = conn.release = close_collected
        return original(exc)

    c.on_connection_error_after_connected = on_connection_error_after_connected
    setattr(c, _CLOSE_GUARD, True)


# -- the Redis result backend ----------------------------------------------------------------
def result_meta(backend: Any, result: Any, state: str, traceback: Any,
                request: Any) -> dict[str, Any]:
    """The result meta the backend stores (through its ``_get_result_meta``, overrides
    included)."""
    meta: dict[str, Any] = backend._get_result_meta(
        result=result, state=state, traceback=traceback, request=request)
    return meta


def max_value_size(backend: Any) -> int:
    """The largest value the Redis backend stores."""
    size: int = backend._MAX_STR_VALUE_SIZE
    return size


def failure_expires(backend: Any) -> Any:
    """How long a FAILURE result is kept: ``result_failure_expires`` (Celery 5.7), else
    ``result_expires`` as on Celery 5.4-5.6, which has no separate setting."""
    return getattr(backend, "failure_expires", backend.expires)


def fail_chain(backend: Any, chain: Any, exc: Any, traceback: Any, *, store_result: bool,
               state: str) -> None:
    """Mark the rest of a failed task's chain as failed, as Celery's ``mark_as_failure`` does
    (5.7: ``_fail_chain``; 5.4-5.6: the same steps inline, reproduced here)."""
    own = getattr(backend, "_fail_chain", None)
    if own is not None:
        own(chain, exc, traceback, store_result=store_result, state=state)
        return
    from celery import states
    from celery.app.task import Context

    try:
        chain_data = iter(chain)
    except (AttributeError, TypeError):
        chain_data = iter(())
    for chain_elem in chain_data:
        ctx = Context(chain_elem)
        ctx.update(ctx.options)
        ctx.id = ctx.options.get("task_id")
        ctx.group = ctx.options.get("group_id")
        if store_result and state in states.PROPAGATE_STATES and ctx.task_id is not None:
            backend.store_result(ctx.task_id, exc, state, traceback=traceback, request=ctx)
        if "chord" in ctx.options:
            backend.on_chord_part_return(ctx, state, exc)


def call_task_errbacks(backend: Any, request: Any, exc: Any, traceback: Any) -> None:
    """Call a failed task's errbacks, as Celery's ``mark_as_failure`` does."""
    backend._call_task_errbacks(request, exc, traceback)


# -- riding in kombu's Redis QoS, subclassed (worker/ridden_transport.py) ---------------------
# The rides, made from the ``append``/``ack`` of a QoS subclass
# (kombu's own extension point: ``Channel.QoS``, ``Transport.Channel``) instead of methods
# assigned over a live channel's QoS. ``plain`` is kombu's own method (``super()``'s).
def ride_client(channel: Any) -> Any:
    """One client for every ridden call of ``channel`` (kombu makes one per pipeline), on
    kombu's own pool."""
    return channel._create_client()


def _ridden_call(client: Any, command: tuple[Any, ...], after: Callable[[Any], None]) -> bool:
    """Send a ridden script; False when kombu's own call must follow (NOSCRIPT)."""
    from redis.exceptions import NoScriptError, ResponseError

    try:
        reply = client.execute_command(*command)
    except ResponseError as exc:
        reply = exc
    except BaseException:
        after(None)
        raise
    after(reply)
    if isinstance(reply, NoScriptError):
        return False
    if isinstance(reply, ResponseError) and str(reply).startswith(KOMBU_ERROR):
        raise ResponseError(str(reply)[len(KOMBU_ERROR):])
    return True


def ridden_append(qos: Any, client: Any, message: Any, delivery_tag: Any,
                  on_append: Callable[[Any, list[Any], list[Any]], Ride | None],
                  plain: Callable[[Any, Any], None]) -> None:
    """kombu's Redis ``QoS.append`` with the ride ``on_append`` returns in its place (its
    script makes kombu's writes first: ``ZADD`` and ``HSET`` as kombu makes them)."""
    from kombu.transport.virtual.base import QoS as VirtualQoS
    from kombu.utils.json import dumps

    info = message.delivery_info
    ride = on_append(message, [qos.unacked_index_key, qos.unacked_key],
                     [delivery_tag, time.time(),
                      dumps([message._raw, info["exchange"], info["routing_key"]])])
    if ride is None or not _ridden_call(client, *ride):
        plain(message, delivery_tag)
        return
    VirtualQoS.append(qos, message, delivery_tag)


def ridden_ack(qos: Any, client: Any, delivery_tag: Any,
               on_ack: Callable[[Any, list[Any], list[Any]], Ride | object | None],
               plain: Callable[[Any], None]) -> None:
    """kombu's Redis ``QoS.ack`` with the ride ``on_ack`` returns in its place (``SENT``: the
    hook sent its script itself; only kombu's local bookkeeping follows)."""
    from kombu.transport.virtual.base import QoS as VirtualQoS

    ride = on_ack(delivery_tag, [qos.unacked_index_key, qos.unacked_key], [delivery_tag])
    if ride is SENT:
        VirtualQoS.ack(qos, delivery_tag)
        return
    if ride is None or not _ridden_call(client, *cast(Ride, ride)):
        plain(delivery_tag)
        return
    VirtualQoS.ack(qos, delivery_tag)
