"""Faults beyond kill -9: a frozen worker, a long task vs the visibility timeout, prefetched tasks
of a dead worker, the lease store (Redis or etcd) unreachable for longer than the TTL, a poison
message."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import EtcdServer, RedisServer, wait_until
from tests.system.test_worker_recovery import BOUND_S, make_combo
from tests.system.workerapp_harness import TTL_S, Combo, committed, runs, send, workers

pytestmark = [pytest.mark.system]


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.mark.parametrize(("pool", "broker", "store"), [
    ("prefork", "redis", "redis"),
    ("threads", "rabbit", "etcd"),
])
def test_sigstop_beyond_ttl_is_cancelled_and_fenced(
    request: pytest.FixtureRequest, redis_srv: RedisServer, tmp_path: Path,
    pool: str, broker: str, store: str,
) -> None:
    combo = make_combo(request, redis_srv, broker, store, pool)
    key = combo.ns
    with workers(combo, tmp_path) as ws:
        ws.start("a", wait=False)
        ws.start("b", wait=False)
        ws.wait_ready("a")
        ws.wait_ready("b")
        send(combo, key, 2.0)
        first = wait_until(lambda: runs(combo, key), 30, what="first run started")[0]
        victim = "a" if first["host"] == ws.hostname("a") else "b"
        survivor = "b" if victim == "a" else "a"
        ws.procs[victim].signal_group(signal.SIGSTOP)
        try:
            # The survivor runs it once the frozen worker's lease expired, and commits.
            done = wait_until(
                lambda: [r for r in runs(combo, key, "finished")
                         if r["host"] == ws.hostname(survivor)],
                BOUND_S + 15, what="the survivor finished the task")
        finally:
            ws.procs[victim].signal_group(signal.SIGCONT)
        second = next(r for r in runs(combo, key) if r["host"] == ws.hostname(survivor))
        assert second["token"] > first["token"]
        assert done[0]["accepted"]
        victim_proc = ws.procs[victim]
        wait_until(lambda: "worker lease lost" in victim_proc.log(), 30,
                   what="the resumed worker noticed its lease loss")
        # Consumption resumes ("consuming again"), or never stopped when the new lease was
        # already held by the time the loop applied the loss ("kept consuming").
        wait_until(lambda: any(m in victim_proc.log()
                               for m in ("consuming again", "kept consuming")), 30,
                   what="the resumed worker took a new lease")
        stale = [r for r in runs(combo, key, "finished") if r["host"] == ws.hostname(victim)]
        if pool == "prefork":
            # Its child was killed before it could finish.
            wait_until(lambda: "cancelled 1 running" in victim_proc.log(), 10,
                       what="the stale run cancelled")
            assert stale == []
        else:
            # A thread cannot be interrupted: its late write is refused by the fenced sink.
            wait_until(lambda: [r for r in runs(combo, key, "finished")
                                if r["host"] == ws.hostname(victim)], 15,
                       what="the stale thread finished")
            stale = [r for r in runs(combo, key, "finished") if r["host"] == ws.hostname(victim)]
            assert [r["accepted"] for r in stale] == [False]
        final = committed(combo, key)
        assert final is not None and final["token"] == second["token"]
        assert len(runs(combo, key)) == 2


def test_task_longer_than_visibility_timeout_runs_once(
    request: pytest.FixtureRequest, redis_srv: RedisServer, tmp_path: Path,
) -> None:
    combo = make_combo(request, redis_srv, "redis", "redis", "prefork")
    combo.extra_env["CRAWL_T_VT"] = "2"
    key = combo.ns
    with workers(combo, tmp_path) as ws:
        ws.start("a", wait=False)
        ws.start("b", wait=False)
        ws.wait_ready("a")
        ws.wait_ready("b")
        send(combo, key, 5.0)  # 2.5 visibility timeouts; kombu sweeps every second
        wait_until(lambda: runs(combo, key, "finished"), 30, what="the task finished")
        assert len(runs(combo, key)) == 1, runs(combo, key)
        assert committed(combo, key) is not None


def test_prefetched_tasks_of_a_dead_worker_are_recovered(
    request: pytest.FixtureRequest, redis_srv: RedisServer, tmp_path: Path,
) -> None:
    combo = make_combo(request, redis_srv, "redis", "redis", "prefork")
    keys = [f"{combo.ns}-{i}" for i in range(3)]
    broker = redis_srv.client(1)
    with workers(combo, tmp_path) as ws:
        ws.start("a")
        send(combo, keys[0], 3.0)
        wait_until(lambda: runs(combo, keys[0]), 30, what="the long task started")
        send(combo, keys[1], 0.2)
        send(combo, keys[2], 0.2)
        # Both short ones are reserved by a (prefetched: off the queue, unacked), not started.
        wait_until(lambda: broker.llen(combo.queue) == 0 and broker.hlen("unacked") >= 3, 15,
                   what="the worker prefetched the short tasks")
        assert not runs(combo, keys[1]) and not runs(combo, keys[2])
        ws.start("b")
        ws.procs["a"].kill9()
        # 3x headroom: on a loaded 2-core machine the survivor's start and the three runs in a
        # row (the recovered ones go to the head of the queue) take far longer than alone.
        for k in keys[1:]:
            wait_until(lambda k=k: runs(combo, k, "finished"), 3 * BOUND_S,
                       what=f"prefetched {k} ran elsewhere")
        wait_until(lambda: len(runs(combo, keys[0])) == 2, 3 * BOUND_S,
                   what="the long task restarted elsewhere")
        for k in keys[1:]:
            assert len(runs(combo, k)) == 1
    broker.close()


class StoreOutage:
    """Makes one lease store unreachable and reachable again: a Redis store is killed and
    restarted on its port (AOF keeps the data); etcd is frozen (SIGSTOP) and resumed (SIGCONT),
    so its clients' requests hang until their timeout, as with a partitioned server."""

    def __init__(self, request: pytest.FixtureRequest, store: str) -> None:
        self.store = store
        if store == "etcd":
            self.etcd: EtcdServer = request.getfixturevalue("fresh_etcd")
            self.url = self.etcd.url
        else:
            self.redis: RedisServer = request.getfixturevalue("fresh_redis_aof")
            self.url = self.redis.url_db(0)

    def begin(self) -> None:
        if self.store == "etcd":
            assert self.etcd.proc is not None
            os.kill(self.etcd.proc.pid, signal.SIGSTOP)
        else:
            self.redis.stop()

    def end(self) -> None:
        if self.store == "etcd":
            assert self.etcd.proc is not None
            os.kill(self.etcd.proc.pid, signal.SIGCONT)
        else:
            self.redis.start()


