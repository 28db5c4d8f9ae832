"""The node task's timers: a heap of what the Node asked for, minus what it forgot, with
idle gossip ticks held back (the rules are agent/driver.py's, which owns the one instance).

Rules:
- A timer the Node has forgotten (``Output.cancelled_timers``, e.g. an acked probe's
  timeout) is dropped when it reaches the top of the heap, never handed back.
- A gossip tick (``Output.gossip_timers``) that comes due while nothing is queued for
  gossip would only ask for the next tick: it is held back, and once something is queued
  it goes back on the heap at its next multiple of ``gossip_interval_ms`` from now.
- The set of forgotten ids stays bounded by the heap: ids of timers that were never pushed
  (forgotten within the same Output) are dropped when the set outgrows the heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from swim import Output, Timer

_Entry = tuple[int, int, Timer]


class TimerHeap:
    """Deadline-ordered timers of one Node (used only in its node task)."""

    def __init__(self, gossip_interval_ms: int) -> None:
        self._heap: list[_Entry] = []
        self._cancelled: set[int] = set()
        """Ids of timers in the heap the Node has forgotten: dropped when they come up."""
        self._gossip_ids: set[int] = set()
        """Ids of the gossip ticks in the heap (or held back)."""
        self._held: _Entry | None = None
        """A gossip tick held back while nothing is queued (its deadline, id, timer)."""
        self._gossip_interval_ms = max(gossip_interval_ms, 1)

    def add(self, out: Output) -> None:
        """The timers an Output asks for, and the ones it forgets or marks as gossip ticks."""
        heap = self._heap
        for timer in out.timers:
            heapq.heappush(heap, (timer.deadline_ms, timer.timer_id, timer))
        if out.gossip_timers:
            self._gossip_ids.update(out.gossip_timers)
        if out.cancelled_timers:
            self._cancelled.update(out.cancelled_timers)
            if len(self._cancelled) > len(heap) + 1:  # ids of timers never pushed: forget
                self._cancelled.intersection_update(entry[1] for entry in heap)

    def next_deadline_ms(self) -> int | None:
        """The earliest deadline on the heap (a held gossip tick is not on it)."""
        return self._heap[0][0] if self._heap else None

    def settle(self, queued: int, now: Callable[[], int]) -> None:
        """Drop forgotten timers from the top, hold back an idle gossip tick there, and put
        a held one back once something is ``queued`` for gossip."""
        heap = self._heap
        cancelled = self._cancelled
        while heap:
            timer_id = heap[0][1]
            if timer_id in cancelled:
                heapq.heappop(heap)
                cancelled.discard(timer_id)
            elif timer_id in self._gossip_ids and self._held is None and not queued:
                self._held = heapq.heappop(heap)
            else:
                break
        held = self._held
        if held is not None and queued:
            self._held = None
            deadline, timer_id, timer = held
            now_ms = now()
            if deadline < now_ms:  # its next multiple of the interval from now on
                interval = self._gossip_interval_ms
                deadline += -(-(now_ms - deadline) // interval) * interval
            heapq.heappush(heap, (deadline, timer_id, timer))

    def due(self, now_ms: int, queued: Callable[[], int]) -> Iterator[Timer]:
        """The timers due at ``now_ms`` to hand to the Node, one at a time (handing one over
        may queue gossip or add timers, so ``queued`` is asked again for each tick)."""
        heap = self._heap
        cancelled = self._cancelled
        gossip = self._gossip_ids
        while heap and heap[0][0] <= now_ms:
            entry = heapq.heappop(heap)
            timer_id = entry[1]
            if timer_id in cancelled:
                cancelled.discard(timer_id)
                continue
            if timer_id in gossip:
                if self._held is None and not queued():
                    self._held = entry
                    continue
                gossip.discard(timer_id)
            yield entry[2]
