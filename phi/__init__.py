"""Phi accrual failure detection (Hayashibara et al. 2004) with Akka's parameters.

* :mod:`phi.formulas` - pure phi functions: Akka's logistic approximation
  (Akka PhiAccrualFailureDetector.scala), the exact normal tail (Hayashibara et
  al. 2004) and the exponential model (Cassandra FailureDetector.java /
  CASSANDRA-2597).
* :mod:`phi.detector` - :class:`PhiConfig` and the single-peer
  :class:`PhiAccrualDetector`.
* :mod:`phi.registry` - :class:`PhiRegistry`, many named peers, O(1) each.
* :mod:`phi.vector` - the numpy versions: :func:`phi.vector.phi_akka_array` and
  :func:`phi.vector.phi_array` (a whole registry in one pass).

Layering rule: this package imports only the Python standard library and numpy,
never reads a clock or randomness, and does no I/O. Time is integer milliseconds
passed in by the caller (``now_ms``). numpy is imported by :mod:`phi.vector`
alone and never by this package's ``__init__``: the agent imports ``phi`` and
must stay free of numpy (about 14 MiB of RSS against its 40 MiB budget).
"""

from phi.detector import PhiAccrualDetector, PhiConfig, WindowSums
from phi.formulas import (
    elapsed_to_reach_phi,
    phi_akka,
    phi_exponential,
    phi_normal_exact,
)
from phi.registry import PhiRegistry, RegistryFullError

__all__ = [
    "PhiAccrualDetector",
    "PhiConfig",
    "PhiRegistry",
    "RegistryFullError",
    "WindowSums",
    "elapsed_to_reach_phi",
    "phi_akka",
    "phi_exponential",
    "phi_normal_exact",
]
