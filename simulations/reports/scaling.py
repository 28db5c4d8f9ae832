"""The scaling sweep's output: markdown summary, plot against n, CSV files, and a finished
sweep read back from its cells.csv (to re-draw the plot).

Rules: everything here reads a ``simulations.experiments.scaling.Sweep``; no world is run.
Method and definitions: ``simulations.experiments.scaling``; command line:
``python -m simulations.scaling``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from simulations.experiments.frontier import CONDITIONS, variant_text
from simulations.experiments.scaling import Sweep, computed_baseline
from simulations.reports.files import pyplot, read_csv, write_csv
from simulations.reports.frontier import cell_text


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
        "Method and definitions: `simulations/experiments/scaling.py`, "
        "`simulations/experiments/frontier.py`. "
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
    lines += ["", "Conditions: see `simulations/experiments/frontier.py` `CONDITIONS`:", ""]
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
