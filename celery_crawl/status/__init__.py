"""What operators see of a fleet: ``crawl status`` (text) and ``/status`` (HTML and JSON).

:func:`gather` reads the view once; :mod:`.text` prints it for the CLI, :mod:`.page` renders it
on the metrics server of every beat and worker. :func:`beat_process` and
:func:`worker_process` are the figures of the process serving the page.
"""

from __future__ import annotations

from typing import Any

from .page import install, render_html
from .text import shown, text_lines
from .view import gather, scrub

__all__ = ["beat_process", "gather", "install", "render_html", "scrub", "shown", "text_lines",
           "worker_process"]


def beat_process(scheduler: Any) -> dict[str, Any]:
    """This beat replica as it sees itself (``LeasedScheduler``)."""
    election = scheduler.election
    lease = election.lease
    return {
        "kind": "beat",
        "id": scheduler.replica_id,
        "role": election.role.value,
        "token": lease.token if lease else None,
        "lease_time_left_s": round(election.remaining_s(), 3),
        "blocked": election.blocked_reason,
        "entries": len(scheduler.entries),
        "schedule": scheduler.schedule_fingerprint,
    }


def worker_process(step: Any) -> dict[str, Any]:
    """This worker as it sees itself (``LeaseStep``): its lease, claims held, recoveries."""
    return {"kind": "worker", "id": step.hostname, **step.status()}
