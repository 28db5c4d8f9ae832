"""Fail-slow detection: a node slowed 1.5x and 3x, flagged within how many steps; false flags
in a run with no slow node.

    python -m bench.slow_nodes --clean-s 600 --trials 5 --quick-factors 2,0

3 nodes x 2 ranks (examples/elastic_ddp.py, profile ``fast``, gloo on loopback) train with
a stand-in compute of ``--step-work`` seconds slept inside each step (between the forward
and the backward pass), the engine's defaults for fail-slow (``slow_policy="report"``,
factor 1.3, 2 windows of 10 steps, quick factor 2), one job per ``--quick-factors``
entry, the first listed last (so the trials of every job run minutes apart at most and
their loads compare). In each job, per factor and trial, node n2's trainers are slowed by
that factor (an injected delay; the factor is written into their ``--slow-file``): each
step sleeps on top for (factor - 1) times the rank's own step compute time from before the
slowdown (the engine's figure, ``el.pace.figure_ms``), so the node's whole step compute,
not only the stand-in, takes factor times as long. When n0's rank 0 logs n2 flagged, the
steps from the first step logged after the slowdown to the flagged step are the figure.
The slowdown is lifted and the flag must clear before the next trial. Then, in the first
listed job only, ``--clean-s`` seconds with nobody slow: every flag there is a false one.

Why an injected delay and not a CPU quota (cgroup v1 ``cpu.cfs_quota_us``, which this host
mounts): a quota slows a process only if it would otherwise get more CPU than the quota,
and on a shared 2-core host at a load of 100 and more the trainers already get far less;
a sleep inside the step slows the node by the same factor whatever the load.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent.procs import until
from agent.training_nodes import TrainingNode, start_nodes
from bench import results as result_files

SCRIPT = "examples/elastic_ddp.py"
FACTORS = (1.5, 3.0)
FLAG_TIMEOUT_S = 180.0
"""A trial that does not flag within this is recorded as a miss."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _rank0(node: TrainingNode) -> list[dict[str, Any]]:
    return [r for r in node.records(0) if "loss" in r]


def _trial(nodes: list[TrainingNode], slow_file: Path, factor: float) -> dict[str, Any]:
    watcher = nodes[0]
    tmp = slow_file.with_suffix(".tmp")
    tmp.write_text(f"{factor}\n")
    tmp.rename(slow_file)  # atomic: a trainer reads the whole number or no file
    began = time.time()
    flagged: dict[str, Any] | None = None
    try:

        def seen() -> bool:
            nonlocal flagged
            flagged = next((r for r in _rank0(watcher) if r["t"] > began and r["slow"]), None)
            return flagged is not None

        until(seen, FLAG_TIMEOUT_S, f"n2 flagged at {factor}x")
    except TimeoutError:
        pass
    finally:
        slow_file.unlink()
    lifted = time.time()
    after = [r for r in _rank0(watcher) if r["t"] > began]
    first = min(r["step"] for r in after)
    out: dict[str, Any] = {"factor": factor, "load": load()}
    if flagged is None:
        out |= {"steps": None, "seconds": None, "flagged": []}
    else:
        out |= {
            "steps": flagged["step"] - first,
            "seconds": flagged["t"] - began,
            "flagged": flagged["slow"],
        }
    until(
        lambda: (rows := [r for r in _rank0(watcher) if r["t"] > lifted]) and not rows[-1]["slow"],
        FLAG_TIMEOUT_S,
        "the flag clears",
    )
    return out


