"""Table tests for every protocol formula, each table citing where its numbers come from."""

from __future__ import annotations

import math

import pytest

from swim import formulas


# memberlist util_test.go TestSuspicionTimeout: suspicionTimeout(3, n, 1s) / 3
@pytest.mark.parametrize(
    ("n", "per_mult_ms"),
    [(5, 1000), (10, 1000), (50, 1698), (100, 2000), (500, 2698), (1000, 3000)],
)
def test_suspicion_timeout_memberlist_table(n: int, per_mult_ms: int) -> None:
    assert formulas.suspicion_timeout_ms(3, n, 1000) // 3 == per_mult_ms


# docs/design.md §5.1, §5.3 (memberlist config.go presets): min suspicion timeout per profile
@pytest.mark.parametrize(
    ("mult", "n", "interval_ms", "expected_ms"),
    [
        (4, 3, 1000, 4000),  # LAN, n=3
        (4, 10, 1000, 4000),  # LAN
        (4, 100, 1000, 8000),
        (4, 1000, 1000, 12000),
        (4, 10000, 1000, 16000),
        (6, 10, 5000, 30000),  # WAN
        (6, 1000, 5000, 90000),
        (3, 10, 1000, 3000),  # Local
        (3, 10000, 1000, 12000),
        (4, 0, 1000, 4000),  # n is floored at 1
        (4, 50, 1000, 6792),  # log10(50) = 1.69897 -> 1698 ms per mult, Go truncation
    ],
)
def test_suspicion_timeout_profiles(mult: int, n: int, interval_ms: int, expected_ms: int) -> None:
    assert formulas.suspicion_timeout_ms(mult, n, interval_ms) == expected_ms


# memberlist suspicion_test.go TestSuspicion_remainingSuspicionTime
@pytest.mark.parametrize(
    ("confirmations", "k", "elapsed_ms", "min_ms", "max_ms", "expected_ms"),
    [
        (0, 3, 0, 2000, 30000, 30000),
        (1, 3, 2000, 2000, 30000, 14000),
        (2, 3, 3000, 2000, 30000, 4810),
        (3, 3, 4000, 2000, 30000, -2000),
        (4, 3, 5000, 2000, 30000, -3000),
        (5, 3, 10000, 2000, 30000, -8000),
    ],
)
def test_remaining_suspicion_time_memberlist_table(
    confirmations: int, k: int, elapsed_ms: int, min_ms: int, max_ms: int, expected_ms: int
) -> None:
    assert (
        formulas.remaining_suspicion_time_ms(confirmations, k, elapsed_ms, min_ms, max_ms)
        == expected_ms
    )


# docs/design.md §5.3 (LAN values): min / max / after one confirmation (k = 2)
@pytest.mark.parametrize(
    ("n", "min_ms", "max_ms", "after_one_ms"),
    [
        (10, 4000, 24000, 11381),
        (100, 8000, 48000, 22762),
        (1000, 12000, 72000, 34144),
        (10000, 16000, 96000, 45525),
    ],
)
def test_lan_suspicion_decay(n: int, min_ms: int, max_ms: int, after_one_ms: int) -> None:
    got_min = formulas.suspicion_timeout_ms(4, n, 1000)
    assert got_min == min_ms
    assert 6 * got_min == max_ms
    k = formulas.suspicion_confirmations(4, n)
    assert k == 2
    assert formulas.remaining_suspicion_time_ms(1, k, 0, min_ms, max_ms) == after_one_ms
    # with all k confirmations the timeout is the minimum
    assert formulas.remaining_suspicion_time_ms(k, k, 0, min_ms, max_ms) == min_ms


# memberlist state.go suspectNode: k = mult - 2, and 0 when n - 2 < k
@pytest.mark.parametrize(
    ("mult", "n", "k"),
    [
        (4, 3, 0),
        (4, 4, 2),
        (4, 100, 2),
        (6, 5, 0),
        (6, 6, 4),
        (3, 3, 1),
        (3, 2, 0),
        (2, 50, 0),
        (1, 50, 0),
    ],
)
def test_suspicion_confirmations(mult: int, n: int, k: int) -> None:
    assert formulas.suspicion_confirmations(mult, n) == k


