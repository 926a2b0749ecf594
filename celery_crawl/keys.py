"""Logical key and lease names, in one place. Drivers prefix them with the namespace."""

from __future__ import annotations

__all__ = [
    "BEAT_COMMANDS",
    "BEAT_LEADER",
    "BEAT_SCHEDULE",
    "REAPER",
    "beat_entry",
    "beat_index",
    "beat_presence",
    "beat_skips",
    "done",
    "task_claim",
    "worker_lease",
]

#: Lease held by the dispatching beat replica.
BEAT_LEADER = "beat-leader"
#: Lease held by the worker currently acting as reaper.
REAPER = "reaper"
#: The schedule the fleet runs: fingerprint and entry count, written by the leader that adopted it.
BEAT_SCHEDULE = "beat/schedule"
#: Queue of operator commands (pause/resume/trigger/backfill) the beat leader applies.
BEAT_COMMANDS = "beat/commands"


def worker_lease(holder: str) -> str:
    """Lease name of one worker process start."""
    return f"worker:{holder}"


def task_claim(task_id: str) -> str:
    """Claim key of one task id."""
    return f"task:{task_id}"


def done(task_id: str) -> str:
    """Tombstone record of a finished task id (drops late duplicates for ``crawl_done_ttl``)."""
    return f"done/{task_id}"


def beat_entry(name: str) -> str:
    """Durable per-entry slot state."""
    return f"beat/entry/{name}"


def beat_index(shard: int) -> str:
    """One shard of the names of the entries that have a stored state (beat/index.py)."""
    return f"beat/index/{shard}"


def beat_skips(name: str) -> str:
    """Counted ranges of skipped slots of one entry."""
    return f"beat/skips/{name}"


def beat_presence(replica_id: str) -> str:
    """Presence record of one beat replica (id, clock offset, last seen)."""
    return f"beat/presence/{replica_id}"
