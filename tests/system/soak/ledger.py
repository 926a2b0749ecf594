"""The soak's accounting: every slot due in the counted window is run exactly once or skipped.

Inputs are plain data gathered by the driver: the recorder's start / accepted / fenced records
(from the sink Redis), the union of the beat's skip ranges seen during the run, the fault log,
and the process-exit count. Nothing here talks to a server, so the rules are easy to read:

* a slot is **due** when ``window_start <= slot <= window_end`` by the entry's own ``TzCron``;
* an accepted completion is **undone** when a rollback recorded later names its slot and claim
  token (the run that took the key over from a worker killed after the write undid it);
* **run once**: exactly one accepted completion for ``(entry, slot)`` that was not undone;
* **skipped**: no accepted completion, and a beat skip range covers the slot (its reason counts);
* **duplicate**: more than one accepted completion not undone (two runs whose effects both
  stuck);
* **contradiction**: run once *and* recorded as skipped (the run counts; the skip record is
  wrong: reported, not a failure of the run-once claim);
* **unaccounted**: neither run nor skipped.
* **lost to a failover**: a duplicate whose first run ended while a Sentinel failover could
  lose acknowledged writes (``LOSSY_FAULTS``: from the fault until ``LOSS_TAIL_S`` after the
  sentinels named the new master — the old master keeps accepting writes until it is demoted,
  and Celery's broker and backend connections stay on it until then): its finish (the done
  tombstone, the broker's ack) was acknowledged by the old master and never reached the new
  one, so the run was delivered again; or an unaccounted slot whose run was in flight then
  (started, never finished: the message given back for it, or its unacked record, was written
  to the old master only), or which came due then and never started (its message was published
  to the old master only: kombu's connection stays on it until Sentinel demotes it). These are
  the losses docs/durability.md names; they are counted here, apart from the duplicates and the
  unaccounted, and only a *concurrent* second run still fails a soak.

Fenced completions (a stale run whose write the claim token refused) are reported, not errors.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = ["Fault", "SkipSpan", "Summary", "account", "parse_slot"]

BEAT_FAULTS = ("beat_kill9", "beat_stop", "beat_term", "beat_skew", "beat_clock_step",
               "leader_partition")
WORKER_FAULTS = ("worker_kill9", "worker_stop", "worker_partition")
#: Faults after which Redis's asynchronous replication may lose acknowledged writes.
LOSSY_FAULTS = ("sentinel_master_kill", "sentinel_failover", "sentinel_master_stop")
#: How long after the sentinels named the new master a write may still reach the old one:
#: Sentinel demotes a master that comes back seconds later (10 s info period + 8 s role wait).
LOSS_TAIL_S = 20.0
#: A run started this long before such a fault may still have been in flight at it.
IN_FLIGHT_S = 30.0


def parse_slot(text: str | None) -> float | None:
    """Epoch seconds of an ISO UTC slot header (``2026-12-02T16:25:01Z``); None if absent."""
    if not text:
        return None
    value = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return round(value.timestamp(), 3)


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%S")


@dataclasses.dataclass(frozen=True)
class SkipSpan:
    """One skip range of the beat (``first``/``last`` as epoch seconds)."""

    entry: str
    first: float
    last: float
    count: int
    reason: str


@dataclasses.dataclass
class Fault:
    """One injected fault, as the injector logged it (times are epoch seconds)."""

    kind: str
    target: str
    t: float
    t_heal: float | None = None
    leader_token: int | None = None
    was_leader: bool = False
    worker_host: str | None = None
    note: str = ""


@dataclasses.dataclass
class Summary:
    """What the soak prints and asserts on."""

    store: str
    seed: int
    window: tuple[float, float]
    due: int = 0
    run_once: int = 0
    skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    duplicates: list[str] = dataclasses.field(default_factory=list)
    failover_losses: list[str] = dataclasses.field(default_factory=list)
    concurrent_duplicates: list[str] = dataclasses.field(default_factory=list)
    contradictions: list[str] = dataclasses.field(default_factory=list)
    unaccounted: list[str] = dataclasses.field(default_factory=list)
    fenced: int = 0
    undone: int = 0
    restarted_runs: int = 0
    beat_exits: int = 0
    worker_exits: int = 0
    audit_ok: bool | None = None
    audit_output: str = ""
    failover_gaps: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    recoveries: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    #: Per lossy fault: the longest stretch without a run starting, from the fault until the
    #: first run that started after the sentinels named the new master.
    interruptions: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    per_entry: dict[str, collections.Counter[str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def worst_failover_gap(self) -> tuple[str, float] | None:
        return max(self.failover_gaps, key=lambda g: g[1], default=None)

    @property
    def worst_recovery(self) -> tuple[str, float] | None:
        return max(self.recoveries, key=lambda g: g[1], default=None)

    @property
    def ok(self) -> bool:
        return (not self.duplicates and not self.unaccounted
                and self.beat_exits == 0 and self.audit_ok is not False and self.due > 0)

    def render(self) -> str:
        def worst(value: tuple[str, float] | None) -> str:
            return "n/a" if value is None else f"{value[1]:.2f}s ({value[0]})"

        reasons = ", ".join(f"{r}={n}" for r, n in sorted(self.skipped.items())) or "none"
        lines = [
            f"soak summary — store={self.store} seed={self.seed} "
            f"window={iso(self.window[0])}..{iso(self.window[1])} UTC "
            f"({self.window[1] - self.window[0]:.0f}s)",
            f"  faults injected     {sum(self.faults.values())}: "
            + (", ".join(f"{k}={n}" for k, n in sorted(self.faults.items())) or "none"),
            f"  slots due           {self.due}",
            f"  run exactly once    {self.run_once}",
            f"  skipped by policy   {sum(self.skipped.values())} ({reasons})",
            f"  duplicates          {len(self.duplicates)}" + _few(self.duplicates),
            f"    of which concurrent {len(self.concurrent_duplicates)} (a second run started "
            "before the first finished)" + _few(self.concurrent_duplicates),
            f"  lost to a failover  {len(self.failover_losses)} (a write only the old master "
            "acknowledged: a run's finish, so it ran again; a redelivery or a publish, so it "
            "never finished or never ran)" + _few(self.failover_losses),
            f"  run, yet recorded skipped {len(self.contradictions)}"
            + _few(self.contradictions),
            f"  unaccounted         {len(self.unaccounted)}" + _few(self.unaccounted),
            f"  fenced stale writes {self.fenced}",
            f"  writes rolled back  {self.undone} (an abandoned run's write, undone by the run "
            "that took its key over)",
            f"  runs restarted      {self.restarted_runs} (started again after a worker fault)",
            f"  beat process exits  {self.beat_exits}",
            f"  worker exits        {self.worker_exits} (not stopped by the soak; restarted)",
            "  audit verify        "
            + {True: "clean", False: "DIVERGED", None: "not run"}[self.audit_ok],
            f"  worst failover gap  {worst(self.worst_failover_gap)}",
            f"  worst recovery time {worst(self.worst_recovery)}",
            *(f"  interruption        {kind}: no run started for {s:.2f}s"
              for kind, s in self.interruptions),
        ]
        for name, counts in sorted(self.per_entry.items()):
            lines.append(f"    {name:<22} " + " ".join(f"{k}={v}" for k, v in
                                                       sorted(counts.items())))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _few(items: Sequence[str], n: int = 5) -> str:
    return "" if not items else "  e.g. " + "; ".join(items[:n])


def account(
    *,
    store: str,
    seed: int,
    window: tuple[float, float],
    due_slots: Mapping[str, Iterable[float]],
    starts: Sequence[Mapping[str, Any]],
    done: Sequence[Mapping[str, Any]],
    fenced: Sequence[Mapping[str, Any]],
    skips: Iterable[SkipSpan],
    faults: Sequence[Fault],
    beat_exits: int,
    audit: tuple[bool, str] | None,
    undone: Sequence[Mapping[str, Any]] = (),
    worker_exits: int = 0,
    stuck_task_ids: Sequence[str] = (),
    namespace: str | None = None,
) -> Summary:
    """Classify every due slot and measure failover gaps and recovery times."""
    summary = Summary(store=store, seed=seed, window=window, beat_exits=beat_exits,
                      worker_exits=worker_exits)
    if audit is not None:
        summary.audit_ok, summary.audit_output = audit
    summary.faults.update(f.kind for f in faults)
    summary.fenced = len(fenced)

    voided = {(u.get("entry"), parse_slot(u.get("slot")), _int(u.get("claim_token")))
              for u in undone}
    accepted: dict[tuple[str, float], list[Mapping[str, Any]]] = collections.defaultdict(list)
    for rec in done:
        slot = parse_slot(rec.get("slot"))
        if slot is None:
            continue
        if (rec["entry"], slot, _int(rec.get("claim_token"))) in voided:
            summary.undone += 1
            continue
        accepted[(rec["entry"], slot)].append(rec)
    started: dict[tuple[str, float], set[str]] = collections.defaultdict(set)
    start_recs: dict[tuple[str, float], list[Mapping[str, Any]]] = collections.defaultdict(list)
    for rec in starts:
        slot = parse_slot(rec.get("slot"))
        if slot is not None:
            started[(rec["entry"], slot)].add(f"{rec.get('worker')}/{rec.get('pid')}")
            start_recs[(rec["entry"], slot)].append(rec)
    stuck = set(stuck_task_ids)
    skip_by_entry: dict[str, list[SkipSpan]] = collections.defaultdict(list)
    for span in skips:
        skip_by_entry[span.entry].append(span)

    for entry, slots in due_slots.items():
        counts = summary.per_entry.setdefault(entry, collections.Counter())
        for slot in slots:
            summary.due += 1
            counts["due"] += 1
            runs = accepted.get((entry, slot), [])
            reason = next((s.reason for s in skip_by_entry[entry]
                           if s.first - 1e-3 <= slot <= s.last + 1e-3), None)
            label = f"{entry}@{iso(slot)}"
            if len(started.get((entry, slot), ())) > 1:
                summary.restarted_runs += 1
            if len(runs) > 1:
                text = (f"{label} x{len(runs)} by "
                        + ",".join(f"{r.get('worker')}/t{r.get('claim_token')}" for r in runs))
                concurrent = _overlapping(runs, start_recs[(entry, slot)])
                first_end = min(float(r["t"]) for r in runs)
                if not concurrent and any(
                        f.kind in LOSSY_FAULTS
                        and f.t - 1.0 <= first_end <= (f.t_heal or f.t) + LOSS_TAIL_S
                        for f in faults):
                    summary.failover_losses.append(text)
                    counts["lost-to-failover"] += 1
                    continue
                summary.duplicates.append(text)
                counts["duplicate"] += 1
                if concurrent:
                    summary.concurrent_duplicates.append(text)
            elif runs and reason is not None:
                summary.contradictions.append(f"{label} ran and skipped ({reason})")
                summary.run_once += 1
                counts["run+skip"] += 1
            elif runs:
                summary.run_once += 1
                counts["run"] += 1
            elif reason is not None:
                summary.skipped[reason] += 1
                counts[f"skip:{reason}"] += 1
            else:
                task_id = _task_id(namespace, entry, slot) if namespace else None
                why = _evidence(start_recs[(entry, slot)], stuck, task_id)
                last = max((float(r["t"]) for r in start_recs[(entry, slot)]), default=None)
                # In flight at the fault (started), or due in its window (never started).
                since, at = (IN_FLIGHT_S, last) if last is not None else (1.0, slot)
                if any(f.kind in LOSSY_FAULTS
                       and f.t - since <= at <= (f.t_heal or f.t) + LOSS_TAIL_S
                       for f in faults):
                    summary.failover_losses.append(f"{label} ({why})")
                    counts["lost-to-failover"] += 1
                    continue
                summary.unaccounted.append(f"{label} ({why})")
                counts["unaccounted"] += 1

    _measure(summary, starts, [*done, *fenced], faults)
    return summary


def _overlapping(runs: Sequence[Mapping[str, Any]], starts: Sequence[Mapping[str, Any]]
                 ) -> bool:
    """Whether a later accepted run started before an earlier one had finished."""
    ordered = sorted(runs, key=lambda r: float(r["t"]))
    for first, later in itertools.pairwise(ordered):
        t_later = next((float(s["t"]) for s in starts
                        if s.get("claim_token") == later.get("claim_token")
                        and s.get("worker") == later.get("worker")),
                       float(later.get("t_start", later["t"])))
        if t_later < float(first["t"]):
            return True
    return False


def _task_id(namespace: str, entry: str, slot: float) -> str:
    """The run's deterministic task id (DESIGN.md: uuid5 of namespace, entry and slot)."""
    text = datetime.fromtimestamp(slot, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}|{entry}|{text}"))


