"""The trace hash: a run's fingerprint, equal for equal seeds.

Rules: blake2b (16 bytes) over ``"{time} {observer} {kind} {member} {incarnation}\n"`` of
every membership event in the order the world handled them, then, when read, the
``repr`` of the world's totals (time, packets and bytes out, packets in, streams out,
packets lost, packets to down nodes). Nothing here depends on ``PYTHONHASHSEED``.
Pinned values: ``tests/simulations/test_trace_pins.py``.
"""

from __future__ import annotations

import hashlib

from swim import MemberEvent


class Trace:
    """Membership events folded into a running hash."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def record(self, t_ms: int, observer: int, event: MemberEvent) -> None:
        m = event.member
        self._hash.update(
            f"{t_ms} {observer} {event.kind.value} {m.name} {m.incarnation}\n".encode()
        )

    def digest(self, totals: tuple[int, ...]) -> str:
        """The hash of the events so far, then ``totals``; recording may go on."""
        h = self._hash.copy()
        h.update(repr(totals).encode())
        return h.hexdigest()


__all__ = ["Trace"]
