"""Leader election as a Celery-free state machine driven by an injected monotonic clock.

The scheduler asks this object *what to do now* (acquire, renew, write presence) and reports
what happened; the machine never talks to a store itself, so every timing rule is unit-tested
with a fake clock and the store calls stay in one place (``scheduler.py``).

Rules it encodes (DESIGN.md "Beat"):

* a leader renews every ``ttl/3`` on its own timer, however long the scheduler would sleep;
* a failed renewal is retried quickly until the lease's *local* validity runs out, then the
  replica demotes itself (it never exits);
* before every publish ``may_publish()`` compares the monotonic clock with ``valid_until``
  (measured from before the acquire/renew request), so a frozen-then-resumed leader stops at
  once even before it learns from the store that its lease is gone;
* a standby polls the lease every ``standby_poll_s`` (<= 0.25 s) so it takes over within a
  second of a release;
* a replica that is *blocked* (clock skew, an evicting Redis) never tries to lead.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from ..leases.base import Lease

__all__ = ["Action", "Election", "Role"]

#: Fastest retry of a failed renewal (seconds); keeps a flapping store from being hammered.
_RENEW_RETRY_S = 0.2
#: Safety margin before ``valid_until`` after which nothing is published (seconds).
_PUBLISH_GUARD_S = 0.02


class Role(enum.Enum):
    """What this replica currently is."""

    STANDBY = "standby"
    LEADER = "leader"


class Action(enum.Enum):
    """The election step the scheduler should perform now."""

    NONE = "none"
    ACQUIRE = "acquire"
    RENEW = "renew"


class Election:
    """Leader state of one beat replica.

    Args:
        ttl_s: lease TTL; renewals happen every ``ttl_s / 3``.
        standby_poll_s: how often a standby tries to take the lease (capped at 0.25 s).
        presence_every_s: how often the presence record is rewritten (default ``ttl_s / 3``).
        clock: monotonic seconds (``CLOCK_BOOTTIME`` in production, a fake in tests).
    """

    def __init__(
        self,
        ttl_s: float,
        *,
        standby_poll_s: float = 0.2,
        presence_every_s: float | None = None,
        clock: Callable[[], float],
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.ttl_s = ttl_s
        self.renew_every_s = ttl_s / 3
        self.standby_poll_s = min(standby_poll_s, 0.25)
        self.presence_every_s = presence_every_s or ttl_s / 3
        self.clock = clock
        self.role = Role.STANDBY
        self.lease: Lease | None = None
        self.blocked_reason: str | None = None
        self.failovers = 0
        self._next_renew = 0.0
        self._next_acquire = 0.0
        self._next_presence = 0.0

    # -- questions -------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.role is Role.LEADER

    def may_publish(self, now: float | None = None) -> bool:
        """True while this replica leads and its lease is locally valid (cheap: per publish)."""
        lease = self.lease
        if lease is None or self.role is not Role.LEADER:
            return False
        t = self.clock() if now is None else now
        return t < lease.valid_until - _PUBLISH_GUARD_S

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds of local validity left on the leader lease (0 when not leading)."""
        if self.lease is None:
            return 0.0
        t = self.clock() if now is None else now
        return max(0.0, self.lease.remaining(t) - _PUBLISH_GUARD_S)

    def action(self, now: float | None = None) -> Action:
        """The election step due at ``now``."""
        t = self.clock() if now is None else now
        if self.role is Role.LEADER:
            return Action.RENEW if t >= self._next_renew else Action.NONE
        if self.blocked_reason is None and t >= self._next_acquire:
            return Action.ACQUIRE
        return Action.NONE

    def renew_due(self, now: float | None = None) -> bool:
        """True when a leader should renew now (checked between publishes during a burst)."""
        t = self.clock() if now is None else now
        return self.role is Role.LEADER and t >= self._next_renew

    def presence_due(self, now: float | None = None) -> bool:
        t = self.clock() if now is None else now
        return t >= self._next_presence

    def seconds_to_next_action(self, now: float | None = None) -> float:
        """How long the scheduler may sleep before the election needs it again."""
        t = self.clock() if now is None else now
        if self.role is Role.LEADER:
            nxt = self._next_renew
        elif self.blocked_reason is None:
            nxt = self._next_acquire
        else:
            nxt = t + self.standby_poll_s
        return max(0.0, min(nxt, self._next_presence) - t)

    # -- reports ---------------------------------------------------------------------------
    def presence_written(self, now: float | None = None) -> None:
        t = self.clock() if now is None else now
        self._next_presence = t + self.presence_every_s

    def acquired(self, lease: Lease, now: float | None = None) -> None:
        """The store granted the lease; this replica now leads."""
        t = self.clock() if now is None else now
        self.role = Role.LEADER
        self.lease = lease
        self.failovers += 1
        self._next_renew = t + self.renew_every_s

    def not_acquired(self, now: float | None = None) -> None:
        """Another replica holds the lease (or the store failed): poll again soon."""
        t = self.clock() if now is None else now
        self._next_acquire = t + self.standby_poll_s

    def renewed(self, lease: Lease, now: float | None = None) -> None:
        t = self.clock() if now is None else now
        self.lease = lease
        self._next_renew = t + self.renew_every_s

    def renew_failed(self, now: float | None = None) -> bool:
        """A renewal hit a store error (not ``LeaseLost``). Returns True if the local validity
        has run out, in which case the replica is demoted; otherwise a retry is scheduled."""
        t = self.clock() if now is None else now
        if self.lease is None or self.lease.remaining(t) <= _PUBLISH_GUARD_S:
            self.demote(t)
            return True
        self._next_renew = t + min(_RENEW_RETRY_S, max(0.0, self.lease.remaining(t) / 2))
        return False

    def demote(self, now: float | None = None) -> None:
        """Leadership is gone (lost, expired, released): stop publishing, go back to standby."""
        t = self.clock() if now is None else now
        self.role = Role.STANDBY
        self.lease = None
        self._next_acquire = t + self.standby_poll_s

    def block(self, reason: str | None) -> None:
        """Forbid (``reason``) or allow again (None) taking the lease; demotes a blocked leader."""
        self.blocked_reason = reason
        if reason is not None and self.role is Role.LEADER:
            self.demote()

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view for logs and the presence record."""
        return {
            "role": self.role.value,
            "token": self.lease.token if self.lease else None,
            "blocked": self.blocked_reason,
        }
