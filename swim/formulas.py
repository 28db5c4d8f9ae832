"""Pure protocol formulas: every number the core derives from configuration and group size.

Rules: each function is pure (no state, no clock, no randomness), takes integer milliseconds
and returns integer milliseconds where it returns a duration, and reproduces memberlist's
arithmetic exactly, including its truncation, so that a table of memberlist's own values is
a valid test (tests/swim/test_formulas.py).

Sources (hashicorp/memberlist @ 1b4c746):
- util.go ``suspicionTimeout``, ``retransmitLimit``, ``pushPullScale``
- suspicion.go ``remainingSuspicionTime`` (Lifeguard LHA-Suspicion, arXiv 1707.00788 §IV-B)
- state.go ``suspectNode`` (k = SuspicionMult - 2, dropped to 0 when n - 2 < k)
- awareness.go ``ApplyDelta``, ``ScaleTimeout`` (Lifeguard LHA-Probe, §IV-A)
- state.go ``probeNode`` (awareness delta of a failed probe)
SWIM paper (Das, Gupta, Motivala 2002) §3.1 for the expected first-detection time.
"""

from __future__ import annotations

import math

PUSH_PULL_SCALE_THRESHOLD = 32
"""util.go ``pushPullScaleThreshold``: push-pull interval is not scaled up to this many nodes."""


def suspicion_timeout_ms(suspicion_mult: int, n: int, probe_interval_ms: int) -> int:
    """Minimum suspicion timeout: ``α · max(1, log10(max(1, n))) · probe interval``.

    memberlist computes ``mult · Duration(nodeScale·1000) · interval / 1000`` in integer
    nanoseconds; in milliseconds the same truncation is ``floor(nodeScale·1000)`` then an
    integer division.
    """
    node_scale = max(1.0, math.log10(max(1.0, float(n))))
    return suspicion_mult * int(node_scale * 1000) * probe_interval_ms // 1000


def suspicion_confirmations(suspicion_mult: int, n: int) -> int:
    """Independent confirmations k that shrink the timeout from max to min (state.go).

    ``k = α − 2``; when fewer than k other peers could ever confirm (``n − 2 < k``), k is 0
    and the timer runs for the minimum directly.
    """
    k = suspicion_mult - 2
    if n - 2 < k or k < 0:
        return 0
    return k


def remaining_suspicion_time_ms(
    confirmations: int, k: int, elapsed_ms: int, min_ms: int, max_ms: int
) -> int:
    """Time left on a suspicion timer after ``confirmations`` independent confirmations.

    ``timeout = max − (log(c+1)/log(k+1))·(max − min)``, floored to whole milliseconds,
    clamped to at least ``min``, minus the time already elapsed. A result ≤ 0 means the
    timer fires at once. Requires k ≥ 1 (with k = 0 there is nothing to decay).
    """
    if k < 1:
        raise ValueError(f"remaining_suspicion_time_ms needs k >= 1, got {k}")
    frac = math.log(confirmations + 1.0) / math.log(k + 1.0)
    raw_ms = max_ms - frac * (max_ms - min_ms)
    timeout_ms = max(math.floor(raw_ms), min_ms)
    return int(timeout_ms) - elapsed_ms


def retransmit_limit(retransmit_mult: int, n: int) -> int:
    """Times a broadcast is piggybacked before it is dropped: ``mult · ceil(log10(n + 1))``."""
    return retransmit_mult * math.ceil(math.log10(n + 1))


def push_pull_scale_ms(interval_ms: int, n: int) -> int:
    """Push-pull interval scaled with group size so TCP sync load stays flat.

    n ≤ 32: the interval; above: ``interval · (ceil(log2 n − log2 32) + 1)``.
    """
    if n <= PUSH_PULL_SCALE_THRESHOLD:
        return interval_ms
    multiplier = math.ceil(math.log2(n) - math.log2(PUSH_PULL_SCALE_THRESHOLD)) + 1
    return multiplier * interval_ms


def awareness_apply_delta(score: int, delta: int, max_multiplier: int) -> int:
    """New local health score after ``delta``, clamped to ``[0, max_multiplier − 1]``."""
    return min(max(score + delta, 0), max_multiplier - 1)


def awareness_scale_ms(timeout_ms: int, score: int) -> int:
    """Lifeguard scaling of a timeout by local health: ``timeout · (score + 1)``."""
    return timeout_ms * (score + 1)


def probe_failure_awareness_delta(expected_nacks: int, nacks_received: int) -> int:
    """LHM delta after a failed probe (state.go ``probeNode``).

    If the indirect helpers were asked for nacks, every missing nack is a sign that *we* are
    the slow one (+1 each; all nacks back means "the target is dead, not me": 0). Without
    nack-capable helpers a failed probe counts +1.
    """
    if expected_nacks > 0:
        return max(expected_nacks - nacks_received, 0)
    return 1


def swim_expected_first_detection_periods(q_f: float = 1.0) -> float:
    """SWIM §3.1: expected protocol periods from a crash to its first detection.

    ``1 / (1 − e^(−q_f))`` for a fraction q_f of non-faulty members; e/(e−1) ≈ 1.582 at 1.
    """
    return 1.0 / (1.0 - math.exp(-q_f))
