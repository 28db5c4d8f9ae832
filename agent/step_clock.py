"""When a local rank last made progress, and how long its steps take.

A rank heartbeats once per step with the step number, and also while it waits on a
collective (so that its agent does not flag it hung: torchhook's engine), with the same
number. So progress is a heartbeat with a *new* step, and a step's length is the time
between two of them. agent/stall_evidence.py reads both: a job whose ranks made no progress
for a few steps is stalled. Pure; times are the agent's clock in ms.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["STEP_WINDOW", "StepClock"]

STEP_WINDOW = 32
"""Step lengths kept: the median of the last 32 follows a job whose steps change length
(a new phase, a new batch size) within a few dozen steps, and a fault's stall, one long
step among them, does not move it."""


@dataclass
class StepClock:
    """One rank's progress: the last step number, since when, and recent step lengths."""

    step: int | None = None
    since_ms: int | None = None
    """When ``step`` was first reported."""
    _lengths_ms: deque[int] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))

    def beat(self, step: int, now_ms: int) -> None:
        """A heartbeat that carries ``step``."""
        if step == self.step:
            return
        if self.since_ms is not None and now_ms >= self.since_ms:
            self._lengths_ms.append(now_ms - self.since_ms)
        self.step, self.since_ms = step, now_ms

    def median_step_ms(self) -> float | None:
        """The median of the recent step lengths; None before two steps."""
        return statistics.median(self._lengths_ms) if self._lengths_ms else None
