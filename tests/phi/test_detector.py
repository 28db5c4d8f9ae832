"""Tests for phi.detector: config, bootstrap, history rules, window, model facts.

Behaviour follows Akka PhiAccrualFailureDetector.scala; see phi/detector.py for the rules.
Time is plain integers (ms); nothing sleeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phi.detector import PhiAccrualDetector, PhiConfig, WindowSums, window_mean_std_ms
from phi.formulas import phi_akka


def steady(detector: PhiAccrualDetector, beats: int, interval_ms: int, start_ms: int = 0) -> int:
    """Feed ``beats`` heartbeats ``interval_ms`` apart; return the last timestamp."""
    now_ms = start_ms
    for i in range(beats):
        now_ms = start_ms + i * interval_ms
        detector.heartbeat(now_ms)
    return now_ms


def first_convicting_silence_ms(detector: PhiAccrualDetector, last_ms: int) -> int:
    """Smallest integer silence with phi >= threshold, by bisection over detector.phi."""
    threshold = detector.config.threshold
    lo, hi = 0, 1
    while detector.phi(last_ms + hi) < threshold:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if detector.phi(last_ms + mid) >= threshold:
            hi = mid
        else:
            lo = mid
    return hi


# --- configuration ---------------------------------------------------------------


def test_defaults_are_akka_cluster_defaults() -> None:
    # Akka cluster reference.conf (failure-detector section).
    config = PhiConfig()
    assert config == PhiConfig.akka_cluster()
    assert config.threshold == 8.0
    assert config.max_sample_size == 1000
    assert config.min_std_deviation_ms == 100
    assert config.acceptable_heartbeat_pause_ms == 3000
    assert config.first_heartbeat_estimate_ms == 1000


def test_akka_remote_watch_preset() -> None:
    # Akka remote reference.conf (watch-failure-detector section).
    config = PhiConfig.akka_remote_watch()
    assert config.threshold == 10.0
    assert config.max_sample_size == 200
    assert config.min_std_deviation_ms == 100
    assert config.acceptable_heartbeat_pause_ms == 10_000
    assert config.first_heartbeat_estimate_ms == 1000


def test_config_is_frozen() -> None:
    config = PhiConfig()
    with pytest.raises(AttributeError):
        config.threshold = 1.0  # type: ignore[misc]


# Columns: keyword, bad value, expected exception, message fragment.
INVALID_CONFIGS: list[tuple[str, object, type[Exception], str]] = [
    ("threshold", 0.0, ValueError, "threshold"),
    ("threshold", -1.0, ValueError, "threshold"),
    ("threshold", math.nan, ValueError, "threshold"),
    ("threshold", math.inf, ValueError, "threshold"),
    ("threshold", True, TypeError, "threshold"),
    ("threshold", "8", TypeError, "threshold"),
    ("max_sample_size", 1, ValueError, "max_sample_size"),
    ("max_sample_size", 0, ValueError, "max_sample_size"),
    ("max_sample_size", -5, ValueError, "max_sample_size"),
    ("max_sample_size", 10.0, TypeError, "max_sample_size"),
    ("min_std_deviation_ms", 0, ValueError, "min_std_deviation_ms"),
    ("min_std_deviation_ms", -100, ValueError, "min_std_deviation_ms"),
    ("acceptable_heartbeat_pause_ms", -1, ValueError, "acceptable_heartbeat_pause_ms"),
    ("acceptable_heartbeat_pause_ms", 1.5, TypeError, "acceptable_heartbeat_pause_ms"),
    ("first_heartbeat_estimate_ms", 0, ValueError, "first_heartbeat_estimate_ms"),
    ("first_heartbeat_estimate_ms", -1000, ValueError, "first_heartbeat_estimate_ms"),
    ("first_heartbeat_estimate_ms", 10**12, ValueError, "first_heartbeat_estimate_ms"),
]


@pytest.mark.parametrize(("field", "value", "error", "fragment"), INVALID_CONFIGS)
def test_config_validation(
    field: str, value: object, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        PhiConfig(**{field: value})  # type: ignore[arg-type]


def test_config_accepts_boundaries() -> None:
    config = PhiConfig(
        threshold=1e-3,
        max_sample_size=2,
        min_std_deviation_ms=1,
        acceptable_heartbeat_pause_ms=0,
        first_heartbeat_estimate_ms=1,
    )
    assert config.bootstrap_intervals_ms() == (1, 1)


def test_max_interval_keeps_sum_of_squares_in_int64() -> None:
    config = PhiConfig()
    assert config.max_interval_ms == 96_038_388
    assert config.max_sample_size * config.max_interval_ms**2 <= 2**63 - 1
    assert config.max_sample_size * (config.max_interval_ms + 1) ** 2 > 2**63 - 1


# --- bootstrap -------------------------------------------------------------------


def test_phi_is_zero_before_first_heartbeat() -> None:
    detector = PhiAccrualDetector()
    assert detector.phi(0) == 0.0
    assert detector.phi(10**9) == 0.0
    assert detector.is_available(10**9)
    assert detector.last_heartbeat_ms is None
    assert detector.mean_ms is None
    assert detector.std_ms is None
    assert detector.sample_count == 0
    assert detector.silence_to_convict_ms() is None


def test_first_heartbeat_seeds_bootstrap_history() -> None:
    # Akka PhiAccrualFailureDetector.scala firstHeartbeat: mean +- mean / 4, no real interval.
    detector = PhiAccrualDetector()
    detector.heartbeat(5_000)
    assert detector.last_heartbeat_ms == 5_000
    assert detector.intervals_ms() == [750, 1250]
    assert detector.mean_ms == 1000.0
    assert detector.std_ms == 250.0
    # phi uses mean + pause (4000) and max(250, 100).
    assert detector.phi(5_000) == phi_akka(0.0, 4000.0, 250.0)
    assert detector.phi(9_000) == pytest.approx(math.log10(2.0))


def test_bootstrap_uses_integer_quarter() -> None:
    detector = PhiAccrualDetector(PhiConfig(first_heartbeat_estimate_ms=1001))
    detector.heartbeat(0)
    assert detector.intervals_ms() == [751, 1251]


def test_second_heartbeat_adds_measured_interval() -> None:
    detector = PhiAccrualDetector()
    detector.heartbeat(0)
    detector.heartbeat(1_200)
    assert detector.intervals_ms() == [750, 1250, 1200]
    assert detector.last_heartbeat_ms == 1_200
    assert detector.mean_ms == pytest.approx((750 + 1250 + 1200) / 3)


# --- history rules ---------------------------------------------------------------


def test_gap_after_failure_is_not_added_to_history() -> None:
    # Akka: `if (isAvailable(timestamp)) history :+ interval else history`.
    detector = PhiAccrualDetector()
    last_ms = steady(detector, 20, 1000)
    before = detector.intervals_ms()
    resumed_ms = last_ms + 60_000
    assert not detector.is_available(resumed_ms)
    detector.heartbeat(resumed_ms)
    assert detector.intervals_ms() == before
    assert detector.last_heartbeat_ms == resumed_ms
    # The peer is healthy again right away, and the next regular gap is recorded.
    assert detector.phi(resumed_ms) < 1.0
    detector.heartbeat(resumed_ms + 1000)
    assert detector.intervals_ms() == [*before, 1000]


def test_long_gap_while_still_available_is_added() -> None:
    detector = PhiAccrualDetector()
    last_ms = steady(detector, 20, 1000)
    assert detector.is_available(last_ms + 3_500)
    detector.heartbeat(last_ms + 3_500)
    assert detector.intervals_ms()[-1] == 3_500


def test_earlier_heartbeat_is_ignored() -> None:
    detector = PhiAccrualDetector()
    steady(detector, 5, 1000)
    state = (detector.intervals_ms(), detector.last_heartbeat_ms, detector.phi(6_000))
    detector.heartbeat(3_999)
    assert (detector.intervals_ms(), detector.last_heartbeat_ms, detector.phi(6_000)) == state


def test_equal_timestamp_adds_zero_interval() -> None:
    # As in Akka: only strictly earlier timestamps are dropped.
    detector = PhiAccrualDetector()
    detector.heartbeat(1_000)
    detector.heartbeat(1_000)
    assert detector.intervals_ms() == [750, 1250, 0]


def test_interval_is_capped_at_max_interval() -> None:
    # A pause so generous that a day-long gap still counts as "available".
    config = PhiConfig(acceptable_heartbeat_pause_ms=10**9)
    detector = PhiAccrualDetector(config)
    detector.heartbeat(0)
    detector.heartbeat(200_000_000)
    assert detector.intervals_ms()[-1] == config.max_interval_ms


# --- window ----------------------------------------------------------------------


def test_window_evicts_oldest_at_max_sample_size() -> None:
    detector = PhiAccrualDetector(PhiConfig(max_sample_size=5))
    now_ms = 0
    detector.heartbeat(now_ms)
    for interval_ms in [1000, 1010, 1020, 1030, 1040, 1050]:
        now_ms += interval_ms
        detector.heartbeat(now_ms)
    assert detector.sample_count == 5
    # Bootstrap samples (750, 1250) and the first measured interval were pushed out.
    assert detector.intervals_ms() == [1010, 1020, 1030, 1040, 1050]
    assert detector.mean_ms == pytest.approx(1030.0, abs=1e-12)
    assert detector.std_ms == pytest.approx(float(np.std([1010, 1020, 1030, 1040, 1050])))


@given(
    window=st.integers(min_value=2, max_value=12),
    gaps_ms=st.lists(st.integers(min_value=-50, max_value=5000), min_size=1, max_size=60),
)
def test_running_sums_match_window(window: int, gaps_ms: Sequence[int]) -> None:
    detector = PhiAccrualDetector(PhiConfig(max_sample_size=window))
    now_ms = 10_000
    detector.heartbeat(now_ms)
    for gap_ms in gaps_ms:
        now_ms += gap_ms
        detector.heartbeat(now_ms)
    samples = detector.intervals_ms()
    assert len(samples) == detector.sample_count <= window
    assert detector.mean_ms == pytest.approx(float(np.mean(samples)), rel=1e-12)
    assert detector.std_ms == pytest.approx(float(np.std(samples)), rel=1e-6, abs=1e-6)
    # The running sums are exact integers over the ring, however often it wrapped.
    last_ms = detector.last_heartbeat_ms
    assert last_ms is not None
    assert detector.window_sums() == WindowSums(
        sum(samples), sum(v * v for v in samples), len(samples), last_ms
    )


def test_window_sums_none_before_first_heartbeat() -> None:
    detector = PhiAccrualDetector(PhiConfig(max_sample_size=3))
    assert detector.window_sums() is None
    detector.heartbeat(7_000)
    assert detector.window_sums() == WindowSums(2000, 750**2 + 1250**2, 2, 7_000)


def test_phi_equals_phi_akka_on_effective_mean_and_std() -> None:
    # Akka: mean := window mean + acceptable pause, std := max(window std, min std).
    config = PhiConfig(
        max_sample_size=10, min_std_deviation_ms=40, acceptable_heartbeat_pause_ms=700
    )
    detector = PhiAccrualDetector(config)
    for now_ms in (0, 1000, 2010, 2990, 4000, 5100):
        detector.heartbeat(now_ms)
    assert detector.mean_ms is not None
    assert detector.std_ms is not None
    for probe_ms in (5100, 5900, 6800, 7500, 9000, 60_000):
        expected = phi_akka(
            float(probe_ms - 5100), detector.mean_ms + 700, max(detector.std_ms, 40.0)
        )
        assert detector.phi(probe_ms) == expected
    # A steady peer hits the floor: std 0 is replaced by min_std_deviation_ms.
    steady_detector = PhiAccrualDetector(PhiConfig(max_sample_size=2, min_std_deviation_ms=40))
    for now_ms in (0, 1000, 2000, 3000):
        steady_detector.heartbeat(now_ms)
    assert steady_detector.std_ms == 0.0
    assert steady_detector.phi(4500) == phi_akka(1500.0, 1000.0 + 3000, 40.0)


def test_window_mean_std_from_sums() -> None:
    # Akka HeartbeatHistory: mean = sum / n, variance = sum_sq / n - mean^2.
    assert window_mean_std_ms(3000, 3_125_000, 3) == pytest.approx(
        (1000.0, math.sqrt(3_125_000 / 3 - 1000.0**2))
    )
    # Rounding can push the variance below zero; it is clamped rather than NaN.
    assert window_mean_std_ms(3, 3, 3) == (1.0, 0.0)


# --- model facts -----------------------------------------------------------------


def test_akka_cluster_defaults_convict_after_about_4_52_s() -> None:
    # Akka cluster defaults with steady 1 s heartbeats. Once the bootstrap samples are
    # evicted the window std is 0, so min_std_deviation (100 ms) dominates: phi uses
    # mean = 1000 + 3000 ms and std = 100 ms, and phi = 8 needs y ~= 5.22, i.e.
    # 4000 + 522 ms of silence.
    detector = PhiAccrualDetector(PhiConfig.akka_cluster())
    last_ms = steady(detector, 1100, 1000)
    assert detector.std_ms == 0.0
    silence_ms = first_convicting_silence_ms(detector, last_ms)
    assert silence_ms == pytest.approx(4520, abs=100)
    model_ms = detector.silence_to_convict_ms()
    assert model_ms is not None
    assert silence_ms - 1 < model_ms <= silence_ms
    assert detector.is_available(last_ms + silence_ms - 1)
    assert not detector.is_available(last_ms + silence_ms)


def test_akka_remote_watch_convicts_after_about_11_6_s() -> None:
    # Akka remote watch: threshold 10, pause 10 s; std floored at 100 ms as above.
    detector = PhiAccrualDetector(PhiConfig.akka_remote_watch())
    last_ms = steady(detector, 300, 1000)
    assert first_convicting_silence_ms(detector, last_ms) == pytest.approx(11_600, abs=100)


def test_jittery_heartbeats_take_longer_to_convict() -> None:
    # Hayashibara et al. 2004: the threshold adapts to the observed variance.
    calm = PhiAccrualDetector(PhiConfig(min_std_deviation_ms=1))
    jittery = PhiAccrualDetector(PhiConfig(min_std_deviation_ms=1))
    steady(calm, 200, 1000)
    now_ms = 0
    for i in range(200):
        jittery.heartbeat(now_ms)
        now_ms += 500 if i % 2 else 1500
    calm_ms = calm.silence_to_convict_ms()
    jittery_ms = jittery.silence_to_convict_ms()
    assert calm_ms is not None
    assert jittery_ms is not None
    assert jittery_ms > calm_ms + 1000


@given(silences_ms=st.lists(st.integers(min_value=-1000, max_value=20_000), min_size=2))
def test_phi_is_monotone_in_silence(silences_ms: list[int]) -> None:
    detector = PhiAccrualDetector()
    last_ms = steady(detector, 10, 1000)
    phis = [detector.phi(last_ms + s) for s in sorted(silences_ms)]
    assert phis == sorted(phis)
    assert all(p >= 0.0 for p in phis)
