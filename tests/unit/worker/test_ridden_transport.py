"""install_worker chooses kombu's Redis transport, subclassed (``ridden_transport.py``), for a
``redis://`` broker the riding gate allows, and for a ``rediss://`` one with its TLS options,
without the broker URL changing; anything else keeps the transport kombu would choose, said once
in the log."""

from __future__ import annotations

import logging
import ssl

import pytest
from celery import Celery
from kombu.transport import redis as kombu_redis

from celery_crawl.worker import install_worker, ridden_transport


def _app(broker: str, **conf: object) -> Celery:
    app = Celery("ridden", broker=broker, set_as_current=False)
    app.conf.update(crawl_lease_url="redis://127.0.0.1:1/0", crawl_store_timeout=2.0, **conf)
    return app


def test_a_redis_broker_gets_the_subclassed_transport_and_keeps_its_url() -> None:
    app = _app("redis://127.0.0.1:1/3")
    install_worker(app)
    assert app.conf.broker_transport == ridden_transport.PATH
    conn = app.connection_for_read()
    cls = conn.get_transport_cls()
    assert cls is ridden_transport.Transport and issubclass(cls, kombu_redis.Transport)
    assert cls.Channel.QoS is ridden_transport.QoS
    assert (conn.hostname, conn.port, conn.virtual_host) == ("127.0.0.1", 1, "3")
    assert app.conf.broker_url == "redis://127.0.0.1:1/3"
    # The worker's banner and tools parsing as_uri() (Flower) see a redis:// URL.
    stock = Celery("stock", broker="redis://127.0.0.1:1/3", set_as_current=False)
    assert conn.as_uri() == stock.connection_for_read().as_uri()
    assert conn.as_uri().startswith("redis://")


@pytest.mark.parametrize("tls", ["url", "broker_use_ssl"])
def test_a_rediss_broker_with_tls_options_gets_the_subclassed_transport(tls: str) -> None:
    query = "?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem" if tls == "url" else ""
    conf = {"broker_use_ssl": {"ssl_cert_reqs": ssl.CERT_REQUIRED}} if tls != "url" else {}
    app = _app(f"rediss://127.0.0.1:1/3{query}", **conf)
    install_worker(app)
    assert app.conf.broker_transport == ridden_transport.TLS_PATH
    conn = app.connection_for_read()
    cls = conn.get_transport_cls()
    assert cls is ridden_transport.TlsTransport and cls.Channel is ridden_transport.Channel
    # The channel connects over TLS with the options given, as kombu's rediss transport does.
    assert conn.ssl and conn.ssl["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    stock = Celery("stock", broker=f"rediss://127.0.0.1:1/3{query}", set_as_current=False)
    assert conn.as_uri() == stock.connection_for_read().as_uri()
    assert conn.as_uri().startswith("rediss://")


@pytest.mark.parametrize("broker", ["amqp://guest@127.0.0.1:1//", "rediss://127.0.0.1:1/0",
                                    "sentinel://127.0.0.1:1/0"])
def test_other_brokers_keep_kombus_transport(broker: str) -> None:
    """``rediss://`` without TLS options: only kombu's transport named ``rediss`` turns TLS
    on by default."""
    app = _app(broker)
    install_worker(app)
    assert not app.conf.broker_transport


def test_a_transport_the_app_chose_stays(caplog: pytest.LogCaptureFixture) -> None:
    app = _app("redis://127.0.0.1:1/0", broker_transport="redis")
    with caplog.at_level(logging.INFO, "celery_crawl.worker"):
        install_worker(app)
    assert app.conf.broker_transport == "redis"
    assert [r for r in caplog.records if "is the app's own" in r.getMessage()]


def test_a_gate_refusal_keeps_kombus_transport_with_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    # The app's own socket_timeout, longer than crawl_store_timeout: the overlap bound fails.
    app = _app("redis://127.0.0.1:1/0", broker_transport_options={"socket_timeout": 30.0})
    with caplog.at_level(logging.INFO, "celery_crawl.worker"):
        install_worker(app)
    assert not app.conf.broker_transport
    lines = [r.getMessage() for r in caplog.records if "transport stays" in r.getMessage()]
    assert len(lines) == 1 and "socket_timeout" in lines[0]
    assert app.connection_for_read().get_transport_cls() is kombu_redis.Transport
