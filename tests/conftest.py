from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.clusters import redis_cluster
from tests.servers import (
    EtcdServer,
    RedisServer,
    delete_rabbit_vhost,
    etcd_binary,
    make_rabbit_vhost,
)

#: Fixtures defined elsewhere, registered here once: a session fixture imported into several
#: test modules would be set up once per module (one 3-master Redis Cluster each).
__all__ = ["redis_cluster"]

settings.register_profile(
    "ci", deadline=None, database=None, derandomize=True, max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


_UNIT = Path(__file__).resolve().parent / "unit"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Collect a test's garbage before its servers stop.

    Celery's ``AsyncResult.__del__`` unsubscribes from its result channel; run by the garbage
    collector in a later test, after the Redis it subscribed on is gone, that unsubscribe goes
    through the backend's retry policy (20 retries, a second apart) and stalls whichever test
    happened to trigger the collection. This runs before the item's fixtures are torn down:
    after every test that may talk to a server, and at the end of each unit-test module (a
    collection costs about 0.1 s; the unit tests start no Redis of their own).
    """
    last_in_module = nextitem is None or nextitem.path != item.path
    if last_in_module or not item.path.is_relative_to(_UNIT):
        gc.collect()
    yield


def _require(what: str, env: str) -> bool:
    return os.environ.get(env) == "1" or os.environ.get("CI") == "true"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for the whole session (tests must use unique key namespaces)."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A private redis-server for one test (to restart or kill it)."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def fresh_redis_aof() -> Iterator[RedisServer]:
    server = RedisServer(appendonly=True).start()
    yield server
    server.cleanup()


def _etcd_or_skip() -> None:
    if etcd_binary() is None:
        if _require("etcd", "CRAWL_REQUIRE_ETCD"):
            pytest.fail("etcd binary not found and CRAWL_REQUIRE_ETCD=1")
        pytest.skip("etcd binary not found (apt-get install etcd-server); "
                    "set CRAWL_REQUIRE_ETCD=1 to make this a failure")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    _etcd_or_skip()
    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def fresh_etcd() -> Iterator[EtcdServer]:
    _etcd_or_skip()
    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def rabbit_vhost() -> Iterator[str]:
    vhost = make_rabbit_vhost()
    if vhost is None:
        if os.environ.get("CI") == "true":
            pytest.fail("RabbitMQ is not reachable through rabbitmqctl")
        pytest.skip("RabbitMQ not available")
    yield vhost
    delete_rabbit_vhost(vhost)


@pytest.fixture(scope="session")
def rabbit_url(rabbit_vhost: str) -> str:
    return f"amqp://guest:guest@127.0.0.1:5672/{rabbit_vhost}"


@pytest.fixture(autouse=True)
def _no_vouch_left_behind() -> Iterator[None]:
    """A test that built a worker's steps in this process and did not release them must not
    leave the process vouching for request tokens (``celery_crawl/_issued.py``): the tests
    after it write results as a process outside any worker."""
    yield
    from celery_crawl import _issued

    _issued.unvouch()
