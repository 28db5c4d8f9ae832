"""The recent events the status page shows: a ring of the last ``RECENT_EVENTS`` events of
the agent's fan-out (agent/events.py), served as ``/v1/events`` (schema in agent/status.py).

Rules:
- The ring is a subscriber like ``swimctl monitor``: it never holds the node task back.
  When it falls behind (a burst larger than its subscription queue arrives before it runs)
  the fan-out cuts it off; it counts that in ``missed``, waits ``RESUBSCRIBE_PAUSE_S`` and
  subscribes again, so a gap is visible instead of silent.
- Each event is kept as the ``monitor`` schema has it, plus ``seq`` (increasing, so the
  page can tell new events from old) and ``time_ms`` (wall clock when the ring got it: the
  events' own ``at_ms`` is the agent's monotonic clock). A user event's payload is
  replaced by its length (``payload_bytes``): payloads are opaque bytes of any size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["RECENT_EVENTS", "RESUBSCRIBE_PAUSE_S", "RecentEvents"]

RECENT_EVENTS = 200
"""Events kept: a few minutes of churn on a large cluster, ~40 KB of JSON per poll."""
RESUBSCRIBE_PAUSE_S = 0.1
"""Pause after being cut off before subscribing again: bounds the retries per second."""

Subscribe = Callable[[], trio.MemoryReceiveChannel[dict[str, Any]]]


class RecentEvents:
    """A bounded ring of recent events, fed by ``follow``."""

    def __init__(self, capacity: int = RECENT_EVENTS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = 0
        self.missed = 0
        """Times the ring was cut off from the fan-out (events were lost)."""

    def add(self, event: dict[str, Any], wall_ms: int) -> None:
        kept: dict[str, Any] = {}
        for key, value in event.items():
            if isinstance(value, bytes | bytearray):
                kept[f"{key}_bytes"] = len(value)
            else:
                kept[str(key)] = value
        self._seq += 1
        kept["seq"] = self._seq
        kept["time_ms"] = wall_ms
        self._ring.append(kept)

    def as_json(self) -> dict[str, Any]:
        return {"capacity": self._ring.maxlen, "missed": self.missed, "events": list(self._ring)}

    async def follow(
        self,
        subscribe: Subscribe,
        wall_ms: Callable[[], int],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Add every event the agent publishes until cancelled (subscribed once started)."""
        channel = subscribe()
        task_status.started()
        while True:
            async with channel:
                async for event in channel:
                    self.add(event, wall_ms())
            self.missed += 1  # cut off for falling behind (or the agent is stopping)
            await trio.sleep(RESUBSCRIBE_PAUSE_S)
            channel = subscribe()
