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
* The window is a ring buffer holding the last ``max_sample_size`` intervals
  (an ``array('q')`` that grows to the window size, then overwrites its oldest
  entry), with running integer sum and sum of squares (Akka's HeartbeatHistory
  keeps them as ``Long``), so a heartbeat and a phi are both O(1).
* Standard library only (``array``, ``math``): the agent scores every member
  with this code and must not import numpy (its RSS budget);
  :mod:`phi.vector` holds the numpy versions.

Deviations from Akka, each deliberate:

* A heartbeat whose ``now_ms`` is earlier than the last one is ignored entirely
  (state unchanged): a reordered or clock-skewed report must not produce a
  negative interval. Equal timestamps are accepted (interval 0), as in Akka.
* Recorded intervals are capped at :attr:`PhiConfig.max_interval_ms` so the
  window's sum of squares always fits in an int64 (the ring is ``array('q')``
  and :mod:`phi.vector` copies the sums into numpy); the cap is over a day for
  any sane window and never changes a verdict.
* A window variance that rounds below zero is clamped to zero before ``sqrt``.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import NamedTuple

from phi.formulas import _phi_akka, elapsed_to_reach_phi

__all__ = ["PhiAccrualDetector", "PhiConfig", "WindowSums", "window_mean_std_ms"]

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
    in :mod:`phi.vector`, so scalar and vectorised windows are bit-identical.
    """
    mean_ms = float(sum_ms) / count
    variance_ms2 = float(sum_sq_ms2) / count - mean_ms * mean_ms
    return mean_ms, math.sqrt(max(variance_ms2, 0.0))


class WindowSums(NamedTuple):
    """A detector's running sums: everything phi depends on besides the config and now."""

    sum_ms: int
    sum_sq_ms2: int
    sample_count: int
    last_heartbeat_ms: int


class PhiAccrualDetector:
    """Phi accrual failure detector for one peer. Not thread-safe; time is passed in."""

    __slots__ = (
        "_config",
        "_intervals_ms",
        "_last_heartbeat_ms",
        "_min_std_ms",
        "_next",
        "_pause_ms",
        "_sum_ms",
        "_sum_sq_ms2",
        "_threshold",
        "_window",
    )

    def __init__(self, config: PhiConfig | None = None) -> None:
        self._config = config if config is not None else PhiConfig()
        # The config is frozen; copies of the fields read on every call save lookups.
        self._window = self._config.max_sample_size
        self._threshold = self._config.threshold
        self._pause_ms = float(self._config.acceptable_heartbeat_pause_ms)
        self._min_std_ms = float(self._config.min_std_deviation_ms)
        # Grows to the window size (its length is the sample count), then is a ring.
        self._intervals_ms = array("q")
        # Next write position once the ring is full; it is also the oldest sample.
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
        return len(self._intervals_ms)

    @property
    def mean_ms(self) -> float | None:
        """Mean interval of the window (without the acceptable pause); None if empty."""
        return self._stats()[0] if self._intervals_ms else None

    @property
    def std_ms(self) -> float | None:
        """Population std of the window (before the min_std floor); None if empty."""
        return self._stats()[1] if self._intervals_ms else None

    def intervals_ms(self) -> list[int]:
        """The window, oldest first."""
        ring = self._intervals_ms
        return ring[self._next :].tolist() + ring[: self._next].tolist()

    def window_sums(self) -> WindowSums | None:
        """The running sums and last heartbeat; None before the first heartbeat."""
        if self._last_heartbeat_ms is None:
            return None
        return WindowSums(
            self._sum_ms, self._sum_sq_ms2, len(self._intervals_ms), self._last_heartbeat_ms
        )

    def heartbeat(self, now_ms: int) -> None:
        """Record a heartbeat received at ``now_ms``; earlier-than-last ones are ignored."""
        last_ms = self._last_heartbeat_ms
        if last_ms is None:
            for interval_ms in self._config.bootstrap_intervals_ms():
                self._record(interval_ms)
        elif now_ms < last_ms:
            return
        elif self.phi(now_ms) < self._threshold:
            self._record(min(now_ms - last_ms, self._config.max_interval_ms))
        self._last_heartbeat_ms = now_ms

    def rebase(self, now_ms: int) -> None:
        """Count silence from ``now_ms`` without recording an interval: the monitored
        process declared a pause that has ended (torchhook's ``paused``), and the pause's
        gap is no sample of its heartbeat rhythm. Before the first heartbeat, or at or
        before the last one, nothing changes."""
        last_ms = self._last_heartbeat_ms
        if last_ms is not None and now_ms > last_ms:
            self._last_heartbeat_ms = now_ms

    def phi(self, now_ms: int) -> float:
        """Suspicion level at ``now_ms``; 0.0 before the first heartbeat."""
        last_ms = self._last_heartbeat_ms
        if last_ms is None:
            return 0.0
        # window_mean_std_ms and the Akka adjustments, inlined: this runs for every
        # member on every metrics scrape and on every heartbeat.
        count = len(self._intervals_ms)
        mean_ms = float(self._sum_ms) / count
        variance_ms2 = float(self._sum_sq_ms2) / count - mean_ms * mean_ms
        std_ms = math.sqrt(variance_ms2) if variance_ms2 > 0.0 else 0.0
        return _phi_akka(
            float(now_ms - last_ms),
            mean_ms + self._pause_ms,
            std_ms if std_ms > self._min_std_ms else self._min_std_ms,
        )

    def is_available(self, now_ms: int) -> bool:
        return self.phi(now_ms) < self._threshold

    def silence_to_convict_ms(self) -> float | None:
        """Silence after the last heartbeat at which phi reaches the threshold (model)."""
        if self._last_heartbeat_ms is None:
            return None
        mean_ms, std_ms = self._stats()
        return elapsed_to_reach_phi(
            self._config.threshold, mean_ms + self._pause_ms, max(std_ms, self._min_std_ms)
        )

    def _stats(self) -> tuple[float, float]:
        return window_mean_std_ms(self._sum_ms, self._sum_sq_ms2, len(self._intervals_ms))

    def _record(self, interval_ms: int) -> None:
        ring = self._intervals_ms
        if len(ring) < self._window:
            ring.append(interval_ms)
        else:
            position = self._next
            evicted_ms = ring[position]
            self._sum_ms -= evicted_ms
            self._sum_sq_ms2 -= evicted_ms * evicted_ms
            ring[position] = interval_ms
            position += 1
            self._next = 0 if position == self._window else position
        self._sum_ms += interval_ms
        self._sum_sq_ms2 += interval_ms * interval_ms
