"""The world's event queue: a calendar of virtual milliseconds.

Rules: a heap of the distinct integer milliseconds that have events, and per millisecond
a list of plain tuples ``(kind, node, a, b)`` in the order they were scheduled. With
thousands of nodes most milliseconds hold many events, so a push is a list append and the
heap stays small; the order is exactly that of a heap on (time, sequence number). The
world's loop reads ``times`` and ``buckets`` directly (its hot path), appends to a bucket
while it works through it (zero-delay events) and calls ``done`` when a millisecond is
finished.
"""

from __future__ import annotations

import heapq
from typing import Any

Event = tuple[int, int, Any, Any]
"""``(kind, node number, a, b)``: what ``a`` and ``b`` hold depends on the kind."""


class Calendar:
    def __init__(self) -> None:
        self.times: list[int] = []
        """Heap of the distinct virtual times that have events."""
        self.buckets: dict[int, list[Event]] = {}
        """Events per time, in the order they were scheduled."""

    def push(self, t_ms: int, event: Event) -> None:
        bucket = self.buckets.get(t_ms)
        if bucket is None:
            self.buckets[t_ms] = [event]
            heapq.heappush(self.times, t_ms)
        else:
            bucket.append(event)

    def done(self, t_ms: int) -> None:
        """Every event of ``t_ms`` (the earliest time) was handled."""
        heapq.heappop(self.times)
        del self.buckets[t_ms]

    def pending(self) -> int:
        return sum(len(b) for b in self.buckets.values())


__all__ = ["Calendar", "Event"]
