"""Phi accrual scores for many named peers, each O(1) per heartbeat and per score.

Source of the model and rules: Akka PhiAccrualFailureDetector.scala (via
:mod:`phi.detector`, whose rules apply here per peer unchanged); Hayashibara et
al. 2004 for phi itself.

Rules:

* Every peer behaves exactly like its own :class:`phi.detector.PhiAccrualDetector`
  fed the same heartbeats: same bootstrap, same "no interval after a failure"
  rule, same ignore-earlier-timestamps rule, same interval cap. Each slot *is*
  such a detector, so histories and phi values are identical to it;
  :func:`phi.vector.phi_array` scores the same windows with numpy and agrees to
  floating-point rounding.
* Standard library only: the agent scores every member on each metrics scrape
  and ``swimctl members`` and must not import numpy (its RSS budget). A peer
  costs its detector's running sums plus a ring of at most ``max_sample_size``
  int64 intervals, allocated as heartbeats arrive, never up front.
* State is indexed by slot; ``capacity`` is a hard bound on the number of slots,
  and adding a peer beyond it raises :class:`RegistryFullError`.
* Peer names map to slots in insertion order. A removed peer's slot goes on a
  free list and is reused (most recently freed first) with fresh state.
* :meth:`PhiRegistry.peers`, :meth:`PhiRegistry.phi_all` and
  :meth:`PhiRegistry.window_sums` report in insertion order;
  :meth:`PhiRegistry.suspects` reports in slot order (equal to insertion order
  until a removal frees a slot that is then reused).
* Time is integer milliseconds passed in as ``now_ms``; nothing reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterator

from phi.detector import PhiAccrualDetector, PhiConfig, WindowSums

__all__ = ["PhiRegistry", "RegistryFullError"]


class RegistryFullError(RuntimeError):
    """Raised when adding a peer to a registry that already holds ``capacity`` peers."""


class PhiRegistry:
    """Phi accrual detectors for up to ``capacity`` named peers."""

    def __init__(self, config: PhiConfig, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self._config = config
        self._capacity = capacity
        # Insertion order lives in the dicts; slot order in the list.
        self._detector_of: dict[str, PhiAccrualDetector] = {}
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
        if peer not in self._slot_of:
            self._add(peer)

    def remove(self, peer: str) -> None:
        """Stop tracking ``peer`` and free its slot; KeyError if unknown."""
        slot = self._slot(peer)
        del self._slot_of[peer]
        del self._detector_of[peer]
        self._peer_at[slot] = None
        self._free_slots.append(slot)

    def heartbeat(self, peer: str, now_ms: int) -> None:
        """Record a heartbeat from ``peer`` (added if new); earlier-than-last ones are ignored."""
        detector = self._detector_of.get(peer)
        if detector is None:
            detector = self._add(peer)
        detector.heartbeat(now_ms)

    def phi(self, peer: str, now_ms: int) -> float:
        """Suspicion level of one peer at ``now_ms``; KeyError if unknown."""
        return self._detector(peer).phi(now_ms)

    def is_available(self, peer: str, now_ms: int) -> bool:
        return self.phi(peer, now_ms) < self._config.threshold

    def last_heartbeat_ms(self, peer: str) -> int | None:
        return self._detector(peer).last_heartbeat_ms

    def intervals_ms(self, peer: str) -> list[int]:
        """The peer's window, oldest first."""
        return self._detector(peer).intervals_ms()

    def window_sums(self) -> list[tuple[str, WindowSums | None]]:
        """Every peer's running sums (None before its first heartbeat), insertion order."""
        return [(peer, d.window_sums()) for peer, d in self._detector_of.items()]

    def phi_all(self, now_ms: int) -> dict[str, float]:
        """All peers' phi at ``now_ms``, insertion order; O(1) per peer."""
        return {peer: d.phi(now_ms) for peer, d in self._detector_of.items()}

    def suspects(self, now_ms: int) -> list[str]:
        """Peers with ``phi >= threshold`` at ``now_ms``, in slot order."""
        threshold = self._config.threshold
        detector_of = self._detector_of
        by_slot = sorted(self._slot_of, key=self._slot_of.__getitem__)
        return [peer for peer in by_slot if detector_of[peer].phi(now_ms) >= threshold]

    def _add(self, peer: str) -> PhiAccrualDetector:
        if not self._free_slots:
            raise RegistryFullError(
                f"cannot add peer {peer!r}: registry is at capacity ({self._capacity})"
            )
        slot = self._free_slots.pop()
        detector = PhiAccrualDetector(self._config)
        self._detector_of[peer] = detector
        self._slot_of[peer] = slot
        self._peer_at[slot] = peer
        return detector

    def _slot(self, peer: str) -> int:
        try:
            return self._slot_of[peer]
        except KeyError:
            raise KeyError(f"unknown peer {peer!r}") from None

    def _detector(self, peer: str) -> PhiAccrualDetector:
        try:
            return self._detector_of[peer]
        except KeyError:
            raise KeyError(f"unknown peer {peer!r}") from None
