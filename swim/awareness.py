"""Lifeguard's LHA-Probe: the node's own health score, which stretches its timeouts.

Rules (hashicorp/memberlist @ 1b4c746 awareness.go; Lifeguard, arXiv:1707.00788 §IV-A;
docs/design.md §5.4):
- The score starts at 0 (healthy) and stays within [0, ``awareness_max_multiplier`` − 1].
  A probe that failed without the expected nacks, or a refutation of an accusation of us,
  raises it; a successful probe lowers it (``formulas.probe_failure_awareness_delta``).
- Probe interval and probe timeout are scaled by (score + 1): a node that misses acks
  because it is slow itself waits longer before accusing others.
- With ``lifeguard_lhm`` off the score never moves.
"""

from __future__ import annotations

from swim import formulas
from swim.config import Config

__all__ = ["Awareness"]


class Awareness:
    def __init__(self, config: Config) -> None:
        self._config = config
        self.score = 0

    def apply_delta(self, delta: int) -> None:
        if not self._config.lifeguard_lhm:
            return
        self.score = formulas.awareness_apply_delta(
            self.score, delta, self._config.awareness_max_multiplier
        )

    def scale_ms(self, timeout_ms: int) -> int:
        return formulas.awareness_scale_ms(timeout_ms, self.score)
