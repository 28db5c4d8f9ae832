"""Per-node runtime context shared by the membership table, the prober and the node.

Rules: one ``Context`` per node; it holds the output of the call in progress, the current
``now_ms``, the live timers and the counters. Timers are identified by a number; a timer
is live while its number is registered, so "cancelling" is forgetting the number and a
stale timer handed back later is recognised and ignored (DESIGN.md: timers are values,
never cancelled by the driver).
"""

from __future__ import annotations

import random
from typing import Any

from swim.config import Config
from swim.effects import (
    EventKind,
    Member,
    MemberEvent,
    NodeStats,
    Notice,
    Output,
    Timer,
)
from swim.queue import BroadcastQueue
from swim.rtt import RttTable
from swim.wire import DropReason


class Context:
    def __init__(self, config: Config, rng: random.Random, now_ms: int) -> None:
        self.config = config
        self.rng = rng
        self.now_ms = now_ms
        self.out = Output()
        self.stats = NodeStats()
        self.broadcasts = BroadcastQueue(config.retransmit_mult, config.max_broadcast_queue)
        self.user_broadcasts = BroadcastQueue(config.retransmit_mult, config.max_broadcast_queue)
        self.rtt = RttTable(config)
        self._timers: dict[int, tuple[str, Any]] = {}
        self._next_timer_id = 0

    def begin(self, now_ms: int) -> None:
        """Start handling one input: fresh output, time never runs backwards."""
        if now_ms > self.now_ms:
            self.now_ms = now_ms
        self.out = Output()

    def finish(self) -> Output:
        """The output of the call in progress; the next ``begin`` starts a fresh one."""
        return self.out

    def set_timer(self, kind: str, delay_ms: int, data: Any = None) -> int:
        self._next_timer_id += 1
        timer_id = self._next_timer_id
        self._timers[timer_id] = (kind, data)
        self.out.timers.append(Timer(self.now_ms + max(delay_ms, 0), timer_id, kind))
        return timer_id

    def cancel_timer(self, timer_id: int | None) -> None:
        if timer_id is not None:
            self._timers.pop(timer_id, None)

    def take_timer(self, timer: Timer) -> tuple[str, Any] | None:
        """The timer's kind and data if it is still live (and forget it), else None."""
        entry = self._timers.get(timer.timer_id)
        if entry is None or entry[0] != timer.kind:
            return None
        del self._timers[timer.timer_id]
        return entry

    @property
    def live_timers(self) -> int:
        return len(self._timers)

    def event(self, kind: EventKind, member: Member) -> None:
        self.out.events.append(MemberEvent(kind, member, self.now_ms))

    def notice(self, level: str, kind: str, message: str) -> None:
        self.out.notices.append(Notice(level, kind, message))

    def drop(self, reason: DropReason, count: int = 1) -> None:
        self.stats.dropped[reason.value] += count
