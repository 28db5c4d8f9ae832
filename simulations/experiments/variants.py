"""The protocol configurations the frontier compares (``simulations.experiments.frontier``):
memberlist's presets, ``fast``, and ``fast`` with one knob changed, so that each row of the
frontier isolates one mechanism (simulations/RESULTS.md §5 and §9).
"""

from __future__ import annotations

from typing import Any

DETECTION_SWITCHES: dict[str, Any] = {
    "coordinated_probes": True,
    "early_probe_conclusion": True,
    "suspicion_cross_checks": 4,
    "confirmed_suspicion_safety_mult": 1,
    "small_group_confirmations": True,
}
"""The faster-detection switches together, as ``fast`` turns them on: the coordinated
probe ring, early conclusion of failed probes, cross-checks of fresh accusations, the
confirmed suspicion window and its use in groups too small for Lifeguard's k."""

BEFORE_DETECTION_SWITCHES: dict[str, Any] = {
    "coordinated_probes": False,
    "early_probe_conclusion": False,
    "suspicion_cross_checks": 0,
    "confirmed_suspicion_safety_mult": 0,
    "small_group_confirmations": False,
    "suspicion_verify_copies": 2,
}
"""``fast`` as it was before those switches: the adaptive timeouts, the derived window and two
last-chance copies, nothing more (the profile the frontier of simulations/RESULTS.md §5
measured)."""

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
    # one faster-detection switch at a time, on the profile before them
    "fast/ring": ("fast", {**BEFORE_DETECTION_SWITCHES, "coordinated_probes": True}),
    "fast/early": ("fast", {**BEFORE_DETECTION_SWITCHES, "early_probe_conclusion": True}),
    "fast/cross": ("fast", {**BEFORE_DETECTION_SWITCHES, "suspicion_cross_checks": 4}),
    "fast/confirmed": (
        "fast",
        {
            **BEFORE_DETECTION_SWITCHES,
            "suspicion_cross_checks": 4,
            "confirmed_suspicion_safety_mult": 1,
        },
    ),
    "fast/no-small-group": ("fast", {"small_group_confirmations": False}),
    "fast/all": ("fast", DETECTION_SWITCHES),
    "fast/all+verify": ("fast", {**DETECTION_SWITCHES, "verify_confirmed_suspicion": True}),
    "fast/before-switches": ("fast", BEFORE_DETECTION_SWITCHES),
    "fast/verify-2": ("fast", {"suspicion_verify_copies": 2}),
}
"""Name -> (preset, overrides): ``Config.profile(preset, **overrides)``."""
