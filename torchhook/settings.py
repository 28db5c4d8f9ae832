"""Every option of the elastic engine, in one frozen dataclass checked on construction.

A wrong value raises ``SettingsError`` naming the field before anything is built (no agent
connection, no store, no process group). The parallelism's own options (checkpoint
directory, mesh shape) belong to its strategy object, not here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchhook.errors import ReformBudgetSpent, SettingsError

__all__ = ["QUORUMS", "ReformBudget", "Settings"]

QUORUMS = ("majority", "any")
SLOW_POLICIES = ("report", "exclude", "replace", "off")
"""What a node flagged slow gets (docs/training.md, "Slow nodes")."""
MAX_SLOW_WINDOWS = 1_000
MAX_SLOW_WINDOW_STEPS = 100_000
"""Bounds of the fail-slow windows: beyond them a slow node would never be flagged in a
job's lifetime, which is a mistake, not a policy (``slow_policy="off"`` turns it off)."""
BACKENDS = ("gloo", "nccl")
MAX_REFORM_ATTEMPTS = 10_000
"""A re-formation budget larger than this is a mistake, not a policy."""
MAX_TARGET_NODES = 100_000
"""A target beyond this many nodes is a mistake, not a job."""
MAX_SPARE_WAIT_S = 30 * 86_400.0
"""A spare that waits longer than a month is forgotten, not kept in reserve."""
RETRY_WAIT_S = 0.2
"""After a formation whose leader was unreachable: wait at least this long for a new view."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Options of one trainer process; every field but ``job`` has a default.

    Bounds: ``formation_timeout_s`` bounds one agreement, ``reform_attempts`` and
    ``reform_timeout_s`` the failed formations in a row (with backoff between them),
    ``join_timeout_s`` the wait for a view the job can use (``min_nodes``, quorum),
    ``pg_timeout_s`` every collective as a backstop (the verdict ends ours first)."""

    job: str
    control: str | Path | None = None
    """The agent's control socket (default: ``SWIM_CONTROL``, else the agent's default)."""
    min_nodes: int = 1
    quorum: str = "majority"
    """``majority``: a member of a previous group re-forms only with a strict majority of
    that group's nodes (a partitioned minority waits); ``any``: no such rule."""
    pg_timeout_s: float = 60.0
    formation_timeout_s: float = 30.0
    join_timeout_s: float = 600.0
    reform_attempts: int = 50
    """Failed formations in a row before the job stops (``ReformBudgetSpent``)."""
    reform_timeout_s: float = 300.0
    """Time from the first failed formation in a row until the job stops."""
    reform_backoff_s: float = 0.05
    """Wait before the third attempt (the second runs at once); doubles per failure. A
    new view ends the wait early."""
    reform_backoff_max_s: float = 2.0
    heartbeat_pause_ms: int = 30_000
    store_host: str = "0.0.0.0"
    local_rank: int | None = None
    """Default: torchrun's ``LOCAL_RANK``, else 0."""
    local_world_size: int | None = None
    """Default: torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    backend: str | None = None
    """``gloo`` or ``nccl``; default ``nccl`` when CUDA is available, else ``gloo``."""
    slow_policy: str = "report"
    """A node flagged slow (``torchhook.slowness``): ``report`` (its agent's metric and
    ``job-slow`` event), ``exclude`` (also left out of the next group at once), ``off``
    (no measuring, no all-gather)."""
    slow_factor: float = 1.3
    """Slow: a node's step compute time at least this many times the job's median."""
    slow_windows: int = 2
    """Slow windows in a row that flag a node (and healthy ones that clear the flag)."""
    slow_quick_factor: float = 2.0
    """A node at least this many times the job's median in one window is flagged at once,
    without waiting for ``slow_windows``; 0 turns the quick flag off, else >= ``slow_factor``."""
    slow_window_steps: int = 10
    """Steps per window: every rank shares its median step time once per window."""
    target_nodes: int = 0
    """The job's size in nodes; nodes beyond it are spares that wait and take a lost
    node's place (``torchhook.roster``). 0: every node trains."""
    spare: bool = False
    """Start as a spare: register only once the job's view lists ``target_nodes`` nodes
    (needs ``target_nodes``)."""
    spare_wait_s: float = 7 * 86_400.0
    """How long a spare waits to be drafted before it stops (``SpareWaitOver``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not self.job:
            raise SettingsError(f"job must be a non-empty string, got {self.job!r}")
        if self.quorum not in QUORUMS:
            raise SettingsError(f"quorum must be one of {QUORUMS}, got {self.quorum!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise SettingsError(f"backend must be one of {BACKENDS} or None, got {self.backend!r}")
        _int_at_least("min_nodes", self.min_nodes, 1)
        _int_at_least("reform_attempts", self.reform_attempts, 1, MAX_REFORM_ATTEMPTS)
        _int_at_least("heartbeat_pause_ms", self.heartbeat_pause_ms, 1)
        _check_slow(self)
        _int_at_least("target_nodes", self.target_nodes, 0, MAX_TARGET_NODES)
        if not isinstance(self.spare, bool):
            raise SettingsError(f"spare must be a bool, got {self.spare!r}")
        if self.spare and self.target_nodes == 0:
            raise SettingsError("spare=True needs target_nodes > 0 (the job's size in nodes)")
        _positive("spare_wait_s", self.spare_wait_s)
        if self.spare_wait_s > MAX_SPARE_WAIT_S:
            raise SettingsError(
                f"spare_wait_s must be <= {MAX_SPARE_WAIT_S}, got {self.spare_wait_s!r}"
            )
        for name in ("pg_timeout_s", "formation_timeout_s", "join_timeout_s", "reform_timeout_s"):
            _positive(name, getattr(self, name))
        _positive("reform_backoff_s", self.reform_backoff_s, zero_ok=True)
        _positive("reform_backoff_max_s", self.reform_backoff_max_s, zero_ok=True)
        if self.reform_backoff_max_s < self.reform_backoff_s:
            raise SettingsError("reform_backoff_max_s must be >= reform_backoff_s")
        if self.local_rank is not None:
            _int_at_least("local_rank", self.local_rank, 0)
        if self.local_world_size is not None:
            _int_at_least("local_world_size", self.local_world_size, 1)
            if self.local_rank is not None and self.local_rank >= self.local_world_size:
                raise SettingsError(
                    f"local_rank ({self.local_rank}) must be < local_world_size "
                    f"({self.local_world_size})"
                )


def _check_slow(s: Settings) -> None:
    if s.slow_policy == "replace" and s.target_nodes == 0:
        raise SettingsError("slow_policy='replace' needs target_nodes > 0 (spares to swap in)")
    if s.slow_policy not in SLOW_POLICIES:
        raise SettingsError(f"slow_policy must be one of {SLOW_POLICIES}, got {s.slow_policy!r}")
    _positive("slow_factor", s.slow_factor)
    if s.slow_factor <= 1.0:
        raise SettingsError(f"slow_factor must be > 1 (times the median), got {s.slow_factor!r}")
    _positive("slow_quick_factor", s.slow_quick_factor, zero_ok=True)
    if 0 < s.slow_quick_factor < s.slow_factor:
        raise SettingsError(
            f"slow_quick_factor must be 0 (off) or >= slow_factor ({s.slow_factor!r}), "
            f"got {s.slow_quick_factor!r}"
        )
    _int_at_least("slow_windows", s.slow_windows, 1, MAX_SLOW_WINDOWS)
    _int_at_least("slow_window_steps", s.slow_window_steps, 1, MAX_SLOW_WINDOW_STEPS)


def _int_at_least(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SettingsError(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise SettingsError(f"{name} must be <= {high}, got {value!r}")


def _positive(name: str, value: object, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and isinstance(value, (int, float)):
        ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise SettingsError(f"{name} must be a finite number {bound}, got {value!r}")


class ReformBudget:
    """Failed formations in a row, against ``reform_attempts`` and ``reform_timeout_s``
    (from the first failure), and the backoff between them: none after the first failure
    (a changed view is the usual cause), then ``reform_backoff_s`` doubling up to
    ``reform_backoff_max_s``; at least ``RETRY_WAIT_S`` after an unreachable leader. The
    caller waits that long for a new view, which ends the wait early."""

    def __init__(self, settings: Settings, now: Callable[[], float]) -> None:
        self.settings = settings
        self._now = now
        self.failures = 0
        self._first: float | None = None

    def failed(self, why: str, *, unreachable: bool) -> float:
        """Count one failure (``why`` names it); the seconds to wait before the next
        attempt. Raises ``ReformBudgetSpent`` once the budget is spent."""
        s = self.settings
        now = self._now()
        self.failures += 1
        self._first = now if self._first is None else self._first
        if self.failures >= s.reform_attempts:
            raise ReformBudgetSpent(
                f"no group formed in {self.failures} attempts "
                f"(reform_attempts={s.reform_attempts}); last: {why}"
            )
        if now - self._first > s.reform_timeout_s:
            raise ReformBudgetSpent(
                f"no group formed for {now - self._first:.1f} s "
                f"(reform_timeout_s={s.reform_timeout_s}); last: {why}"
            )
        delay = 0.0
        if self.failures >= 2:
            # the exponent is capped: 2**10000 would not fit a float
            delay = min(
                s.reform_backoff_max_s, s.reform_backoff_s * 2 ** min(self.failures - 2, 64)
            )
        return max(delay, RETRY_WAIT_S) if unreachable else delay