def _evidence(starts: Sequence[Mapping[str, Any]], stuck: set[str],
              task_id: str | None = None) -> str:
    """What is known of an unaccounted slot's run."""
    if not starts and task_id in stuck:
        return f"{task_id[:8]}: delivered, never started, still in the broker's unacked hash"
    if starts:
        ids = {s.get("task_id") for s in starts}
        where = ",".join(sorted({str(s.get("worker")) for s in starts}))
        return f"started on {where}, never finished" + (
            "; still in the broker's unacked hash" if ids & stuck else "")
    return (f"{task_id[:8]}: " if task_id else "") + "no run started, no skip record"


def _measure(summary: Summary, starts: Sequence[Mapping[str, Any]],
             ends: Sequence[Mapping[str, Any]], faults: Sequence[Fault]) -> None:
    """Failover gap: from a fault of the leading beat to the first run a newer leader sent.
    Recovery: from a worker fault to its in-flight runs starting elsewhere; from the end of a
    store fault to the first run that starts after it."""
    by_time = sorted(starts, key=lambda r: float(r["t"]))
    for f in faults:
        if f.kind in BEAT_FAULTS:
            if not f.was_leader or f.leader_token is None:
                continue
            nxt = next((r for r in by_time if float(r["t"]) >= f.t
                        and _int(r.get("leader_token")) > f.leader_token), None)
            if nxt is not None:
                summary.failover_gaps.append((f.kind, float(nxt["t"]) - f.t))
            else:
                summary.notes.append(f"no run under a newer leader after {f.kind} at {iso(f.t)}")
        elif f.kind in WORKER_FAULTS:
            host = f.worker_host
            in_flight = {r["task_id"] for r in by_time
                         if r.get("worker") == host and f.t - 120 <= float(r["t"]) < f.t}
            finished = {r["task_id"] for r in ends
                        if r.get("worker") == host and float(r["t"]) < f.t}
            for task_id in in_flight - finished:
                again = next((r for r in by_time if r["task_id"] == task_id
                              and float(r["t"]) > f.t), None)
                if again is not None:
                    summary.recoveries.append((f.kind, float(again["t"]) - f.t))
        else:
            t0 = f.t_heal if f.t_heal is not None else f.t
            nxt = next((r for r in by_time if float(r["t"]) > t0), None)
            if nxt is not None:
                summary.recoveries.append((f.kind, float(nxt["t"]) - t0))
                if f.kind in LOSSY_FAULTS:
                    marks = [f.t, *(float(r["t"]) for r in by_time
                                    if f.t < float(r["t"]) <= float(nxt["t"]))]
                    summary.interruptions.append(
                        (f.kind, max(b - a for a, b in itertools.pairwise(marks))))


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
