"""Fail-slow with ``slow_policy="replace"``: the job's throughput after a spare takes a
slow node's place, against the failure-free run and against keeping the slow node.

    python -m bench.slow_replace --window-s 30

One job on four agents (profile ``fast``, loopback), 2 ranks each, examples/elastic_ddp.py
with ``--step-work`` seconds of stand-in compute slept inside each step, ``--target-nodes
3``, ``--slow-policy replace`` and the engine's fail-slow defaults (factor 1.3, 2 windows
of 10 steps): n0-n2 train, n3 waits as a spare. In order, each window ``--window-s`` long:

1. a failure-free window;
2. n2 slowed 1.5x: it is flagged and leaves, the spare trains in its place (the same world
   of 6); a window after the swap;
3. n2 restarted (it waits as a spare); the node that took its place slowed 3x, swapped for
   n2 the same way; a window after the swap;
4. no spare left: a node slowed 1.5x is flagged and stays (``replace`` with no spare acts
   as ``report``); a window while it does; the slowdown lifted until the flag clears; the
   same at 3x;
5. a failure-free window again (the failure-free rate is the mean of 1 and 5: the shared
   host's load drifts).

A slowdown is an injected delay, as in bench/slow_nodes.py (whose docstring says why not a
CPU quota): the node's trainers sleep (factor - 1) times their own step compute time from
before the slowdown on top of each step. Throughput is n0's local rank 0 (never slowed,
never swapped): steps per second between its first and last step in a window. Steps to
the flag: from the first step logged after the slowdown to the step at which the slow
node left (2, 3) or was first logged flagged (4). The swap: from the slow node leaving to
the spare's first completed step at the full world; the job's pause is the longest gap
between two of n0's steps around it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.procs import until
from agent.training_nodes import TrainingNode, start_nodes
from bench import results as result_files
from torchhook.client import fetch_view

SCRIPT = "examples/elastic_ddp.py"
FACTORS = (1.5, 3.0)
RANKS = 2
WORLD = 3 * RANKS
TIMEOUT_S = 120.0
"""A wait (the flag, the swap, a restarted spare) that takes longer fails the run."""
START_TIMEOUT_S = 300.0
"""Eight trainers importing torch on a shared 2-core host take a while."""
EXIT_WAIT_S = 20.0
"""A slow node's trainer still running this long after the spare trains is recorded
(exit status None) and killed: the node must be free to restart as a spare."""
EXCLUDED_EXIT = 3  # examples/job.py: a trainer whose node was left out as slow


def rate(records: Sequence[dict[str, Any]], t0: float, t1: float) -> float | None:
    """Steps per second of one rank between its first and last step record with
    ``t0 <= t < t1``: the steps done between them over the time between them (the window's
    edges cut no step in half); None with fewer than two records."""
    inside = sorted((r for r in records if t0 <= r["t"] < t1), key=lambda r: r["t"])
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    steps = float(inside[-1]["step"] - inside[0]["step"])
    return steps / float(inside[-1]["t"] - inside[0]["t"])


def longest_gap(records: Sequence[dict[str, Any]], t0: float, t1: float) -> float | None:
    """The longest time between two consecutive step records of one rank, the first of
    the two at or after ``t0`` and the second before ``t1``; None with fewer than two."""
    times = sorted(r["t"] for r in records if t0 <= r["t"] < t1)
    return max((b - a for a, b in itertools.pairwise(times)), default=None)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _since(node: TrainingNode, t: float, local_rank: int = 0) -> list[dict[str, Any]]:
    """The node's step records of ``local_rank`` after ``t`` (both jobs append to one log)."""
    return [r for r in node.steps(local_rank) if r["t"] > t]


def _trains(nodes: Sequence[TrainingNode], since: float) -> bool:
    """Every local rank of ``nodes`` ran 3 steps at the full world after ``since``."""
    for n in nodes:
        for lr in range(n.ranks):
            recent = _since(n, since, lr)[-3:]
            if len(recent) < 3 or any(r["world"] != WORLD for r in recent):
                return False
    return True


def _set_slow(path: Path, factor: float | None) -> float:
    """Slow the node reading ``path`` by ``factor`` (None: lift it); returns the time."""
    if factor is None:
        path.unlink(missing_ok=True)
    else:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{factor}\n")
        tmp.rename(path)  # atomic: a trainer reads the whole number or no file
    return time.time()


