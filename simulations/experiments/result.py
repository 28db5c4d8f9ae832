"""What an experiment hands back: a scenario's ``Result`` (seed, trace hash, summary,
tables, plots to draw) and its ``Plot`` descriptions.

Rules: plain values, no I/O; ``simulations.reports`` turns them into files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Plot:
    """A line/step plot: named series of (x, y) points."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, list[tuple[float, float]]]
    step: bool = False
    logy: bool = False
    logx: bool = False


@dataclass(slots=True)
class Result:
    """Everything a scenario hands back."""

    scenario: str
    seed: int
    trace_hash: str
    params: dict[str, Any]
    summary: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    plots: list[Plot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


__all__ = ["Plot", "Result"]
