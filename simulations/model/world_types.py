"""Value types of the simulated world: per-node traffic counters, and the listener
protocols that the invariant checker and the metrics implement.

Rules: plain slotted dataclasses and lists indexed by node number, so the event loop's
per-packet bookkeeping is a list increment (see ``simulations.model.world``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from swim import MemberEvent, Node

K_PACKET = 0
K_TIMER = 1
K_SERVE = 2
K_RESULT = 3
K_CALL = 4
LATE = 8
"""Added to a kind: a slow node's queued input, now due (never deferred again)."""


class Listener(Protocol):
    def on_event(self, idx: int, event: MemberEvent) -> None: ...

    def on_lifecycle(self, kind: str, idx: int) -> None: ...


class InputChecker(Protocol):
    def after_input(self, idx: int, node: Node) -> None: ...


@dataclass(slots=True)
class Traffic:
    """Per-node counters, indexed by node number (lists, for speed)."""

    pkts_out: list[int] = field(default_factory=list)
    bytes_out: list[int] = field(default_factory=list)
    pkts_in: list[int] = field(default_factory=list)
    bytes_in: list[int] = field(default_factory=list)
    streams_out: list[int] = field(default_factory=list)
    stream_bytes_out: list[int] = field(default_factory=list)
    streams_in: list[int] = field(default_factory=list)
    stream_bytes_in: list[int] = field(default_factory=list)

    def grow(self) -> None:
        for counters in self.columns().values():
            counters.append(0)

    def columns(self) -> dict[str, list[int]]:
        return {
            "pkts_out": self.pkts_out,
            "bytes_out": self.bytes_out,
            "pkts_in": self.pkts_in,
            "bytes_in": self.bytes_in,
            "streams_out": self.streams_out,
            "stream_bytes_out": self.stream_bytes_out,
            "streams_in": self.streams_in,
            "stream_bytes_in": self.stream_bytes_in,
        }

    def snapshot(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self.columns().items()}


__all__ = [
    "K_CALL",
    "K_PACKET",
    "K_RESULT",
    "K_SERVE",
    "K_TIMER",
    "LATE",
    "InputChecker",
    "Listener",
    "Traffic",
]
