"""The frontier sweep's output: tables, markdown summary, Pareto plot, CSV files.

Rules: everything here reads a finished ``simulations.experiments.frontier.Report``; no
world is run. Method and definitions: ``simulations.experiments.frontier``; command line:
``python -m simulations.frontier``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulations.experiments.frontier import (
    CONDITIONS,
    SLOW_DELAY_MS,
    SLOW_EVERY_MS,
    SLOW_PAUSE_MS,
    SLOW_QUEUE,
    Condition,
    Report,
    pareto,
    quantile,
    variant_text,
)
from simulations.reports.files import fmt, pyplot, write_csv

VARIANT_COLS = dict(
    variant="variant", crashes="crashes", detected="detected",
    all_dead_median_s="all-dead median (s)", all_dead_p99_s="all-dead p99 (s)",
    healthy_dead_p99_s="healthy-dead p99 (s)",
    first_suspect_median_s="first suspect median (s)",
    fp_dead_about_healthy="FP dead about healthy",
    fp_dead_about_healthy_per_1000h="per 1000 member-h",
    fp_dead_about_healthy_at_healthy="of which at healthy observers",
    fp_suspect_about_healthy="FP suspect about healthy", fp_dead_about_slow="FP dead about slow",
    pkts_per_member_per_s="pkts/member/s", load_vs_lan="× lan", frontier="frontier",
)  # fmt: skip


def cell_text(value: Any) -> str:
    if isinstance(value, bool):
        return "**yes**" if value else "no"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return fmt(value)


def variant_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| " + " | ".join(VARIANT_COLS.values()) + " |", "|" + "---|" * len(VARIANT_COLS)]
    for row in rows:
        lines.append("| " + " | ".join(cell_text(row[k]) for k in VARIANT_COLS) + " |")
    return lines


BUDGET_PHASES = (
    ("wait", "crash_s", "first_ping_s", "until a prober picks the victim: its first ping"),
    ("probe", "first_ping_s", "first_suspect_s", "direct timeout, indirect round: suspect"),
    ("suspicion", "first_suspect_s", "first_dead_s", "the suspicion window: first dead"),
    ("spread", "first_dead_s", "all_dead_s", "the verdict reaching the last live member"),
)
"""The detection budget: crash → all dead cut at the first ping to the victim, the first
suspicion and the first death (``simulations.model.metrics``), per crash."""


def budget_rows(crashes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, condition): median and p99 (nearest rank) of each phase, over the
    crashes detected everywhere whose first ping was seen (a keyring hides pings)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in crashes:
        if c.get("all_dead_s") is not None and c.get("first_ping_s") is not None:
            groups.setdefault((c["variant"], c["condition"]), []).append(c)
    rows = []
    for (variant, condition), group in groups.items():
        row: dict[str, Any] = {"variant": variant, "condition": condition, "crashes": len(group)}
        for phase, start, end, _ in (*BUDGET_PHASES, ("total", "crash_s", "all_dead_s", "")):
            values = [
                (c[end] or 0.0) - (0.0 if start == "crash_s" else c[start] or 0.0) for c in group
            ]
            row[f"{phase}_median_s"] = quantile(values, 0.5)
            row[f"{phase}_p99_s"] = quantile(values, 0.99)
        rows.append(row)
    return rows


def budget_table(crashes: list[dict[str, Any]]) -> list[str]:
    phases = [p for p, *_ in BUDGET_PHASES] + ["total"]
    lines = [
        "| variant | condition | crashes | " + " | ".join(phases) + " |",
        "|" + "---|" * (3 + len(phases)),
    ]
    for row in budget_rows(crashes):
        cells = [
            f"{cell_text(row[f'{p}_median_s'])} / {cell_text(row[f'{p}_p99_s'])}" for p in phases
        ]
        lines.append(
            f"| {row['variant']} | {row['condition']} | {row['crashes']} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def matrix(report: Report, title: str, cell: Callable[[dict[str, Any]], str]) -> list[str]:
    conds = report.options.conditions
    lines = [f"{title}", "", "| variant | " + " | ".join(conds) + " |"]
    lines.append("|" + "---|" * (len(conds) + 1))
    by = {(c["variant"], c["condition"]): c for c in report.cells}
    for v in report.options.variants:
        lines.append(f"| {v} | " + " | ".join(cell(by[v, c]) for c in conds) + " |")
    return [*lines, ""]


def markdown(report: Report) -> str:
    o = report.options
    lines = [
        "# Frontier: detection latency, false positives, load",
        "",
        f"    {report.command}",
        "",
        f"n = {o.nodes}; seeds {','.join(map(str, o.seeds))}; {o.crashes} crashes per run; "
        f"{len(report.runs)} runs; trace hash of the sweep `{report.trace_hash}` "
        "(per run: runs.csv). Method and definitions: `simulations/experiments/frontier.py`.",
        "",
        "## Per variant, pooled over conditions and seeds",
        "",
        *variant_table(report.variants),
        "",
        "## Per condition",
        "",
    ]
    lines += matrix(
        report,
        "All-dead latency, median / p99 (s):",
        lambda c: f"{cell_text(c['all_dead_median_s'])} / {cell_text(c['all_dead_p99_s'])}",
    )
    lines += matrix(
        report, "FP dead about healthy members (events):", lambda c: fmt(c["fp_dead_about_healthy"])
    )
    lines += matrix(
        report,
        "Packets sent per member per second:",
        lambda c: cell_text(c["pkts_per_member_per_s"]),
    )
    lines += [
        "## Detection budget",
        "",
        "Median / p99 (s) of each phase of a crash's detection; the phases of one crash add",
        "up to its total, their medians need not. "
        + "; ".join(f"*{p}*: {text}" for p, _, _, text in BUDGET_PHASES)
        + ".",
        "",
        *budget_table(report.crashes),
        "",
    ]
    lines += ["Variants:", ""]
    lines += [f"- `{name}`: {variant_text(name)}" for name in o.variants]
    lines += ["", "Conditions:", ""]
    lines += [f"- `{name}`: {_describe(CONDITIONS[name])}" for name in o.conditions]
    return "\n".join(lines) + "\n"


def _describe(c: Condition) -> str:
    text = f"latency {c.latency}, loss {c.loss:g}"
    if c.slow:
        text += f", {c.slow} slow (+{SLOW_DELAY_MS} ms/input, {SLOW_PAUSE_MS} ms pause"
        text += f" every {SLOW_EVERY_MS} ms, queue {SLOW_QUEUE})"
    return text


def plot(report: Report, path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: frontier.png skipped (pip install matplotlib)"
    rows = report.variants
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, key, label in (
        (axes[0], "all_dead_median_s", "all-dead latency, median (s)"),
        (axes[1], "all_dead_p99_s", "all-dead latency, p99 (s)"),
    ):
        _panel(ax, rows, key)
        ax.set_xlabel(label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylabel("FP dead about healthy / 1000 member-h")
        ax.set_yscale("symlog", linthresh=1.0)
        top = max([r["fp_dead_about_healthy_per_1000h"] or 0.0 for r in rows] + [1.0])
        ax.set_ylim(-0.3, 3 * top)
        ax.grid(True, alpha=0.3)
    names = "   ".join(f"{i} {r['variant']}" for i, r in enumerate(rows, start=1))
    fig.text(0.5, 0.01, names, ha="center", fontsize=8, wrap=True)
    fig.suptitle(
        f"n = {report.options.nodes}: marker area ∝ pkts/member/s; orange: Pareto frontier "
        "(3 criteria); line: its points non-dominated in the panel's two"
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


def _panel(ax: Any, rows: list[dict[str, Any]], key: str) -> None:
    """Numbered points; an infinite latency (undetected crashes) at the right edge."""
    fp = "fp_dead_about_healthy_per_1000h"
    finite = [r[key] for r in rows if r[key] is not None and math.isfinite(r[key])]
    edge = 1.15 * max(finite, default=1.0)
    if len(finite) < len(rows):
        ax.axvline(edge, color="grey", linewidth=0.5, linestyle=":")
        where = {"xycoords": ("data", "axes fraction"), "textcoords": "offset points"}
        ax.annotate("∞: undetected", (edge, 1), xytext=(-4, -12), ha="right", fontsize=8, **where)
    points = []
    for i, r in enumerate(rows, start=1):
        x = r[key] if r[key] in finite else edge
        size = 12 * r["pkts_per_member_per_s"]
        ax.scatter(x, r[fp], s=size, alpha=0.6, color="C1" if r["frontier"] else "C0")
        ax.annotate(str(i), (x, r[fp]), xytext=(5, 4), textcoords="offset points", fontsize=8)
        if r["frontier"]:
            points.append({"x": x, "y": r[fp]})
    keep = pareto(points, ("x", "y"))
    line = sorted((p["x"], p["y"]) for p, on in zip(points, keep, strict=True) if on)
    if len(line) > 1:
        ax.step(*zip(*line, strict=True), where="post", color="C1", linewidth=1)


def write(report: Report, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", report.runs)
    write_csv(out / "crashes.csv", report.crashes)
    write_csv(out / "variants.csv", report.variants)
    write_csv(out / "cells.csv", report.cells)
    (out / "summary.md").write_text(markdown(report))
    return [plot(report, out / "frontier.png"), f"results in {out}/"]
