"""The consumer bootstep: every delivery is claimed before Celery builds its request.

A shell, as Celery's own Heart step is (``celery/worker/consumer/heart.py``): it builds the
consumer's claims (``consumer_claims.ConsumerClaims``: the desk, the route, the lease-loss
handling) once, hangs them on the consumer as ``c.crawl_claims`` at every start, and stops them
with the consumer. Celery restarts the consumer's steps on every broker reconnection.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from .consumer_claims import ConsumerClaims

__all__ = ["ClaimStep"]


class ClaimStep(bootsteps.StartStopStep):
    """Consumer bootstep: claims every delivery before Celery builds its request.

    Registered with ``LeaseStep`` by ``celery_crawl.worker.install_worker(app)``.
    """

    label = "crawl-claims"
    name = "celery_crawl.worker.steps.ClaimStep"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        # The worker step is built before the consumer (Celery's Consumer step comes last).
        self.claims = ConsumerClaims(c.controller.crawl_lease)

    def start(self, c: Any) -> None:
        c.crawl_claims = self.claims
        self.claims.start(c)

    def stop(self, c: Any) -> None:
        self.claims.stop(c)

    def shutdown(self, c: Any) -> None:
        self.claims.stop(c)