@pytest.mark.parametrize("store", ["redis", "etcd"])
def test_store_unreachable_longer_than_ttl(
    request: pytest.FixtureRequest, redis_srv: RedisServer, tmp_path: Path, store: str,
) -> None:
    outage = StoreOutage(request, store)
    combo = Combo(broker=redis_srv.url_db(1), backend=redis_srv.url_db(2), lease=outage.url,
                  sink=redis_srv.url_db(3), pool="prefork")
    key, later = f"{combo.ns}-a", f"{combo.ns}-b"
    with workers(combo, tmp_path) as ws:
        proc = ws.start("a")
        send(combo, key, 5.0)
        first = wait_until(lambda: runs(combo, key), 30, what="task started")[0]
        outage.begin()
        t_down = time.time()
        try:
            wait_until(lambda: "worker lease lost" in proc.log(), 3 * TTL_S + 10,
                       what="lease loss noticed")
            # Lost because renewals failed against the unreachable store.
            assert "renewing the worker lease failed" in proc.log()
            wait_until(lambda: "not consuming tasks" in proc.log(), 10, what="consumption stop")
            wait_until(lambda: "cancelled 1 running" in proc.log(), 10, what="task cancelled")
            send(combo, later, 0.2)
            # The fault injected is an outage longer than the TTL (the loss is noticed as soon
            # as the validity left at its start ran out, which can be much sooner).
            time.sleep(max(0.0, t_down + 1.5 * TTL_S - time.time()))
            assert not runs(combo, later)
        finally:
            t_back = time.time()
            outage.end()
        wait_until(lambda: "consuming again" in proc.log(), 3 * TTL_S + 10,
                   what="new lease after the outage")
        wait_until(lambda: runs(combo, later, "finished"), 30, what="the later task ran")
        reruns = wait_until(lambda: len(runs(combo, key)) >= 2 and runs(combo, key), 30,
                            what="the cancelled task ran again")
        assert reruns[1]["token"] > first["token"]
        assert len(runs(combo, later)) == 1
        # Failed closed: nothing started while no lease was held.
        assert runs(combo, later)[0]["t"] >= t_back and reruns[1]["t"] >= t_back
        wait_until(lambda: runs(combo, key, "finished"), 30, what="the rerun finished")
        assert [r["accepted"] for r in runs(combo, key, "finished")] == [True]
        assert len(runs(combo, key)) == 2


