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

import functools
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


# --- the fast profile: adaptive probe timeouts and a derived suspicion window -------------
#
# Not in memberlist. The probe timeout is Hayashibara's phi accrual detector (2004) applied
# to a peer's round-trip times, with Akka's logistic approximation of the normal CDF
# (PhiAccrualFailureDetector.scala; phi/formulas.py ``phi_akka``): the timeout is the RTT a
# live peer exceeds with probability ≈ 10^−phi. SWIM §4 asks for a timeout from "the
# 99th-percentile RTT"; this is the same idea, per peer and learned online.

AKKA_LOGISTIC_A = 1.5976
AKKA_LOGISTIC_B = 0.070566
"""Akka's coefficients: F(y) ≈ 1/(1 + exp(−y(A + B·y²))), y = (t − mean)/std."""


@functools.cache
def phi_sigmas(phi: float) -> float:
    """Standard deviations past the mean at which Akka's phi reaches ``phi``.

    phi = log10(1 + e^x) with x = y(A + B y²), so x = ln(10^phi − 1) and y is the one real
    root of B y³ + A y − x = 0 (Cardano; the cubic is increasing, A, B > 0).
    """
    if not phi > 0.0 or math.isinf(phi):
        raise ValueError(f"phi must be finite and > 0, got {phi!r}")
    x = math.log(math.expm1(phi * math.log(10.0)))
    p = AKKA_LOGISTIC_A / AKKA_LOGISTIC_B
    q = -x / AKKA_LOGISTIC_B
    root = math.sqrt((q / 2.0) ** 2 + (p / 3.0) ** 3)
    return math.cbrt(-q / 2.0 + root) + math.cbrt(-q / 2.0 - root)


def adaptive_probe_timeout_ms(
    mean_rtt_ms: float, std_rtt_ms: float, phi: float, min_ms: int, max_ms: int
) -> int:
    """Probe timeout for one peer: ``ceil(mean + phi_sigmas(phi)·std)`` within [min, max].

    ``std_rtt_ms`` is the effective deviation (the caller floors it, as Akka floors
    ``min-std-deviation``), so a perfectly regular peer still gets slack.
    """
    if min_ms > max_ms:
        raise ValueError(f"min_ms ({min_ms}) > max_ms ({max_ms})")
    raw = mean_rtt_ms + phi_sigmas(phi) * std_rtt_ms
    return min(max(math.ceil(raw), min_ms), max_ms)


def gossip_rounds(n: int, gossip_nodes: int) -> int:
    """Gossip rounds for news to reach all n members: ``ceil(log_{fanout+1} n) + 1``.

    Push gossip to f peers per round multiplies the informed set by up to f+1 each round
    (SWIM §4.1, infection-style dissemination); the +1 covers the phase of each member's
    own gossip ticker. Measured in this simulator (simulations/RESULTS.md §1, fanout 3,
    200 ms rounds): t99 at n = 30 / 1,000 / 10,000 is 2.5 / 3.8 / 4.3 rounds against
    3 / 6 / 8 here, so the bound is conservative.
    """
    if n <= 1:
        return 1
    if gossip_nodes < 1:
        raise ValueError(f"gossip_nodes must be >= 1, got {gossip_nodes}")
    return math.ceil(math.log(n) / math.log(gossip_nodes + 1) - 1e-9) + 1


def dissemination_ms(n: int, gossip_interval_ms: int, gossip_nodes: int, rtt_ms: int) -> int:
    """Time for one message to reach every member: rounds × (interval + one-way delay)."""
    return gossip_rounds(n, gossip_nodes) * (gossip_interval_ms + (rtt_ms + 1) // 2)


def derived_suspicion_timeout_ms(
    n: int, gossip_interval_ms: int, gossip_nodes: int, rtt_ms: int, safety_mult: int
) -> int:
    """Minimum suspicion window from what a falsely suspected member needs to survive.

    The accusation must reach the suspect (one dissemination; the buddy system usually does
    it in one probe) and its refutation must reach everyone who holds the suspicion (one
    more dissemination): ``safety · 2 · dissemination(n)``. memberlist instead uses
    ``α · log10(n) · probe_interval`` (util.go ``suspicionTimeout``), which ties the window
    to the probe period rather than to how fast the refutation can travel.
    """
    return safety_mult * 2 * dissemination_ms(n, gossip_interval_ms, gossip_nodes, rtt_ms)
