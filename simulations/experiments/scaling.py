"""Protocols across cluster sizes: the frontier method (``simulations.frontier``) run at
several n, with load, bandwidth, detection latency and false positives per (variant,
condition, n), and plots against n.

    python -m simulations.scaling --nodes 10,100,1000 \\
        --variants lan,fast,heartbeat,heartbeat/fast --conditions clean,loss1,loss10,slow1 \\
        --crashes 3,8,3 --seeds 1,2,3,4,5:1,2:1 --out simulations/results/baseline

Rules:
- Every cell is a pooled ``frontier`` cell (same worlds, victims and slow members for a
  seed whatever the variant); ``--crashes`` and ``--seeds`` take one value for all n or one
  per n (seeds: comma lists separated by ``:``).
- Cluster-wide load = per-member packets/s × n (every member runs the same protocol).
- The all-to-all baseline is refused above ``BASELINE_MAX_N`` members: it holds n² Phi
  detectors (10⁸ at n = 10,000, tens of GB) and handles n² heartbeats per interval (10⁸
  events per simulated second). Its load there is computed, not simulated: (n − 1) /
  interval packets per member per second, each the size measured at smaller n.
- Results are rewritten after each n, so a long sweep keeps what it finished.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulations.frontier import (
    BASELINES,
    CONDITIONS,
    Options,
    Report,
    all_variants,
    explore,
    variant_text,
)
from simulations.frontier_report import cell_text
from simulations.report import pyplot, read_csv, write_csv

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
    cells: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    crash_rows: list[dict[str, Any]] = field(default_factory=list)
    hashes: dict[int, str] = field(default_factory=dict)
    wall_s: dict[int, float] = field(default_factory=dict)

    def options(self, i: int) -> Options:
        n = self.nodes[i]
        variants = [v for v in self.variants if v not in BASELINES or n <= BASELINE_MAX_N]
        return Options(n, self.seeds[i], variants, self.conditions, self.crashes[i], self.jobs)

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


# --- output -----------------------------------------------------------------------------


def _matrix(sweep: Sweep, condition: str, title: str, key: str, fmt2: str = "") -> list[str]:
    ns = sorted({c["n"] for c in sweep.cells})
    by = {(c["variant"], c["n"]): c for c in sweep.cells if c["condition"] == condition}
    lines = [title, "", "| variant | " + " | ".join(f"n = {n:,}" for n in ns) + " |"]
    lines.append("|" + "---|" * (len(ns) + 1))
    for v in sweep.variants:
        row = []
        for n in ns:
            cell = by.get((v, n))
            if cell is None:
                row.append("—")
            elif fmt2:
                row.append(f"{cell_text(cell[key])} / {cell_text(cell[fmt2])}")
            else:
                row.append(cell_text(cell[key]))
        lines.append(f"| {v} | " + " | ".join(row) + " |")
    return [*lines, ""]


def markdown(sweep: Sweep) -> str:
    lines = [
        "# Scaling: load, detection and false positives against cluster size",
        "",
        f"    {sweep.command}",
        "",
        "Method and definitions: `simulations/scaling.py`, `simulations/frontier.py`. "
        "Trace hash per n: "
        + ", ".join(f"{n}: `{h}`" for n, h in sorted(sweep.hashes.items()))
        + "; wall time per n: "
        + ", ".join(f"{n}: {w:.0f} s" for n, w in sorted(sweep.wall_s.items()))
        + ".",
        "",
    ]
    for cond in sweep.conditions:
        lines += [f"## Condition `{cond}`", ""]
        lines += _matrix(
            sweep, cond, "Packets sent per member per second:", "pkts_per_member_per_s"
        )
        lines += _matrix(sweep, cond, "Packets per second, whole cluster:", "pkts_cluster_per_s")
        lines += _matrix(
            sweep, cond, "UDP bytes sent per member per second:", "bytes_per_member_per_s"
        )
        lines += _matrix(
            sweep,
            cond,
            "TCP (push-pull) bytes sent per member per second:",
            "stream_bytes_per_member_per_s",
        )
        lines += _matrix(
            sweep,
            cond,
            "Crash → dead at every live member, median / p99 (s):",
            "all_dead_median_s",
            "all_dead_p99_s",
        )
        lines += _matrix(
            sweep,
            cond,
            "False dead declarations about healthy members (all observers / healthy observers):",
            "fp_dead_about_healthy",
            "fp_dead_about_healthy_at_healthy",
        )
    computed = computed_baseline(sweep)
    if computed:
        lines += ["## The baseline where it is not simulated (computed)", ""]
        lines += ["| variant | n | pkts/member/s | bytes/member/s | cluster pkts/s |"]
        lines += ["|---|---|---|---|---|"]
        for r in computed:
            lines.append(
                f"| {r['variant']} | {r['n']:,} | {r['pkts_per_member_per_s']:,.0f} | "
                f"{r['bytes_per_member_per_s']:,.0f} | {r['pkts_cluster_per_s']:,.0f} |"
            )
        lines.append("")
    lines += ["Variants:", ""]
    lines += [f"- `{v}`: {variant_text(v)}" for v in sweep.variants]
    lines += ["", "Conditions: see `simulations/frontier.py` `CONDITIONS`:", ""]
    lines += [f"- `{c}`: {CONDITIONS[c]}" for c in sweep.conditions]
    return "\n".join(lines) + "\n"


PANELS = (
    ("clean", "pkts_per_member_per_s", "", "packets sent per member per second"),
    ("clean", "pkts_cluster_per_s", "", "packets per second, whole cluster"),
    (
        "clean",
        "all_dead_median_s",
        "all_dead_p99_s",
        "crash → dead everywhere (s): median, p99 dashed",
    ),
    ("loss10", "fp_dead_about_healthy_per_1000h", "", "false deaths at 10 % loss / 1000 member-h"),
)


def plot(sweep: Sweep, path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: plots skipped (pip install matplotlib)"
    computed = computed_baseline(sweep)
    panels = [p for p in PANELS if p[0] in sweep.conditions]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 5), squeeze=False)
    for ax, (cond, key, key2, label) in zip(axes[0], panels, strict=True):
        for i, v in enumerate(sweep.variants):
            _curve(ax, sweep, v, cond, key, {"marker": "o", "color": f"C{i}", "label": v})
            if key2:
                _curve(ax, sweep, v, cond, key2, {"linestyle": "--", "color": f"C{i}"})
            extra = [(r["n"], r[key]) for r in computed if r["variant"] == v and key in r]
            last = _points(sweep, v, cond, key)[-1:]
            if extra and last:
                ax.plot(*zip(*last, *extra, strict=True), linestyle=":", color=f"C{i}")
                ax.scatter(*zip(*extra, strict=True), marker="x", color=f"C{i}")
        ax.set_xscale("log")
        if key.startswith("fp_"):
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(bottom=-0.2)
        else:
            ax.set_yscale("log")
        ax.set_xlabel("members (n)")
        ax.set_title(label, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("one-way delay 1–5 ms; dotted/x: computed, not simulated (n² state)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


def _points(sweep: Sweep, variant: str, cond: str, key: str) -> list[tuple[int, float]]:
    return sorted(
        (c["n"], c[key])
        for c in sweep.cells
        if c["variant"] == variant and c["condition"] == cond and c.get(key) is not None
    )


def _curve(ax: Any, sweep: Sweep, variant: str, cond: str, key: str, style: dict[str, Any]) -> None:
    pts = [(n, y) for n, y in _points(sweep, variant, cond, key) if math.isfinite(y)]
    if pts:
        ax.plot(*zip(*pts, strict=True), **style)


def load(result_dir: Path) -> Sweep:
    """A finished sweep's cells back from its cells.csv (to re-draw its plot)."""
    cells = read_csv(result_dir / "cells.csv")
    variants = list(dict.fromkeys(c["variant"] for c in cells))
    conditions = list(dict.fromkeys(c["condition"] for c in cells))
    nodes = sorted({c["n"] for c in cells})
    sweep = Sweep(nodes, variants, conditions, [], [], out=result_dir)
    sweep.cells = cells
    return sweep