def test_store_unreachable_with_continue_keeps_running(
    redis_srv: RedisServer, fresh_redis: RedisServer, tmp_path: Path,
) -> None:
    combo = Combo(broker=redis_srv.url_db(1), backend=redis_srv.url_db(2),
                  lease=fresh_redis.url_db(0), sink=redis_srv.url_db(3), pool="prefork",
                  extra_env={"CRAWL_T_ON_LOSS": "continue"})
    key = combo.ns
    with workers(combo, tmp_path) as ws:
        proc = ws.start("a")
        send(combo, key, 5.0)
        wait_until(lambda: runs(combo, key), 30, what="task started")
        fresh_redis.stop()
        try:
            wait_until(lambda: "crawl_on_lease_loss=continue" in proc.log(), 3 * TTL_S + 10,
                       what="lease loss logged")
            # Not cancelled: it finishes (and is acked) while the store is still down.
            done = wait_until(lambda: runs(combo, key, "finished"), 30, what="task finished")
            assert done[0]["accepted"]
            assert "not consuming" not in proc.log()
        finally:
            fresh_redis.start()
        wait_until(lambda: "new worker lease" in proc.log(), 3 * TTL_S + 10,
                   what="new lease after the outage")
        assert len(runs(combo, key)) == 1


def test_poison_message_ends_as_failure(
    request: pytest.FixtureRequest, redis_srv: RedisServer, tmp_path: Path,
) -> None:
    combo = make_combo(request, redis_srv, "redis", "redis", "prefork")
    combo.extra_env["CRAWL_T_MAX_DELIVERIES"] = "2"
    key = combo.ns
    with workers(combo, tmp_path) as ws:
        ws.start("a")
        task_id = send(combo, key, 0, task="crawltest.die")
        client = combo.app()
        try:
            result = client.AsyncResult(task_id)
            wait_until(lambda: result.state == "FAILURE", 60, what="poison FAILURE stored")
            assert "PoisonMessage" in str(type(result.result).__name__) or "delivered 2 times" in (
                str(result.result))
        finally:
            client.close()
        assert len(runs(combo, key)) == 1
        assert "poison message" in ws.procs["a"].log()


def test_reconnection_releases_claims_of_dropped_reserved_tasks(
    redis_srv: RedisServer, rabbit_url: str, rabbit_vhost: str, tmp_path: Path,
) -> None:
    """On a lost broker connection Celery drops its reserved requests and RabbitMQ requeues
    every unacked message; the claims of the dropped ones must go too, or their redelivered
    copies would park behind our own live claims forever. (The Redis broker restart has its own
    test below.)
    """
    combo = Combo(broker=rabbit_url, backend=redis_srv.url_db(2), lease=redis_srv.url_db(0),
                  sink=redis_srv.url_db(3), pool="prefork")
    long_key, short = f"{combo.ns}-long", [f"{combo.ns}-s{i}" for i in range(2)]
    with workers(combo, tmp_path) as ws:
        proc = ws.start("a")
        send(combo, long_key, 3.0)
        wait_until(lambda: runs(combo, long_key), 30, what="long task started")
        for k in short:
            send(combo, k, 0.1)
        wait_until(lambda: proc.log().count("received") >= 3, 15, what="short tasks reserved")
        ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
        subprocess.run([ctl, "close_all_connections", "-p", rabbit_vhost, "test reconnect"],
                       check=True, capture_output=True, timeout=60)
        for k in short:
            wait_until(lambda k=k: runs(combo, k, "finished"), 60,
                       what=f"reserved {k} ran after the reconnection")
        for k in short:
            assert len(runs(combo, k)) == 1
        # The running one was requeued too: its copy parks behind our live claim and is dropped
        # once the run wrote its tombstone (stock Celery would run it a second time).
        wait_until(lambda: "as a duplicate" in proc.log(), 30, what="the copy dropped")
        assert len(runs(combo, long_key)) == 1


