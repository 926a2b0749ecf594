"""django-celery-beat's rows run by ``LeasedScheduler`` replicas: real Django, real
django-celery-beat, a real PostgreSQL (a database of the test's own, reached through a TCP proxy
so that it can be cut) and SQLite, real ``celery beat`` processes.

The project is configured as django-celery-beat's documentation shows (tests/djangoproj), with
``CELERY_BEAT_SCHEDULER`` switched to the leased scheduler and ``CELERY_CRAWL_SCHEDULE_SOURCES``
set. Runs are read from the broker's queue (no worker is needed to see what was published):
every (entry, slot) must be published under one task id.

* two replicas, one leader; an admin edit (a row added, a row disabled, through the ORM) reaches
  the leader; the leader killed -9, the standby takes over and runs the rows it read itself;
  ``last_run_at``/``total_run_count`` written back under the fence of the newest token;
* PostgreSQL cut (the proxy refuses) at the ticks: the rows keep running, the write-back waits
  and catches up when the database is back;
* a DST night in America/New_York and one in Europe/Berlin (libfaketime on the beat, monotonic
  clocks untouched; an etcd lease store and a RabbitMQ broker, so no Redis clock pulls the beat
  back to the real time): a row at 02:30 runs once, at the jump.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django_celery_beat")

from celery_crawl import keys
from celery_crawl.beat.state import SkipLog
from celery_crawl.leases import open_store
from tests.procs import ROOT, Proc, celery_args, faketime_lib
from tests.servers import (
    EtcdServer,
    RedisServer,
    delete_rabbit_vhost,
    etcd_binary,
    make_rabbit_vhost,
    missing_tool,
    wait_until,
)
from tests.tcpproxy import TcpProxy

pytestmark = pytest.mark.system

APP = "tests.djangoproj.celeryapp"
TTL_S = 3.0
#: a standby takes over within ttl + 1 s (3x headroom); a row edit is read within the 1 s poll
TAKEOVER_S = 3 * (TTL_S + 1.0)
EDIT_S = 3 * 3.0


def _pg_admin() -> Any:
    psycopg = pytest.importorskip("psycopg")
    try:
        return psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres",
                               autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        missing_tool(f"PostgreSQL on 127.0.0.1:5432 is not reachable: {exc}")


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A PostgreSQL database of this test's own, dropped at the end."""
    name = f"crawl_djbeat_{uuid.uuid4().hex[:10]}"
    conn = _pg_admin()
    conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


def _admin(env: dict[str, str], *ops: dict[str, Any]) -> None:
    """Edits through the ORM in a process of their own (with ``env``'s LD_PRELOAD, if any)."""
    out = subprocess.run([sys.executable, "-m", "tests.djangoproj.admin", json.dumps(list(ops))],
                         env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]


