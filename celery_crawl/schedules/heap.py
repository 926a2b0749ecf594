"""``DueHeap``: the next due entry among many, without scanning them all on every tick.

Each entry's next fire instant is cached in a binary heap. Rescheduling or removing an entry
does not search the heap: the old item becomes stale (its sequence number no longer matches the
entry's) and is dropped when it reaches the top, so every operation is O(log n) amortised.
"""

from __future__ import annotations

import heapq
import itertools
from datetime import datetime

__all__ = ["DueHeap"]


class DueHeap:
    """Names keyed by their next due instant; one live instant per name.

    Not thread-safe: the scheduler owns it from one thread.
    """

    __slots__ = ("_counter", "_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple[datetime, int, str]] = []
        self._live: dict[str, tuple[int, datetime]] = {}
        self._counter = itertools.count()

    def push(self, name: str, when: datetime) -> None:
        """Set ``name``'s next due instant (replacing any earlier one)."""
        seq = next(self._counter)
        self._live[name] = (seq, when)
        heapq.heappush(self._heap, (when, seq, name))
        if len(self._heap) > 64 and len(self._heap) > 3 * len(self._live):
            self._compact()

    def remove(self, name: str) -> None:
        """Forget ``name``; its heap item is discarded lazily. Unknown names are ignored."""
        self._live.pop(name, None)

    def _is_live(self, item: tuple[datetime, int, str]) -> bool:
        current = self._live.get(item[2])
        return current is not None and current[0] == item[1]

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)

    def peek(self) -> tuple[str, datetime] | None:
        """The earliest ``(name, when)`` without removing it, or ``None`` when empty."""
        self._drop_stale()
        if not self._heap:
            return None
        when, _, name = self._heap[0]
        return name, when

    def pop_due(self, now: datetime) -> list[tuple[str, datetime]]:
        """Remove and return every ``(name, when)`` with ``when <= now``, earliest first.

        The caller computes each entry's following instant and pushes it back.
        """
        due: list[tuple[str, datetime]] = []
        heap = self._heap
        while True:
            self._drop_stale()
            if not heap or heap[0][0] > now:
                return due
            when, _, name = heapq.heappop(heap)
            del self._live[name]
            due.append((name, when))

    def when(self, name: str) -> datetime | None:
        """The cached instant of ``name``, or ``None``."""
        current = self._live.get(name)
        return None if current is None else current[1]

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if self._is_live(item)]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, name: object) -> bool:
        return name in self._live
