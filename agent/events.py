"""The agent's events fan-out: membership events, user events and log notices to every
subscriber (the control API's ``monitor``), and a "something changed" signal (the job
``watch`` recomputes its view on it).

Rules:
- Publishing never blocks the node task: each subscriber has a bounded queue
  (``DEFAULT_DEPTH`` events); a subscriber whose queue is full is cut off (its channel is
  closed, so its reader sees the end of the stream) rather than holding memory or the
  publisher back. Serf's ``monitor`` drops a slow client the same way.
- ``changed`` is a fresh ``trio.Event`` per change: take it *before* reading state, then
  wait on it, and no change between the read and the wait is lost.
- Event dicts follow the ``monitor`` schema in agent/control.py; this module does not
  build them, it only delivers them.
"""

from __future__ import annotations

from typing import Any

import trio

DEFAULT_DEPTH = 256
"""Events queued per subscriber before it counts as too slow and is cut off."""

Event = dict[str, Any]


class Events:
    """Subscribe/publish with bounded queues, plus the change notification."""

    def __init__(self) -> None:
        self._subscribers: list[trio.MemorySendChannel[Event]] = []
        self._changed = trio.Event()

    def subscribe(self, depth: int = DEFAULT_DEPTH) -> trio.MemoryReceiveChannel[Event]:
        send, receive = trio.open_memory_channel[Event](depth)
        self._subscribers.append(send)
        return receive

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, event: Event) -> None:
        keep = []
        for subscriber in self._subscribers:
            try:
                subscriber.send_nowait(event)
                keep.append(subscriber)
            except trio.WouldBlock:
                subscriber.close()  # a subscriber that cannot keep up is cut off, bounded
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self._subscribers = keep

    def notify_changed(self) -> None:
        """Wake everyone waiting on ``changed``: membership or local tags changed."""
        self._changed.set()
        self._changed = trio.Event()

    @property
    def changed(self) -> trio.Event:
        """Set at the next change; take it *before* reading state, then wait on it."""
        return self._changed

    def close(self) -> None:
        """End every subscription (the agent stopped)."""
        for subscriber in self._subscribers:
            subscriber.close()
        self._subscribers = []