class Published:
    """The runs the beats published, read from the broker's ``celery`` list."""

    def __init__(self, broker: RedisServer) -> None:
        self.client = broker.client(0)

    def all(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.client.lrange("celery", 0, -1):
            headers = json.loads(raw)["headers"]
            out.append({"entry": headers.get("crawl_entry"), "slot": headers.get("crawl_slot"),
                        "id": headers["id"], "token": headers.get("crawl_leader_token")})
        return out

    def of(self, entry: str) -> list[dict[str, Any]]:
        return [r for r in self.all() if r["entry"] == entry]

    def wait(self, entry: str, more: int, timeout_s: float) -> None:
        base = len(self.of(entry))
        wait_until(lambda: len(self.of(entry)) >= base + more, timeout_s,
                   what=f"{more} more runs of {entry}")

    def check_once(self) -> Counter[str]:
        """Every (entry, slot) was published under one task id; returns runs per entry."""
        ids: dict[tuple[str, str], set[str]] = defaultdict(set)
        for r in self.all():
            ids[(r["entry"], r["slot"])].add(r["id"])
        twice = {k: v for k, v in ids.items() if len(v) > 1}
        assert not twice, f"slots published under several task ids: {twice}"
        return Counter(entry for entry, _ in ids)


class Beats:
    """``celery beat`` replicas of the Django project, each in its own session."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs, self.procs, self.n = env, logs, [], 0
        self.store = open_store(env["CRAWL_DJ_LEASE"], namespace=env["CRAWL_DJ_NS"],
                                timeout_s=2.0)

    def spawn(self, *, env: dict[str, str] | None = None, preload: str | None = None) -> Proc:
        self.n += 1
        args = celery_args(APP, "beat", "-l", "INFO", "-s", str(self.logs / f"unused-{self.n}"))
        if preload:  # libfaketime: the launcher that sleeps without clock_nanosleep
            args = [sys.executable, "-m", "tests.system.faketime_celery", *args[1:]]
        proc = Proc(args, env={**self.env, **(env or {})}, preload=preload,
                    log_path=self.logs / f"beat-{self.n}.log")
        self.procs.append(proc)
        return proc

    def holder(self) -> tuple[str, int] | None:
        try:
            return self.store.holder(keys.BEAT_LEADER)
        except Exception:
            return None

    def leader(self) -> tuple[Proc, int]:
        got = wait_until(self.holder, TAKEOVER_S * 2, what="a beat leader")
        pid = int(got[0].split(":")[1])
        return next(p for p in self.procs if p.pid == pid), got[1]

    def logs_tail(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-3000:]}" for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            if p.alive():
                p.signal_group(signal.SIGTERM)
        for p in self.procs:
            p.stop(grace_s=3)
        self.store.close()


def _ha_scenario(env: dict[str, str], logs: Path, broker: RedisServer, read_row: Any,
                 proxy: TcpProxy | None) -> int:
    """Runs the scenario; returns the token of the leader that ended it."""
    _admin(env, {"op": "migrate"}, {"op": "interval", "name": "tick", "every": 1},
           {"op": "interval", "name": "gone", "every": 1})
    beats = Beats(env, logs)
    published = Published(broker)
    try:
        beats.spawn()
        beats.spawn()
        leader, token = beats.leader()
        published.wait("tick", 3, timeout_s=30)
        assert {r["token"] for r in published.all()} == {token}, beats.logs_tail()

        # An admin edit: a row added, a row disabled.
        _admin(env, {"op": "interval", "name": "added", "every": 1},
               {"op": "set", "name": "gone", "fields": {"enabled": False}})
        published.wait("added", 2, timeout_s=EDIT_S)
        gone_then = len(published.of("gone"))
        published.wait("added", 3, timeout_s=10)
        assert len(published.of("gone")) <= gone_then + 1, "a disabled row kept running"

        # The leader writes the runs back (the admin shows them).
        wait_until(lambda: read_row("tick")[1] >= 3, 10, what="tick's runs written back")

        # kill -9 of the leader: the standby, which read the rows itself, takes over.
        leader.kill9()
        got = wait_until(lambda: (h := beats.holder()) and h[1] > token and h, TAKEOVER_S,
                         interval_s=0.05, what="a new leader")
        new_token = got[1]
        published.wait("added", 3, timeout_s=15)
        assert any(r["token"] == new_token for r in published.of("added"))
        before = read_row("tick")
        wait_until(lambda: read_row("tick")[1] > before[1], 10,
                   what="the new leader writes back")

        if proxy is not None:
            # The database cut at the ticks: the last good rows keep running, nothing is
            # written back until it is back, then the write-back catches up.
            def skips() -> dict[str, Any]:
                return {n: SkipLog.from_record(beats.store.get(keys.beat_skips(n))).totals
                        for n in ("tick", "added")}

            skipped_before = skips()
            proxy.refuse()
            cut_at = datetime.now(UTC)
            published.wait("tick", 4, timeout_s=15)
            published.wait("added", 2, timeout_s=10)
            (new_leader,) = [p for p in beats.procs if p.alive() and p.pid != leader.pid][:1]
            wait_until(lambda: "django-celery-beat rows not read" in new_leader.log(), 10,
                       what="the beat reports the database down")
            proxy.passthrough()
            wait_until(lambda: (r := read_row("tick"))[0] is not None and r[0] > cut_at, 15,
                       what="the write-back catches up after the outage")
            assert skips() == skipped_before, "the outage wrote slots off as skipped"
        counts = published.check_once()
        assert counts["tick"] >= 7 and counts["added"] >= 5, counts
        return int(new_token)
    finally:
        beats.stop()


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


def _env(broker: RedisServer, db_url: str) -> dict[str, str]:
    return {"CRAWL_DJ_DB": db_url, "CRAWL_DJ_BROKER": broker.url_db(0),
            "CRAWL_DJ_LEASE": broker.url_db(1), "CRAWL_DJ_NS": f"dj-{uuid.uuid4().hex[:6]}"}


def test_two_replicas_on_postgresql(pg_database: str, broker: RedisServer,
                                    tmp_path: Path) -> None:
    psycopg = pytest.importorskip("psycopg")
    with TcpProxy("127.0.0.1", 5432) as proxy:
        env = _env(broker, f"postgresql://postgres@127.0.0.1:{proxy.port}/{pg_database}")
        reader = psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={pg_database}",
                                 autocommit=True, connect_timeout=5)

        def read_row(name: str) -> tuple[Any, int]:
            got = reader.execute("SELECT last_run_at, total_run_count FROM "
                                 "django_celery_beat_periodictask WHERE name = %s",
                                 [name]).fetchone()
            assert got is not None
            return got[0], int(got[1])

        try:
            token = _ha_scenario(env, tmp_path, broker, read_row, proxy)
            fence = reader.execute("SELECT namespace, token FROM celery_crawl_beat_fence")
            assert fence.fetchall() == [(env["CRAWL_DJ_NS"], token)]
        finally:
            reader.close()


def test_two_replicas_on_sqlite(broker: RedisServer, tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "db.sqlite3"
    env = _env(broker, f"sqlite:///{path}")

    def read_row(name: str) -> tuple[Any, int]:
        with sqlite3.connect(path, timeout=5) as db:
            got = db.execute("SELECT last_run_at, total_run_count FROM "
                             "django_celery_beat_periodictask WHERE name = ?", [name]).fetchone()
        assert got is not None
        when = datetime.fromisoformat(got[0]).replace(tzinfo=UTC) if got[0] else None
        return when, int(got[1])

    _ha_scenario(env, tmp_path, broker, read_row, None)


# -- DST nights ----------------------------------------------------------------------------------

#: (zone, the UTC instant its clocks jump forward in 2026): 02:30 local does not exist then.
NIGHTS = {"America/New_York": datetime(2026, 3, 8, 7, 0, tzinfo=UTC),
          "Europe/Berlin": datetime(2026, 3, 29, 1, 0, tzinfo=UTC)}
#: how long before the jump the faked clocks start: a beat's start and promotion fit in it
LEAD_S = 12


def _drain(broker_url: str, queue: str, seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Take the messages waiting in ``queue`` (RabbitMQ) into ``seen``; returns ``seen``."""
    from kombu import Connection

    with Connection(broker_url, connect_timeout=5) as conn:
        q = conn.SimpleQueue(queue)
        try:
            while True:
                try:
                    msg = q.get(block=False)
                except q.Empty:
                    break
                seen.append({"entry": msg.headers.get("crawl_entry"),
                             "slot": msg.headers.get("crawl_slot"), "id": msg.headers["id"],
                             "row": msg.headers.get("periodic_task_name")})
                msg.ack()
        finally:
            q.close()
    return seen


@pytest.fixture
def rabbit_vhost() -> Iterator[str]:
    vhost = make_rabbit_vhost()
    if vhost is None:
        missing_tool("RabbitMQ (rabbitmqctl) is not available")
    try:
        yield vhost
    finally:
        delete_rabbit_vhost(vhost)


def test_a_dst_night_in_new_york_and_in_berlin_runs_each_slot_once(
        tmp_path: Path, rabbit_vhost: str) -> None:
    """A row at 02:30 on the night 02:00 jumps to 03:00, in each zone: one run, at the jump.
    Stock django-celery-beat (its ``DatabaseScheduler``) on the same New York night, from the
    same faked clock, runs a row every minute at the jump and the 02:30 row not at all.

    The beat's wall clock is libfaketime's; its reference clock must move with it, so the
    lease store is etcd (no clock of its own) and the broker RabbitMQ (not a Redis the guard
    would read): the clock guard is then off, and the faked clock is the beat's "now".
    """
    lib = faketime_lib()
    if lib is None:
        missing_tool("libfaketime not installed (apt-get install faketime)")
    if etcd_binary() is None:
        missing_tool("etcd not installed")
    broker_url = f"amqp://guest:guest@127.0.0.1:5672/{rabbit_vhost}"
    etcd = EtcdServer().start()
    started: list[tuple[str, Beats, str]] = []
    runs = [("America/New_York", "leased"), ("Europe/Berlin", "leased"),
            ("America/New_York", "stock")]
    try:
        for zone, kind in runs:  # each night on its own clock, all at once
            jump = NIGHTS[zone]
            offset = int((jump - datetime.now(UTC)).total_seconds()) - LEAD_S
            fake = {"FAKETIME": f"{offset:+d}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
            tag = f"{kind}-{zone.replace('/', '-')}"
            env = {"CRAWL_DJ_DB": f"sqlite:///{tmp_path / tag}.sqlite3",
                   "CRAWL_DJ_BROKER": broker_url, "CRAWL_DJ_BACKEND": "",
                   "CRAWL_DJ_QUEUE": f"q-{tag}", "CRAWL_DJ_LEASE": etcd.url,
                   "CRAWL_DJ_NS": f"dst-{tag}-{uuid.uuid4().hex[:4]}"}
            ops: list[dict[str, Any]] = [
                {"op": "migrate"},
                {"op": "crontab", "name": "at-0230", "minute": "30", "hour": "2", "tz": zone}]
            if kind == "stock":
                env["CRAWL_DJ_SCHEDULER"] = "stock"
                ops.append({"op": "crontab", "name": "every-min", "minute": "*", "hour": "*",
                            "tz": zone})
                # its rows' date_changed starts its schedule: made on the same faked clock
                _admin({**env, **fake, "LD_PRELOAD": lib}, *ops)
            else:
                _admin(env, *ops)
            logs = tmp_path / tag
            logs.mkdir()
            beats = Beats(env, logs)
            started.append((tag, beats, f"q-{tag}"))
            beats.spawn(env=fake, preload=lib)
        seen: dict[str, list[dict[str, Any]]] = {tag: [] for tag, _, _ in started}
        for tag, _beats, queue in started:
            row = "every-min" if tag.startswith("stock") else "at-0230"
            wait_until(lambda t=tag, q=queue, r=row: any(  # type: ignore[misc]
                m["row"] == r for m in _drain(broker_url, q, seen[t])),
                LEAD_S + 70, interval_s=0.2, what=f"the run at the jump ({tag})")
        for (zone, kind), (tag, beats, queue) in zip(runs, started, strict=True):
            at_0230 = [m for m in _drain(broker_url, queue, seen[tag]) if m["row"] == "at-0230"]
            if kind == "stock":
                # its every-minute row ran at the jump; the 02:30 row did not, and will not
                # before the next day
                assert at_0230 == [], (tag, at_0230)
                continue
            # Once, with the jump as its slot (the first real instant after the skipped 02:30);
            # its next slot is a day later, so nothing else can come now.
            assert [m["slot"] for m in at_0230] == [f"{NIGHTS[zone]:%Y-%m-%dT%H:%M:%SZ}"], \
                (tag, at_0230, beats.logs_tail())
    finally:
        for _tag, beats, _queue in started:
            beats.stop()
        etcd.cleanup()
