"""The fault-injecting TCP proxy of the fault tests, against a local echo server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.tcpproxy import TcpProxy


@pytest.fixture
def echo() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def _client(proxy: TcpProxy, timeout_s: float = 2.0) -> socket.socket:
    return socket.create_connection(proxy.address, timeout=timeout_s)


def _roundtrip(sock: socket.socket, data: bytes = b"ping") -> bytes:
    sock.sendall(data)
    return sock.recv(4096)


def test_modes_switch_at_run_time(echo: int) -> None:
    with TcpProxy("127.0.0.1", echo) as proxy:
        assert proxy.mode == "pass"
        with _client(proxy) as sock:
            assert _roundtrip(sock) == b"ping"
            # A partition stalls the open connection both ways...
            proxy.black_hole()
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                _roundtrip(sock, b"lost?")
            # ...and holds new ones: accepted, then nothing.
            with _client(proxy, 0.3) as fresh, pytest.raises(TimeoutError):
                _roundtrip(fresh)
            # Healed: what waited is delivered, in order.
            proxy.passthrough()
            sock.settimeout(2.0)
            got = b""
            while len(got) < len(b"lost?"):
                got += sock.recv(4096)
            assert got == b"lost?"
            proxy.latency(0.2)
            t0 = time.monotonic()
            assert _roundtrip(sock) == b"ping"
            assert time.monotonic() - t0 >= 0.35  # 0.2 s each way
            proxy.refuse()
            with contextlib.suppress(OSError):
                sock.sendall(b"x")
            with pytest.raises((ConnectionError, OSError)):
                data = sock.recv(4096)
                if not data:
                    raise ConnectionResetError("closed")
        with pytest.raises((ConnectionError, OSError)), _client(proxy) as refused:
            # Reset at once: the connect itself or the first use fails.
            data = _roundtrip(refused)
            if not data:
                raise ConnectionResetError("closed")
        proxy.passthrough()
        with _client(proxy) as sock:
            assert _roundtrip(sock) == b"ping"
    with TcpProxy("127.0.0.1", echo) as proxy, pytest.raises(ValueError, match="delay_s"):
        proxy.latency(-1)
