"""Single-peer phi accrual failure detector with Akka's parameters.

Sources: Hayashibara et al. 2004 (the model), Akka PhiAccrualFailureDetector.scala
(parameters, bootstrap, history rules, logistic approximation).

Rules (all as in Akka unless noted):

* Time is integer milliseconds supplied by the caller as ``now_ms``; this module
  never reads a clock.
* Before the first heartbeat phi is 0.0 (an unmanaged peer is treated as healthy).
* The first heartbeat records its timestamp and seeds the window with two
  bootstrap intervals, ``estimate - estimate // 4`` and ``estimate + estimate // 4``
  (``estimate = first_heartbeat_estimate_ms``); it adds no measured interval.
* A later heartbeat adds ``now_ms - last_heartbeat_ms`` to the window only if the
  peer is still available at ``now_ms`` (``phi < threshold``): the long gap that
  ends a failure would otherwise skew the statistics. The timestamp is always
  updated.
* phi uses ``mean := window_mean + acceptable_heartbeat_pause_ms`` and
  ``std := max(window_std, min_std_deviation_ms)``.
* The window is a fixed-size ring buffer holding the last ``max_sample_size``
  intervals, with running integer sum and sum of squares (Akka's HeartbeatHistory
  keeps them as ``Long``), so a heartbeat is O(1).

Deviations from Akka, each deliberate:

* A heartbeat whose ``now_ms`` is earlier than the last one is ignored entirely
  (state unchanged): a reordered or clock-skewed report must not produce a
  negative interval. Equal timestamps are accepted (interval 0), as in Akka.
* Recorded intervals are capped at :attr:`PhiConfig.max_interval_ms` so the
  window's sum of squares always fits in an int64 (the registry stores it in
  numpy); the cap is over a day for any sane window and never changes a verdict.
* A window variance that rounds below zero is clamped to zero before ``sqrt``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from phi.formulas import elapsed_to_reach_phi, phi_akka

__all__ = ["PhiAccrualDetector", "PhiConfig", "window_mean_std_ms"]

_INT64_MAX = 2**63 - 1


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class PhiConfig:
    """Detector parameters; defaults are Akka cluster's failure-detector defaults."""

    threshold: float = 8.0
    max_sample_size: int = 1000
    min_std_deviation_ms: int = 100
    acceptable_heartbeat_pause_ms: int = 3000
    first_heartbeat_estimate_ms: int = 1000

    def __post_init__(self) -> None:
        threshold: object = self.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise TypeError(f"threshold must be a number, got {type(threshold).__name__}")
        if not 0.0 < threshold < math.inf:
            raise ValueError(f"threshold must be finite and > 0, got {threshold}")
        # Two bootstrap samples must fit in the window.
        _require_int("max_sample_size", self.max_sample_size, 2)
        # A zero std would divide by zero in phi.
        _require_int("min_std_deviation_ms", self.min_std_deviation_ms, 1)
        _require_int("acceptable_heartbeat_pause_ms", self.acceptable_heartbeat_pause_ms, 0)
        _require_int("first_heartbeat_estimate_ms", self.first_heartbeat_estimate_ms, 1)
        largest_bootstrap_ms = max(self.bootstrap_intervals_ms())
        if largest_bootstrap_ms > self.max_interval_ms:
            raise ValueError(
                f"first_heartbeat_estimate_ms={self.first_heartbeat_estimate_ms} is too large "
                f"for max_sample_size={self.max_sample_size} (cap {self.max_interval_ms} ms)"
            )

    @classmethod
    def akka_cluster(cls) -> PhiConfig:
        """akka.cluster.failure-detector: threshold 8, window 1000, pause 3 s."""
        return cls()

    @classmethod
    def akka_remote_watch(cls) -> PhiConfig:
        """akka.remote.watch-failure-detector: threshold 10, window 200, pause 10 s."""
        return cls(threshold=10.0, max_sample_size=200, acceptable_heartbeat_pause_ms=10_000)

    @property
    def max_interval_ms(self) -> int:
        """Largest interval recorded; keeps ``max_sample_size * interval^2`` within int64."""
        return math.isqrt(_INT64_MAX // self.max_sample_size)

    def bootstrap_intervals_ms(self) -> tuple[int, int]:
        """Akka's two seed samples: ``estimate -/+ estimate // 4``."""
        quarter_ms = self.first_heartbeat_estimate_ms // 4
        return (
            self.first_heartbeat_estimate_ms - quarter_ms,
            self.first_heartbeat_estimate_ms + quarter_ms,
        )


def window_mean_std_ms(sum_ms: int, sum_sq_ms2: int, count: int) -> tuple[float, float]:
    """Mean and population std of a window from its running sums (Akka's HeartbeatHistory).

    Integers are converted to float before dividing, the same way numpy does it
    in the registry, so scalar and vectorised results are bit-identical.
    """
    mean_ms = float(sum_ms) / count
    variance_ms2 = float(sum_sq_ms2) / count - mean_ms * mean_ms
    return mean_ms, math.sqrt(max(variance_ms2, 0.0))


class PhiAccrualDetector:
    """Phi accrual failure detector for one peer. Not thread-safe; time is passed in."""

    def __init__(self, config: PhiConfig | None = None) -> None:
        self._config = config if config is not None else PhiConfig()
        self._intervals_ms: npt.NDArray[np.int64] = np.zeros(
            self._config.max_sample_size, dtype=np.int64
        )
        self._count = 0
        # Next write position; once the window is full it is also the oldest sample.
        self._next = 0
        self._sum_ms = 0
        self._sum_sq_ms2 = 0
        self._last_heartbeat_ms: int | None = None

    @property
    def config(self) -> PhiConfig:
        return self._config

    @property
    def last_heartbeat_ms(self) -> int | None:
        """Timestamp of the last accepted heartbeat, or None before the first."""
        return self._last_heartbeat_ms

    @property
    def sample_count(self) -> int:
        return self._count

    @property
    def mean_ms(self) -> float | None:
        """Mean interval of the window (without the acceptable pause); None if empty."""
        return self._stats()[0] if self._count else None

    @property
    def std_ms(self) -> float | None:
        """Population std of the window (before the min_std floor); None if empty."""
        return self._stats()[1] if self._count else None

    def intervals_ms(self) -> list[int]:
        """The window, oldest first."""
        if self._count < self._config.max_sample_size:
            return [int(v) for v in self._intervals_ms[: self._count]]
        return [int(v) for v in np.roll(self._intervals_ms, -self._next)]

    def heartbeat(self, now_ms: int) -> None:
        """Record a heartbeat received at ``now_ms``; earlier-than-last ones are ignored."""
        last_ms = self._last_heartbeat_ms
        if last_ms is None:
            for interval_ms in self._config.bootstrap_intervals_ms():
                self._record(interval_ms)
        elif now_ms < last_ms:
            return
        elif self.is_available(now_ms):
            self._record(min(now_ms - last_ms, self._config.max_interval_ms))
        self._last_heartbeat_ms = now_ms

    def phi(self, now_ms: int) -> float:
        """Suspicion level at ``now_ms``; 0.0 before the first heartbeat."""
        if self._last_heartbeat_ms is None:
            return 0.0
        mean_ms, std_ms = self._effective_mean_std_ms()
        return phi_akka(float(now_ms - self._last_heartbeat_ms), mean_ms, std_ms)

    def is_available(self, now_ms: int) -> bool:
        return self.phi(now_ms) < self._config.threshold

    def silence_to_convict_ms(self) -> float | None:
        """Silence after the last heartbeat at which phi reaches the threshold (model)."""
        if self._last_heartbeat_ms is None:
            return None
        mean_ms, std_ms = self._effective_mean_std_ms()
        return elapsed_to_reach_phi(self._config.threshold, mean_ms, std_ms)

    def _stats(self) -> tuple[float, float]:
        return window_mean_std_ms(self._sum_ms, self._sum_sq_ms2, self._count)

    def _effective_mean_std_ms(self) -> tuple[float, float]:
        mean_ms, std_ms = self._stats()
        return (
            mean_ms + self._config.acceptable_heartbeat_pause_ms,
            max(std_ms, float(self._config.min_std_deviation_ms)),
        )

    def _record(self, interval_ms: int) -> None:
        if self._count == self._config.max_sample_size:
            evicted_ms = int(self._intervals_ms[self._next])
            self._sum_ms -= evicted_ms
            self._sum_sq_ms2 -= evicted_ms * evicted_ms
        else:
            self._count += 1
        self._intervals_ms[self._next] = interval_ms
        self._sum_ms += interval_ms
        self._sum_sq_ms2 += interval_ms * interval_ms
        self._next = (self._next + 1) % self._config.max_sample_size
