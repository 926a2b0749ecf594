"""The election state machine under a fake monotonic clock."""

from __future__ import annotations

from celery_crawl.beat.election import Action, Election, Role
from celery_crawl.leases.base import Lease


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def lease(valid_until: float, token: int = 7) -> Lease:
    return Lease("beat-leader", "h:1:x", token, 3.0, valid_until)


def test_standby_polls_quickly_and_leads_after_acquire() -> None:
    clock = FakeClock()
    e = Election(3.0, clock=clock)
    assert e.action() is Action.ACQUIRE
    e.presence_written()
    e.not_acquired()
    assert e.action() is Action.NONE
    assert 0 < e.seconds_to_next_action() <= 0.25
    clock.t += 0.2
    assert e.action() is Action.ACQUIRE
    e.acquired(lease(clock.t + 2.9))
    assert e.role is Role.LEADER and e.may_publish()
    assert e.failovers == 1


def test_renews_every_third_of_ttl_whatever_the_sleep() -> None:
    clock = FakeClock()
    e = Election(3.0, clock=clock)
    e.presence_written()
    e.acquired(lease(clock.t + 2.9))
    assert e.seconds_to_next_action() <= 1.0
    clock.t += 0.99
    assert e.action() is Action.NONE
    clock.t += 0.02
    assert e.action() is Action.RENEW and e.renew_due()
    e.renewed(lease(clock.t + 2.9))
    assert e.action() is Action.NONE


def test_validity_is_checked_against_the_monotonic_clock() -> None:
    clock = FakeClock()
    e = Election(3.0, clock=clock)
    e.acquired(lease(clock.t + 2.9))
    clock.t += 2.95  # frozen past validity: no publish even before the store says so
    assert not e.may_publish()
    assert e.remaining_s() == 0.0


def test_failed_renewal_retries_then_demotes_when_validity_runs_out() -> None:
    clock = FakeClock()
    e = Election(3.0, clock=clock)
    e.acquired(lease(clock.t + 2.9))
    clock.t += 1.0
    assert e.renew_failed() is False
    assert e.is_leader and e.seconds_to_next_action() <= 0.2
    clock.t += 1.9
    assert e.renew_failed() is True
    assert e.role is Role.STANDBY and e.lease is None and not e.may_publish()
    assert e.action() is Action.NONE  # polls again after standby_poll_s
    clock.t += 0.25
    assert e.action() is Action.ACQUIRE


def test_blocked_replica_never_acquires_and_blocking_demotes() -> None:
    clock = FakeClock()
    e = Election(3.0, clock=clock)
    e.acquired(lease(clock.t + 2.9))
    e.block("clock offset 30.0s exceeds crawl_max_clock_skew 1.0s")
    assert e.role is Role.STANDBY
    clock.t += 10
    assert e.action() is Action.NONE
    assert e.snapshot()["blocked"].startswith("clock offset")
    e.block(None)
    assert e.action() is Action.ACQUIRE


def test_presence_timer() -> None:
    clock = FakeClock()
    e = Election(3.0, clock=clock)
    assert e.presence_due()
    e.presence_written()
    assert not e.presence_due()
    clock.t += 1.0
    assert e.presence_due()
