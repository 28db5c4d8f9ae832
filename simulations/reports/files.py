"""The reports' file formats: numbers as text, CSV tables written and read back, PNG plots.

Rules: every table is a CSV with the union of its rows' columns (empty cell = None, floats
to 6 significant digits); plots need matplotlib, imported lazily — without it the plots
are skipped with a clear message and everything else is still written.
"""

from __future__ import annotations

import csv
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulations.experiments.result import Plot


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "—"
    return str(value)


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


__all__ = ["fmt", "pyplot", "read_csv", "write_csv", "write_plots"]
