"""One exception tree for everything celery-crawl raises.

Foreign errors (redis-py, grpc/etcd3, croniter, tomllib) are translated at the boundary where they
occur, ``raise Mapped(...) from exc``, so callers only ever catch these::

    CrawlError
    ├── ConfigError                 a crawl_* setting or install() argument is wrong
    ├── ScheduleError               a cron expression, zone or schedule entry is wrong
    │   └── ScheduleFileError       a schedule file is unreadable or malformed (names file, entry)
    ├── StoreError                  the lease store failed
    │   ├── StoreUnavailable        cannot connect / connection dropped / auth or TLS refused
    │   ├── StoreTimeout            a store call did not answer within its timeout
    │   └── StoreDataError          a key holds something celery-crawl did not write (garbage)
    ├── LeaseError
    │   ├── LeaseLost               the lease expired or is held by another holder
    │   └── NotLeader               a leader-only write was attempted without the current token
    ├── FencedError                 a write carried an older fencing token than the stored one
    ├── PoisonMessage               a task was delivered crawl_max_deliveries times; ended FAILURE
    ├── AbandonedRun                a key's earlier run died unfinished (passed to rollback)
    ├── RollbackFailed              a dead run's effects could not be rolled back
    ├── ReplayError                 a finished idempotency key's outcome cannot be replayed
    ├── TaskIdReused                a dropped duplicate's canvas had no recorded outcome to get
    ├── SerializationRefused        a payload in a serializer other than JSON was aimed at us
    └── UnsupportedSetup            a worker/beat configuration celery-crawl refuses to run under
"""

from __future__ import annotations

__all__ = [
    "AbandonedRun",
    "ConfigError",
    "CrawlError",
    "FencedError",
    "LeaseError",
    "LeaseLost",
    "NotLeader",
    "PoisonMessage",
    "RecordChanged",
    "ReplayError",
    "RollbackFailed",
    "ScheduleError",
    "ScheduleFileError",
    "SerializationRefused",
    "StoreDataError",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TaskIdReused",
    "UnsupportedSetup",
]


class CrawlError(Exception):
    """Root of every error celery-crawl raises."""


class ConfigError(CrawlError):
    """A setting is invalid; the message names the setting and what is wrong."""


class ScheduleError(CrawlError):
    """A cron expression, time zone or entry definition is invalid."""


class ScheduleFileError(ScheduleError):
    """A schedule file problem, located by file, entry and field."""

    def __init__(
        self,
        reason: str,
        *,
        file: str | None = None,
        entry: str | None = None,
        field: str | None = None,
    ) -> None:
        self.reason = reason
        self.file = file
        self.entry = entry
        self.field = field
        where = ", ".join(
            f"{label} {value!r}" if label != "file" else str(value)
            for label, value in (("file", file), ("entry", entry), ("field", field))
            if value is not None
        )
        super().__init__(f"{where}: {reason}" if where else reason)


class StoreError(CrawlError):
    """The lease store failed; the message names the store URL with the password masked."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, refused the connection, or refused our credentials."""


class StoreTimeout(StoreError):
    """A store call did not answer within its timeout."""


class StoreDataError(StoreError):
    """A key holds data celery-crawl did not write; it is reported, never trusted."""


class LeaseError(CrawlError):
    """Base of lease ownership errors."""


class LeaseLost(LeaseError):
    """The lease expired, was released, or is now held by another holder."""


class NotLeader(LeaseError):
    """A leader-only write was attempted without holding the current leader token."""


class RecordChanged(LeaseError):
    """A guarded claim was refused: the record it was conditioned on changed since it was read
    (read it again and decide again)."""


class FencedError(CrawlError):
    """A write carried an older fencing token than the one already stored."""


class PoisonMessage(CrawlError):
    """A task was delivered ``crawl_max_deliveries`` times and is ended without running again.

    Stored as the task's FAILURE so callers see why; usually its worker was killed (OOM) by it.
    """


class AbandonedRun(CrawlError):
    """An earlier run of an idempotency key stopped (its worker killed or frozen) unfinished.

    Passed to ``rollback`` by the run that takes the key over, so the dead run's effects are
    undone before the key runs again.
    """


class RollbackFailed(CrawlError):
    """A dead run's effects could not be rolled back, so the key is not run again over them."""


class ReplayError(CrawlError):
    """A finished idempotency key's stored outcome could not be restored for replay."""


class TaskIdReused(CrawlError):
    """A message reused the id of a finished task and was dropped as its duplicate, and that
    run's outcome is not recorded (expired, ignored) to give the message's chord, chain or
    callbacks instead: they fail with this rather than wait for ever."""


class SerializationRefused(CrawlError):
    """A payload in a serializer other than JSON was aimed at celery-crawl."""


class UnsupportedSetup(CrawlError):
    """A worker or beat setup that celery-crawl cannot make safe (e.g. the solo pool)."""