def _job(args: argparse.Namespace, work: Path, quick: float, clean_s: float) -> dict[str, Any]:
    """One job at quick factor ``quick``: the trials, then ``clean_s`` seconds with nobody
    slow; its own agents and trainers, all stopped before it returns."""
    work.mkdir(parents=True)
    slow_file = work / "slow"
    out: dict[str, Any] = {"quick_factor": quick}
    nodes = start_nodes(["n0", "n1", "n2"], work, "fast", args.ranks)
    try:
        budget = clean_s + 600 + len(FACTORS) * args.trials * FLAG_TIMEOUT_S * 2
        for n in nodes:
            extra = ["--slow-file", str(slow_file)] if n.name == "n2" else []
            n.start_trainers(
                SCRIPT,
                *("--job", "slow", "--steps", "100000000"),
                *("--stop-file", str(work / "stop"), "--step-work", str(args.step_work)),
                *("--pg-timeout", "60", "--min-nodes", "2", "--slow-quick-factor", str(quick)),
                *extra,
                timeout_s=budget,
            )
        world = 3 * args.ranks
        until(lambda: all(n.training_at(world) for n in nodes), 300, "the full world")
        time.sleep(5)  # past the first steps
        trials = []
        for factor in FACTORS:
            for i in range(args.trials):
                row = _trial(nodes, slow_file, factor)
                say(f"-- quick factor {quick:g}, {factor}x trial {i + 1}: {row}")
                trials.append(row)
        out["trials"] = trials
        if clean_s > 0:
            clean0 = time.time()
            say(f"-- quick factor {quick:g}: clean run {clean_s:.0f} s, load {load()}")
            time.sleep(clean_s)
            clean1 = time.time()
            clean = [r for n in nodes for r in n.all_records() if "loss" in r]
            clean = [r for r in clean if clean0 <= r["t"] < clean1]
            steps = [r["step"] for r in clean if r["rank"] == 0]
            watched = sorted((r for r in clean if r["rank"] == 0), key=lambda r: r["step"])
            flags = sum(
                len(set(b["slow"]) - set(a["slow"])) for a, b in itertools.pairwise(watched)
            )
            tops = [r["slow_top"] for r in watched if "slow_top" in r]
            out["clean"] = {
                "seconds": clean1 - clean0,
                "steps": (max(steps) - min(steps) + 1) if steps else 0,
                "false_flags": flags + len(watched[0]["slow"] if watched else []),
                "flagged_steps": sum(1 for r in watched if r["slow"]),
                "top_ratio": max(tops, default=None),
                "load": load(),
            }
            say(f"   {out['clean']}")
        (work / "stop").write_text(str(max(r["step"] for r in _rank0(nodes[0])) + 3))
        for n in nodes:
            for t in n.trainers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    t.wait(60)  # a trainer that does not finish is killed below
    finally:
        for n in nodes:
            n.stop()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": load()}
    with result_files.workdir(args.workdir, "swim-slow-") as work:
        # one job per quick factor, the first listed last: its trials follow the others'
        # at once (the loads compare), then its clean run
        jobs: list[dict[str, Any]] = []
        for i in reversed(range(len(args.quick_factors))):
            clean_s = args.clean_s if i == 0 else 0.0
            jobs.insert(0, _job(args, work / f"quick-{i}", args.quick_factors[i], clean_s))
        out["jobs"] = jobs
    out["load_after"] = load()
    return out


