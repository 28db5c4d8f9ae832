"""Tests for phi.formulas: closed-form phi values, quantile facts, inversion."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phi.formulas import (
    PHI_FACTOR,
    elapsed_to_reach_phi,
    phi_akka,
    phi_exponential,
    phi_normal_exact,
)
from phi.vector import phi_akka_array

LN10 = math.log(10.0)


def akka_reference(elapsed_ms: float, mean_ms: float, std_ms: float) -> float:
    """Literal transcription of Akka PhiAccrualFailureDetector.scala's phi(timeDiff, mean, std)."""
    y = (elapsed_ms - mean_ms) / std_ms
    e = math.exp(-y * (1.5976 + 0.070566 * y * y))
    if elapsed_ms > mean_ms:
        return -math.log10(e / (1.0 + e))
    return -math.log10(1.0 - 1.0 / (1.0 + e))


def logistic_phi(y: float) -> float:
    """Hand closed form: phi = -log10(1 - F(y)) = log10(1 + exp(y (1.5976 + 0.070566 y^2)))."""
    return math.log10(1.0 + math.exp(y * (1.5976 + 0.070566 * y * y)))


# Akka PhiAccrualFailureDetector.scala logistic approximation, expected values
# computed by hand from the closed form: phi = log10(1 + exp(x)), x = y (1.5976 + 0.070566 y^2).
# Columns: elapsed_ms, mean_ms, std_ms, expected phi.
AKKA_TABLE = [
    # elapsed == mean: F = 1/2, phi = -log10(0.5).
    (4000.0, 4000.0, 100.0, 0.30103),
    (1000.0, 1000.0, 250.0, math.log10(2.0)),
    # y = +1: x = 1.668166.
    (4100.0, 4000.0, 100.0, math.log10(1.0 + math.exp(1.668166))),
    # y = -1: x = -1.668166.
    (3900.0, 4000.0, 100.0, math.log10(1.0 + math.exp(-1.668166))),
    # y = +2: x = 2 (1.5976 + 0.282264) = 3.759728.
    (1500.0, 1000.0, 250.0, math.log10(1.0 + math.exp(3.759728))),
    # y = +3: x = 3 (1.5976 + 0.635094) = 6.698082.
    (4300.0, 4000.0, 100.0, math.log10(1.0 + math.exp(6.698082))),
    # y = +5.2: x = 5.2 (1.5976 + 1.90810464) = 18.229...; phi just below 8.
    (4520.0, 4000.0, 100.0, math.log10(1.0 + math.exp(5.2 * (1.5976 + 0.070566 * 27.04)))),
    # Far tail, y = +10: x = 86.542, phi ~= x / ln 10 (the log1p term is ~e^-86).
    (5000.0, 4000.0, 100.0, 86.542 / LN10),
    # Far tail, y = +25: x = 25 (1.5976 + 44.10375) = 1142.534375. Akka's doubles give
    # Infinity here (exp underflows to 0); the stable form keeps it finite.
    (6500.0, 4000.0, 100.0, 1142.534375 / LN10),
    # Deep "early" side, y = -25: exp(x) underflows, phi = 0 (as in Akka).
    (1500.0, 4000.0, 100.0, 0.0),
    (0.0, 4000.0, 100.0, 0.0),
]


