"""Per-domain politeness shared by every worker: a token bucket and an in-flight cap in Redis.

Why in Redis and in one script: the rate a site sees is the sum over all workers and all their
pool processes, so the bucket must be shared; and "take a concurrency slot" and "take a token"
must happen together, or a worker could burn a token while no slot is free (or hold a slot while
it waits for a token). The script reads the server's ``TIME``, so workers' clocks do not matter.

In-flight slots are scored with their expiry: a worker killed mid-fetch frees its slot after
``slot_ttl_s`` without anyone cleaning up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import redis

from celery_crawl.errors import CrawlError, StoreTimeout, StoreUnavailable

__all__ = ["Politeness", "PolitenessBusy", "Slot", "domain_of"]

# KEYS[1] bucket hash {tokens, ts}; KEYS[2] in-flight zset {holder -> expiry ms}
# ARGV: rate per s, burst, concurrency cap (0 = none), holder, slot ttl ms
# Returns {1, 0, "ok"} or {0, wait_ms, reason}.
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local ttl = tonumber(ARGV[5])
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= cap then
    local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    local wait = math.min(250, math.max(10, tonumber(first[2]) - now))
    return {0, wait, 'concurrency'}
  end
end
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1])
local ts = tonumber(b[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate / 1000)
local keep = math.ceil(burst * 1000 / rate) + 1000
if tokens < 1 then
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], keep)
  return {0, math.max(1, math.ceil((1 - tokens) * 1000 / rate)), 'rate'}
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', now)
redis.call('PEXPIRE', KEYS[1], keep)
if cap > 0 then
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ttl + 1000)
end
return {1, 0, 'ok'}
"""


class PolitenessBusy(CrawlError):
    """No token or slot became free within the caller's budget.

    Attributes:
        domain: the domain waited for.
        reason: ``rate`` or ``concurrency``.
        wait_s: the server's last estimate of the wait.
    """

    def __init__(self, domain: str, reason: str, wait_s: float) -> None:
        self.domain = domain
        self.reason = reason
        self.wait_s = wait_s
        super().__init__(f"{domain}: politeness {reason} limit, next chance in {wait_s:.2f}s")


@dataclasses.dataclass(frozen=True)
class Slot:
    """A granted fetch permission; release it when the fetch ends."""

    domain: str
    holder: str
    waited_s: float


def domain_of(url: str) -> str:
    """The politeness domain of ``url``: its lower-cased host and explicit port."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return f"{host}:{parts.port}" if parts.port else host


class Politeness:
    """The shared limiter. One instance per process (it holds a Redis connection pool).

    Args:
        client: a redis-py client for the politeness Redis (socket timeouts set).
        namespace: key prefix shared by every worker of the fleet.
        rate_per_s: fetches per second per domain.
        burst: bucket capacity.
        concurrency: in-flight fetches per domain (0: no cap).
        slot_ttl_s: how long a slot outlives a worker that never released it.
    """

    def __init__(self, client: redis.Redis, *, namespace: str, rate_per_s: float, burst: int,
                 concurrency: int, slot_ttl_s: float) -> None:
        self.client = client
        self.namespace = namespace
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.concurrency = concurrency
        self.slot_ttl_s = slot_ttl_s
        self.pid = os.getpid()
        self._script = client.register_script(_ACQUIRE_LUA)

    def _keys(self, domain: str) -> list[str]:
        base = f"{self.namespace}:politeness:{domain}"
        return [f"{base}:bucket", f"{base}:inflight"]

    def try_acquire(self, domain: str, holder: str) -> tuple[bool, float, str]:
        """One attempt: ``(granted, wait_s, reason)``.

        Raises:
            StoreUnavailable, StoreTimeout: the politeness Redis failed.
        """
        args: list[Any] = [self.rate_per_s, self.burst, self.concurrency, holder,
                           int(self.slot_ttl_s * 1000)]
        try:
            granted, wait_ms, reason = self._script(keys=self._keys(domain), args=args)
        except redis.TimeoutError as exc:
            raise StoreTimeout(f"politeness redis: {exc}") from exc
        except redis.RedisError as exc:
            raise StoreUnavailable(f"politeness redis: {exc}") from exc
        reason = reason.decode() if isinstance(reason, bytes) else str(reason)
        return bool(granted), int(wait_ms) / 1000.0, reason

    def acquire(self, domain: str, *, budget_s: float) -> Slot:
        """Wait (sleeping as the server advises) for a token and a slot.

        Raises:
            PolitenessBusy: not granted within ``budget_s``; the caller re-queues the fetch.
        """
        holder = uuid.uuid4().hex
        started = time.monotonic()
        while True:
            granted, wait_s, reason = self.try_acquire(domain, holder)
            if granted:
                return Slot(domain, holder, time.monotonic() - started)
            left = budget_s - (time.monotonic() - started)
            if wait_s > left:
                raise PolitenessBusy(domain, reason, wait_s)
            time.sleep(wait_s)

    def release(self, slot: Slot) -> None:
        """Give the in-flight slot back (best effort: it expires by itself anyway)."""
        if self.concurrency <= 0:
            return
        with contextlib.suppress(redis.RedisError):
            self.client.zrem(self._keys(slot.domain)[1], slot.holder)

    @contextlib.contextmanager
    def slot(self, domain: str, *, budget_s: float) -> Iterator[Slot]:
        """``acquire`` ... ``release`` as a context manager."""
        granted = self.acquire(domain, budget_s=budget_s)
        try:
            yield granted
        finally:
            self.release(granted)
