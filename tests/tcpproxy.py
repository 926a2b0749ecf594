"""A TCP proxy on 127.0.0.1 whose behaviour is switched at run time: the network faults of the
fault tests and the chaos soak (a partition, a slow link, a refusing host) between one client and
one server, while everything else keeps its direct connections.

Modes (``proxy.mode``, switched with the methods of the same name):

* ``pass`` — bytes are forwarded both ways as they arrive;
* ``black-hole`` — a partition: nothing is forwarded in either direction, on the connections
  already open (they stall, their bytes wait in the kernel buffers as unacknowledged TCP data
  would) and on new ones (accepted and held, so a client's connect succeeds and its first read
  hangs until its own timeout). Switching back to ``pass`` delivers what waited, in order, as a
  healed network would;
* ``latency`` — every chunk read is forwarded ``delay_s`` later (one direction's chunks stay in
  order; both directions are delayed), a slow link or a slow server;
* ``refuse`` — every open connection is reset and every new one is accepted and reset at once
  (the client sees ``ECONNRESET`` at its first use), a host whose port is closed.

Usage::

    with TcpProxy("127.0.0.1", redis_port) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=1)
        proxy.black_hole()
        ...
        proxy.passthrough()

One thread accepts; each connection has one thread per direction. ``close()`` (also on leaving
the ``with`` block) closes every socket and joins every thread.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from types import TracebackType

__all__ = ["MODES", "TcpProxy"]

MODES = ("pass", "black-hole", "latency", "refuse")
#: How often idle threads look at the mode and the stop flag.
_TICK_S = 0.02


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port``.

    Args:
        target_host: the server's address.
        target_port: the server's port.
        port: the port to listen on (0: a free one, read back from ``port``).
    """

    def __init__(self, target_host: str, target_port: int, *, port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._mode = "pass"
        self._delay_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._threads: list[threading.Thread] = []
        #: connections accepted so far (for tests that need to know a client reconnected).
        self.accepted = 0
        acceptor = threading.Thread(target=self._accept, name=f"tcpproxy-{self.port}",
                                    daemon=True)
        acceptor.start()
        self._threads.append(acceptor)

    # -- modes ---------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def passthrough(self) -> None:
        """Forward everything again (what waited during a black hole is delivered now)."""
        self._set("pass")

    def black_hole(self) -> None:
        """Forward nothing, on open and new connections, until the mode changes."""
        self._set("black-hole")

    def latency(self, delay_s: float) -> None:
        """Forward every chunk ``delay_s`` after it was read."""
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        with self._lock:
            self._delay_s = float(delay_s)
        self._set("latency")

    def refuse(self) -> None:
        """Reset every open connection and every new one."""
        self._set("refuse")
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                _reset(sock)

    def _set(self, mode: str) -> None:
        with self._lock:
            self._mode = mode

    # -- plumbing ------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], _TICK_S * 5)
            except (OSError, ValueError):  # closed by close()
                return
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                continue
            self.accepted += 1
            self._threads = [t for t in self._threads if t.is_alive()]
            if self._mode == "refuse":
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            for sock in (client, upstream):
                sock.setblocking(True)
                sock.settimeout(None)
            with self._lock:
                self._pairs.append((client, upstream))
            for src, dst, name in ((client, upstream, "up"), (upstream, client, "down")):
                pump = threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                                        name=f"tcpproxy-{self.port}-{name}")
                pump.start()
                self._threads.append(pump)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy ``src`` to ``dst`` under the current mode until either side closes."""
        try:
            while not self._stop.is_set():
                mode = self._mode
                if mode == "black-hole":
                    # Leave the bytes unread: the sender's window fills as in a partition.
                    time.sleep(_TICK_S)
                    continue
                if mode == "refuse":
                    return
                ready, _, _ = select.select([src], [], [], _TICK_S)
                if not ready or self._mode == "black-hole":
                    continue
                data = src.recv(65536)
                if not data:
                    return
                if self._mode == "latency":
                    deadline = time.monotonic() + self._delay_s
                    while not self._stop.is_set() and time.monotonic() < deadline:
                        time.sleep(min(_TICK_S, max(0.0, deadline - time.monotonic())))
                # A black hole entered while this chunk was in hand holds it until it ends.
                while self._mode == "black-hole" and not self._stop.is_set():
                    time.sleep(_TICK_S)
                dst.sendall(data)
        except (OSError, ValueError):  # reset, or closed under us by close()/refuse()
            return
        finally:
            # Either side ending ends the connection (the clients here need no half-close).
            with self._lock:
                self._pairs = [p for p in self._pairs if src not in p]
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        """Close the listener and every connection; join every thread."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TcpProxy(127.0.0.1:{self.port} -> {self.target[0]}:{self.target[1]}, {self._mode})"


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0), as a refusing or crashed peer does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
