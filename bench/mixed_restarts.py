"""What a restarted victim's start-up costs the training nodes when every node shares one
host's CPUs, from a kept bench/mixed_efficiency.py workdir.

On this test machine a victim comes back on the same 2 cores as the training nodes: its
agent starts, its trainers import torch and build their model, then it waits as a spare.
On a cluster it would start on its own host and cost the job nothing. Its *restart
window* runs from its agent's first log line to its local rank 0's ``is a spare`` line
(torchhook.spares); the harness, which knows when it started each restart, moves the start
back to that moment (``from_restarts``: the agent's imports come before its first line).
The cost is the global steps the job did not complete in those
windows against the failure-free pace: ``window / step_s - steps`` summed, where
``step_s`` is the mean gap between global steps outside stalls and windows (a gap over
``STALL_STEPS`` normal steps is a stall: a recovery, counted elsewhere).

    python -m bench.mixed_restarts WORKDIR [--every-s 60] [--result FILE]

``--result``: a result file of the run that kept WORKDIR, written before the harness
computed these itself; its figures gain the step efficiency against the pace between
faults (bench/mixed_results.py ``pace_between``) and its notes this cost. The faults'
times come from its "Every fault" table (seconds after the first fault) and the first
stall of the records (the first fault), to within a step: ``SETTLE_S`` absorbs that.

Prints each window and the total: steps lost, the seconds of training they are worth, and
that as a share of one fault interval (``--every-s``), i.e. the step efficiency a run
would gain if restarts cost nothing here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.step_efficiency import STALL_STEPS, count

__all__ = ["cost", "from_restarts", "main", "records", "windows"]

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
SPARE = re.compile(r"torchhook\.elastic node \S+ is a spare")
INCARNATION = re.compile(r"^(?P<name>[A-Za-z0-9_-]+)\.(?P<i>\d+)$")


def _stamp(line: str) -> float | None:
    m = STAMP.match(line)
    if m is None:
        return None
    t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return t.replace(tzinfo=datetime.UTC).timestamp()


def windows(work: Path) -> list[tuple[float, float]]:
    """Each restarted incarnation's (start, waiting as a spare) wall times, in order; an
    incarnation that never waited as a spare is left out."""
    out = []
    for d in sorted(p for p in work.iterdir() if p.is_dir() and INCARNATION.match(p.name)):
        name = INCARNATION.match(d.name)["name"]  # type: ignore[index]
        here = d / "again" if (d / "again").is_dir() else d  # the second try on a new port
        start = ready = None
        with contextlib.suppress(FileNotFoundError), (here / f"{name}.agent.log").open() as f:
            start = next((t for line in f if (t := _stamp(line)) is not None), None)
        with contextlib.suppress(FileNotFoundError), (here / f"{name}.r0.trainer.log").open() as f:
            ready = next((_stamp(line) for line in f if SPARE.search(line)), None)
        if start is not None and ready is not None and ready > start:
            out.append((start, ready))
    return sorted(out)


def from_restarts(
    spans: Sequence[tuple[float, float]], restarts: Sequence[float], max_s: float = 30.0
) -> list[tuple[float, float]]:
    """Each window begun at the restart that started it: the last of ``restarts`` (the
    harness's wall times when it started a victim's agent) at or before the window's
    start, no more than ``max_s`` before it. An agent's first log line comes after its
    imports (~0.5 CPU-s), and a start's cost begins with the process."""
    out = []
    for start, ready in spans:
        began = max((t for t in restarts if t <= start), default=None)
        out.append((began if began is not None and start - began <= max_s else start, ready))
    return out


def records(work: Path) -> list[dict[str, Any]]:
    """Every step record of every local rank 0 under ``work``."""
    out = []
    for path in sorted(work.rglob("*.r0.steps.jsonl")):
        with path.open() as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if "loss" in rec:
                        out.append(rec)
    return out