def write(sweep: Sweep, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "cells.csv", sweep.cells)
    write_csv(out / "runs.csv", sweep.runs)
    write_csv(out / "crashes.csv", sweep.crash_rows)
    computed = computed_baseline(sweep)
    if computed:
        write_csv(out / "computed.csv", computed)
    (out / "summary.md").write_text(markdown(sweep))
    return [plot(sweep, out / "scaling.png"), f"results in {out}/"]


# --- command line -----------------------------------------------------------------------


def _per_n(text: str, count: int, what: str) -> list[str]:
    parts = text.split(":") if ":" in text else [text]
    if len(parts) == 1:
        return parts * count
    if len(parts) != count:
        raise SystemExit(f"--{what}: one value or one per n ({count}), got {len(parts)}")
    return parts


def parse(argv: Sequence[str]) -> Sweep:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="10,100,1000")
    parser.add_argument("--variants", default="lan,fast,heartbeat,heartbeat/fast")
    parser.add_argument("--conditions", default="clean,loss1,loss10,slow1")
    parser.add_argument("--crashes", default="3,8,3", help="one, or one per n (commas)")
    parser.add_argument("--seeds", default="1,2,3,4,5:1,2:1", help="one list, or one per n (:)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("simulations/results/baseline"))
    parser.add_argument("--render", type=Path, help="only re-draw DIR/scaling.png from DIR")
    args = parser.parse_args(argv)
    nodes = [int(x) for x in args.nodes.split(",")]
    known = all_variants()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    bad = [v for v in variants if v not in known] + [c for c in conditions if c not in CONDITIONS]
    if bad:
        raise SystemExit(f"unknown {', '.join(bad)}; variants: {', '.join(known)}")
    crash_text = args.crashes.replace(",", ":") if "," in args.crashes else args.crashes
    crashes = [int(x) for x in _per_n(crash_text, len(nodes), "crashes")]
    seeds = [[int(s) for s in p.split(",")] for p in _per_n(args.seeds, len(nodes), "seeds")]
    sweep = Sweep(nodes, variants, conditions, crashes, seeds, args.jobs, args.out)
    sweep.command = "python -m simulations.scaling " + shlex.join(argv)
    sweep.render = args.render
    return sweep


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep = parse(argv)
    if sweep.render is not None:
        print(plot(load(sweep.render), sweep.render / "scaling.png"))
        return 0
    messages: list[str] = []
    for i, n in enumerate(sweep.nodes):
        wall0 = time.perf_counter()
        report = explore(sweep.options(i), progress=True)
        sweep.add(n, report, time.perf_counter() - wall0)
        messages = write(sweep, sweep.out)
        print(f"== n {n} done in {sweep.wall_s[n]:.0f} s, trace hash {report.trace_hash}")
    print("\n".join(messages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
