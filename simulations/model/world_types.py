"""Value types of the simulated world: slow-member specs, per-node traffic counters, and
the listener protocols that the invariant checker and the metrics implement.

Rules: plain slotted dataclasses and lists indexed by node number, so the event loop's
per-packet bookkeeping is a list increment (see ``simulations.model.world``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from swim import MemberEvent, Node


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


__all__ = ["InputChecker", "Listener", "SlowSpec", "SlowState", "Traffic"]
