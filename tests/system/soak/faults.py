"""Seeded fault injector: real signals, real server restarts, real clock skew.

Faults are drawn from a seeded ``random.Random``: the kinds cycle through a fresh random
permutation each round (so even a short run sees different kinds, and a long one sees every
kind many times), targets and durations are drawn from the same generator. Every choice is
printed with its time, so a failing run can be read and replayed with the same seed.

One fault at a time; each is healed (SIGCONT, restart, the proxy back to passing, the clock
back to real) before the next one starts. Partitions and slow links are made by the TCP proxy
each process has in front of the lease store (``Member.proxies``): the process keeps its broker
and result backend connections, as when one host loses its route to the store.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from celery_crawl import keys
from celery_crawl.leases import LeaseStore

from .ledger import Fault
from .stack import Member, Stack, now

__all__ = ["FAULT_KINDS", "SENTINEL_FAULT_KINDS", "FaultInjector", "LeaderMonitor"]

FAULT_KINDS = (
    "beat_kill9", "beat_stop", "beat_term", "beat_skew", "beat_clock_step", "leader_partition",
    "worker_kill9", "worker_stop", "worker_partition",
    "redis_restart", "store_unreachable", "slow_store",
)
#: The soak's ``crawl_store_timeout`` (recorder.py): a slow store's delay goes up to twice it.
STORE_TIMEOUT_S = 1.0
ETCD_FAULT_KINDS = ("etcd_leader_kill", "etcd_follower_kill")
#: Failovers of a Sentinel-managed master: kill -9, ``SENTINEL FAILOVER``, and a SIGSTOP past
#: ``down-after-milliseconds`` with SIGCONT after the failover (the old master comes back and is
#: demoted).
SENTINEL_FAULT_KINDS = ("sentinel_master_kill", "sentinel_failover", "sentinel_master_stop")
#: The process faults of the Sentinel run (no proxies there: a process follows the master).
SENTINEL_PROCESS_KINDS = ("beat_kill9", "beat_stop", "beat_term", "worker_kill9", "worker_stop")


@dataclass
class Sample:
    t: float
    holder: str | None
    token: int | None


@dataclass
class LeaderMonitor:
    """Samples the beat leader lease every 0.2 s from the soak's own store connection.

    Gives the fault injector its target (the current leader) and checks that a skewed
    replica never leads and that leader tokens never go backwards.
    """

    store: LeaseStore
    stack: Stack
    samples: list[Sample] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        last_token = -1
        while not self._stop.wait(0.2):
            try:
                got = self.store.holder(keys.BEAT_LEADER)
            except Exception:  # the store is the fault right now
                continue
            holder, token = got if got else (None, None)
            self.samples.append(Sample(now(), holder, token))
            if token is not None:
                if token < last_token:
                    self.violations.append(f"leader token went back {last_token} -> {token}")
                last_token = max(last_token, token)
                member = self.member_of(holder)
                if member is not None and member.skew:
                    self.violations.append(
                        f"{now():.1f}: skewed replica {member.name} ({member.skew}) leads")
            self.stack.check_exits()

    def member_of(self, holder: str | None) -> Member | None:
        if not holder:
            return None
        parts = holder.split(":")
        pid = next((int(p) for p in reversed(parts[:-1]) if p.isdigit()), None)
        return self.stack.by_pid(pid) if pid is not None else None

    def leader(self) -> tuple[Member | None, int | None]:
        if not self.samples:
            return None, None
        last = self.samples[-1]
        return self.member_of(last.holder), last.token


class FaultInjector:
    """Injects one fault at a time into ``stack`` until ``deadline`` (epoch seconds)."""

    def __init__(self, stack: Stack, monitor: LeaderMonitor, seed: int,
                 log: Callable[[str], None] = print,
                 kinds: Sequence[str] | None = None, rounds: int | None = None) -> None:
        self.stack = stack
        self.monitor = monitor
        self.seed = seed
        self.rng = random.Random(seed)
        self.log = log
        self.faults: list[Fault] = []
        available = FAULT_KINDS + (ETCD_FAULT_KINDS if stack.etcd is not None else ())
        if stack.sentinels is not None:
            available = SENTINEL_PROCESS_KINDS + SENTINEL_FAULT_KINDS
        unknown = sorted(set(kinds or ()) - set(available))
        if unknown:
            raise ValueError(f"unknown fault kinds for store {stack.store_kind}: {unknown}; "
                             f"known: {', '.join(available)}")
        self.kinds = tuple(kinds) if kinds else available
        self._round: list[str] = []
        #: Rounds of every kind to inject at most (None: until the deadline).
        self.rounds = rounds
        self._rounds_begun = 0
        self.ttl_s = stack.ttl_s

    def next_kind(self) -> str | None:
        if not self._round:
            if self.rounds is not None and self._rounds_begun >= self.rounds:
                return None
            self._rounds_begun += 1
            self._round = list(self.kinds)
            self.rng.shuffle(self._round)
        return self._round.pop(0)

    def run(self, deadline: float) -> list[Fault]:
        self.log(f"fault injector: seed={self.seed} kinds={','.join(self.kinds)}")
        while now() < deadline - self.ttl_s:
            kind = self.next_kind()
            if kind is None:
                break
            fault = getattr(self, kind)()
            fault.t_heal = fault.t_heal or now()
            self.faults.append(fault)
            self.log(f"  {time.strftime('%H:%M:%S')} fault {kind} target={fault.target} "
                     f"leader_token={fault.leader_token} healed after "
                     f"{fault.t_heal - fault.t:.1f}s {fault.note}")
            self._sleep(self.rng.uniform(1.0, 2.5))
        return self.faults

    # -- helpers ------------------------------------------------------------------------------
    def _sleep(self, seconds: float) -> None:
        # The outage / pause length *is* the fault; this is not synchronisation.
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.stack.check_exits()
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def _held(self, seconds: float, begin: Callable[[], None], end: Callable[[], None]) -> None:
        """``begin`` a fault, keep it ``seconds``, then ``end`` it, even if the wait fails."""
        begin()
        try:
            self._sleep(seconds)
        finally:
            end()

    def _beyond_ttl(self) -> float:
        return self.ttl_s + self.rng.uniform(1.0, 2.0)

    def _beat_target(self) -> tuple[Member, bool, int | None]:
        leader, token = self.monitor.leader()
        if leader is not None and leader.role == "beat" and leader.alive():
            return leader, True, token
        return self.rng.choice(self.stack.beats), False, token

    # -- beat faults ----------------------------------------------------------------------------
    def beat_kill9(self) -> Fault:
        m, was_leader, token = self._beat_target()
        f = Fault("beat_kill9", m.name, now(), leader_token=token, was_leader=was_leader)
        with self.stack.lock:
            m.kill9()
        self._sleep(self.rng.uniform(0.5, 2.0))
        with self.stack.lock:
            m.start()
        return f

    def beat_stop(self) -> Fault:
        m, was_leader, token = self._beat_target()
        pause = self._beyond_ttl()
        f = Fault("beat_stop", m.name, now(), leader_token=token, was_leader=was_leader,
                  note=f"SIGSTOP {pause:.1f}s")
        m.signal(signal.SIGSTOP)
        self._sleep(pause)
        m.signal(signal.SIGCONT)
        return f

    def beat_term(self) -> Fault:
        m, was_leader, token = self._beat_target()
        f = Fault("beat_term", m.name, now(), leader_token=token, was_leader=was_leader)
        with self.stack.lock:
            code = m.terminate(grace_s=10.0)
            f.note = f"exit {code}"
        self._sleep(self.rng.uniform(0.3, 1.0))
        with self.stack.lock:
            m.start()
        return f

    def beat_skew(self) -> Fault:
        """Restart one replica under libfaketime (only that process); the previously skewed
        replica, if any, comes back on the real clock."""
        m, was_leader, token = self._beat_target()
        offset = self.rng.choice(["+", "-"]) + f"{self.rng.randint(3, 8)}s"
        f = Fault("beat_skew", m.name, now(), leader_token=token, was_leader=was_leader,
                  note=f"FAKETIME={offset}")
        with self.stack.lock:
            for other in self.stack.beats:
                if other.skew and other is not m:
                    other.terminate()
                    other.skew = None
                    other.start()
            m.terminate()
            m.skew = offset
            m.start()
        return f

    def beat_clock_step(self) -> Fault:
        """Step the wall clock of the replica that runs on a clock file by +-1 h, then back.

        Whether it leads or not, it must not dispatch on the stepped clock: no slot early, no
        slot recorded skipped for the hour it jumped over, no silent entry once it is back.
        """
        m = next(b for b in self.stack.beats if b.clock_file is not None)
        leader, token = self.monitor.leader()
        offset = self.rng.choice(["+1h", "-1h"])
        hold = self.rng.uniform(1.0, 2.0 * self.ttl_s)
        f = Fault("beat_clock_step", m.name, now(), leader_token=token,
                  was_leader=leader is m, note=f"clock {offset} for {hold:.1f}s")
        if m.skew:  # beat_skew restarted it on a fixed offset: back onto its clock file
            with self.stack.lock:
                m.terminate()
                m.skew = None
                m.start()
        self._held(hold, lambda: m.step_clock(offset), lambda: m.step_clock("+0"))
        return f

    def leader_partition(self) -> Fault:
        """Cut the leader off the lease store (it keeps the broker) for longer than a TTL."""
        m, was_leader, token = self._beat_target()
        cut = self._beyond_ttl()
        f = Fault("leader_partition", m.name, now(), leader_token=token, was_leader=was_leader,
                  note=f"store black-holed {cut:.1f}s")
        self._held(cut, m.cut_off, m.heal_store)
        return f

    # -- worker faults --------------------------------------------------------------------------
    def _worker(self) -> Member:
        return self.rng.choice(self.stack.workers)

    def worker_kill9(self) -> Fault:
        m = self._worker()
        f = Fault("worker_kill9", m.name, now(), worker_host=f"{m.name}@soak")
        with self.stack.lock:
            m.kill9()
        self._sleep(self.rng.uniform(0.5, 2.0))
        with self.stack.lock:
            m.start()
        return f

    def worker_stop(self) -> Fault:
        m = self._worker()
        pause = self._beyond_ttl()
        f = Fault("worker_stop", m.name, now(), worker_host=f"{m.name}@soak",
                  note=f"SIGSTOP {pause:.1f}s")
        m.signal(signal.SIGSTOP)
        self._sleep(pause)
        m.signal(signal.SIGCONT)
        return f

    def worker_partition(self) -> Fault:
        """Cut one worker off the lease store, not off the broker, for longer than a TTL.

        Its lease runs out on its own clock while its tasks could still run and ack: it must
        stop them before the reaper hands them to the other worker.
        """
        m = self._worker()
        cut = self._beyond_ttl()
        f = Fault("worker_partition", m.name, now(), worker_host=f"{m.name}@soak",
                  note=f"store black-holed {cut:.1f}s")
        self._held(cut, m.cut_off, m.heal_store)
        return f

    # -- store faults ---------------------------------------------------------------------------
    def redis_restart(self) -> Fault:
        down = self.rng.uniform(0.2, 1.5)
        f = Fault("redis_restart", "stack-redis", now(), note=f"down {down:.1f}s")
        self.stack.redis.stop()  # kill -9; AOF with fsync always keeps every write
        self._sleep(down)
        self.stack.redis.start()
        return f

    def store_unreachable(self) -> Fault:
        pause = self._beyond_ttl()
        if self.stack.etcd is not None:
            targets = [m.proc for m in self.stack.etcd.members if m.proc is not None]
            name = "etcd-cluster"
        else:
            targets = [self.stack.redis.proc] if self.stack.redis.proc else []
            name = "stack-redis"
        f = Fault("store_unreachable", name, now(), note=f"SIGSTOP {pause:.1f}s")
        for p in targets:
            p.send_signal(signal.SIGSTOP)
        try:
            self._sleep(pause)
        finally:
            for p in targets:
                p.send_signal(signal.SIGCONT)
        return f

    def _etcd_member_kill(self, kind: str, leader_side: bool) -> Fault:
        cluster = self.stack.etcd
        assert cluster is not None
        leader = cluster.wait_leader()
        followers = [m for m in cluster.members if m is not leader and m.alive()]
        target = leader if leader_side else self.rng.choice(followers)
        f = Fault(kind, target.name, now())
        target.kill()
        self._sleep(self.rng.uniform(1.0, 3.0))
        target.start()
        return f

    def etcd_leader_kill(self) -> Fault:
        return self._etcd_member_kill("etcd_leader_kill", leader_side=True)

    def etcd_follower_kill(self) -> Fault:
        return self._etcd_member_kill("etcd_follower_kill", leader_side=False)

    def slow_store(self) -> Fault:
        """Every process's link to the store slowed by up to twice ``crawl_store_timeout``."""
        delay = self.rng.uniform(0.1, 2.0 * STORE_TIMEOUT_S)
        length = self.rng.uniform(self.ttl_s, 2.0 * self.ttl_s)
        f = Fault("slow_store", "all-processes", now(),
                  note=f"+{delay * 1000:.0f}ms per chunk for {length:.1f}s")
        members = self.stack.members()
        self._held(length, lambda: [m.slow_store(delay) for m in members],
                   lambda: [m.heal_store() for m in members])
        return f

    # -- Sentinel failovers ---------------------------------------------------------------------
    def _failover(self, kind: str, begin: Callable[[], object],
                  after: Callable[[], None] | None = None) -> Fault:
        """``begin`` a failover of the current master; the fault heals when every sentinel
        names a new master (``t_heal``: the fleet is measured from there); ``after`` runs
        then (the old master's return); two TTLs later, the next fault may come once a replica
        is linked."""
        sentinels = self.stack.sentinels
        assert sentinels is not None
        old = sentinels.wait_settled(timeout_s=60, replicas=1)
        _, token = self.monitor.leader()
        f = Fault(kind, f"master:{old}", now(), leader_token=token)
        begin()
        new = sentinels.wait_new_master(old, timeout_s=60)
        f.t_heal = now()
        f.note = f"new master {new} after {f.t_heal - f.t:.1f}s"
        if after is not None:
            after()
        # Two TTLs for the fleet to go on before anything else happens, so what the ledger
        # measures after this failover is this failover's.
        self._sleep(2 * self.ttl_s)
        sentinels.wait_settled(timeout_s=60, replicas=1)
        return f

    def sentinel_master_kill(self) -> Fault:
        sentinels = self.stack.sentinels
        assert sentinels is not None
        killed: list[object] = []
        return self._failover(
            "sentinel_master_kill", lambda: killed.append(sentinels.kill_master()),
            lambda: sentinels.restart_node(killed[0]))  # type: ignore[arg-type]

    def sentinel_failover(self) -> Fault:
        sentinels = self.stack.sentinels
        assert sentinels is not None
        return self._failover("sentinel_failover", sentinels.planned_failover)

    def sentinel_master_stop(self) -> Fault:
        sentinels = self.stack.sentinels
        assert sentinels is not None
        node = sentinels.master()
        return self._failover("sentinel_master_stop", lambda: sentinels.pause(node),
                              lambda: sentinels.resume(node))

