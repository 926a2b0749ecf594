"""One pass over every ``LeaseStore`` operation, with light checks of the results.

Run under a least-privilege account it shows the plugins need no more than that account has;
run under a full account while the server counts commands it finds the commands they use.
"""

from __future__ import annotations

import uuid
from typing import Any

TTL_S = 10.0  # above etcd's 2 s floor; long enough for a loaded machine


def exercise_store(store: Any) -> None:
    """Call every operation of the lease-store contract once (and the Redis extras beat uses).

    Raises:
        AssertionError: when an operation does not behave as the contract says.
    """
    tag = uuid.uuid4().hex[:8]
    a, b = f"sec-a-{tag}", f"sec-b-{tag}"
    lease = store.acquire(a, TTL_S, f"host:1:{tag}")
    assert lease is not None, "acquire of a free lease returned None"
    assert store.acquire(a, TTL_S, f"other:2:{tag}") is None
    lease = store.renew(lease)
    assert store.holder(a) == (lease.holder, lease.token)
    left = store.lease_ttl_left(a)
    assert left is not None and left > 0
    other = store.acquire(b, TTL_S, f"host:3:{tag}")
    assert other is not None and other.token > lease.token

    token = store.claim(lease, f"task:{tag}", {"queue": "crawl", "deliveries": 1})
    assert token is not None
    assert store.claim(other, f"task:{tag}", {"queue": "crawl"}) is None
    many = store.claim_many(lease, [(f"task:{tag}-{i}", {"i": i}) for i in range(3)])
    assert all(t is not None for t in many)
    claim = store.claimant(f"task:{tag}")
    assert claim is not None and claim.alive and claim.token == token
    assert len(store.claims_of(a)) == 4
    assert store.unclaim(lease, f"task:{tag}-0")

    store.put(f"beat/entry/{tag}", {"slot": "2026-01-01T00:00:00Z", "runs": 1}, lease=lease)
    store.put_many([(f"beat/presence/{tag}-{i}", {"i": i}) for i in range(2)], ttl_s=TTL_S)
    assert store.get(f"beat/entry/{tag}") == {"slot": "2026-01-01T00:00:00Z", "runs": 1}
    assert store.get_many([f"beat/presence/{tag}-0", f"missing/{tag}"])[1] is None
    assert len(store.scan(f"beat/presence/{tag}-")) == 2
    assert store.delete(f"beat/presence/{tag}-1")
    assert store.delete(f"beat/entry/{tag}", lease=lease)

    store.push(f"beat/commands/{tag}", {"op": "pause", "entry": "x"})
    assert store.pop_all(f"beat/commands/{tag}", lease=lease) == [{"op": "pause", "entry": "x"}]

    store.server_time()
    assert store.ping() >= 0
    assert store.watch_free(b, 0.3) is False
    store.release(other)
    assert store.watch_free(b, 2.0) is True

    # Orphan the remaining claims and reap them, as the reaper does.
    store.release(lease)
    orphans = [c for c in store.orphaned_claims() if c.lease_name == a]
    assert len(orphans) == 3, orphans
    assert all(store.drop_claim(c) for c in orphans)

    for extra in ("eviction_risk", "persistence"):  # read by the beat before it leads
        if hasattr(store, extra):
            getattr(store, extra)()
