"""A Redis connection on which the consumer's loop sends script calls without waiting.

The loop receives, decides and acks every message, so a round trip it waits for is time no
other message is handled. On a ``ReplyLine`` the loop sends a command and goes on; the reply is
read when the socket has it (a reader on the consumer's hub), or else when the next command is
sent or the consumer's timer polls, and handed in sending order to what the sender registered
with it. A line that fails (a broken connection, a server that stopped answering) fails every
pending command: each learns it got no reply (None) and does what an unknown outcome needs.

Used for ridden acks (``riding.py``: the ack and its end in one script on the broker's server)
and for the claims and ends of deliveries when the lease store is a Redis server of its own
(``line_wiring.py``: a RabbitMQ broker, say). Celery-free.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry

from .. import _celery_compat as compat

__all__ = ["ReplyLine", "Watch", "line_for", "pack"]

logger = logging.getLogger("celery_crawl.worker")

#: ``(add_reader(fd, callback), remove_reader(fd))`` of the loop the line's replies wake.
Watch = tuple[Callable[[int, Callable[[], None]], Any], Callable[[int], Any]]

_DOWN = (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError)


def pack(command: tuple[Any, ...]) -> bytes:
    """``command`` in the Redis protocol, as redis-py's ``pack_command`` makes it (UTF-8 text,
    ``repr`` of numbers), for the commands the lines send: a script call's name and every key
    and argument given one by one (no ``"CONFIG GET"``-style name to split). redis-py's packer
    costs the loop several microseconds per argument, and a claim has a score of them.

    Raises:
        redis.DataError: an argument of another type (as redis-py would).
    """
    parts = [b"*%d\r\n" % len(command)]
    append = parts.append
    for arg in command:
        kind = type(arg)
        if kind is str:
            data = arg.encode()
        elif kind is bytes:
            data = arg
        elif kind is int or kind is float:
            data = repr(arg).encode()
        elif isinstance(arg, bytes | bytearray | memoryview):
            data = bytes(arg)
        elif isinstance(arg, str):
            data = str(arg).encode()
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise redis_lib.DataError(
                f"invalid input of type {type(arg).__name__!r} in a line's command")
        append(b"$%d\r\n" % len(data))
        append(data)
        append(b"\r\n")
    return b"".join(parts)


class ReplyLine:
    """Commands sent without waiting; their replies read later, in order.

    Thread use: sends and reads come from the consumer's loop; ``drain`` may come from the
    thread that stops the worker. The lock keeps the socket's reads and writes whole; the
    replies' callbacks run outside it, one at a time and in order (a callback that sends on the
    line again only queues further replies behind the ones being handed out).

    Args:
        connect: a new, unconnected redis-py connection.
        name: what the line is, for the log.
        watch: the loop's reader registration: replies are read as soon as they come (and
            not looked for on each send).
        later: schedules a callable on the loop's next turn (``hub.call_soon``): commands sent
            in one turn are written together, in one system call, when it runs.
    """

    def __init__(self, connect: Callable[[], Any], *, name: str = "reply line",
                 watch: Watch | None = None,
                 later: Callable[[Callable[[], None]], Any] | None = None) -> None:
        self._connect = connect
        self._name = name
        self._watch = watch
        self._later = later
        #: Packed commands not written yet (``later``), and whether their write is scheduled.
        self._unwritten: list[bytes] = []
        self._write_scheduled = False
        self._conn: Any = None
        self._fd: int | None = None
        self._lock = threading.RLock()
        #: (what to do with the reply, when it was sent (monotonic)), in sending order.
        self._pending: collections.deque[tuple[Callable[[Any], None], float]] = (
            collections.deque())
        #: Replies read, waiting for their callbacks (run by ``_hand_out``).
        self._ready: collections.deque[tuple[Callable[[Any], None], Any]] = (
            collections.deque())
        self._handing_out = False

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def watched(self) -> bool:
        """Whether replies are read when they come (not only on sends and polls)."""
        return self._watch is not None

    def send(self, command: tuple[Any, ...], after: Callable[[Any], None]) -> bool:
        """Send ``command``; ``after`` gets its reply later (a ``ResponseError`` for an error
        reply, None if the line failed first). False when it could not be sent (nothing is
        pending for it): the caller makes the call another way."""
        with self._lock:
            if self._watch is None:
                self._read_ready()
            try:
                if self._conn is None:
                    self._open()
                packed = pack(command)
                if self._later is None:
                    self._conn.send_packed_command([packed], check_health=False)
                else:
                    self._unwritten.append(packed)
                    if not self._write_scheduled:
                        self._write_scheduled = True
                        self._later(self._write)
            except _DOWN as exc:
                logger.info("celery-crawl: the %s is down (%s)", self._name, exc)
                self._fail()
                sent = False
            else:
                self._pending.append((after, time.monotonic()))
                sent = True
        self._hand_out()
        return sent

    def _write(self) -> None:
        """The loop's next turn: write what was sent in the last one (a failure fails every
        pending command: none of them is known to have reached the server)."""
        with self._lock:
            self._write_scheduled = False
            self._flush()
        self._hand_out()

    def _flush(self) -> None:
        chunks, self._unwritten = self._unwritten, []
        if not chunks or self._conn is None:
            return
        try:
            self._conn.send_packed_command([b"".join(chunks)], check_health=False)
        except _DOWN as exc:
            logger.info("celery-crawl: the %s is down (%s)", self._name, exc)
            self._fail()

    def poll(self, overdue_s: float | None = None) -> None:
        """Read the replies that have come; fail everything pending when the oldest has waited
        ``overdue_s`` (a server that stopped answering)."""
        with self._lock:
            self._read_ready()
            if (overdue_s is not None and self._pending
                    and time.monotonic() - self._pending[0][1] >= overdue_s):
                logger.warning("celery-crawl: %d call(s) on the %s unanswered for %.0fs",
                               len(self._pending), self._name, overdue_s)
                self._fail()
        self._hand_out()

    def drain(self) -> None:
        """Wait for every pending reply (the loop is going), within the connection's read
        timeout; then close."""
        with self._lock:
            self._flush()
            while self._pending:
                try:
                    reply = self._read_one()
                except _DOWN:
                    self._fail()
                    break
                after, _ = self._pending.popleft()
                self._ready.append((after, reply))
            self._close()
        self._hand_out()

    def _open(self) -> None:
        conn = self._connect()
        conn.connect()
        self._conn = conn
        if self._watch is not None:
            sock = compat.redis_socket(conn)
            if sock is not None:
                self._fd = sock.fileno()
                self._watch[0](self._fd, self._on_readable)

    def _on_readable(self) -> None:
        """The loop's reader: never raises (an exception would end the consumer's loop)."""
        try:
            with self._lock:
                if not self._pending and self._conn is not None:
                    # Nothing is expected: the server closed the connection (or sent what
                    # nobody asked for). Closed, or the loop would be woken for it forever;
                    # the next send connects again.
                    logger.info("celery-crawl: the %s was closed by its server", self._name)
                    self._close()
                    return
            self.poll()
        except Exception:
            logger.exception("celery-crawl: reading the %s failed", self._name)

    def _read_ready(self) -> None:
        conn = self._conn
        while self._pending and conn is not None:
            try:
                if not conn.can_read(timeout=0):
                    return
                reply = self._read_one()
            except _DOWN:
                self._fail()
                return
            after, _ = self._pending.popleft()
            self._ready.append((after, reply))

    def _read_one(self) -> Any:
        try:
            return self._conn.read_response()
        except redis_lib.ResponseError as exc:  # the command's error: its reply
            return exc

    def _fail(self) -> None:
        pending, self._pending = self._pending, collections.deque()
        self._unwritten = []
        self._close()
        self._ready.extend((after, None) for after, _ in pending)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        fd, self._fd = self._fd, None
        if fd is not None and self._watch is not None:
            try:
                self._watch[1](fd)
            except Exception:  # the loop's poller is gone already
                logger.debug("celery-crawl: unwatching the %s", self._name, exc_info=True)
        if conn is not None:
            try:
                conn.disconnect()
            except Exception:  # already broken
                logger.debug("celery-crawl: closing the %s", self._name, exc_info=True)

    def _hand_out(self) -> None:
        with self._lock:
            if self._handing_out:
                return
            self._handing_out = True
        try:
            while True:
                with self._lock:
                    if not self._ready:
                        self._handing_out = False
                        return
                    after, reply = self._ready.popleft()
                try:
                    after(reply)
                except Exception:
                    logger.exception("celery-crawl: handling a reply on the %s failed",
                                     self._name)
        except BaseException:
            with self._lock:
                self._handing_out = False
            raise


def line_for(pool: Any, timeout_s: float, *, name: str = "reply line",
             watch: Watch | None = None,
             later: Callable[[Callable[[], None]], Any] | None = None) -> ReplyLine:
    """A ``ReplyLine`` to the server of redis-py connection pool ``pool``: the same connection
    class and settings, but connect and read bounded by ``timeout_s`` (``crawl_store_timeout``:
    the loop connects it and a shutdown drains it), without health checks (a PING would read a
    pending reply) or retries (a reconnection would lose the pending replies)."""
    kwargs = {**pool.connection_kwargs, "health_check_interval": 0,
              "retry": Retry(NoBackoff(), 0), "socket_timeout": timeout_s,
              "socket_connect_timeout": timeout_s}
    return ReplyLine(lambda: pool.connection_class(**kwargs), name=name, watch=watch,
                     later=later)
