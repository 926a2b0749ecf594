"""Riding is on only for tested kombu/redis-py versions and a bounded broker socket."""

from __future__ import annotations

from celery_crawl.worker.ride_gate import TESTED, installed_versions, ride_refusal


def test_the_installed_versions_ride_with_a_bounded_socket() -> None:
    kombu, redis = installed_versions()
    assert ride_refusal(kombu, redis, socket_timeout_s=1.0, store_timeout_s=2.0) is None


def test_an_untested_version_or_an_unbounded_socket_keeps_the_default_path() -> None:
    assert TESTED["kombu"] == ((5, 4), (5, 7))
    for kombu in ("5.4.2", "5.5.4", "5.6.2", "5.7.0"):
        assert ride_refusal(kombu, "5.2.1", socket_timeout_s=1.0, store_timeout_s=2.0) is None
    why = ride_refusal("5.8.0", "8.2.0", socket_timeout_s=1.0, store_timeout_s=2.0)
    assert why is not None and "kombu 5.8.0" in why
    why = ride_refusal("5.7.0", "4.6.0", socket_timeout_s=1.0, store_timeout_s=2.0)
    assert why is not None and "redis-py 4.6.0" in why
    for timeout in (None, 5.0):
        why = ride_refusal("5.7.0", "8.2.0", socket_timeout_s=timeout, store_timeout_s=2.0)
        assert why is not None and "socket_timeout" in why
