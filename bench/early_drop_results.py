"""The result file of ``bench.torch_recovery --early-drop on,off``: its own question.

Each in-process case runs with the agents' ``job_early_drop`` on and off, repeats
interleaved (modes ending ``, early drop on`` / ``, early drop off``); the figures are
bench/training_results.py's, the ratios are on / off for each case, same run. A question of
its own, so a run of a few cases never replaces the full recovery table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.training_results import FAULTS, by_mode_and_fault, median_total

__all__ = ["early_drop"]

ON, OFF = ", early drop on", ", early drop off"


def early_drop(
    built: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    nodes: int,
    ranks: int,
    profile: str,
) -> dict[str, Any]:
    """``built`` (``recovery``/``power``/``spares``) as the early-drop question, with the
    ratio on / off of each case's median fault → first step."""
    groups = by_mode_and_fault(rows)
    ratios = []
    for (mode, fault), runs in groups.items():
        if not mode.endswith(ON):
            continue
        base = mode[: -len(ON)]
        on, off = median_total(runs), median_total(groups.get((base + OFF, fault), []))
        if on is not None and off:
            label = f"{base}, {FAULTS.get(fault, fault)}: early drop on / off, fault → first step"
            ratios.append({"label": label, "value": round(on / off, 2)})
    out = dict(built)
    out |= {
        "question": f"training-early-drop-{nodes}x{ranks}-{profile}",
        "title": f"Early drop on and off: {nodes} nodes × {ranks} ranks, `{profile}`",
        "method": (
            f"{out['method']} Each case twice, repeats interleaved: the agents' "
            "`job_early_drop` on (a suspect whose agent refuses the TCP ping leaves the job's "
            "view before its death verdict) and off (the job waits for the verdict)."
        ),
        "ratios": ratios + list(out.get("ratios", [])),
    }
    return out
