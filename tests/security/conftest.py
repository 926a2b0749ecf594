"""Fixtures of the security tests: one PKI per session, TLS/auth servers shared per module."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.tlsservers import AclRedis, Pki, SecureEtcd, SecureRedis, make_pki
from tests.servers import etcd_binary


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throw-away CA with server/client certificates, plus a rogue CA nobody trusts."""
    return make_pki(Path(tmp_path_factory.mktemp("pki")))


@pytest.fixture(scope="module")
def tls_redis(pki: Pki) -> Iterator[SecureRedis]:
    """redis-server on TLS only, client certificates required, ``default`` user off."""
    server = SecureRedis(pki)
    server.start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[AclRedis]:
    """Plain-TCP redis-server with ACL users, ``default`` user off."""
    server = AclRedis()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def secure_etcd(pki: Pki) -> Iterator[SecureEtcd]:
    """etcd with auth enabled; TLS listener requiring client certificates, plus a plain one."""
    if etcd_binary() is None:
        if os.environ.get("CI") == "true" or os.environ.get("CRAWL_REQUIRE_ETCD") == "1":
            pytest.fail("etcd binary not found")
        pytest.skip("etcd binary not found")
    server = SecureEtcd(pki)
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A TCP port that completes the handshake (kernel backlog) but never answers a byte:
    the shape of a stuck proxy or a half-dead server. A client without timeouts hangs here."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every log record of every logger at DEBUG, to search for leaked secrets."""
    caplog.set_level(logging.DEBUG)
    return caplog
