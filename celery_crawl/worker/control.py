"""Remote control command ``crawl_leases``: each worker's lease and the claims it holds.

``celery -A proj inspect crawl_leases`` (the client must import this module too, which
``celery_crawl.install(app)`` does) or ``app.control.broadcast("crawl_leases", reply=True)``.
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import inspect_command

__all__ = ["crawl_leases"]


@inspect_command(  # type: ignore[untyped-decorator]
    help="celery-crawl: this worker's lease (holder, token, time left) and its task claims.",
)
def crawl_leases(state: Any, **kwargs: Any) -> dict[str, Any]:
    """The worker lease and claims of the worker answering."""
    step = getattr(state.consumer.controller, "crawl_lease", None)
    if step is None:
        return {"error": "celery-crawl LeaseStep is not installed in this worker"}
    return {**step.status(), "claimed": step.claims()}
