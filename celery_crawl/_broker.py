"""What the lease machinery needs from the broker: redeliver exact tags, keep own tags fresh,
and (for the beat's delivery check) tell whether a task still waits in its queue.

Redis broker (kombu's virtual transport): an unacked message lives in the ``unacked`` hash and the
``unacked_index`` zset (score = delivery time) until acked. A dead worker's messages would wait
there for ``visibility_timeout`` (3600 s by default); kombu's own ``QoS.restore_by_tag`` puts one
back on its queue atomically (it knows key prefixes, priority queues and custom queue keys), at the
head (the right end, popped next), and it is idempotent: a tag already restored or acked is no
longer in the hash. Re-scoring our own tags in ``unacked_index`` on every renewal keeps
``restore_visible`` from redelivering a task that is still running or reserved here, however long
it runs.

These calls use a dedicated kombu connection of the same broker URL and transport options, owned by
the renewal thread: the consumer's channel belongs to the event loop and is not thread-safe.

RabbitMQ: the broker requeues a dead connection's unacked messages itself (at once after kill -9;
after the heartbeat timeout after a freeze), so both operations are no-ops there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ._celery_compat import forget_unacked_locally, priority_queue_key, restore_unacked

__all__ = ["AmqpBroker", "BrokerOps", "BrokerSentinels", "RedisBroker", "broker_master_address",
           "broker_ops",
           "json_tag", "sentinel_master"]

logger = logging.getLogger(__name__)


class BrokerOps(Protocol):
    """Broker operations used by the renewal thread and the reaper."""

    kind: str
    #: A redelivered copy comes back under the same delivery tag, so acking a message whose
    #: claim was taken over could settle the copy running elsewhere (Redis).
    tags_outlive_delivery: bool

    def release(self, message: Any, tag: Any, *, reaper_restores: bool) -> None:
        """Hand an unacked message back without acking it. ``reaper_restores``: a claim in the
        store records its tag, so the reaper restores it exactly once (where the broker
        cannot redeliver by itself, it is only forgotten locally here)."""
        ...

    def restore(self, tags: Sequence[Any]) -> int:
        """Put the messages of these delivery tags back on their queues; returns how many."""
        ...

    def refresh(self, tags: Sequence[Any]) -> None:
        """Mark these delivery tags as just delivered (so the visibility timeout restarts)."""
        ...

    def queued(self, queues: Sequence[str], task_ids: Sequence[str], *,
               between: Callable[[], None] | None = None) -> set[str] | None:
        """Which of ``task_ids`` wait in ``queues``; None when the broker cannot tell.
        ``between`` runs between the reads of a long queue (the beat leader renews there)."""
        ...

    def close(self) -> None:
        """Release the dedicated connection."""
        ...


class AmqpBroker:
    """RabbitMQ and other real AMQP brokers: redelivery is the broker's job."""

    kind = "amqp"
    tags_outlive_delivery = False

    def release(self, message: Any, tag: Any, *, reaper_restores: bool) -> None:
        message.reject(requeue=True)

    def restore(self, tags: Sequence[Any]) -> int:
        return 0

    def refresh(self, tags: Sequence[Any]) -> None:
        return None

    def queued(self, queues: Sequence[str], task_ids: Sequence[str], *,
               between: Callable[[], None] | None = None) -> set[str] | None:
        return None  # a queue cannot be read without consuming it

    def close(self) -> None:
        return None


