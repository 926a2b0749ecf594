"""Worker leases, task claims and dead-worker recovery (``LeaseStep``).

``install_worker(app)`` registers the worker and consumer bootsteps; ``current_claim()`` gives a
running task its claim's fencing token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .context import CLAIM_HEADER, current_claim
from .install import install_worker

if TYPE_CHECKING:
    from .steps import ClaimStep, LeaseStep

__all__ = ["CLAIM_HEADER", "ClaimStep", "LeaseStep", "current_claim", "install_worker"]


def __getattr__(name: str) -> Any:
    # The steps import Celery's worker machinery; only load it when asked for.
    if name in ("LeaseStep", "ClaimStep"):
        from . import steps

        return getattr(steps, name)
    raise AttributeError(name)
