"""The broker operations live in :mod:`celery_crawl._broker`: the worker (redelivery, tag
refresh) and the beat (delivery check) both use them, and the beat may not import the worker."""

from __future__ import annotations

from .._broker import AmqpBroker, BrokerOps, RedisBroker, broker_ops

__all__ = ["AmqpBroker", "BrokerOps", "RedisBroker", "broker_ops"]
