"""The worker bootstep: the worker lease, its renewal thread, the reaper, guards and visibility.

``LeaseStep`` lives as long as the worker: it checks the setup, opens the lease store (main
process only - prefork children never see it), takes the worker lease and starts the renewal
thread with the reaper. What happens to deliveries is the consumer's claims'
(``consumer_claims.ConsumerClaims``, built by ``claim_step.ClaimStep``); the two meet through
``claim_step`` (a ``ClaimSide`` handle), which the consumer's claims set when Celery builds the
consumer (before any step starts), and through the lease machinery this step hands them in
``start``. This module does not import the claim step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Protocol

from celery import bootsteps, signals

from .. import _celery_compat as compat
from .. import _finishing as finishing
from .. import _issued as issued
from .. import metrics, status
from .._broker import BrokerSentinels, sentinel_master
from ..clock import monotonic
from ..config import CrawlConfig
from ..errors import StoreError
from ..leases import store_for
from ..leases.base import LeaseStore
from .broker import BrokerOps, broker_ops
from .guards import check_beat, check_memory, check_pool
from .keeper import Keeper
from .reaper import Reaper, orphan_grace
from .stats import flat_stats


class ClaimSide(Protocol):
    """What the worker step needs of the consumer's claims (``consumer_claims.ConsumerClaims``),
    which registers itself here: the two share state through this handle, not through each
    other's modules (no import circle)."""

    def changed_from_thread(self) -> None: ...
    def refresh_unacked(self) -> None: ...
    def drain_backlog(self) -> None: ...
    def bind_lease(self, store: LeaseStore, keeper: Keeper) -> None: ...
    def release_deliveries(self, *, lease_held: bool) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def claims(self) -> list[dict[str, Any]]: ...

__all__ = ["LeaseStep"]

logger = logging.getLogger("celery_crawl.worker")


