"""Lifeguard's LHA-Probe: the node's own health score, which stretches its timeouts.

Rules (hashicorp/memberlist @ 1b4c746 awareness.go; Lifeguard, arXiv:1707.00788 §IV-A;
docs/design.md §5.4):
- The score starts at 0 (healthy) and stays within [0, ``awareness_max_multiplier`` − 1].
  A probe that failed without the expected nacks, or a refutation of an accusation of us,
  raises it; a successful probe lowers it (``formulas.probe_failure_awareness_delta``).
- Probe interval and probe timeout are scaled by (score + 1): a node that misses acks
  because it is slow itself waits longer before accusing others.
- With ``lifeguard_lhm`` off the score never moves.
- Starvation (ours, ``starved_lag_ms``; 0: off): a timer handed back ``starved_lag_ms`` or
  more after its deadline shows that this process itself was not running. That raises the
  score by one, at most once per probe interval, and is remembered (``starved_ms``, the
  last such moment) so that a suspicion that ran out meanwhile is held (swim.suspicion).
  Without it, a box whose CPUs are saturated (a fleet of agents starting at once, data
  loaders on every core) declares its own live members dead: their acks and refutations
  are late because they, too, are not running.
"""

from __future__ import annotations

from swim import formulas
from swim.config import Config

__all__ = ["Awareness"]


class Awareness:
    def __init__(self, config: Config) -> None:
        self._config = config
        self.score = 0
        self.starved_ms: int | None = None
        """When a timer was last handed back late by ``starved_lag_ms`` or more."""
        self.lag_ms = 0
        """How late the last timer was handed back (logged with a failed probe)."""

    def note_timer(self, deadline_ms: int, now_ms: int) -> None:
        """A timer due at ``deadline_ms`` handed back at ``now_ms``: late enough to mean
        this node was starved? Then raise the score, at most once per probe interval."""
        self.lag_ms = max(now_ms - deadline_ms, 0)
        lag_ms = self._config.starved_lag_ms
        if not lag_ms or self.lag_ms < lag_ms:
            return
        last = self.starved_ms
        self.starved_ms = now_ms
        if last is None or now_ms - last >= self._config.probe_interval_ms:
            self.apply_delta(1)

    def starved_since(self, since_ms: int) -> bool:
        """Whether this node was starved at or after ``since_ms``."""
        return self.starved_ms is not None and self.starved_ms >= since_ms

    def apply_delta(self, delta: int) -> None:
        if not self._config.lifeguard_lhm:
            return
        self.score = formulas.awareness_apply_delta(
            self.score, delta, self._config.awareness_max_multiplier
        )

    def scale_ms(self, timeout_ms: int) -> int:
        return formulas.awareness_scale_ms(timeout_ms, self.score)
