"""Reading, verifying and exporting the audit stream of ``AuditedRedisBackend``.

The stream ``{namespace}:audit`` holds one record per state write attempt (written or refused)
and per forget. ``verify`` compares, per task, the last *written* record with the stored result:
a result whose digest differs is diverging; a result that is gone although it should still be
there (no forget recorded, expiry not yet reached) is missing; a result past its expiry is
normal. Reading is done in pages (``XRANGE ... COUNT``), so memory stays bounded by the number
of distinct tasks in the stream, not by its length.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Any

from celery import states
from kombu.utils.encoding import bytes_to_str

from .._celery_compat import failure_expires
from ..errors import SerializationRefused
from .audited import AuditedRedisBackend

__all__ = ["AuditRecord", "VerifyReport", "export", "history", "iter_records", "verify"]

_PAGE = 1000
_MGET_BATCH = 500
_SLACK_S = 5.0


@dataclasses.dataclass(frozen=True)
class AuditRecord:
    """One audit record. ``time`` is the store time (the stream id's milliseconds, server clock)."""

    id: str
    time: datetime
    task: str
    state: str
    token: int | None
    worker: str
    digest: str
    outcome: str
    rollback: str

    def as_json(self) -> dict[str, Any]:
        """JSON-able form (``audit export``)."""
        return {**dataclasses.asdict(self), "time": self.time.isoformat()}


@dataclasses.dataclass
class VerifyReport:
    """Result of ``verify``: counts and the problem task ids (with a reason each)."""

    records: int = 0
    tasks: int = 0
    ok: int = 0
    expired: int = 0
    forgotten: int = 0
    missing: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    diverging: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def clean(self) -> bool:
        """True when nothing is missing or diverging."""
        return not self.missing and not self.diverging


def _record(entry_id: bytes | str, fields: dict[Any, Any]) -> AuditRecord:
    rid = bytes_to_str(entry_id)
    f = {bytes_to_str(k): bytes_to_str(v) for k, v in fields.items()}
    token = f.get("token") or ""
    return AuditRecord(
        id=rid, time=datetime.fromtimestamp(int(rid.split("-", 1)[0]) / 1000, UTC),
        task=f.get("task", ""), state=f.get("state", ""),
        token=int(token) if token.lstrip("-").isdigit() else None,
        worker=f.get("worker", ""), digest=f.get("digest", ""), outcome=f.get("outcome", ""),
        rollback=f.get("rollback", ""),
    )


def _epoch_ms(when: datetime) -> int:
    # Stream ids are unsigned: a time before 1970 (or too far out to convert) means "from the
    # start" / "from the end".
    try:
        return min(max(0, int(when.timestamp() * 1000)), 2**63 - 1)
    except (OverflowError, ValueError, OSError):
        return 0 if when.year < 1970 else 2**63 - 1


def iter_records(backend: AuditedRedisBackend, *, since: datetime | None = None,
                 page: int = _PAGE) -> Iterator[AuditRecord]:
    """Every record from ``since`` (store time, inclusive) on, oldest first.

    Raises:
        StoreError: Redis cannot be reached or refused us (``StoreUnavailable``,
            ``StoreTimeout``; the message names the masked URL), or another Redis error.
    """
    client = backend.client
    start = "-" if since is None else f"{_epoch_ms(since)}-0"
    while True:
        with backend.translate_errors(f"reading the audit stream {backend.audit_key!r}"):
            batch = client.xrange(backend.audit_key, min=start, max="+", count=page)
        for entry_id, fields in batch:
            yield _record(entry_id, fields)
        if len(batch) < page:
            return
        start = "(" + bytes_to_str(batch[-1][0])


def history(backend: AuditedRedisBackend, task_id: str) -> list[AuditRecord]:
    """Every record of one task, oldest first (a scan of the stream)."""
    return [r for r in iter_records(backend) if r.task == task_id]


def export(backend: AuditedRedisBackend, out: IO[str], *, since: datetime | None = None) -> int:
    """Write records since ``since`` as JSON lines; returns how many."""
    count = 0
    for record in iter_records(backend, since=since):
        out.write(json.dumps(record.as_json(), sort_keys=True) + "\n")
        count += 1
    return count


def verify(backend: AuditedRedisBackend, *, now: datetime | None = None) -> VerifyReport:
    """Compare every task's last written record with its stored result.

    Raises:
        StoreError: as ``iter_records``.
    """
    report = VerifyReport()
    last: dict[str, AuditRecord] = {}
    for record in iter_records(backend):
        report.records += 1
        if record.outcome in ("written", "forgotten"):
            last[record.task] = record
    report.tasks = len(last)
    now = now or datetime.now(UTC)
    tasks = list(last)
    for i in range(0, len(tasks), _MGET_BATCH):
        chunk = tasks[i:i + _MGET_BATCH]
        with backend.translate_errors("reading results"):
            values = backend.client.mget([backend.get_key_for_task(t) for t in chunk])
        for task_id, value in zip(chunk, values, strict=True):
            _judge(backend, report, last[task_id], value, now)
    return report


def _judge(backend: AuditedRedisBackend, report: VerifyReport, record: AuditRecord,
           value: bytes | None, now: datetime) -> None:
    if record.outcome == "forgotten":
        if value is None:
            report.forgotten += 1
        else:
            report.diverging.append((record.task, "forgotten, but a result is stored"))
        return
    if value is None:
        expires = failure_expires(backend) if record.state == states.FAILURE else backend.expires
        age = (now - record.time).total_seconds()
        if expires and age >= float(expires) - _SLACK_S:
            report.expired += 1
        else:
            when = record.time.strftime("%Y-%m-%d %H:%M:%SZ")
            report.missing.append(
                (record.task, f"{record.state} written {when} is gone before its expiry"))
        return
    try:
        digest = backend.stored_digest(value)
    except SerializationRefused as exc:
        report.diverging.append((record.task, f"stored value unreadable: {exc}"))
        return
    if digest != record.digest:
        report.diverging.append((record.task, f"stored digest {digest} != audited "
                                              f"{record.digest} ({record.state})"))
    else:
        report.ok += 1
