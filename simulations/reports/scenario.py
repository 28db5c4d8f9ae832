"""Writing a scenario's results: CSV tables, PNG plots, a short markdown summary.

Rules: the summary's first lines are the seed and the trace hash, so two runs can be
compared at a glance; every table is one CSV named after the scenario and the table
(formats: ``simulations.reports.files``).
"""

from __future__ import annotations

from pathlib import Path

from simulations.experiments.result import Result
from simulations.reports.files import fmt, write_csv, write_plots


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


__all__ = ["markdown", "write"]