class Job:
    """One job on the four nodes: its trainers' arguments, its stop file, its windows."""

    def __init__(self, name: str, nodes: list[TrainingNode], work: Path, args: Any) -> None:
        self.name, self.nodes, self.work, self.args = name, nodes, work, args
        self.stop_file = work / f"{name}-stop"
        self.started = time.time()

    def slow_file(self, node: TrainingNode) -> Path:
        return self.work / f"{self.name}-slow-{node.name}"

    def start(self, node: TrainingNode, spare: bool) -> None:
        node.start_trainers(
            SCRIPT,
            *("--job", self.name, "--steps", "100000000", "--stop-file", str(self.stop_file)),
            *("--step-work", str(self.args.step_work), "--pg-timeout", "60"),
            *("--min-nodes", "2", "--target-nodes", "3", "--slow-policy", self.name),
            *("--slow-file", str(self.slow_file(node)), *(["--spare"] if spare else [])),
            timeout_s=START_TIMEOUT_S + 20 * self.args.window_s + 8 * TIMEOUT_S,
        )

    def spare_waits(self, spare: TrainingNode, seen_by: TrainingNode) -> None:
        def waits() -> bool:
            member = fetch_view(self.name, seen_by.control).member(spare.name)
            return member is not None and member.role == "spare"

        until(waits, TIMEOUT_S, f"{spare.name} waits as a spare")

    def window(self, what: str) -> dict[str, Any]:
        """Steps per second of n0's rank 0 over the next ``--window-s`` seconds."""
        t0 = time.time()
        time.sleep(self.args.window_s)
        got = rate(_since(self.nodes[0], t0), t0, time.time())
        out = {"steps_per_s": got, "load": load()}
        say(f"   {self.name}: {what}: {got or 0:.2f} steps/s, load {out['load']}")
        return out

    def first_step_after(self, t: float) -> int:
        until(lambda: _since(self.nodes[0], t), TIMEOUT_S, "a step after the slowdown")
        return int(_since(self.nodes[0], t)[0]["step"])

    def stop(self, training: Sequence[TrainingNode]) -> None:
        last = max(r["step"] for r in _since(self.nodes[0], self.started))
        self.stop_file.write_text(str(last + 3))
        for n in training:
            for t in n.trainers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    t.wait(60)
        for n in self.nodes:  # a trainer that did not finish (a spare never does)
            for t in n.trainers:
                if t.poll() is None:
                    t.kill()
                    t.wait(10)


def _swap(
    job: Job, training: list[TrainingNode], spare: TrainingNode, factor: float
) -> dict[str, Any]:
    """Slow the last of ``training`` by ``factor`` until it leaves and ``spare`` trains in
    its place: steps to the flag, the swap's times."""
    n0, victim = training[0], training[-1]
    began = _set_slow(job.slow_file(victim), factor)
    first = job.first_step_after(began)

    def left() -> dict[str, Any] | None:
        return next((r for r in victim.records(0) if "excluded" in r and r["t"] > began), None)

    until(lambda: left() is not None, TIMEOUT_S, f"{victim.name} leaves, slowed {factor}x")
    gone = left()
    assert gone is not None
    after = [*training[:-1], spare]
    until(lambda: _trains(after, gone["t"]), TIMEOUT_S, f"{spare.name} trains")
    joined = min(r["t"] for r in _since(spare, began))
    _set_slow(job.slow_file(victim), None)
    with contextlib.suppress(TimeoutError):  # one that does not exit is recorded, killed
        until(lambda: all(t.poll() is not None for t in victim.trainers), EXIT_WAIT_S, "exit")
    codes = [t.poll() for t in victim.trainers[-RANKS:]]
    for t in victim.trainers:
        if t.poll() is None:
            t.kill()
            t.wait(10)
    n0_steps = _since(n0, began)
    return {
        "policy": "replace",
        "factor": factor,
        "victim": victim.name,
        "spare": spare.name,
        "exit_codes": codes,
        "steps_to_flag": int(gone["step"]) - first,
        "flag_s": gone["t"] - began,
        "slowed_steps_per_s": rate(n0_steps, began, gone["t"]),
        "swap_s": joined - gone["t"],
        "pause_s": longest_gap(n0_steps, gone["t"] - 5, joined + 5),
    }


