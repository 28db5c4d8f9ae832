"""The protocol configurations the frontier compares (``simulations.experiments.frontier``):
memberlist's presets, ``fast``, and ``fast`` with one knob changed, so that each row of the
frontier isolates one mechanism (simulations/RESULTS.md §5 and §9).
"""

from __future__ import annotations

from typing import Any

ALL_17: dict[str, Any] = {
    "coordinated_probes": True,
    "early_probe_conclusion": True,
    "suspicion_cross_checks": 4,
    "confirmed_suspicion_safety_mult": 1,
}
"""Issue 17's four switches together (``fast``'s since issue 17)."""

BEFORE_17: dict[str, Any] = {
    "coordinated_probes": False,
    "early_probe_conclusion": False,
    "suspicion_cross_checks": 0,
    "confirmed_suspicion_safety_mult": 0,
    "suspicion_verify_copies": 2,
}
"""``fast`` as it was before issue 17 (issue 7's profile)."""

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "lan": ("lan", {}),
    "local": ("local", {}),
    "fast": ("fast", {}),
    "fast/static-timeout": ("fast", {"adaptive_probe_timeout": False}),
    "fast/memberlist-suspicion": ("fast", {"derived_suspicion": False}),
    "fast/safety-1": ("fast", {"suspicion_safety_mult": 1}),
    "fast/safety-3": ("fast", {"suspicion_safety_mult": 3}),
    "fast/200ms": ("fast", {"probe_interval_ms": 200, "probe_timeout_max_ms": 100}),
    "fast/beta-6": ("fast", {"suspicion_max_timeout_mult": 6}),
    "fast/no-lhm": ("fast", {"lifeguard_lhm": False}),
    "fast/no-verify": ("fast", {"verify_unconfirmed_suspicion": False}),
    "fast/ring": ("fast", {"coordinated_probes": True}),
    "fast/early": ("fast", {"early_probe_conclusion": True}),
    "fast/cross": ("fast", {"suspicion_cross_checks": 4}),
    "fast/confirmed": ("fast", {"suspicion_cross_checks": 4, "confirmed_suspicion_safety_mult": 1}),
    "fast/all": ("fast", ALL_17),
    "fast/all+verify": ("fast", {**ALL_17, "verify_confirmed_suspicion": True}),
    "fast/before-17": ("fast", BEFORE_17),
    "fast/verify-2": ("fast", {"suspicion_verify_copies": 2}),
}
"""Name -> (preset, overrides): ``Config.profile(preset, **overrides)``."""
