"""kombu's Redis transport with claims and ends riding in its unacked round trips.

Built as kombu builds its own Redis transport (``kombu/transport/redis.py``: ``QoS`` subclasses
``virtual.QoS``, ``Channel.QoS = QoS``, ``Transport.Channel = Channel``): a ``QoS`` whose
``append`` and ``ack`` let the channel's ride hooks (``riding.py``) replace kombu's MULTI/EXEC
round trip with one script making kombu's writes and the claim's or the end's. A channel
without hooks (the lease store is another server, riding was refused) behaves exactly as
kombu's: every call goes to kombu's own method.

``install_worker`` makes it the app's ``broker_transport`` when the broker URL is ``redis://``,
or ``rediss://`` with its TLS options set (``ssl_*`` in the URL or ``broker_use_ssl``), and
``ride_gate.ride_refusal`` allows; the URL stays the user's. A ``rediss://`` URL without them
keeps kombu's transport: kombu switches TLS on by default (without certificate checks) only for
its transport named ``rediss``, while a named transport class connects with the TLS options it
is given, or in plain text. Anything else keeps kombu's transport, said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kombu.connection import Connection
from kombu.transport import redis as kombu_redis

from .. import _celery_compat as compat
from ..config import CrawlConfig
from .ride_gate import installed_versions, ride_refusal

__all__ = ["PATH", "TLS_PATH", "Channel", "QoS", "TlsTransport", "Transport", "hook", "install",
           "unhook"]

logger = logging.getLogger("celery_crawl.worker")

#: The app's ``broker_transport`` when claims ride (kombu resolves a dotted path).
PATH = "celery_crawl.worker.ridden_transport:Transport"
#: The same for a ``rediss://`` broker (shown as ``rediss``).
TLS_PATH = "celery_crawl.worker.ridden_transport:TlsTransport"

AppendHook = Callable[[Any, list[Any], list[Any]], Any]
AckHook = Callable[[Any, list[Any], list[Any]], Any]


class QoS(kombu_redis.QoS):  # type: ignore[misc]
    """kombu's Redis QoS; ``append``/``ack`` ride when the channel has hooks."""

    def append(self, message: Any, delivery_tag: Any) -> None:
        hooks = self.channel.crawl_ride
        if hooks is None:
            super().append(message, delivery_tag)
            return
        compat.ridden_append(self, self.channel.crawl_client(), message, delivery_tag,
                             hooks[0], super().append)

    def ack(self, delivery_tag: Any) -> None:
        hooks = self.channel.crawl_ride
        if hooks is None:
            super().ack(delivery_tag)
            return
        compat.ridden_ack(self, self.channel.crawl_client(), delivery_tag, hooks[1],
                          super().ack)


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    QoS = QoS
    #: ``(on_append, on_ack)`` while a consumer's claims ride on this channel (``hook``).
    crawl_ride: tuple[AppendHook, AckHook] | None = None
    _crawl_client: Any = None

    def crawl_client(self) -> Any:
        """One client for every ridden call of this channel."""
        if self._crawl_client is None:
            self._crawl_client = compat.ride_client(self)
        return self._crawl_client


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


class TlsTransport(Transport):
    """``Transport`` for a ``rediss://`` broker: the connection's TLS options (from the URL's
    ``ssl_*`` or ``broker_use_ssl``) make kombu's channel connect over TLS, as its ``rediss``
    transport does."""


def hook(channel: Any, on_append: AppendHook, on_ack: AckHook) -> bool:
    """Have ``channel``'s appends and acks ride; False when it is not this transport's."""
    if not isinstance(channel, Channel):
        return False
    channel.crawl_ride = (on_append, on_ack)
    return True


def unhook(channel: Any) -> None:
    """``channel``'s appends and acks are kombu's own again."""
    if isinstance(channel, Channel):
        channel.crawl_ride = None


def _scheme(urls: list[Any]) -> str | None:
    """``redis`` or ``rediss`` when every broker URL is one Redis server URL of that scheme."""
    if not all(isinstance(u, str) and "://" in u and ";" not in u for u in urls):
        return None
    schemes = {u.split("://", 1)[0] for u in urls}
    if len(schemes) != 1:
        return None
    scheme = schemes.pop()
    return scheme if scheme in ("redis", "rediss") else None


def _tls_options(app: Any, urls: list[str]) -> bool:
    """Whether a ``rediss://`` broker connection gets TLS options (kombu turns the URL's
    ``ssl_*`` query keys into them; ``broker_use_ssl`` gives them too)."""
    if app.conf.get("broker_use_ssl"):
        return True
    return all(any(key.startswith("ssl_") for key in parse_qs(urlsplit(u).query)) for u in urls)


def install(app: Any, config: CrawlConfig) -> None:
    """Make this the app's broker transport when its broker URL is a plain ``redis://`` one or
    a ``rediss://`` one with TLS options, the app chose no transport of its own and the riding
    gate allows (else one log line)."""
    urls = [app.conf.get(k) for k in ("broker_url", "broker_read_url", "broker_write_url")]
    urls = [u for u in urls if u]
    scheme = _scheme(urls) if urls else None
    if scheme is None:
        return
    path = PATH if scheme == "redis" else TLS_PATH
    chosen = app.conf.get("broker_transport")
    if chosen and chosen not in (PATH, TLS_PATH):
        logger.info("celery-crawl: broker_transport=%r is the app's own: claims and ends do not "
                    "ride in the broker's round trips", chosen)
        return
    if scheme == "rediss" and not _tls_options(app, urls):
        logger.warning("celery-crawl: kombu's Redis transport stays; claims and ends do not "
                       "ride in the broker's round trips: the rediss:// broker URL has no TLS "
                       "options (ssl_* in the URL, or broker_use_ssl), so only kombu's own "
                       "rediss transport would speak TLS")
        return
    options = app.conf.get("broker_transport_options") or {}
    refusal = ride_refusal(*installed_versions(), socket_timeout_s=options.get("socket_timeout"),
                           store_timeout_s=config.store_timeout_s)
    if refusal is not None:
        logger.warning("celery-crawl: kombu's Redis transport stays; claims and ends do not "
                       "ride in the broker's round trips: %s", refusal)
        return
    # Shown as the ``redis``/``rediss`` transport it is (the worker's banner, ``as_uri()`` that
    # Flower and other tools parse), as kombu shows ``pyamqp`` as ``amqp``.
    Connection.resolve_aliases.setdefault(path, scheme)
    app.conf["broker_transport"] = path
