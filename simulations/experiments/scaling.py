"""Protocols across cluster sizes: the frontier method (``simulations.experiments.frontier``)
run at several n, with load, bandwidth, detection latency and false positives per
(variant, condition, n); output: ``simulations.reports.scaling``; command line:
``python -m simulations.scaling``.

Rules:
- Every cell is a pooled ``frontier`` cell (same worlds, victims and slow members for a
  seed whatever the variant); ``--crashes`` and ``--seeds`` take one value for all n or one
  per n (seeds: comma lists separated by ``:``).
- Cluster-wide load = per-member packets/s × n (every member runs the same protocol).
- The all-to-all baseline is refused above ``BASELINE_MAX_N`` members: it holds n² Phi
  detectors (10⁸ at n = 10,000, tens of GB) and handles n² heartbeats per interval (10⁸
  events per simulated second). Its load there is computed, not simulated: (n − 1) /
  interval packets per member per second, each the size measured at smaller n.
- Results are rewritten after each n (by the command), so a long sweep keeps what it
  finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulations.experiments.frontier import BASELINES, Options, Report

PER_MEMBER = "pkts_per_member_per_s"
BYTES = "bytes_per_member_per_s"
BASELINE_MAX_N = 2_000
COMPUTED_N = (10_000,)
"""Sizes at which the baseline's load is computed (above ``BASELINE_MAX_N``)."""


@dataclass(slots=True)
class Sweep:
    nodes: list[int]
    variants: list[str]
    conditions: list[str]
    crashes: list[int]
    seeds: list[list[int]]
    jobs: int = 1
    out: Path = Path("simulations/results/baseline")
    command: str = ""
    render: Path | None = None
    lossy_tcp: bool = False
    cells: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    crash_rows: list[dict[str, Any]] = field(default_factory=list)
    hashes: dict[int, str] = field(default_factory=dict)
    wall_s: dict[int, float] = field(default_factory=dict)

    def options(self, i: int) -> Options:
        n = self.nodes[i]
        variants = [v for v in self.variants if v not in BASELINES or n <= BASELINE_MAX_N]
        return Options(
            n, self.seeds[i], variants, self.conditions, self.crashes[i], self.jobs, self.lossy_tcp
        )

    def add(self, n: int, report: Report, wall_s: float) -> None:
        for cell in report.cells:
            self.cells.append({"n": n, **cell, "pkts_cluster_per_s": _total(cell, n)})
        self.runs += report.runs
        self.crash_rows += [{"n": n, **c} for c in report.crashes]
        self.hashes[n] = report.trace_hash
        self.wall_s[n] = wall_s


def _total(cell: dict[str, Any], n: int) -> float | None:
    per = cell.get("pkts_per_member_per_s")
    return None if per is None else per * n


def computed_baseline(sweep: Sweep) -> list[dict[str, Any]]:
    """The baseline's load where it is not simulated: (n−1)/interval per member, bytes at
    the mean packet size measured in the largest simulated clean cell."""
    rows = []
    for variant in (v for v in sweep.variants if v in BASELINES):
        measured = [c for c in sweep.cells if c["variant"] == variant and c["condition"] == "clean"]
        if not measured:
            continue
        ref = max(measured, key=lambda c: c["n"])
        size = ref["bytes_per_member_per_s"] / ref["pkts_per_member_per_s"]
        interval_s = BASELINES[variant]().heartbeat_interval_ms / 1000
        for n in COMPUTED_N:
            per = (n - 1) / interval_s
            rows.append(
                {
                    "variant": variant,
                    "n": n,
                    "pkts_per_member_per_s": per,
                    "bytes_per_member_per_s": per * size,
                    "pkts_cluster_per_s": per * n,
                }
            )
    return rows
