"""The leader's delivery check (``crawl_beat_verify_delivery``): a published run that reached no
worker and no longer waits in its queue is published again.

kombu's Redis transport takes a message off its queue (``BRPOP``) before it writes it to the
``unacked`` hash. A worker killed in between loses the message with no trace: nothing redelivers
it, and the slot is neither run nor recorded as skipped. The worker plugin claims every task it
receives, and writes a ``done/<id>`` tombstone when the delivery ends, so a run of the beat's
that has neither, some time after it was published, is either still queued or lost. The check
reads the queue (from its oldest end) to tell the two apart, reads the store once more (a worker
may have taken it meanwhile), and publishes what is found nowhere again under the same task id:
if the first copy was not lost after all, the worker plugin parks the second behind the first
one's claim and drops it once the tombstone exists, so a run never runs twice for it.

Every worker consuming the beat's queues must run the worker plugin: a plain worker leaves no
claim and no tombstone, and its runs would look lost. The check is off by default for that
reason, and does nothing on RabbitMQ, which keeps unacked messages itself.

Runs to check live in the entry's durable state (``EntryState.unverified``), so a new leader
goes on checking what the old one published.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import keys, metrics
from ..errors import CrawlError
from ..leases.base import LeaseStore
from .state import EntryState, Sent

__all__ = ["MAX_RESENDS", "MAX_UNVERIFIED", "DeliveryCheck"]

log = logging.getLogger("celery_crawl.beat")

#: Publishing a run again this many times without it reaching a worker gives it up (recorded
#: as skipped, reason ``lost``).
MAX_RESENDS = 3
#: Runs kept per entry; older ones are dropped unchecked (with a warning).
MAX_UNVERIFIED = 1000
#: Runs looked at per check, so one check stays one or two store round trips.
BATCH = 500

#: ``republish(name, sent)`` publishes the run again; False when it could not.
Republish = Callable[[str, Sent], bool]
#: ``give_up(name, sent)`` records a run that never reached a worker.
GiveUp = Callable[[str, Sent], None]


class DeliveryCheck:
    """Looks for published runs at workers, in the broker, and publishes the lost ones again.

    Args:
        store: the lease store (claims and tombstones).
        broker: broker operations (``celery_crawl.worker.broker``); ``queued`` returns None
            where a queue cannot be read, and the check then stays idle.
        after_s: how long after publishing (and between looks) a run is looked for.
        queues_of: the broker queue names an entry's runs go to.
        between: run between the requests of a long check (reading a queue is O(backlog):
            3.4 s at 200 k messages); the leader renews there and raises to abort.
    """

    def __init__(self, store: LeaseStore, broker: Any, after_s: float,
                 queues_of: Callable[[str], Sequence[str]], *,
                 between: Callable[[], None] | None = None) -> None:
        self.store = store
        self.broker = broker
        self.after_s = after_s
        self.queues_of = queues_of
        self.between = between or (lambda: None)

    def track(self, st: EntryState, task_id: str, slot: str, manual: bool) -> None:
        """Remember a run just published."""
        st.unverified.append(Sent(task_id, slot, manual, time.time() + self.after_s))
        if len(st.unverified) > MAX_UNVERIFIED:
            dropped = st.unverified[:-MAX_UNVERIFIED]
            del st.unverified[:-MAX_UNVERIFIED]
            log.warning("beat: %d published run(s) dropped from the delivery check unchecked "
                        "(more than %d waiting), e.g. %s", len(dropped), MAX_UNVERIFIED,
                        dropped[0].task_id)

    def step(self, states: Mapping[str, EntryState], republish: Republish,
             give_up: GiveUp) -> set[str]:
        """One check of every run due for a look; returns the entries whose state changed.

        Raises:
            CrawlError: the store (``StoreError``) or the broker failed; what was decided
                before stands, the rest is looked at again next time.
        """
        now = time.time()
        due = [(name, s) for name, st in states.items() for s in st.unverified
               if s.check_at <= now][:BATCH]
        changed: set[str] = set()
        later: list[Sent] = []
        suspects: list[tuple[str, Sent]] = []
        for (name, sent), seen in zip(due, self._at_workers(due), strict=True):
            if seen == "done":
                states[name].unverified.remove(sent)
                changed.add(name)
            elif seen == "claimed":
                later.append(sent)
            else:
                suspects.append((name, sent))
        if suspects:
            queued = self._queued(suspects)
            if queued is None:
                return changed  # RabbitMQ: nothing more to learn here
            unseen = [(n, s) for n, s in suspects if s.task_id not in queued]
            later += [s for n, s in suspects if s.task_id in queued]
            # A worker may have taken a run off the queue between the two reads.
            for (name, sent), seen in zip(unseen, self._at_workers(unseen), strict=True):
                changed.add(name)
                if seen == "done":
                    states[name].unverified.remove(sent)
                elif seen == "claimed":
                    later.append(sent)
                else:
                    self._lost(name, sent, now, states[name], republish, give_up)
        for sent in later:
            sent.check_at = now + self.after_s
        return changed

    def _lost(self, name: str, sent: Sent, now: float, st: EntryState,
              republish: Republish, give_up: GiveUp) -> None:
        if sent.resent >= MAX_RESENDS:
            st.unverified.remove(sent)
            log.error("beat: entry %r run %s (slot %s) never reached a worker after %d "
                      "publishes; giving it up", name, sent.task_id, sent.slot, sent.resent + 1)
            give_up(name, sent)
            return
        sent.check_at = now + self.after_s
        if republish(name, sent):
            sent.resent += 1
            metrics.BEAT_RESENT.inc()
            log.warning("beat: entry %r run %s (slot %s) is neither at a worker nor in its "
                        "queue %.0fs after publishing (lost between the broker and a worker); "
                        "published again", name, sent.task_id, sent.slot, self.after_s)

    def _at_workers(self, runs: Sequence[tuple[str, Sent]]) -> list[str | None]:
        """``done`` (tombstone), ``claimed`` (a worker holds it) or None, per run."""
        if not runs:
            return []
        ids = [s.task_id for _, s in runs]
        tombs = self.store.get_many([keys.done(i) for i in ids])
        out: list[str | None] = []
        for i, (task_id, tomb) in enumerate(zip(ids, tombs, strict=True)):
            if i % 100 == 99:
                self.between()
            if tomb is not None:
                out.append("done")
            elif self.store.claimant(keys.task_claim(task_id)) is not None:
                out.append("claimed")
            else:
                out.append(None)
        return out

    def _queued(self, runs: Sequence[tuple[str, Sent]]) -> set[str] | None:
        queues: list[str] = []
        for name in dict.fromkeys(n for n, _ in runs):
            queues.extend(self.queues_of(name))
        try:
            found: set[str] | None = self.broker.queued(
                queues, [s.task_id for _, s in runs], between=self.between)
            return found
        except CrawlError:
            raise  # the lease was lost in between: the leader has stepped down
        except Exception as exc:  # kombu/redis raise many types; look again next time
            raise CrawlError(f"reading the broker queues {queues}: {exc}") from exc
