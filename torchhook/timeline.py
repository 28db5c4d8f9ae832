"""Where a re-formation's time goes: wall-clock marks from leaving a group to the first
step that completes in the next one, for measurements (bench/torch_recovery.py reads them
from the examples' step logs).

Rules: a re-formation opens at the first ``open`` after a completed step (the group was
left: a verdict, a failed collective, a planned switch) and closes at the next completed
step; marks in between keep the first time each name was reached (a retried formation
shows when its first try got there) and are bounded by ``MAX_MARKS``. Outside a
re-formation ``mark`` does nothing, so the strategies may mark every step for free.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["MAX_MARKS", "Timeline"]

MAX_MARKS = 32
"""Names kept per re-formation: the engine and a strategy mark about a dozen; a bound so
that a loop marking by mistake cannot grow the record."""


class Timeline:
    """The marks of the re-formation in progress and of the last one that completed."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._marks: dict[str, float] | None = None
        self.last: dict[str, float] = {}
        """Name → wall-clock time of the last completed re-formation (``open`` first,
        ``step`` last); empty before the first one."""

    def open(self, name: str) -> None:
        """The group was left (``name`` says how); a no-op inside a re-formation."""
        if self._marks is None:
            self._marks = {name: self._clock()}

    def mark(self, name: str) -> None:
        marks = self._marks
        if marks is not None and name not in marks and len(marks) < MAX_MARKS:
            marks[name] = self._clock()

    def close(self) -> None:
        """A step completed: the re-formation (if one was open) ends here."""
        if self._marks is not None:
            self.mark("step")
            self.last, self._marks = self._marks, None
