"""Connections of one's own, taken from a redis-py client's pool, for the calls made for every
task (the audited backend's script calls, the lease store's batches).

redis-py's ``execute_command`` and pipeline objects check a connection out of the pool and back
in for every call, with the pool's lock, its bookkeeping and a read that checks for leftover
data: more Python than the call's own packing and parsing. ``Lanes`` keeps a free list of
connections taken from the pool once: each call takes one, so no two calls (or threads) share a
connection at a time, and gives it back. A connection whose call failed other than by an error
reply (read whole: redis-py raises it only after the reply) is disconnected first, so none is
ever left with an unread reply; its next use reconnects (through ``connect``, so a
Sentinel-managed connection finds the current master). A new client (a cluster slot that
moved) or a forked child starts a new list: no connection of another client or of the parent
process is used.
"""

from __future__ import annotations

import os
from typing import Any

from .._celery_compat import pool_connection, redis_socket

__all__ = ["Lanes"]


class Lanes:
    """The free list of connections of one user of a redis-py client."""

    def __init__(self) -> None:
        #: (client, pid, free connections).
        self._free: tuple[Any, int, list[Any]] | None = None

    def take(self, client: Any) -> tuple[Any, list[Any]]:
        """A connection of ``client``'s pool for one call, and the list it goes back to
        (``give``)."""
        pid = os.getpid()
        state = self._free
        if state is None or state[0] is not client or state[1] != pid:
            state = self._free = (client, pid, [])
        free = state[2]
        try:
            conn = free.pop()
        except IndexError:
            return pool_connection(client.connection_pool), free
        if redis_socket(conn) is None:
            # Disconnected after a failed call: connect the way its class does (a Sentinel-managed
            # one asks the sentinels where the master is now), not to the address it had, as a
            # send on a closed connection would.
            conn.connect()
        return conn, free

    @staticmethod
    def give(taken: tuple[Any, list[Any]], *, broken: bool = False) -> None:
        """Give back a connection after its call; ``broken``: the call failed other than by a
        whole error reply (the connection is disconnected first)."""
        conn, free = taken
        if broken:
            conn.disconnect()
        free.append(conn)