def cost(recs: Sequence[dict[str, Any]], spans: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Steps lost in ``spans`` against the pace outside stalls and spans (module
    docstring): ``step_s``, ``per_window`` (start, seconds, steps done, steps lost) and
    ``lost_steps``, ``lost_s`` (the lost steps × ``step_s``)."""
    times = sorted(float(r["t"]) for r in recs if r["rank"] == 0)
    gaps = [(a, b - a) for a, b in itertools.pairwise(times)]
    if not gaps:
        raise ValueError("no global steps in the records")
    normal = statistics.median(g for _, g in gaps)
    clean = [
        g for a, g in gaps if g <= STALL_STEPS * normal and not any(s <= a < e for s, e in spans)
    ]
    step_s = statistics.mean(clean) if clean else normal
    rows = []
    for s, e in spans:
        done, _ = count(recs, s, e)
        rows.append((s, e - s, done, max(0.0, (e - s) / step_s - done)))
    lost = sum(r[3] for r in rows)
    return {"step_s": step_s, "per_window": rows, "lost_steps": lost, "lost_s": lost * step_s}


def _fmt(result: Mapping[str, Any], every_s: float) -> Iterable[str]:
    rows = result["per_window"]
    yield f"failure-free pace outside stalls and restarts: {result['step_s'] * 1000:.1f} ms a step"
    for i, (_, seconds, done, lost) in enumerate(rows, 1):
        yield f"  restart {i}: {seconds:.1f} s, {done} steps, {lost:.1f} lost"
    if rows:
        per = result["lost_s"] / len(rows)
        yield (
            f"{len(rows)} restarts: {result['lost_steps']:.0f} steps lost "
            f"({result['lost_s']:.1f} s of training; {per:.2f} s each, "
            f"{100 * per / every_s:.2f} % of a {every_s:g} s fault interval)"
        )


def update(path: Path, recs: Sequence[dict[str, Any]], spans: Sequence[tuple[float, float]]) -> str:
    """Add the pace between faults and the restart cost to the result file at ``path``
    (module docstring); returns the new step efficiency figure's text."""
    from bench import mixed_results

    result = json.loads(path.read_text())
    rows = next(t["rows"] for t in result["tables"] if t["caption"] == "Every fault")
    times = sorted(float(r["t"]) for r in recs if r["rank"] == 0)
    normal = statistics.median(b - a for a, b in itertools.pairwise(times))
    first = next(a for a, b in itertools.pairwise(times) if b - a > STALL_STEPS * normal)
    fault_ts = [first + float(r["at"]) for r in rows]
    end = fault_ts[0] + float(result["figures"]["faults"]["value"]) * 60.0
    got = mixed_results.pace_between(recs, fault_ts, end)
    if got["between_faults_step_s"] is None:
        raise ValueError(f"{path}: no steps between its faults in the records")
    spent = cost(recs, [w for w in spans if fault_ts[0] <= w[0] < end])
    r = {
        **got,
        "restarts": len(spent["per_window"]),
        "restart_lost_s": spent["lost_s"],
        "window_s": end - fault_ts[0],
    }
    figure = mixed_results.built_figure_between(r)
    result["figures"] = {"efficiency_between_faults": figure, **result["figures"]}
    pace, *notes = mixed_results.notes_of(r)  # the pace note first
    before = [b - a for a, b in itertools.pairwise(times) if fault_ts[0] - 120.0 <= a < fault_ts[0]]
    if before and got["between_faults_step_s"]:
        slower = statistics.mean(before) / got["between_faults_step_s"] - 1
        pace += (
            f"; the 120 s before the first fault ran at {1000 * statistics.mean(before):.2f} ms a "
            f"step, {100 * slower:.1f} % slower (the host still busy from earlier work), so the "
            "step efficiency against that baseline reads above 100 % and is not the one to quote"
        )
    result["notes"] = [pace + " (added afterwards from the kept logs: "
                       f"python -m bench.mixed_restarts WORKDIR --result {path.name})", *notes,
                       *result["notes"]]  # fmt: skip
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return f"{figure['value']} {figure['unit']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("workdir", type=Path, help="a bench.mixed_efficiency --workdir")
    parser.add_argument("--every-s", type=float, default=60.0)
    parser.add_argument("--result", type=Path, default=None, help="a result file to complete")
    args = parser.parse_args(argv)
    if not args.workdir.is_dir():
        parser.error(f"{args.workdir}: not a directory")
    recs, spans = records(args.workdir), windows(args.workdir)  # read once: an hour is ~100 MB
    try:
        print("\n".join(_fmt(cost(recs, spans), args.every_s)))
        if args.result is not None:
            got = update(args.result, recs, spans)
            print(f"{args.result}: step efficiency against the pace between faults {got}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