def _kept(job: Job, training: list[TrainingNode], factor: float) -> dict[str, Any]:
    """Slow the last of ``training`` by ``factor`` with no spare left: it is flagged and
    stays (as with ``report``); a window while it does; then lifted until the flag clears."""
    n0, victim = training[0], training[-1]
    began = _set_slow(job.slow_file(victim), factor)
    first = job.first_step_after(began)

    def flagged() -> dict[str, Any] | None:
        return next((r for r in _since(n0, began) if victim.name in r["slow"]), None)

    until(lambda: flagged() is not None, TIMEOUT_S, f"{victim.name} flagged at {factor}x")
    flag = flagged()
    assert flag is not None
    row = {
        "policy": "kept (no spare)",
        "factor": factor,
        "victim": victim.name,
        "steps_to_flag": int(flag["step"]) - first,
        "flag_s": flag["t"] - began,
        "slowed_steps_per_s": rate(_since(n0, began), began, flag["t"]),
    }
    say(f"-- kept {factor}x: {row}, load {load()}")
    row |= job.window(f"slowed {factor}x, kept")
    row["still_training"] = all(t.poll() is None for t in victim.trainers[-RANKS:])
    lifted = _set_slow(job.slow_file(victim), None)

    def cleared() -> bool:
        rows = _since(n0, lifted)
        return bool(rows) and not rows[-1]["slow"]

    until(cleared, TIMEOUT_S, "the flag clears")
    return row


def run_job(nodes: list[TrainingNode], work: Path, args: Any) -> dict[str, Any]:
    """The module docstring's sequence, in one job."""
    job = Job("replace", nodes, work, args)
    n0, n1, n2, n3 = nodes
    for n in nodes:
        job.start(n, spare=n is n3)
    until(lambda: _trains([n0, n1, n2], job.started), START_TIMEOUT_S, "the full world")
    job.spare_waits(n3, n0)
    time.sleep(3)  # past the first steps
    out: dict[str, Any] = {"clean": job.window("failure-free"), "trials": []}
    training, spare = [n0, n1, n2], n3
    for i, factor in enumerate(FACTORS):
        row = _swap(job, training, spare, factor)
        say(f"-- replace {factor}x: {row}, load {load()}")
        row |= job.window(f"after the swap at {factor}x")
        out["trials"].append(row)
        victim, training = training[-1], [*training[:-1], spare]
        if i + 1 < len(FACTORS):  # the slow node, restarted, waits as a spare
            job.start(victim, spare=True)
            job.spare_waits(victim, n0)
            spare = victim
    for factor in FACTORS:  # no spare left: the slow node stays
        out["trials"].append(_kept(job, training, factor))
    out["clean_end"] = job.window("failure-free again")
    job.stop(training)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": load()}
    with result_files.workdir(args.workdir, "swim-slow-replace-", fresh=True) as work:
        nodes = start_nodes(["n0", "n1", "n2", "n3"], work, "fast", RANKS)
        try:
            out |= run_job(nodes, work, args)
        finally:
            for n in nodes:
                n.stop()
    out["load_after"] = load()
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def failure_free(result: dict[str, Any]) -> float | None:
    """The failure-free rate: the mean of the windows at the start and at the end (the
    host's load drifts between them); the one there is if the other has no figure."""
    got = [w["steps_per_s"] for w in (result["clean"], result["clean_end"])]
    known = [g for g in got if g is not None]
    return sum(known) / len(known) if known else None


