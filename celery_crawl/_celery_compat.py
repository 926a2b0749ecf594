"""Every private Celery, kombu and redis-py name the package uses, behind small named functions.

Checked against Celery 5.7.0 and kombu 5.7.0. These names are not public API, so an upgrade
may remove or change them without notice; keeping them in one module makes the exposure
visible and testable: tests/unit/test_celery_compat.py asserts each name in
``PRIVATE_NAMES`` and ``BACKEND_OVERRIDES`` still exists on the real class or object, and that
no other module of the package touches one of them (an override extending its base through
``super()`` is the one allowed use).

Imports nothing of the package, so every part may use it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

__all__ = [
    "BACKEND_OVERRIDES",
    "CHECKED_AGAINST",
    "KOMBU_ERROR",
    "PRIVATE_NAMES",
    "SENT",
    "call_task_errbacks",
    "cancel_quietly",
    "channel_gone",
    "config_source",
    "exec_options",
    "fail_chain",
    "forget_unacked_locally",
    "guard_connection_close",
    "max_value_size",
    "priority_queue_key",
    "redis_channel_server",
    "redis_socket",
    "remove_unacked",
    "request_message",
    "restore_unacked",
    "result_meta",
    "ride_redis_acks",
    "task_registry",
    "threads_pool_future",
]

logger = logging.getLogger("celery_crawl.worker")

#: The versions these names were checked against.
CHECKED_AGAINST = {"celery": "5.7.0", "kombu": "5.7.0"}

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
        "_fail_chain", "_call_task_errbacks", "_get_result_meta", "_MAX_STR_VALUE_SIZE"),
    "redis.connection:Connection": ("_sock",),
}

#: Private methods of ``celery.backends.redis:RedisBackend`` that ``AuditedRedisBackend``
#: overrides: the hooks Celery offers for the URL, the client, the result meta and the writes
#: have no public names.
BACKEND_OVERRIDES: tuple[str, ...] = (
    "_params_from_url", "_create_client", "_get_result_meta", "_store_result", "_forget")

# Our own marker on a consumer whose connection close is guarded (see guard_connection_close).
_CLOSE_GUARD = "_crawl_close_guard"
# Our own marker on a Redis channel's QoS whose appends and acks carry extra commands.
_RIDE_MARK = "_crawl_ride"

#: One script call to make instead of kombu's own MULTI/EXEC round trip, and what to do with
#: its reply (the reply; the error the server answered; None: the round trip failed and its
#: error is being raised). The script makes kombu's writes first, from the keys and arguments
#: the hook was given (``ride_redis_acks``).
Ride = tuple[tuple[Any, ...], Callable[[Any], None]]

#: What an ack hook returns when it sent the script itself (it reads the reply later): kombu's
#: local bookkeeping of the ack is all that is left to do.
SENT = object()

#: Prefix of the error a ridden script answers when kombu's own writes in it failed (nothing
#: else in it ran): raised to kombu's caller without the prefix, as kombu would have raised it.
KOMBU_ERROR = "KOMBU "


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


def cancel_quietly(req: Any) -> None:
    """Keep Celery from announcing a request as revoked or retried (its task runs elsewhere)
    and cancel its ETA timer, before the request is cancelled."""
    req._already_cancelled = True
    entry = getattr(req, "_eta_timer_entry", None)
    if entry is not None:
        with contextlib.suppress(Exception):
            entry.cancel()


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


def redis_socket(conn: Any) -> Any:
    """The socket of a connected redis-py connection (None when it has none): a loop that
    reads the replies of commands sent without waiting watches it for readability."""
    return getattr(conn, "_sock", None)


def remove_unacked(channel: Any, tag: Any) -> None:
    """kombu's own ack writes for one Redis delivery (its ``ZREM``/``HDEL``), without its local
    bookkeeping: for an ack whose ridden script the server did not know."""
    channel.qos._remove_from_indices(tag).execute()


def ride_redis_acks(channel: Any,
                    on_append: Callable[[Any, list[Any], list[Any]], Ride | None],
                    on_ack: Callable[[Any, list[Any], list[Any]], Ride | object | None]
                    ) -> None:
    """Let the script calls ``on_append(message, keys, args)`` and ``on_ack(delivery_tag, keys,
    args)`` return replace the MULTI/EXEC round trip kombu's Redis ``QoS`` makes when it records
    a message as unacked and when it acks one (``QoS.append`` and ``QoS.ack`` of kombu 5.7).

    The hooks get kombu's writes as script keys and arguments, which the script they return
    makes first: append ``keys = [unacked index, unacked hash]``, ``args = [delivery tag,
    score, unacked entry]`` (``ZADD`` and ``HSET``, as kombu writes them); ack the same keys
    and ``args = [delivery tag]`` (``ZREM`` and ``HDEL``). One command replaces four, in one
    atomic script. The reply goes to the ride's callback, also when the round trip fails
    (None), before kombu's error is raised. A script the server does not know (NOSCRIPT: it
    made none of kombu's writes) is followed by kombu's own call. A hook returning None leaves
    that call exactly as kombu makes it; an ack hook returning ``SENT`` has sent its script
    itself, and only kombu's local bookkeeping of the ack follows."""
    qos = channel.qos
    if getattr(qos, _RIDE_MARK, False):
        return
    from kombu.transport.virtual.base import QoS as VirtualQoS
    from kombu.utils.json import dumps
    from redis.exceptions import NoScriptError, ResponseError

    plain_append, plain_ack = qos.append, qos.ack
    # One client for every ridden call (kombu makes one per pipeline), on kombu's own pool.
    client = channel._create_client()

    def call(command: tuple[Any, ...], after: Callable[[Any], None]) -> bool:
        """Send a ridden script; False when kombu's own call must follow (NOSCRIPT)."""
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

    def append(message: Any, delivery_tag: Any) -> None:
        info = message.delivery_info
        ride = on_append(message, [qos.unacked_index_key, qos.unacked_key],
                         [delivery_tag, time.time(),
                          dumps([message._raw, info["exchange"], info["routing_key"]])])
        if ride is None or not call(*ride):
            plain_append(message, delivery_tag)
            return
        VirtualQoS.append(qos, message, delivery_tag)

    def ack(delivery_tag: Any) -> None:
        ride = on_ack(delivery_tag, [qos.unacked_index_key, qos.unacked_key], [delivery_tag])
        if ride is SENT:
            VirtualQoS.ack(qos, delivery_tag)
            return
        if ride is None or not call(*cast(Ride, ride)):
            plain_ack(delivery_tag)
            return
        VirtualQoS.ack(qos, delivery_tag)

    qos.append, qos.ack = append, ack
    setattr(qos, _RIDE_MARK, True)


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


def fail_chain(backend: Any, chain: Any, exc: Any, traceback: Any, *, store_result: bool,
               state: str) -> None:
    """Mark the rest of a failed task's chain as failed, as Celery's ``mark_as_failure`` does."""
    backend._fail_chain(chain, exc, traceback, store_result=store_result, state=state)


def call_task_errbacks(backend: Any, request: Any, exc: Any, traceback: Any) -> None:
    """Call a failed task's errbacks, as Celery's ``mark_as_failure`` does."""
    backend._call_task_errbacks(request, exc, traceback)
