"""Phi accrual scores for many peers at once, vectorised with numpy.

Source of the model and rules: Akka PhiAccrualFailureDetector.scala (via
:mod:`phi.detector`, whose rules apply here per peer unchanged); Hayashibara et
al. 2004 for phi itself.

Rules:

* Every peer behaves exactly like its own :class:`phi.detector.PhiAccrualDetector`
  fed the same heartbeats: same bootstrap, same "no interval after a failure"
  rule, same ignore-earlier-timestamps rule, same interval cap. Heartbeats are
  decided with the same scalar code, so histories are identical; vectorised phi
  agrees with the scalar phi to floating-point rounding.
* State lives in preallocated arrays indexed by slot: a ``[capacity, window]``
  int64 ring buffer of intervals plus per-slot running sum, sum of squares,
  count, write index and last heartbeat. ``capacity`` is a hard bound; adding a
  peer beyond it raises :class:`RegistryFullError`.
* Peer names map to slots in insertion order. A removed peer's slot goes on a
  free list and is reused (most recently freed first) with fresh state.
* :meth:`PhiRegistry.peers`, :meth:`PhiRegistry.phi_all` and
  :meth:`PhiRegistry.phi_array` report in insertion order;
  :meth:`PhiRegistry.suspects` reports in slot order (equal to insertion order
  until a removal frees a slot that is then reused).
* Time is integer milliseconds passed in as ``now_ms``; nothing reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from phi.detector import PhiConfig, window_mean_std_ms
from phi.formulas import phi_akka, phi_akka_array

__all__ = ["PhiRegistry", "RegistryFullError"]


class RegistryFullError(RuntimeError):
    """Raised when adding a peer to a registry that already holds ``capacity`` peers."""


class PhiRegistry:
    """Phi accrual detectors for up to ``capacity`` named peers, scored in bulk."""

    def __init__(self, config: PhiConfig, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self._config = config
        self._capacity = capacity
        window = config.max_sample_size
        self._intervals_ms = np.zeros((capacity, window), dtype=np.int64)
        self._sum_ms = np.zeros(capacity, dtype=np.int64)
        self._sum_sq_ms2 = np.zeros(capacity, dtype=np.int64)
        self._count = np.zeros(capacity, dtype=np.int64)
        self._next = np.zeros(capacity, dtype=np.int64)
        self._last_heartbeat_ms = np.zeros(capacity, dtype=np.int64)
        self._has_heartbeat = np.zeros(capacity, dtype=np.bool_)
        self._occupied = np.zeros(capacity, dtype=np.bool_)
        self._slot_of: dict[str, int] = {}
        self._peer_at: list[str | None] = [None] * capacity
        # Reversed so pop() hands out slot 0 first.
        self._free_slots: list[int] = list(range(capacity - 1, -1, -1))

    @property
    def config(self) -> PhiConfig:
        return self._config

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, peer: object) -> bool:
        return peer in self._slot_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._slot_of)

    def peers(self) -> list[str]:
        """Peer names in insertion order."""
        return list(self._slot_of)

    def add(self, peer: str) -> None:
        """Start tracking ``peer`` (phi 0.0 until its first heartbeat); no-op if known."""
        if peer in self._slot_of:
            return
        if not self._free_slots:
            raise RegistryFullError(
                f"cannot add peer {peer!r}: registry is at capacity ({self._capacity})"
            )
        slot = self._free_slots.pop()
        self._reset_slot(slot)
        self._occupied[slot] = True
        self._slot_of[peer] = slot
        self._peer_at[slot] = peer

    def remove(self, peer: str) -> None:
        """Stop tracking ``peer`` and free its slot; KeyError if unknown."""
        slot = self._slot(peer)
        del self._slot_of[peer]
        self._peer_at[slot] = None
        self._occupied[slot] = False
        self._free_slots.append(slot)

    def heartbeat(self, peer: str, now_ms: int) -> None:
        """Record a heartbeat from ``peer`` (added if new); earlier-than-last ones are ignored."""
        self.add(peer)
        slot = self._slot_of[peer]
        if not self._has_heartbeat[slot]:
            for interval_ms in self._config.bootstrap_intervals_ms():
                self._record(slot, interval_ms)
            self._has_heartbeat[slot] = True
        else:
            last_ms = int(self._last_heartbeat_ms[slot])
            if now_ms < last_ms:
                return
            if self._phi_slot(slot, now_ms) < self._config.threshold:
                self._record(slot, min(now_ms - last_ms, self._config.max_interval_ms))
        self._last_heartbeat_ms[slot] = now_ms

    def phi(self, peer: str, now_ms: int) -> float:
        """Suspicion level of one peer at ``now_ms``; KeyError if unknown."""
        return self._phi_slot(self._slot(peer), now_ms)

    def is_available(self, peer: str, now_ms: int) -> bool:
        return self.phi(peer, now_ms) < self._config.threshold

    def last_heartbeat_ms(self, peer: str) -> int | None:
        slot = self._slot(peer)
        return int(self._last_heartbeat_ms[slot]) if self._has_heartbeat[slot] else None

    def intervals_ms(self, peer: str) -> list[int]:
        """The peer's window, oldest first."""
        slot = self._slot(peer)
        count = int(self._count[slot])
        row = self._intervals_ms[slot]
        if count < self._config.max_sample_size:
            return [int(v) for v in row[:count]]
        return [int(v) for v in np.roll(row, -int(self._next[slot]))]

    def phi_array(self, now_ms: int) -> tuple[list[str], npt.NDArray[np.float64]]:
        """All peers' phi at ``now_ms`` (insertion order), computed in one vectorised pass."""
        names = list(self._slot_of)
        slots = np.fromiter(self._slot_of.values(), dtype=np.intp, count=len(names))
        return names, self._phi_slots(slots, now_ms)

    def phi_all(self, now_ms: int) -> dict[str, float]:
        names, values = self.phi_array(now_ms)
        return dict(zip(names, values.tolist(), strict=True))

    def suspects(self, now_ms: int) -> list[str]:
        """Peers with ``phi >= threshold`` at ``now_ms``, in slot order."""
        slots = np.flatnonzero(self._occupied)
        phis = self._phi_slots(slots, now_ms)
        return [self._peer_name(int(s)) for s in slots[phis >= self._config.threshold]]

    def _slot(self, peer: str) -> int:
        try:
            return self._slot_of[peer]
        except KeyError:
            raise KeyError(f"unknown peer {peer!r}") from None

    def _peer_name(self, slot: int) -> str:
        peer = self._peer_at[slot]
        assert peer is not None, "occupied slot without a peer"
        return peer

    def _reset_slot(self, slot: int) -> None:
        # The interval row needs no clearing: only the first `count` entries are ever read.
        self._sum_ms[slot] = 0
        self._sum_sq_ms2[slot] = 0
        self._count[slot] = 0
        self._next[slot] = 0
        self._last_heartbeat_ms[slot] = 0
        self._has_heartbeat[slot] = False

    def _phi_slot(self, slot: int, now_ms: int) -> float:
        if not self._has_heartbeat[slot]:
            return 0.0
        mean_ms, std_ms = window_mean_std_ms(
            int(self._sum_ms[slot]), int(self._sum_sq_ms2[slot]), int(self._count[slot])
        )
        elapsed_ms = float(now_ms - int(self._last_heartbeat_ms[slot]))
        return phi_akka(
            elapsed_ms,
            mean_ms + self._config.acceptable_heartbeat_pause_ms,
            max(std_ms, float(self._config.min_std_deviation_ms)),
        )

    def _phi_slots(self, slots: npt.NDArray[np.intp], now_ms: int) -> npt.NDArray[np.float64]:
        result = np.zeros(slots.shape[0], dtype=np.float64)
        beating = self._has_heartbeat[slots]
        live = slots[beating]
        if live.size == 0:
            return result
        count = self._count[live].astype(np.float64)
        mean_ms = self._sum_ms[live].astype(np.float64) / count
        variance_ms2 = self._sum_sq_ms2[live].astype(np.float64) / count - mean_ms * mean_ms
        std_ms = np.maximum(
            np.sqrt(np.maximum(variance_ms2, 0.0)), float(self._config.min_std_deviation_ms)
        )
        elapsed_ms = (np.int64(now_ms) - self._last_heartbeat_ms[live]).astype(np.float64)
        mean_ms += self._config.acceptable_heartbeat_pause_ms
        result[beating] = phi_akka_array(elapsed_ms, mean_ms, std_ms)
        return result

    def _record(self, slot: int, interval_ms: int) -> None:
        window = self._config.max_sample_size
        position = int(self._next[slot])
        if self._count[slot] == window:
            evicted_ms = int(self._intervals_ms[slot, position])
            self._sum_ms[slot] -= evicted_ms
            self._sum_sq_ms2[slot] -= evicted_ms * evicted_ms
        else:
            self._count[slot] += 1
        self._intervals_ms[slot, position] = interval_ms
        self._sum_ms[slot] += interval_ms
        self._sum_sq_ms2[slot] += interval_ms * interval_ms
        self._next[slot] = (position + 1) % window
