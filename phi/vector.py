"""Vectorised phi with numpy: many peers or many instants scored in one pass.

For simulations, benchmarks, tests and offline analysis. The agent never imports
this module (numpy alone costs ~14 MiB of RSS against its 40 MiB budget); it
scores members with the pure-stdlib :mod:`phi.registry`, and the functions here
agree with that scalar code to floating-point rounding.

Sources and rules are those of :mod:`phi.formulas` (Akka
PhiAccrualFailureDetector.scala's logistic approximation of Hayashibara et al.
2004's normal model, evaluated as a stable softplus) and :mod:`phi.detector`
(window mean and population std from running sums, ``mean := window_mean +
acceptable_heartbeat_pause``, ``std := max(window_std, min_std_deviation)``,
phi 0.0 before the first heartbeat). Time is integer milliseconds passed in as
``now_ms``; nothing reads a clock.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from phi.formulas import LOGISTIC_A, LOGISTIC_B
from phi.registry import PhiRegistry

__all__ = ["phi_akka_array", "phi_array"]

_LN10 = math.log(10.0)


def phi_akka_array(
    elapsed_ms: npt.ArrayLike, mean_ms: npt.ArrayLike, std_ms: npt.ArrayLike
) -> npt.NDArray[np.float64]:
    """Vectorised :func:`phi.formulas.phi_akka`; arguments broadcast against each other."""
    elapsed = np.asarray(elapsed_ms, dtype=np.float64)
    mean = np.asarray(mean_ms, dtype=np.float64)
    std = np.asarray(std_ms, dtype=np.float64)
    if not bool(np.all(std > 0.0)) or not bool(np.all(np.isfinite(std))):
        raise ValueError("std_ms must be finite and > 0 everywhere")
    y = (elapsed - mean) / std
    x = y * (LOGISTIC_A + LOGISTIC_B * y * y)
    # log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|).
    result: npt.NDArray[np.float64] = (np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))) / _LN10
    return result


def phi_array(registry: PhiRegistry, now_ms: int) -> tuple[list[str], npt.NDArray[np.float64]]:
    """All of ``registry``'s peers' phi at ``now_ms`` (insertion order), in one numpy pass.

    Agrees with :meth:`PhiRegistry.phi_all` to rounding; a peer without a heartbeat
    scores 0.0.
    """
    rows = registry.window_sums()
    names = [name for name, _ in rows]
    beating = np.fromiter((sums is not None for _, sums in rows), dtype=np.bool_, count=len(rows))
    result = np.zeros(len(rows), dtype=np.float64)
    live = [sums for _, sums in rows if sums is not None]
    if not live:
        return names, result
    # Every value fits in int64 (phi.detector caps intervals for exactly this).
    table = np.array(live, dtype=np.int64).reshape(len(live), 4)
    sum_ms, sum_sq_ms2, count, last_ms = table.T
    config = registry.config
    # Same float conversions as phi.detector.window_mean_std_ms.
    count_f = count.astype(np.float64)
    mean_ms = sum_ms.astype(np.float64) / count_f
    variance_ms2 = sum_sq_ms2.astype(np.float64) / count_f - mean_ms * mean_ms
    std_ms = np.maximum(np.sqrt(np.maximum(variance_ms2, 0.0)), float(config.min_std_deviation_ms))
    elapsed_ms = (np.int64(now_ms) - last_ms).astype(np.float64)
    mean_ms += config.acceptable_heartbeat_pause_ms
    result[beating] = phi_akka_array(elapsed_ms, mean_ms, std_ms)
    return names, result
