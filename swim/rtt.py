"""Per-peer round-trip estimates and the Phi-adaptive probe timeout (the ``fast`` profile).

Rules:
- A sample is the time from sending a ping to receiving its ack over the same, direct path:
  our own probe's direct ack (also one that arrives after the direct timeout, while the
  indirect phase runs) and the ack to a ping we relay for someone else. Indirect acks are
  two hops and are not samples.
- Each peer keeps an exponentially weighted mean and variance over ≈ ``rtt_window``
  samples (the cumulative average until that many, then weight 1/window; Welford's update
  applied to an exponential window): a fixed three numbers per peer, so 1,000 simulated
  members probing each other cost ~100 MB, not the ~500 MB a ring of samples would.
- The probe timeout for a peer is where Akka's phi accrual detector over those RTTs
  reaches ``probe_timeout_phi`` (``formulas.adaptive_probe_timeout_ms``), with the deviation
  floored at ``rtt_min_std_ms``, clamped to [``probe_timeout_min_ms``,
  ``probe_timeout_max_ms``]. A peer with fewer than ``rtt_min_samples`` samples gets the
  timeout of the pooled estimate over all peers (round-robin probing samples one peer
  only every n probe periods, 16 s at 64 members, while the fabric is shared); with too
  few samples overall, the static ``probe_timeout_ms`` applies. Lifeguard's local health
  multiplies the result (LHA-Probe, arXiv 1707.00788 §IV-A scales probe timeouts too;
  memberlist only scales the interval).
- The table is bounded by ``max_members``: beyond it, the peer not heard from the longest
  is forgotten.
- The pooled estimate (every sample, same window) also gives ``typical_ms``, the
  cluster's RTT as this node sees it, used for the derived suspicion window
  (``formulas.derived_suspicion_timeout_ms``).

Sources: Hayashibara et al. 2004 (phi accrual), Akka PhiAccrualFailureDetector.scala
(logistic CDF, min std deviation), SWIM §4 ("timeout from the 99th-percentile RTT"),
Jacobson 1988 / RFC 6298 (smoothed RTT and variance for a retransmission timeout).
"""

from __future__ import annotations

from swim import formulas
from swim.config import Config


class RttTable:
    """Smoothed RTT per peer, and the adaptive probe timeout derived from it."""

    __slots__ = ("_config", "_peers", "_pooled")

    def __init__(self, config: Config) -> None:
        self._config = config
        # name -> (mean_ms, var_ms², samples); insertion order = least recently sampled first
        self._peers: dict[str, tuple[float, float, int]] = {}
        self._pooled: tuple[float, float, int] = (0.0, 0.0, 0)

    def __len__(self) -> int:
        return len(self._peers)

    def sample(self, peer: str, rtt_ms: int) -> None:
        if rtt_ms < 0 or not peer:
            return
        window = self._config.rtt_window
        x = float(rtt_ms)
        old = self._peers.pop(peer, None)
        if old is None and len(self._peers) >= self._config.max_members:
            del self._peers[next(iter(self._peers))]
        self._peers[peer] = _update(old, x, window)
        self._pooled = _update(self._pooled, x, window)

    def estimate(self, peer: str) -> tuple[float, float, int] | None:
        """(mean ms, standard deviation ms, samples) for a peer, if sampled."""
        entry = self._peers.get(peer)
        if entry is None:
            return None
        mean, var, n = entry
        return mean, var**0.5, n

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    @property
    def typical_ms(self) -> int:
        """Smoothed RTT over every peer; 0 before the first sample."""
        return round(self._pooled[0])

    def probe_timeout_ms(self, peer: str, health_score: int) -> int:
        """Direct-ack timeout for a probe of ``peer`` (static one when not adaptive)."""
        c = self._config
        if not c.adaptive_probe_timeout:
            return c.probe_timeout_ms
        entry = self._peers.get(peer)
        if entry is None or entry[2] < c.rtt_min_samples:
            entry = self._pooled
        if entry[2] < c.rtt_min_samples:
            base = c.probe_timeout_ms
        else:
            mean, var, _ = entry
            std = max(var**0.5, float(c.rtt_min_std_ms))
            base = formulas.adaptive_probe_timeout_ms(
                mean, std, c.probe_timeout_phi, c.probe_timeout_min_ms, c.probe_timeout_max_ms
            )
        return formulas.awareness_scale_ms(base, health_score)


def _update(
    old: tuple[float, float, int] | None, x: float, window: int
) -> tuple[float, float, int]:
    """Welford's mean/variance update over an exponential window of ``window`` samples."""
    if old is None or old[2] == 0:
        return (x, 0.0, 1)
    mean, var, n = old
    n = min(n + 1, window)
    new_mean = mean + (x - mean) / n
    var += ((x - mean) * (x - new_mean) - var) / n
    return (new_mean, max(var, 0.0), n)
