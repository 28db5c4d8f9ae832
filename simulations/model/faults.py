"""Slow members (Lifeguard, arXiv 1707.00788 §V: CPU exhaustion): how a slow process
handles its inputs.

Rules:
- Every datagram or stream to a slow node waits for the previous ones to finish, plus
  ``delay_ms`` of service time; timers fire ``timer_delay_ms`` late without waiting behind
  the queue; nothing is handled during a pause (a GC or SIGSTOP stop).
- Inputs queue up and are handled late (with the late time as ``now_ms``); datagrams
  beyond ``queue_limit`` queued ones are dropped (memberlist ``HandoffQueueDepth``, 1024:
  https://github.com/hashicorp/memberlist/blob/master/config.go).
- The world asks ``SlowState.admit`` for every input of a slow node and schedules it at the
  time it returns; crashes, partitions and loss are the world's and the network's
  (``simulations.model.world``, ``simulations.model.network``).
"""

from __future__ import annotations

from dataclasses import dataclass

NOW = -1
"""``SlowState.admit``: handle the input at once."""
DROP = -2
"""``SlowState.admit``: the queue is full, the datagram is dropped."""


@dataclass(slots=True)
class SlowSpec:
    """How a slow member processes its inputs."""

    delay_ms: int = 0
    """Service time per input: each input finishes this long after the previous one."""
    pauses: tuple[tuple[int, int], ...] = ()
    """Virtual-time intervals [start, end) during which the process is stopped."""
    queue_limit: int = 1024
    """Datagrams beyond this many queued inputs are dropped."""
    timer_delay_ms: int = 0
    """Timers fire this late (and after any pause), without waiting behind queued packets:
    a starved process still runs its timer goroutine while its receive path lags, which is
    how a slow member comes to miss acks and accuse healthy peers (Lifeguard §III)."""


@dataclass(slots=True)
class SlowState:
    """A slow member's queue: when its receive path is free again, how much is queued."""

    spec: SlowSpec
    free_at_ms: int = 0
    queued: int = 0
    dropped: int = 0

    def admit(self, t_ms: int, *, timer: bool, datagram: bool) -> int:
        """When an input arriving at ``t_ms`` is handled: ``NOW``, ``DROP`` (a datagram
        beyond the queue limit) or the later time it is due (then it is queued, except a
        timer, which does not wait behind the queue)."""
        spec = self.spec
        start = t_ms if timer else max(t_ms, self.free_at_ms)
        for p_start, p_end in spec.pauses:
            if p_start <= start < p_end:
                start = p_end
        done = start + (spec.timer_delay_ms if timer else spec.delay_ms)
        if done <= t_ms:
            return NOW
        if timer:
            return done
        if datagram and self.queued >= spec.queue_limit:
            self.dropped += 1
            return DROP
        self.free_at_ms = done
        self.queued += 1
        return done


__all__ = ["DROP", "NOW", "SlowSpec", "SlowState"]