def built(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    f = result_files.figure
    clean = failure_free(result)
    figures: dict[str, Any] = {}
    ratios: list[dict[str, Any]] = []
    rows = []
    for t in result["trials"]:
        swapped = t["policy"] == "replace"
        x = f"{t['factor']}x"
        kept = _ratio(t["steps_per_s"], clean)
        key = f"{'replace' if swapped else 'kept'}_{x.replace('.', '_')}"
        after = "after the swap" if swapped else "with the slow node kept"
        label = f"slowed {x}: steps/s {after} / failure-free"
        figures[f"{key}_ratio"] = f(label, kept, "x", 2, text=None if kept else "no figure")
        if kept is not None:
            ratios.append({"label": f"slowed {x}: {after} / failure-free", "value": kept})
        if swapped:
            figures[f"{key}_steps"] = f(
                f"slowed {x}: steps to the flag (replace)", t["steps_to_flag"], "steps", 0
            )
            figures[f"{key}_swap_s"] = f(
                f"slowed {x}: slow node out to the spare's first step", t["swap_s"], "s", 2
            )
        rows.append(
            {
                "policy": "replace" if swapped else "replace, no spare left (as report)",
                "factor": t["factor"],
                "steps": t["steps_to_flag"],
                "swap_s": t.get("swap_s"),
                "pause_s": t.get("pause_s"),
                "slowed": t["slowed_steps_per_s"],
                "after": t["steps_per_s"],
                "ratio": kept,
                "load": t["load"],
            }
        )
    by = {(t["policy"] == "replace", t["factor"]): t["steps_per_s"] for t in result["trials"]}
    for factor in FACTORS:
        if (r := _ratio(by.get((True, factor)), by.get((False, factor)))) is not None:
            ratios.append({"label": f"slowed {factor}x: after the swap / kept", "value": r})
    for ratio in ratios:
        ratio["digits"] = 2
    ends = [result["clean"]["steps_per_s"], result["clean_end"]["steps_per_s"]]
    return {
        "question": "fail-slow-replace",
        "title": "Fail-slow with replace: throughput after a spare takes the slow node's place",
        "method": (
            f"3 nodes x {RANKS} ranks + 1 spare (target 3 nodes), examples/elastic_ddp.py, "
            f"profile fast, gloo on loopback; {args.step_work * 1000:.0f} ms of stand-in "
            "compute slept inside each step; slow_policy replace, fail-slow defaults (factor "
            "1.3, 2 windows of 10 steps). One job: a failure-free window; a training node "
            "slowed 1.5x (an injected delay: see bench/slow_nodes.py), flagged and swapped "
            "for the spare, a window after the swap; the slow node restarted as a spare, the "
            "node that replaced it slowed 3x, the same again; with no spare left, a node "
            "slowed 1.5x and then 3x stays in the job flagged (replace without a spare acts "
            "as report), a window each; a failure-free window at the end. Windows of "
            f"{args.window_s:.0f} s; throughput is n0's rank 0 (never slowed or swapped)."
        ),
        "figures": figures
        | {"clean": f("failure-free (mean of the start and end windows)", clean, "steps/s", 1)},
        "peers": ["the same job with the slow node kept (no spare left)"],
        "ratios": ratios,
        "tables": [
            {
                "caption": "Per slowdown, whole-job steps per second",
                "columns": [
                    result_files.column("policy", "policy"),
                    result_files.column("factor", "slowed", 1),
                    result_files.column("steps", "steps to the flag", 0),
                    result_files.column("swap_s", "out to the spare's first step (s)", 2),
                    result_files.column("pause_s", "longest step gap (s)", 2),
                    result_files.column("slowed", "steps/s slowed, before the flag", 1),
                    result_files.column("after", "steps/s after the swap / kept", 1),
                    result_files.column("ratio", "/ failure-free", 2),
                    result_files.column("load", "load (1/5/15 min)"),
                ],
                "rows": rows,
            }
        ],
        "notes": [
            "failure-free windows: "
            + ", ".join("none" if e is None else f"{e:.1f}" for e in ends)
            + f" steps/s (start, end); load average before {result['load_before']}, "
            f"after {result['load_after']}",
            "the swapped nodes' trainers left with exit status "
            + ", ".join(str(t["exit_codes"]) for t in result["trials"] if "exit_codes" in t)
            + f" ({EXCLUDED_EXIT}: left out as slow; None: still running {EXIT_WAIT_S:.0f} s "
            "after the swap, killed by the benchmark); a kept slow node still trained after "
            "its window: "
            + ", ".join(
                str(t["still_training"]) for t in result["trials"] if "still_training" in t
            ),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--window-s", type=float, default=30.0, help="each throughput window")
    parser.add_argument("--step-work", type=float, default=0.02, help="seconds slept per step")
    parser.add_argument("--workdir", type=Path, default=None, help="keep every log here")
    result_files.add_arguments(parser)
    args = parser.parse_args(argv)
    started = result_files.machine()
    result = run(args)
    print(result)
    result_files.record(args, "bench.slow_replace", argv, started, built(result, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
