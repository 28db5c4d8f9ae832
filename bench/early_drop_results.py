"""The result files of ``bench.torch_recovery --early-drop on,off`` and
``--stall-drop on,off``: a question of their own each.

Each in-process case runs with the agents' switch on and off, repeats interleaved (modes
ending ``, early drop on`` / ``, early drop off``, bench/agent_variants.py); the figures are
bench/training_results.py's, the ratios are on / off for each case, same run. A question of
its own, so a run of a few cases never replaces the full recovery table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.training_results import FAULTS, by_mode_and_fault, median_total

__all__ = ["METHODS", "switch"]

METHODS = {
    "early drop": "the agents' `job_early_drop` on (a suspect whose agent refuses the TCP "
    "ping leaves the job's view before its death verdict) and off (the job waits for the "
    "verdict).",
    "stall drop": "the agents' `job_stall_drop` on (a suspect leaves the job's view before "
    "its death verdict where the job's ranks on that agent stopped stepping) and off (the "
    "job waits for the verdict).",
    "small group": "the protocol's `small_group_confirmations` on and off.",
}
"""What each switch does, for the result file's method (bench/agent_variants.py ``SWITCHES``)."""


def switch(
    built: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    name: str,
    *,
    nodes: int,
    ranks: int,
    profile: str,
) -> dict[str, Any]:
    """``built`` (``recovery``/``power``/``spares``) as the question of switch ``name``
    (``early drop``, ``stall drop``, ...), with the ratio on / off of each case's median
    fault → first step."""
    on_mode, off_mode = f", {name} on", f", {name} off"
    groups = by_mode_and_fault(rows)
    ratios = []
    for (mode, fault), runs in groups.items():
        if on_mode not in mode:
            continue
        off_key = (mode.replace(on_mode, off_mode), fault)
        on, off = median_total(runs), median_total(groups.get(off_key, []))
        if on is not None and off:
            base = mode.replace(on_mode, "")
            label = f"{base}, {FAULTS.get(fault, fault)}: {name} on / off, fault → first step"
            ratios.append({"label": label, "value": round(on / off, 2)})
    out = dict(built)
    slug = name.replace(" ", "-")
    out |= {
        "question": f"training-{slug}-{nodes}x{ranks}-{profile}",
        "title": f"{name.capitalize()} on and off: {nodes} nodes × {ranks} ranks, `{profile}`",
        "method": f"{out['method']} Each case twice, repeats interleaved: {METHODS[name]}",
        "ratios": ratios + list(out.get("ratios", [])),
    }
    return out