def test_a_redis_broker_restart_does_not_stop_the_worker(
    redis_srv: RedisServer, fresh_redis_aof: RedisServer, tmp_path: Path,
) -> None:
    """Celery 5.7 collects a lost connection, then closes it; on the Redis transport the close
    (restoring unacked messages) and the ack of a task that was running both raise
    AttributeError, and a stock worker stops with "Unrecoverable error". With the plugin the
    worker reconnects: the running task finishes once, the reserved ones run once after the
    restart, and a task sent afterwards runs."""
    combo = Combo(broker=fresh_redis_aof.url_db(1), backend=redis_srv.url_db(2),
                  lease=redis_srv.url_db(0), sink=redis_srv.url_db(3), pool="prefork")
    keys = [f"{combo.ns}-{i}" for i in range(3)]
    with workers(combo, tmp_path) as ws:
        proc = ws.start("a")
        for k in keys:
            send(combo, k, 2.0)
        wait_until(lambda: runs(combo, keys[0]), 30, what="the first task started")
        # Every message reserved (recorded as unacked) first: kombu's Redis transport loses a
        # message whose BRPOP the server answered as it went down (its unacked record is
        # written after the reply), whatever the worker does; that window is not under test.
        broker = fresh_redis_aof.client(1)
        wait_until(lambda: broker.hlen("unacked") == len(keys), 30,
                   what="every message reserved")
        fresh_redis_aof.restart(down_s=1.0)
        for k in keys:
            wait_until(lambda k=k: runs(combo, k, "finished") or not proc.alive(), 60,
                       what=f"{k} finished\n{proc.log()[-3000:]}")
        assert proc.alive(), proc.log()[-3000:]
        after = f"{combo.ns}-after"
        send(combo, after, 0.1)
        wait_until(lambda: runs(combo, after, "finished"), 60,
                   what=f"a task sent after the restart\n{proc.log()[-3000:]}")
        for k in keys:
            assert len(runs(combo, k)) == 1, (k, runs(combo, k))
        assert proc.alive() and "Unrecoverable error" not in proc.log()


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_task_that_finished_during_a_whole_store_outage_is_not_run_again(
    redis_srv: RedisServer, fresh_redis: RedisServer, tmp_path: Path, pool: str,
) -> None:
    """One Redis is lease store, broker and (audited) result backend, and it freezes
    (SIGSTOP) just as a task's body returns: the result write blocks, the worker loses its
    lease. The body's work is done, so the run is kept rather than cancelled; when the store
    answers again its result is written and acked before the reaper's grace ends, and the task
    never runs a second time. A prefork child marks the body's return in a file, a threads
    pool in the worker's memory."""
    combo = Combo(broker=fresh_redis.url_db(1),
                  backend=fresh_redis.url_db(2).replace("redis://", "crawlredis://"),
                  lease=fresh_redis.url_db(0), sink=redis_srv.url_db(3), pool=pool,
                  # The blocked result write times out and waits 3 s before its retry, so the
                  # loss handler runs while the finished run is still writing its result.
                  extra_env={"CRAWL_T_BACKEND_TIMEOUT": "1"})
    key = combo.ns
    with workers(combo, tmp_path) as ws:
        proc = ws.start("a")
        ws.start("b")
        task_id = send(combo, key, 1.0)
        first = wait_until(lambda: runs(combo, key), 30, what="task started")[0]
        assert fresh_redis.proc is not None
        os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
        t_down = time.time()
        try:
            # The body goes on (the sink is another server), commits, and returns.
            wait_until(lambda: runs(combo, key, "finished"), 30, what="the body returned")
            owner = proc if first["host"] == ws.hostname("a") else ws.procs["b"]
            # The keeper thread notices; the loss handler runs in the event loop, which the
            # frozen broker holds up until the store answers again.
            wait_until(lambda: "worker lease lost" in owner.log(), 3 * TTL_S + 10,
                       what="lease loss noticed")
            # The outage outlasts the TTL, so every lease in the store has expired.
            time.sleep(max(0.0, t_down + 1.5 * TTL_S - time.time()))
        finally:
            os.kill(fresh_redis.proc.pid, signal.SIGCONT)
        meta = wait_until(
            lambda: fresh_redis.client(2).get(f"celery-task-meta-{task_id}"), 30,
            what="the result written once the store answers")
        assert b'"SUCCESS"' in meta
        wait_until(lambda: "lease lost (" in owner.log(), 30, what="the loss handled")
        assert "cancelled 1 running" not in owner.log()
        # Long enough for a reaper to have reaped and a second worker to have run it.
        time.sleep(3 * TTL_S)
        assert len(runs(combo, key)) == 1, runs(combo, key)
        assert [r["accepted"] for r in runs(combo, key, "finished")] == [True]
        assert fresh_redis.client(1).hlen("unacked") == 0