class RedisBroker:
    """kombu's Redis transport, through a dedicated connection made lazily in the calling thread.

    Args:
        app: the Celery app (its broker URL and ``broker_transport_options`` are reused).
    """

    kind = "redis"
    tags_outlive_delivery = True

    def release(self, message: Any, tag: Any, *, reaper_restores: bool) -> None:
        if reaper_restores:
            # Forgotten locally so closing our channel does not restore it a second time.
            forget_unacked_locally(message, tag)
        else:
            message.reject(requeue=True)

    def __init__(self, app: Any, *, timeout_s: float = 5.0) -> None:
        self._app = app
        self._timeout_s = timeout_s
        self._conn: Any = None
        self._channel: Any = None
        # The maintenance thread and the event loop (after a reconnection) both call in.
        self._lock = threading.RLock()

    def _chan(self) -> Any:
        if self._channel is None:
            # Bounded even when the app left the broker's socket timeouts unset: a hung broker
            # must not wedge the maintenance thread.
            options = dict(self._app.conf.broker_transport_options or {})
            options.setdefault("socket_timeout", self._timeout_s)
            options.setdefault("socket_connect_timeout", self._timeout_s)
            conn = self._app.connection_for_write(transport_options=options)
            conn.ensure_connection(max_retries=1)
            self._conn = conn
            self._channel = conn.channel()
        return self._channel

    def _reset(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        if conn is not None:
            try:
                conn.release()
            except Exception:  # the connection is being thrown away anyway
                logger.debug("celery-crawl: closing the broker connection failed", exc_info=True)

    def restore(self, tags: Sequence[Any]) -> int:
        if not tags:
            return 0
        with self._lock:
            return self._restore(tags)

    def _restore(self, tags: Sequence[Any]) -> int:
        chan = self._chan()
        try:
            done = 0
            for tag in tags:
                # leftmost=False is RPUSH: kombu publishes with LPUSH and consumes with BRPOP
                # from the right, so the right end of the message's own priority list is the
                # head. A recovered task is next, not behind the whole backlog (kombu's
                # "leftmost" is the tail for its own consumer).
                restore_unacked(chan, json_tag(tag), leftmost=False)
                done += 1
            return done
        except Exception:
            self._reset()
            raise

    def refresh(self, tags: Sequence[Any]) -> None:
        if not tags:
            return
        with self._lock:
            self._refresh(tags)

    def _refresh(self, tags: Sequence[Any]) -> None:
        chan = self._chan()
        try:
            now = time.time()
            # XX: only tags still unacked; an acked or restored tag must not reappear.
            with chan.conn_or_acquire() as client:
                client.zadd(chan.unacked_index_key, {json_tag(t): now for t in tags}, xx=True)
        except Exception:
            self._reset()
            raise

    def queued(self, queues: Sequence[str], task_ids: Sequence[str], chunk: int = 500, *,
               between: Callable[[], None] | None = None) -> set[str] | None:
        """Which of ``task_ids`` still wait in ``queues`` (every priority list of each).

        Read from the oldest end (kombu pushes left and pops right), chunk by chunk, stopping
        once every id is found: the ids asked about were published a while ago, so they sit
        near that end unless the queue is long and stalled.
        """
        wanted = set(task_ids)
        if not wanted or not queues:
            return set()
        with self._lock:
            chan = self._chan()
            found: set[str] = set()
            try:
                with chan.conn_or_acquire() as client:
                    # kombu prefixes the keys of the commands it uses itself (not LRANGE).
                    prefix = "" if "LRANGE" in getattr(client, "PREFIXED_SIMPLE_COMMANDS", (
                        "LRANGE",)) else str(getattr(client, "global_keyprefix", "") or "")
                    for queue in dict.fromkeys(queues):
                        for pri in chan.priority_steps:
                            key = prefix + priority_queue_key(chan, queue, pri)
                            start = 0
                            while wanted - found:
                                if start and between is not None:
                                    between()  # O(backlog) reads: may outlast a lease
                                raw = client.lrange(key, -(start + chunk), -(start + 1))
                                for item in raw:
                                    task_id = _task_id_of(item)
                                    if task_id in wanted:
                                        found.add(task_id)
                                if len(raw) < chunk:
                                    break
                                # Workers pop from this end while we read, which moves unread
                                # messages into positions already read: the next window
                                # overlaps this one by half, so up to chunk/2 pops in between
                                # skip nothing (a skipped one would only be published again).
                                start += max(1, chunk // 2)
            except Exception:
                self._reset()
                raise
            return found

    def unacked_score(self, tag: Any) -> float | None:
        """Delivery time recorded for ``tag`` (tests and the benchmark use it)."""
        chan = self._chan()
        with chan.conn_or_acquire() as client:
            score = client.zscore(chan.unacked_index_key, json_tag(tag))
        return None if score is None else float(score)

    def close(self) -> None:
        with self._lock:
            self._reset()



def json_tag(tag: Any) -> Any:
    """A delivery tag as JSON can hold it (kombu's Redis tags are str, AMQP's int)."""
    return tag if isinstance(tag, int | str) or tag is None else str(tag)


def _task_id_of(raw: Any) -> str | None:
    """The task id of one message as kombu's Redis transport stores it (None if unreadable)."""
    try:
        headers = json.loads(raw).get("headers") or {}
        return str(headers["id"]) if "id" in headers else None
    except (ValueError, TypeError, AttributeError):
        return None


def broker_ops(app: Any, *, timeout_s: float = 5.0) -> BrokerOps:
    """The broker operations for ``app``'s broker transport."""
    driver = app.connection_for_write().transport.driver_type
    if driver == "redis":
        return RedisBroker(app, timeout_s=timeout_s)
    return AmqpBroker()


def sentinel_master(app: Any) -> str | None:
    """The Sentinel master name of the app's broker (kombu's ``sentinel://`` transport, its
    ``master_name`` transport option), or None for any other broker.

    A lease store behind the same master sees a failover within half a second; kombu's
    connections stay on the old master until Sentinel demotes it (up to about 20 s), so the
    worker and the beat make their broker connection anew when the store sees the master move.
    """
    url = app.conf.broker_url or ""
    first = url.split(";")[0] if isinstance(url, str) else (url[0] if url else "")
    if not str(first).startswith("sentinel://"):
        return None
    name = (app.conf.broker_transport_options or {}).get("master_name")
    return str(name) if name else None


class BrokerSentinels:
    """The sentinels of an app's ``sentinel://`` broker, asked as kombu asks them.

    kombu asks the sentinels of the broker URL in their order and takes the first master one
    names (redis-py's ``Sentinel.discover_master``); right after a failover a sentinel that has
    not heard of it yet still names the old master, and a consumer connected there (a replica
    once demoted) waits on a queue nothing is published to. Asked the same way, the worker
    reconnects only once kombu would find the new master. One instance keeps its connections
    to the sentinels for a series of questions; ``close`` them after.
    """

    def __init__(self, sentinels: list[tuple[str, int]], name: str, *,
                 sentinel_kwargs: dict[str, Any], min_other_sentinels: int) -> None:
        from redis.sentinel import Sentinel

        self.name = name
        self._manager = Sentinel(sentinels, min_other_sentinels=min_other_sentinels,
                                 sentinel_kwargs=sentinel_kwargs)

    @classmethod
    def of(cls, app: Any, *, timeout_s: float) -> BrokerSentinels | None:
        """The broker's sentinels (every call bounded by ``timeout_s``), or None when the
        broker is not ``sentinel://`` with a ``master_name``."""
        from urllib.parse import urlsplit

        name = sentinel_master(app)
        if not name:
            return None
        conn = app.connection_for_read()
        try:
            urls = [str(u) for u in (getattr(conn, "alt", None) or [conn.as_uri()])]
        finally:
            conn.release()
        sentinels = [(parts.hostname, parts.port or 26379) for parts in map(urlsplit, urls)
                     if parts.scheme == "sentinel" and parts.hostname]
        if not sentinels:
            return None
        options = app.conf.broker_transport_options or {}
        kwargs = dict(options.get("sentinel_kwargs") or {})
        kwargs.setdefault("socket_timeout", timeout_s)
        kwargs.setdefault("socket_connect_timeout", timeout_s)
        return cls(sentinels, name, sentinel_kwargs=kwargs,
                   min_other_sentinels=int(options.get("min_other_sentinels", 0)))

    def master(self) -> tuple[str, int] | None:
        """The master kombu would connect to now, or None if no sentinel names one."""
        from redis.exceptions import RedisError
        from redis.sentinel import MasterNotFoundError

        try:
            host, port = self._manager.discover_master(self.name)
        except (MasterNotFoundError, RedisError, OSError):
            return None
        return str(host), int(port)

    def close(self) -> None:
        for client in self._manager.sentinels:
            client.close()


def broker_master_address(app: Any, *, timeout_s: float) -> tuple[str, int] | None:
    """The master kombu's ``sentinel://`` transport would connect to now (``BrokerSentinels``),
    or None if no sentinel names one or the broker is not behind Sentinel."""
    sentinels = BrokerSentinels.of(app, timeout_s=timeout_s)
    if sentinels is None:
        return None
    try:
        return sentinels.master()
    finally:
        sentinels.close()
