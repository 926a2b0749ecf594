"""The two bootsteps of the worker plugin, where Celery's step names say they are.

``LeaseStep`` (``lease_step.py``, worker blueprint) holds the worker lease, its renewal thread
and the reaper; ``ClaimStep`` (``claim_step.py``, consumer blueprint) claims, runs and settles
deliveries under that lease. Their step names (``celery_crawl.worker.steps.*``) are how an app's
blueprints know them, so they resolve here.
"""

from __future__ import annotations

from .claim_step import ClaimStep
from .lease_step import LeaseStep

__all__ = ["ClaimStep", "LeaseStep"]
