"""Claims and ends ride in kombu's round trips on a ``rediss://`` broker too.

A redis-server speaking only TLS with client certificates (``tlsservers.SecureRedis``) is the
broker and the lease store; the broker URL carries its TLS options (``ssl_*``), so
``install_worker`` gives it the subclassed transport for ``rediss`` and kombu's channel connects
over TLS with them. The same checks as on plain TCP (``tests/integration/test_worker_riding.py``):
a claim and an end take no store round trip of their own, and every delivery is acked.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_crawl.worker import ridden_transport
from tests.integration.test_worker_riding import Rig, open_rig
from tests.integration.test_worker_riding import (
    test_a_claim_and_an_end_take_no_store_round_trip_of_their_own as claims_ride,
)
from tests.integration.test_worker_riding import (
    test_an_end_whose_ack_never_comes_is_recorded_separately as end_recorded_separately,
)
from tests.security.tlsservers import ADMIN_USER, SecureRedis


class _Server:
    """What the riding checks read of the broker's server: a client of one database."""

    def __init__(self, server: SecureRedis) -> None:
        self.server = server

    def client(self, db: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.server.port, db=db, username=ADMIN_USER,
                           password=self.server.admin_password, socket_timeout=5,
                           **self.server.client_kwargs())  # type: ignore[arg-type]


@pytest.fixture
def tls_rig(tls_redis: SecureRedis) -> Iterator[Rig]:
    url = tls_redis.url(ADMIN_USER, tls_redis.admin_password, db=5, **tls_redis.tls_query())
    with open_rig(url, _Server(tls_redis), transport=ridden_transport.TLS_PATH) as rig:
        assert rig.conn.ssl, "the broker connection has no TLS options"
        yield rig


def test_a_claim_and_an_end_ride_on_a_tls_broker(tls_rig: Rig) -> None:
    client = tls_rig.conn.default_channel.client
    assert issubclass(client.connection_pool.connection_class, redis.SSLConnection)
    claims_ride(tls_rig)


def test_an_end_whose_ack_never_comes_is_recorded_on_a_tls_broker(tls_rig: Rig) -> None:
    end_recorded_separately(tls_rig)