@pytest.mark.parametrize(("elapsed_ms", "mean_ms", "std_ms", "expected"), AKKA_TABLE)
def test_phi_akka_table(elapsed_ms: float, mean_ms: float, std_ms: float, expected: float) -> None:
    assert phi_akka(elapsed_ms, mean_ms, std_ms) == pytest.approx(expected, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(("elapsed_ms", "mean_ms", "std_ms", "expected"), AKKA_TABLE)
def test_phi_akka_array_table(
    elapsed_ms: float, mean_ms: float, std_ms: float, expected: float
) -> None:
    got = phi_akka_array(np.array([elapsed_ms]), mean_ms, std_ms)
    assert got.shape == (1,)
    assert float(got[0]) == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_phi_akka_far_tail_is_finite_where_akka_overflows() -> None:
    # Akka PhiAccrualFailureDetector.scala: e = exp(-x) underflows to 0 and -log10(0) = Infinity.
    assert phi_akka(1e6, 4000.0, 100.0) > 1e10
    assert math.isfinite(phi_akka(1e6, 4000.0, 100.0))
    assert np.all(np.isfinite(phi_akka_array([1e6, 1e9], 4000.0, 100.0)))


@given(
    y=st.floats(min_value=-20.0, max_value=20.0),
    mean_ms=st.floats(min_value=0.0, max_value=1e6),
    std_ms=st.floats(min_value=1.0, max_value=1e5),
)
def test_phi_akka_matches_literal_akka_code(y: float, mean_ms: float, std_ms: float) -> None:
    # Same function as Akka's two-branch code, wherever Akka's result is finite.
    elapsed_ms = mean_ms + y * std_ms
    expected = akka_reference(elapsed_ms, mean_ms, std_ms)
    assert phi_akka(elapsed_ms, mean_ms, std_ms) == pytest.approx(expected, rel=1e-9, abs=1e-12)


# The naive closed form loses digits for y << 0 (1 + tiny) and overflows for y > ~20.
@given(y=st.floats(min_value=-4.0, max_value=19.0))
def test_phi_akka_equals_hand_closed_form(y: float) -> None:
    assert phi_akka(y, 0.0, 1.0) == pytest.approx(logistic_phi(y), rel=1e-9)


@given(
    a=st.floats(min_value=-1e5, max_value=1e5),
    b=st.floats(min_value=-1e5, max_value=1e5),
)
def test_phi_akka_monotone_in_elapsed(a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert phi_akka(lo, 4000.0, 100.0) <= phi_akka(hi, 4000.0, 100.0)


def test_phi_akka_array_equals_scalar_and_broadcasts() -> None:
    elapsed = np.linspace(-5000.0, 20000.0, 501)
    means = np.array([[1000.0], [4000.0], [11000.0]])
    got = phi_akka_array(elapsed, means, 100.0)
    assert got.shape == (3, 501)
    for i, mean_ms in enumerate(means[:, 0]):
        expected = [phi_akka(float(e), float(mean_ms), 100.0) for e in elapsed]
        np.testing.assert_allclose(got[i], expected, rtol=1e-12, atol=1e-12)


def test_logistic_approximation_error_bound() -> None:
    # Akka PhiAccrualFailureDetector.scala quotes a CDF error of 0.00014 for the logistic
    # approximation; the maximum over the line is 1.404e-4 (reached near |y| = 2.69).
    ys = np.linspace(-8.0, 8.0, 16001)
    logistic_cdf = 1.0 / (1.0 + np.exp(-ys * (1.5976 + 0.070566 * ys * ys)))
    normal_cdf = np.array([0.5 * math.erfc(-y / math.sqrt(2.0)) for y in ys])
    assert float(np.max(np.abs(logistic_cdf - normal_cdf))) < 1.45e-4


@pytest.mark.parametrize("bad_std", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_std_rejected(bad_std: float) -> None:
    with pytest.raises(ValueError, match="std_ms"):
        phi_akka(1.0, 1.0, bad_std)
    with pytest.raises(ValueError, match="std_ms"):
        phi_normal_exact(1.0, 1.0, bad_std)
    with pytest.raises(ValueError, match="std_ms"):
        phi_akka_array([1.0, 2.0], 1.0, [1.0, bad_std])


# Normal-model quantile facts (Hayashibara et al. 2004, exact normal tail):
# phi = -log10(Q(z)). phi 1/2/3 <=> P(alive but late) = 10 % / 1 % / 0.1 %;
# phi 8/10/12 are reached 5.612/6.361/7.034 sigma beyond the mean.
NORMAL_QUANTILES = [
    (1.2816, 1.0),
    (2.3263, 2.0),
    (3.0902, 3.0),
    (5.612, 8.0),
    (6.361, 10.0),
    (7.034, 12.0),
]


@pytest.mark.parametrize(("z", "expected_phi"), NORMAL_QUANTILES)
def test_phi_normal_exact_quantiles(z: float, expected_phi: float) -> None:
    mean_ms, std_ms = 4000.0, 100.0
    got = phi_normal_exact(mean_ms + z * std_ms, mean_ms, std_ms)
    assert got == pytest.approx(expected_phi, abs=0.01)


def test_phi_normal_exact_at_mean_and_early() -> None:
    # Hayashibara et al. 2004: at the mean half of live peers are later, phi = -log10(0.5).
    assert phi_normal_exact(1000.0, 1000.0, 10.0) == pytest.approx(math.log10(2.0), abs=1e-15)
    assert phi_normal_exact(-1e9, 1000.0, 10.0) == 0.0
    assert math.copysign(1.0, phi_normal_exact(-1e9, 1000.0, 10.0)) == 1.0


def test_phi_normal_exact_far_tail_is_finite_and_continuous() -> None:
    # erfc alone would underflow to 0 near 38 sigma and -log10(0) would fail.
    below = phi_normal_exact(30.0 - 1e-9, 0.0, 1.0)
    above = phi_normal_exact(30.0, 0.0, 1.0)
    assert above == pytest.approx(below, rel=1e-9)
    huge = phi_normal_exact(1e4, 0.0, 1.0)
    # Leading term: z^2 / (2 ln 10).
    assert math.isfinite(huge)
    assert huge == pytest.approx(1e8 / (2.0 * LN10), rel=1e-6)


@given(
    a=st.floats(min_value=-100.0, max_value=1000.0),
    b=st.floats(min_value=-100.0, max_value=1000.0),
)
def test_phi_normal_exact_monotone(a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert phi_normal_exact(lo, 0.0, 1.0) <= phi_normal_exact(hi, 0.0, 1.0)


# Exponential model, Cassandra FailureDetector.java / CASSANDRA-2597:
# P_later(t) = exp(-t / mu) => phi = t / (mu ln 10), PHI_FACTOR = 1 / ln 10.
# Columns: elapsed_ms, mean_ms, expected phi.
EXPONENTIAL_TABLE = [
    (0.0, 1000.0, 0.0),
    (1000.0 * LN10, 1000.0, 1.0),
    (1000.0 * LN10 * 8.0, 1000.0, 8.0),
    (250.0 * LN10 * 12.0, 250.0, 12.0),
    (1000.0, 1000.0, 1.0 / LN10),
    # Cassandra: with threshold 8, conviction after 8 ln 10 = 18.42 mean intervals of silence.
    (18.42 * 1000.0, 1000.0, 18.42 / LN10),
    # A clock that runs backwards means "not late at all".
    (-500.0, 1000.0, 0.0),
]


@pytest.mark.parametrize(("elapsed_ms", "mean_ms", "expected"), EXPONENTIAL_TABLE)
def test_phi_exponential_table(elapsed_ms: float, mean_ms: float, expected: float) -> None:
    assert phi_exponential(elapsed_ms, mean_ms) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_cassandra_convicts_after_about_18_4_means() -> None:
    # Cassandra FailureDetector.java / CASSANDRA-2597: phi = 8 at t = 8 ln 10 mu = 18.42 mu.
    assert math.isclose(PHI_FACTOR, 1.0 / LN10, rel_tol=1e-15)
    mean_ms = 1000.0
    assert phi_exponential(18.3 * mean_ms, mean_ms) < 8.0
    assert phi_exponential(18.5 * mean_ms, mean_ms) > 8.0
    assert math.isclose(8.0 * LN10, 18.42, abs_tol=0.005)


@pytest.mark.parametrize("bad_mean", [0.0, -1.0, math.nan])
def test_phi_exponential_rejects_bad_mean(bad_mean: float) -> None:
    with pytest.raises(ValueError, match="mean_ms"):
        phi_exponential(1.0, bad_mean)


# Silence to convict in the Akka model (Akka PhiAccrualFailureDetector.scala, with the
# Akka cluster / remote-watch defaults): steady 1000 ms beats give window std 0, so the
# effective std is min_std_deviation (100 ms) and the effective mean is 1000 ms + pause.
# Columns: threshold, effective mean_ms, std_ms, expected silence_ms, tolerance_ms.
SILENCE_TABLE = [
    (8.0, 4000.0, 100.0, 4520.0, 100.0),
    (10.0, 11000.0, 100.0, 11600.0, 100.0),
    # phi = log10(2) exactly at the mean.
    (math.log10(2.0), 4000.0, 100.0, 4000.0, 1e-6),
]


@pytest.mark.parametrize(("threshold", "mean_ms", "std_ms", "expected_ms", "tol_ms"), SILENCE_TABLE)
def test_elapsed_to_reach_phi_table(
    threshold: float, mean_ms: float, std_ms: float, expected_ms: float, tol_ms: float
) -> None:
    assert elapsed_to_reach_phi(threshold, mean_ms, std_ms) == pytest.approx(
        expected_ms, abs=tol_ms
    )


@given(
    phi=st.floats(min_value=1e-6, max_value=500.0),
    mean_ms=st.floats(min_value=0.0, max_value=1e5),
    std_ms=st.floats(min_value=1.0, max_value=1e4),
)
def test_elapsed_to_reach_phi_inverts_phi_akka(phi: float, mean_ms: float, std_ms: float) -> None:
    elapsed_ms = elapsed_to_reach_phi(phi, mean_ms, std_ms)
    assert phi_akka(elapsed_ms, mean_ms, std_ms) >= phi
    assert phi_akka(elapsed_ms, mean_ms, std_ms) == pytest.approx(phi, rel=1e-6)
    # The answer is the boundary: the next smaller double is still below the target.
    assert phi_akka(math.nextafter(elapsed_ms, -math.inf), mean_ms, std_ms) < phi


@pytest.mark.parametrize("bad_phi", [0.0, -1.0, math.nan, math.inf])
def test_elapsed_to_reach_phi_rejects_bad_phi(bad_phi: float) -> None:
    with pytest.raises(ValueError, match="phi"):
        elapsed_to_reach_phi(bad_phi, 1000.0, 100.0)