def test_remaining_suspicion_time_needs_k() -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        formulas.remaining_suspicion_time_ms(0, 0, 0, 1000, 6000)


# memberlist util_test.go TestRetransmitLimit (mult 3) and the LAN (mult 4) steps.
# The step is at n=100, not n=99: memberlist's own test has retransmitLimit(3, 99) == 6
# (ceil(log10(100)) == 2).
@pytest.mark.parametrize(
    ("mult", "n", "limit"),
    [
        (3, 0, 0),
        (3, 1, 3),
        (3, 99, 6),
        (4, 1, 4),
        (4, 9, 4),
        (4, 10, 8),
        (4, 99, 8),
        (4, 100, 12),
        (4, 999, 12),
        (4, 1000, 16),
        (4, 10000, 20),
        (2, 50, 4),
    ],
)
def test_retransmit_limit(mult: int, n: int, limit: int) -> None:
    assert formulas.retransmit_limit(mult, n) == limit


# memberlist util_test.go TestPushPullScale, and docs/design.md §5.5 (LAN 30 s)
@pytest.mark.parametrize(
    ("interval_ms", "n", "expected_ms"),
    [
        (1000, 0, 1000),
        (1000, 32, 1000),
        (1000, 33, 2000),
        (1000, 64, 2000),
        (1000, 65, 3000),
        (1000, 128, 3000),
        (30000, 64, 60000),
        (30000, 128, 90000),
        (30000, 1000, 180000),
        (30000, 10000, 300000),
    ],
)
def test_push_pull_scale(interval_ms: int, n: int, expected_ms: int) -> None:
    assert formulas.push_pull_scale_ms(interval_ms, n) == expected_ms


# memberlist awareness_test.go TestAwareness: max 8, deltas clamp to [0, 7]
@pytest.mark.parametrize(
    ("score", "delta", "expected"),
    [
        (0, 0, 0),
        (0, -1, 0),
        (0, 1, 1),
        (0, -1, 0),
        (0, 3, 3),
        (3, 10, 7),
        (7, 1, 7),
        (7, -1, 6),
        (6, -10, 0),
    ],
)
def test_awareness_apply_delta(score: int, delta: int, expected: int) -> None:
    assert formulas.awareness_apply_delta(score, delta, 8) == expected


# memberlist awareness.go ScaleTimeout: timeout * (score + 1); LAN interval up to 8 s
@pytest.mark.parametrize(
    ("timeout_ms", "score", "expected_ms"),
    [(1000, 0, 1000), (1000, 1, 2000), (1000, 7, 8000), (500, 3, 2000)],
)
def test_awareness_scale(timeout_ms: int, score: int, expected_ms: int) -> None:
    assert formulas.awareness_scale_ms(timeout_ms, score) == expected_ms


# memberlist state.go probeNode: missing nacks count against us; without nacks +1
@pytest.mark.parametrize(
    ("expected_nacks", "received", "delta"),
    [(0, 0, 1), (3, 0, 3), (3, 1, 2), (3, 3, 0), (1, 0, 1), (2, 5, 0)],
)
def test_probe_failure_delta(expected_nacks: int, received: int, delta: int) -> None:
    assert formulas.probe_failure_awareness_delta(expected_nacks, received) == delta


# SWIM paper §3.1: expected first-detection time 1/(1 - e^-q_f) periods; e/(e-1) at q_f=1
@pytest.mark.parametrize(
    ("q_f", "periods"), [(1.0, math.e / (math.e - 1)), (0.5, 1 / (1 - math.exp(-0.5)))]
)
def test_swim_first_detection(q_f: float, periods: float) -> None:
    assert formulas.swim_expected_first_detection_periods(q_f) == pytest.approx(periods)
    assert formulas.swim_expected_first_detection_periods() == pytest.approx(1.582, abs=1e-3)