@pytest.mark.parametrize(("pool", "freeze_s"), [("prefork", 13.0), ("threads", 2.0)])
def test_a_lease_store_freeze_under_a_rabbitmq_stream_runs_each_task_once(
    redis_srv: RedisServer, fresh_redis: RedisServer, rabbit_url: str, tmp_path: Path,
    pool: str, freeze_s: float,
) -> None:
    """RabbitMQ broker, a lease store of its own: claims and ends go out on the consumer's
    claim line. The store freezes (SIGSTOP) while two workers drain a stream of short tasks,
    so claims and ends sit on the line unanswered. A short freeze only delays them; one
    longer than the line's overdue bound (10 s) fails them: the claims are decided again by
    reading (which times out too, so they park), the ends go to the backlog, and when the
    store resumes it still executes the claims it had buffered, leaving claims of our own
    live lease that no run holds in front of parked deliveries. Every task still runs and
    commits exactly once, none stays parked, and nothing is left claimed."""
    combo = Combo(broker=rabbit_url, backend=redis_srv.url_db(2), lease=fresh_redis.url_db(0),
                  sink=redis_srv.url_db(3), pool=pool,
                  # Longer than the freeze plus a renewal's timeout: the lease is kept.
                  extra_env={"CRAWL_T_TTL": str(freeze_s + 8)})
    keys = [f"{combo.ns}-{i}" for i in range(60)]
    assert fresh_redis.proc is not None
    with workers(combo, tmp_path) as ws:
        a, b = ws.start("a", wait=False), ws.start("b", wait=False)
        ws.wait_ready("a")
        ws.wait_ready("b")
        for proc in (a, b):
            assert "on a claim line" in proc.log(), proc.log()[-3000:]
        for k in keys[:20]:
            send(combo, k, 0.05)
        wait_until(lambda: runs(combo, keys[0], "finished"), 30, what="the stream under way")
        os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
        try:
            for k in keys[20:]:  # delivered, claimed and ended while the store is frozen
                send(combo, k, 0.05)
            time.sleep(freeze_s)  # the fault: an outage of that length (nothing to wait for)
        finally:
            os.kill(fresh_redis.proc.pid, signal.SIGCONT)
        for k in keys:
            wait_until(lambda k=k: runs(combo, k, "finished"), 90,
                       what=f"{k} finished")
        # Long enough for a stray second delivery to have run.
        time.sleep(2 * TTL_S)
        logs = a.log() + b.log()
        assert "worker lease lost" not in logs
        for k in keys:
            assert len(runs(combo, k)) == 1, (k, runs(combo, k))
            assert [r["accepted"] for r in runs(combo, k, "finished")] == [True]
        store = fresh_redis.client(0)
        wait_until(lambda: not [key for key in store.scan_iter("*claim:task:*")],
                   30, what="no claim left")