class LeaseStep(bootsteps.StartStopStep):
    """Worker bootstep: one lease per worker start, the reaper, guards and visibility.

    Registered by ``celery_crawl.worker.install_worker(app)`` (and ``celery_crawl.install``).
    """

    label = "crawl-lease"
    name = "celery_crawl.worker.steps.LeaseStep"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, beat: bool = False, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.app = w.app
        self.config = CrawlConfig.from_app(w.app)
        check_beat(beat)
        compat.warn_untested("worker")
        self.pool_name = check_pool(w.pool_cls)
        self.memory_limit = check_memory(
            self.config.min_memory_bytes, w.app.conf.get("worker_max_memory_per_child"))
        self.worker = w
        self.hostname = getattr(w, "hostname", "") or ""
        self.store: LeaseStore | None = None
        self.broker: BrokerOps | None = None
        self.keeper: Keeper | None = None
        self.reaper: Reaper | None = None
        #: The consumer step of this worker (it registers itself when the consumer is built).
        self.claim_step: ClaimSide | None = None
        self._closed = False
        # Before the pool forks (our start runs after it), so every child inherits the path; a
        # threads pool runs its tasks here, and keeps its marks in memory.
        finishing.setup(in_process=self.pool_name == "threads")
        w.crawl_lease = self

    def _master_moved(self, _old: tuple[str, int], new: tuple[str, int]) -> None:
        """The lease store's Redis master moved (a Sentinel failover): when the broker is
        behind the same master, the consumer's connection is made anew on the event loop (a
        connection error there is Celery's own reconnection), instead of consuming from the old
        master until Sentinel demotes it."""
        link = getattr(self.store, "sentinel_link", None)
        hub = getattr(self.worker, "hub", None)
        if link is None or hub is None or sentinel_master(self.app) != link.master_name:
            return
        logger.warning("celery-crawl: the Redis master %r moved to %s:%s: reconnecting to the "
                       "broker through Sentinel", link.master_name, *new)

        def reconnect() -> None:
            raise ConnectionError(f"the Redis master {link.master_name!r} moved to "
                                  f"{new[0]}:{new[1]} (Sentinel failover)")

        def when_kombu_sees_it() -> None:
            # kombu asks the broker's sentinels in order: one that has not heard of the
            # failover yet would send the consumer back to the old master (then a replica,
            # which nothing is published to). Reconnect once they name the new master, or
            # after the deadline in any case (Celery's reconnection retries by itself).
            deadline = monotonic() + max(10.0, 3 * self.config.store_timeout_s)
            sentinels = BrokerSentinels.of(self.app, timeout_s=0.5)
            try:
                while sentinels is not None and monotonic() < deadline:
                    if sentinels.master() == new:
                        break
                    time.sleep(0.1)
            finally:
                if sentinels is not None:
                    sentinels.close()
            hub.call_soon(reconnect)

        threading.Thread(target=when_kombu_sees_it, name="crawl-broker-master",
                         daemon=True).start()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, w: Any) -> None:
        config = self.config
        claims = self.claim_step
        assert claims is not None, "ClaimStep is installed with LeaseStep (install_worker)"
        self.store = store_for(config)
        metrics.watch_master_changes(self.store, self._master_moved)
        self.broker = broker_ops(self.app, timeout_s=max(2.0, config.store_timeout_s))
        self.keeper = Keeper(self.store, ttl_s=config.worker_lease_ttl_s,
                             on_change=claims.changed_from_thread)
        self.reaper = Reaper(
            self.store, self.broker, holder=lambda: self.keeper.holder if self.keeper else "",
            ttl_s=config.worker_lease_ttl_s, interval_s=config.reaper_interval_s,
            done_ttl_s=config.done_ttl_s, grace_s=orphan_grace(config.store_timeout_s))
        self.keeper.hooks = [claims.refresh_unacked, claims.drain_backlog, self.reaper]
        lease = self.keeper.acquire_blocking(timeout_s=max(config.worker_lease_ttl_s, 5.0))
        claims.bind_lease(self.store, self.keeper)
        self.keeper.start()
        status.install(self.app, lambda: status.worker_process(self))
        metrics.start_at_zero("worker")
        metrics.start_metrics_server(config.metrics_port, addr=config.metrics_addr)
        self._warn_acks_early()
        signals.worker_shutdown.connect(self._on_worker_shutdown, weak=False)
        logger.info(
            "celery-crawl: worker lease %s (token %s, ttl %.1fs) held on %s; pool %s, broker %s, "
            "on lease loss: %s", lease.name, lease.token, config.worker_lease_ttl_s,
            self.store.url, self.pool_name, self.broker.kind, config.on_lease_loss)

    def stop(self, w: Any) -> None:
        # The lease must outlive the pool (a warm shutdown waits for running tasks, whose
        # completion writes need it): released on worker_shutdown, after the blueprint stopped.
        return None

    def shutdown(self, w: Any) -> None:
        self.release()

    def _on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
        self.release()

    def release(self) -> None:
        """Release the lease (our remaining claims become orphaned for the reaper)."""
        if self._closed:
            return
        self._closed = True
        if self.claim_step is not None:
            self.claim_step.release_deliveries(lease_held=self.keeper is not None)
        if self.keeper is not None:
            self.keeper.stop(release=True)
        if self.reaper is not None:
            self.reaper.release()
        if self.broker is not None:
            self.broker.close()
        if self.store is not None:
            with contextlib.suppress(StoreError):
                self.store.close()
        finishing.teardown()
        issued.unvouch()

    def _warn_acks_early(self) -> None:
        early = sorted(name for name, task in self.app.tasks.items()
                       if not name.startswith("celery.") and not getattr(task, "acks_late", False))
        if early:
            logger.warning(
                "celery-crawl: task(s) %s acknowledge early (acks_late=False): their message is "
                "gone before they run, so a killed worker's run of them cannot be recovered",
                ", ".join(early))

    # -- visibility ------------------------------------------------------------------------
    def info(self, w: Any) -> dict[str, Any]:
        """Merged into ``celery inspect stats``: flat rows, so Flower's worker page shows them."""
        return flat_stats(self.status())

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self.keeper.info() if self.keeper else {}
        out.update(self.reaper.info() if self.reaper else {})
        if self.claim_step is not None:
            out.update(self.claim_step.status())
        out.update({
            "store": self.store.url if self.store else None, "pool": self.pool_name,
            "broker": self.broker.kind if self.broker else None,
            "on_lease_loss": self.config.on_lease_loss,
        })
        return out

    def claims(self) -> list[dict[str, Any]]:
        """The deliveries this worker holds, for ``celery inspect crawl_leases``."""
        return self.claim_step.claims() if self.claim_step is not None else []
