"""Writing a scenario's results: CSV tables, PNG plots, a short markdown summary.

Rules: the summary's first lines are the seed and the trace hash, so two runs can be
compared at a glance; every table is one CSV named after the scenario and the table;
plots need matplotlib, imported lazily — without it the plots are skipped with a clear
message and everything else is still written.
"""

from __future__ import annotations

import csv
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
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


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "—"
    return str(value)


def markdown(result: Result) -> str:
    lines = [
        f"# Scenario `{result.scenario}`",
        "",
        f"- seed: {result.seed}",
        f"- trace hash: `{result.trace_hash}`",
    ]
    lines += [f"- {k}: {fmt(v)}" for k, v in result.params.items()]
    lines += ["", "## Summary", ""]
    lines += [f"- {k}: {fmt(v)}" for k, v in result.summary.items()]
    for name, rows in result.tables.items():
        if not rows or len(rows) > 40:
            lines += ["", f"Table `{name}`: {len(rows)} rows (see the CSV)."]
            continue
        cols = list(rows[0])
        lines += ["", f"## {name}", "", "| " + " | ".join(cols) + " |"]
        lines.append("|" + "---|" * len(cols))
        lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    if result.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c)) for c in cols})


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows written by ``write_csv``, with numbers back as int or float and empty cells as
    None (other text stays text)."""
    with path.open(newline="") as f:
        return [{k: _value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _value(text: str) -> Any:
    if text == "":
        return None
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() and "." not in text else number


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def write(result: Result, out_dir: Path, *, plots: bool = True) -> list[str]:
    """Write CSVs, the summary and the plots; returns messages for the user."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result.scenario
    messages = []
    summary_row = {**result.params, **result.summary, "seed": result.seed}
    summary_row["trace_hash"] = result.trace_hash
    write_csv(out_dir / f"{stem}-summary.csv", [summary_row])
    for name, rows in result.tables.items():
        if rows:
            write_csv(out_dir / f"{stem}-{name}.csv", rows)
    (out_dir / f"{stem}.md").write_text(markdown(result))
    if plots and result.plots:
        messages += write_plots(result.plots, out_dir, stem)
    messages.append(f"results in {out_dir}/{stem}*")
    return messages


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None when matplotlib is not
    installed (plots are optional: callers skip them and say so)."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def write_plots(plots: Sequence[Plot], out_dir: Path, stem: str) -> list[str]:
    plt = pyplot()
    if plt is None:
        return ["matplotlib is not installed: plots skipped (pip install matplotlib)"]
    written = []
    for plot in plots:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, points in plot.series.items():
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            if plot.step:
                ax.step(xs, ys, where="post", label=label)
            else:
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_title(plot.title)
        ax.set_xlabel(plot.xlabel)
        ax.set_ylabel(plot.ylabel)
        if plot.logy:
            ax.set_yscale("log")
        if plot.logx:
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        if len(plot.series) > 1:
            ax.legend(fontsize=8)
        path = out_dir / f"{stem}-{plot.name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path.name)
    return [f"plots: {', '.join(written)}"] if written else []