def _flag_rows(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for factor in FACTORS:
        got = [t for t in trials if t["factor"] == factor]
        steps = [t["steps"] for t in got if t["steps"] is not None]
        rows.append(
            {
                "factor": factor,
                "median": statistics.median(steps) if steps else None,
                "lo": min(steps, default=None),
                "hi": max(steps, default=None),
                "trials": len(got),
                "misses": len(got) - len(steps),
            }
        )
    return rows


def built(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    f = result_files.figure
    figures: dict[str, Any] = {}
    rows = []
    for i, job in enumerate(result["jobs"]):
        quick = job["quick_factor"]
        for row in _flag_rows(job["trials"]):
            factor = row["factor"]
            if i == 0:  # the headline figures: the first job's quick factor
                key = f"flagged_{str(factor).replace('.', '_')}x_steps"
                figures[key] = f(
                    f"node slowed {factor}x: flagged within (steps, median)",
                    row["median"],
                    "steps",
                    0,
                    spread=(row["lo"], row["hi"]) if row["median"] is not None else None,
                    runs=row["trials"],
                    text=None
                    if row["median"] is not None
                    else f"not flagged in {FLAG_TIMEOUT_S:.0f} s",
                )
            rows.append(
                {
                    "quick": f"{quick:g}" if quick else "off",
                    "factor": factor,
                    "steps": result_files.stat(row["median"], lo=row["lo"], hi=row["hi"]),
                    "trials": row["trials"],
                    "misses": row["misses"],
                }
            )
    first = result["jobs"][0]
    notes = [f"load average before {result['load_before']}, after {result['load_after']}"]
    if "clean" in first:
        clean = first["clean"]
        figures["false_flags"] = f(
            f"false flags in {clean['seconds'] / 60:.1f} min ({clean['steps']} steps), "
            "no slow node",
            clean["false_flags"],
            "flags",
            0,
        )
        figures["flagged_steps"] = f(
            "steps with a node flagged in that run", clean["flagged_steps"], "steps", 0
        )
        notes.append(
            f"run with no slow node: load {clean['load']} at its end; the slowest node's "
            f"figure reached {clean['top_ratio']} times the reference in a window"
        )
    for job in result["jobs"]:
        ones = [float(t["load"].split()[0]) for t in job["trials"]]
        name = f"{job['quick_factor']:g}" if job["quick_factor"] else "off"
        if ones:
            notes.append(
                f"quick factor {name}: 1-minute load {min(ones):.1f} to {max(ones):.1f} "
                "during its trials (compare the jobs' steps at similar loads)"
            )
    quicks = ", ".join(
        f"{j['quick_factor']:g}" if j["quick_factor"] else "off" for j in result["jobs"]
    )
    return {
        "question": "fail-slow",
        "title": "Fail-slow: a node slowed 1.5x and 3x flagged within how many steps",
        "method": (
            f"3 nodes x {args.ranks} ranks, examples/elastic_ddp.py, profile fast, gloo on "
            f"loopback; {args.step_work * 1000:.0f} ms of stand-in compute slept inside each "
            "step; slow_policy report, factor 1.3, 2 windows of 10 steps (the defaults), "
            f"one job per quick factor ({quicks}), the first listed last. In every job "
            f"{args.trials} trials per factor: n2's trainers sleep (factor - 1) times their "
            "own step compute time on top (an injected delay, not a CPU quota: see "
            "bench/slow_nodes.py) until n0's rank 0 "
            "logs n2 flagged, then the delay is lifted and the flag clears. Then, in the "
            f"first listed job, {args.clean_s:.0f} s with no slow node."
        ),
        "figures": figures,
        "tables": [
            {
                "caption": "Steps from the slowdown to the flag",
                "columns": [
                    result_files.column("quick", "quick factor"),
                    result_files.column("factor", "slowed", 1),
                    result_files.column("steps", "flagged within (steps)", 0),
                    result_files.column("trials", "trials"),
                    result_files.column("misses", "not flagged"),
                ],
                "rows": rows,
            }
        ],
        "notes": [
            *notes,
            "by construction at most 30 steps: the window the slowdown starts in counts only "
            "if most of its 10 steps were slow (its lower quartile), then two full windows; "
            "with the quick flag, a node at least the quick factor times the reference is "
            "flagged at the end of the first such window (at most 20 steps)",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--clean-s", type=float, default=600.0, help="the run with no slow node")
    parser.add_argument("--trials", type=int, default=5, help="per factor")
    parser.add_argument("--ranks", type=int, default=2, help="per node")
    parser.add_argument("--step-work", type=float, default=0.02, help="seconds slept per step")
    parser.add_argument("--workdir", type=Path, default=None, help="keep every log here")
    parser.add_argument(
        "--quick-factors",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[2.0],
        help="slow_quick_factor of each job, comma-separated (0: off); the first has the "
        "clean run and gives the headline figures",
    )
    result_files.add_arguments(parser)
    args = parser.parse_args(argv)
    started = result_files.machine()
    result = run(args)
    print(result)
    result_files.record(args, "bench.slow_nodes", argv, started, built(result, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
