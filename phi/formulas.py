"""Closed-form suspicion levels (phi) for accrual failure detection.

Pure functions only: no state, no clock, standard library only (``math``): the
agent scores every member through this module and must not pay for numpy. The
numpy versions live in :mod:`phi.vector`. Every time argument is in
milliseconds (``*_ms``); phi is dimensionless.

Definitions and sources:

* Hayashibara et al. 2004, "The phi accrual failure detector":
  ``phi(t_now) = -log10(P_later(t_now - T_last))`` with ``P_later(t) = 1 - F(t)``
  and ``F`` the CDF of ``N(mu, sigma^2)`` fitted to a sliding window of
  heartbeat inter-arrival times. phi = 1, 2, 3 means the probability that a
  live peer is merely this late is 10 %, 1 %, 0.1 %.
  :func:`phi_normal_exact` evaluates that tail exactly (via ``math.erfc``).
* Akka PhiAccrualFailureDetector.scala replaces ``F`` with the logistic
  approximation ``F(y) ~= 1 / (1 + exp(-y (1.5976 + 0.070566 y^2)))``,
  ``y = (elapsed - mean) / std`` ("error is 0.00014 at +-3.16").
  :func:`phi_akka` implements it (:func:`phi.vector.phi_akka_array` is the
  numpy version, equal to rounding). The caller passes the
  *effective* mean (Akka adds ``acceptable_heartbeat_pause`` to the window mean)
  and the *effective* std (Akka floors it at ``min_std_deviation``).
* Cassandra FailureDetector.java / CASSANDRA-2597 use an exponential model,
  ``P_later(t) = exp(-t / mu)``, hence ``phi = t / (mu ln 10)``
  (Cassandra's ``PHI_FACTOR = 1 / ln 10``): :func:`phi_exponential`.

Numerical rules:

* Akka computes ``e = exp(-x)`` with ``x = y (1.5976 + 0.070566 y^2)`` and then
  ``-log10(e / (1 + e))`` or ``-log10(1 - 1 / (1 + e))`` depending on the sign
  of ``elapsed - mean``. Both branches equal ``log10(1 + exp(x))``; we evaluate
  that as a stable softplus, so the result never overflows, never hits
  ``log10(0)`` and stays finite in the far tail where Akka's doubles give
  ``Infinity`` (``x > ~745``). Elsewhere it agrees with Akka to rounding.
* :func:`phi_normal_exact` switches from ``erfc`` to the asymptotic (Mills
  ratio) expansion of the normal tail once ``erfc`` would lose range, so it
  returns large finite values instead of ``inf``.
* A standard deviation must be strictly positive; a mean for the exponential
  model must be strictly positive. Violations raise ``ValueError``.
"""

from __future__ import annotations

import math

__all__ = [
    "LOGISTIC_A",
    "LOGISTIC_B",
    "PHI_FACTOR",
    "elapsed_to_reach_phi",
    "phi_akka",
    "phi_exponential",
    "phi_normal_exact",
]

# Coefficients of the logistic approximation used by Akka PhiAccrualFailureDetector.scala.
LOGISTIC_A = 1.5976
LOGISTIC_B = 0.070566

_LN10 = math.log(10.0)
# Cassandra FailureDetector.java: PHI_FACTOR = 1.0 / Math.log(10.0).
PHI_FACTOR = 1.0 / _LN10

# Beyond this many sigmas erfc drifts towards the subnormal range (Q(38) ~ 1e-316),
# while the 4-term asymptotic series is already accurate to ~1e-11 relative.
_ASYMPTOTIC_FROM_SIGMAS = 30.0
_HALF_LN_2PI = 0.5 * math.log(2.0 * math.pi)
_BISECTION_STEPS = 200


def _require_positive(name: str, value: float) -> None:
    if not value > 0.0 or math.isinf(value):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")


def phi_akka(elapsed_ms: float, mean_ms: float, std_ms: float) -> float:
    """Akka's phi: ``-log10(1 - F(elapsed))`` with the logistic approximation of F.

    ``mean_ms`` is the effective mean (window mean + acceptable pause) and
    ``std_ms`` the effective std (already floored), exactly as Akka passes them.
    """
    _require_positive("std_ms", std_ms)
    return _phi_akka(elapsed_ms, mean_ms, std_ms)


def _phi_akka(elapsed_ms: float, mean_ms: float, std_ms: float) -> float:
    """:func:`phi_akka` without the argument check, for callers whose std is floored >= 1."""
    y = (elapsed_ms - mean_ms) / std_ms
    x = y * (LOGISTIC_A + LOGISTIC_B * y * y)
    # log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|).
    if x > 0.0:
        return (x + math.log1p(math.exp(-x))) / _LN10
    return math.log1p(math.exp(x)) / _LN10


def _normal_tail_neg_ln(z: float) -> float:
    """``-ln Q(z)`` for the standard normal upper tail Q, finite for every finite z."""
    if z < _ASYMPTOTIC_FROM_SIGMAS:
        return -math.log(0.5 * math.erfc(z / math.sqrt(2.0)))
    # Mills-ratio expansion: Q(z) = phi(z)/z * (1 - 1/z^2 + 3/z^4 - 15/z^6 + 105/z^8 ...).
    inv2 = 1.0 / (z * z)
    series = 1.0 - inv2 * (1.0 - inv2 * (3.0 - inv2 * (15.0 - 105.0 * inv2)))
    return 0.5 * z * z + math.log(z) + _HALF_LN_2PI - math.log(series)


def phi_normal_exact(elapsed_ms: float, mean_ms: float, std_ms: float) -> float:
    """Hayashibara's phi with the exact normal tail: ``-log10(Q((elapsed - mean) / std))``."""
    _require_positive("std_ms", std_ms)
    z = (elapsed_ms - mean_ms) / std_ms
    # max() keeps its first argument on ties, turning -0.0 (tail exactly 1) into +0.0.
    return max(0.0, _normal_tail_neg_ln(z) / _LN10)


def phi_exponential(elapsed_ms: float, mean_ms: float) -> float:
    """Cassandra's exponential-model phi: ``elapsed / (mean ln 10)``.

    Negative elapsed time (a clock that went backwards) is treated as zero,
    since ``P_later(t) = 1`` for ``t <= 0``.
    """
    _require_positive("mean_ms", mean_ms)
    return PHI_FACTOR * max(elapsed_ms, 0.0) / mean_ms


def elapsed_to_reach_phi(phi: float, mean_ms: float, std_ms: float) -> float:
    """Smallest elapsed time (ms) at which :func:`phi_akka` reaches ``phi``.

    Inverts the Akka model by bisection (phi is strictly increasing in elapsed
    time); useful to report "silence to convict" for a threshold.
    """
    _require_positive("phi", phi)
    _require_positive("std_ms", std_ms)
    lo, hi = _bracket(phi, mean_ms, std_ms)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if phi_akka(mid, mean_ms, std_ms) >= phi:
            hi = mid
        else:
            lo = mid
    return hi


def _bracket(phi: float, mean_ms: float, std_ms: float) -> tuple[float, float]:
    """Return (lo, hi) with phi_akka(lo) < phi <= phi_akka(hi)."""
    step = std_ms
    lo = hi = mean_ms
    while phi_akka(lo, mean_ms, std_ms) >= phi:
        lo, step = lo - step, step * 2.0
    step = std_ms
    while phi_akka(hi, mean_ms, std_ms) < phi:
        hi, step = hi + step, step * 2.0
    return lo, hi
