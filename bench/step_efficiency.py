"""Step efficiency under repeated node failures: the fraction of failure-free throughput a
job keeps when one node is SIGKILLed and restarted every ``--every-s`` seconds.

Three "nodes" × two ranks on loopback (CPU/gloo), in one run:

- ``in-process``: swim agents (profile ``fast``) + examples/elastic_ddp.py trainers
  (agent/training_nodes.py). The victims rotate over every node, the first one included (the
  group's rank 0 and state source). A restarted node is a new agent joining a live node,
  and new trainers with the same arguments; by default under the same name and on the same
  address as the dead one, as a rebooted host comes back (``--restart-as``: a new port, or a
  new name; a dead member's name on a new address is refused until the dead entry is
  reaped, as in memberlist).
- ``torchrun + c10d``: stock torchrun with the c10d rendezvous (``--nnodes=2:3
  --nproc-per-node=2 --max-restarts=1000``) running examples/torchrun_train.py
  (bench/torchrun_recovery.py's ``Node``). The victims rotate over node1 and node2: node0
  hosts c10d's TCPStore, and killing it ends the job for good.
- ``torchrun + swim`` (optional): the same torchrun with ``--rdzv-backend=swim``, same
  victims as c10d (node0's agent is the rendezvous endpoint).

Each setup first trains failure-free (``--baseline-s``) for its steps/s, then for
``--minutes`` a node is killed every ``--every-s`` seconds (or, when the job is not back at
full size at that moment, as soon as it is: a job is never left with fewer than 2 training
nodes) and restarted right away. Steps are counted from the step logs (one record per step
from the rank 0 of whatever group ran it), so a step is one completed global step:

- step efficiency: steps completed in the faulty window / (baseline steps/s × window);
- rank-step efficiency: the same weighted by the world size of each step (÷ full world),
  i.e. the samples a job with a fixed per-rank batch would have processed; on this machine
  a step at world 4 takes as long as one at world 6 (``--step-sleep`` dominates), so
  steps/s alone overstates what a reduced world keeps on real GPUs.

Each step sleeps ``--step-sleep`` (0.05 s: elastic_ddp's ``--step-sleep``, torchrun_train's
``--step-delay`` default) so that a step is dominated by "compute", as a GPU step is, and
the 2 CPU cores are not the bottleneck. torchrun's workers count steps but keep no
checkpoint: its efficiency counts steps executed, as if each restart resumed for free.

    python -m bench.step_efficiency [--minutes 10] [--every-s 60] [--baseline-s 120]
                                    [--setups in-process,torchrun-c10d]

Its result file goes under results/ (bench/training_results.py; ``--results DIR``,
``--no-results``), the same question as bench/torch_recovery.py's efficiency part.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from agent.procs import until
from bench import results as result_files
from bench import torchrun_recovery, training_results
from bench.clusters import Cluster, InProcess, Record, Torchrun, say
from bench.torchrun_recovery import worker_of

ROOT = Path(__file__).resolve().parents[1]
SETUPS = ("in-process", "torchrun-c10d", "torchrun-swim")
LABELS = {
    "in-process": "in-process DDP + swim",
    "torchrun-c10d": "torchrun + c10d (stock)",
    "torchrun-swim": "torchrun + swim",
}
RESTART_AS = ("same-address", "new-address", "new-name")
TARGET_EFFICIENCY = 0.95
STALL_STEPS = 4  # a gap between global steps longer than this many failure-free steps
TORCHRUN_STEP_DELAY_S = 0.05  # examples/torchrun_train.py --step-delay default


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _rank0(records: Iterable[Record], start: float, end: float) -> list[Record]:
    """One record per global step completed in (start, end]: its group's rank 0's."""
    return [r for r in records if r["rank"] == 0 and start < r["t"] <= end]


def _step_times(records: Iterable[Record], start: float, end: float) -> list[float]:
    return sorted(float(r["t"]) for r in _rank0(records, start, end))


def count(records: Iterable[Record], start: float, end: float) -> tuple[int, int]:
    """Global steps completed in (start, end] (rank 0's records) and their rank-steps."""
    steps = _rank0(records, start, end)
    return len(steps), sum(int(r["world"]) for r in steps)


def pace(
    records: Iterable[Record], start: float, end: float, normal_s: float
) -> tuple[float, dict[int, float]]:
    """The stall time in (start, end]: every gap between consecutive global steps (and the
    window's edges) longer than ``STALL_STEPS`` failure-free steps, less one step; and the
    seconds per step at each world size over the other gaps."""
    inside = sorted((r["t"], int(r["world"])) for r in _rank0(records, start, end))
    stalled = 0.0
    spent: dict[int, list[float]] = {}
    prev = start
    for t, w in [*inside, (end, 0)]:
        gap = t - prev
        if gap > STALL_STEPS * normal_s:
            stalled += gap - normal_s
        elif w:
            spent.setdefault(w, []).append(gap)
        prev = t
    return stalled, {w: sum(g) / len(g) for w, g in sorted(spent.items(), reverse=True)}


def failure(
    cluster: Cluster[Any], records: list[Record], victim: str, kill_t: float, until_t: float
) -> dict[str, Any]:
    """For one kill: the first step of a group without the victim, and the first step back
    at the full world, both before ``until_t`` (the next kill or the end)."""
    out: dict[str, Any] = {"victim": victim, "kill_t": kill_t}
    before: dict[tuple[str, int], object] = {}
    for r in records:
        if r["t"] <= kill_t and r["node"] != victim:
            before[worker_of(r)] = cluster.generation(r)
    new = [
        r
        for r in records
        if kill_t < r["t"] <= until_t
        and r["node"] != victim
        and worker_of(r) in before
        and cluster.generation(r) != before[worker_of(r)]
    ]
    out["recover_s"] = out["recover_world"] = out["full_s"] = out["regrow_pause_s"] = None
    if not new:
        return out
    first = min(new, key=lambda r: r["t"])
    out["recover_s"] = first["t"] - kill_t
    out["recover_world"] = first["world"]
    full = [
        r
        for r in records
        if first["t"] <= r["t"] <= until_t and r["world"] == cluster.full_world and r["rank"] == 0
    ]
    if full:
        back = min(r["t"] for r in full)
        out["full_s"] = back - kill_t
        reduced = [
            r["t"]
            for r in records
            if first["t"] <= r["t"] < back and r["world"] < cluster.full_world and r["rank"] == 0
        ]
        if reduced:
            out["regrow_pause_s"] = back - max(reduced)
    return out


def run(
    setup: str,
    *,
    minutes: float,
    every_s: float,
    baseline_s: float,
    profile: str = "fast",
    ranks: int = 2,
    step_sleep: float = 0.05,
    start_timeout_s: float = 240.0,
    workdir: Path | None = None,
    restart_as: str = "same-address",
) -> dict[str, Any]:
    """One setup: start, train failure-free for ``baseline_s``, then kill and restart a node
    every ``every_s`` for ``minutes``; every process is gone on return."""
    window_s = minutes * 60
    result: dict[str, Any] = {
        "setup": setup,
        "label": LABELS[setup],
        "profile": profile if setup != "torchrun-c10d" else "-",
        "ranks": ranks,
        "minutes": minutes,
        "every_s": every_s,
        "baseline_s": baseline_s,
        "restart_as": restart_as if setup != "torchrun-c10d" else "-",
        "step_sleep": step_sleep if setup == "in-process" else TORCHRUN_STEP_DELAY_S,
        "load_before": load(),
    }
    with tempfile.TemporaryDirectory(prefix=f"swim-eff-{setup}-") as tmp:
        work = Path(tmp)
        if workdir is not None:  # kept for reading the logs afterwards
            work = workdir / f"efficiency-{setup}"
            work.mkdir(parents=True)
        result["workdir"] = str(work) + ("" if workdir is not None else " (removed)")
        began = time.monotonic()
        cluster: Cluster[Any]
        if setup == "in-process":
            run_s = start_timeout_s + baseline_s + window_s + 60
            cluster = InProcess(work, profile, ranks, step_sleep, run_s, restart_as)
        else:
            backend: torchrun_recovery.Backend = "c10d" if setup == "torchrun-c10d" else "swim"
            cluster = Torchrun(work, backend, profile, ranks, restart_as)
        try:
            until(lambda: cluster.at_full(0.0), start_timeout_s, f"{setup}: full world")
            result["startup_s"] = time.monotonic() - began
            time.sleep(5)  # past the first steps' warm-up
            base0 = time.time()
            time.sleep(baseline_s)
            base1 = time.time()
            say(f"   {setup}: baseline done, load {load()}")
            kills = _faults(cluster, base1, window_s, every_s)
            end = base1 + window_s
            records = cluster.records()
            result["port_fallbacks"] = cluster.port_fallbacks
        finally:
            cluster.close()
        result["load_after"] = load()
    steps_b, rank_steps_b = count(records, base0, base1)
    steps_f, rank_steps_f = count(records, base1, end)
    rate = steps_b / (base1 - base0)
    gaps = [b - a for a, b in itertools.pairwise(_step_times(records, base0, base1))]
    normal = statistics.median(gaps) if gaps else 1.0
    stall_b, _ = pace(records, base0, base1, normal)
    stall_f, per_world = pace(records, base1, end, normal)
    result.update(
        baseline_stall_s=stall_b,
        stall_s=stall_f,
        time_efficiency=1 - stall_f / window_s,
        step_s_by_world=per_world,
        baseline_steps=steps_b,
        baseline_rate=rate,
        baseline_step_s=(1 / rate) if rate else None,
        faulty_steps=steps_f,
        window_s=window_s,
        efficiency=steps_f / (rate * window_s) if rate else None,
        rank_efficiency=(
            rank_steps_f / (rank_steps_b / (base1 - base0) * window_s) if rank_steps_b else None
        ),
    )
    if setup == "in-process":  # the global step count: equal to steps_f unless a step reran
        before = [r["step"] for r in records if r["t"] <= base1]
        inside = [r["step"] for r in records if r["t"] <= end]
        result["progress"] = max(inside) - max(before) if before and inside else None
    fails = []
    for i, (victim, kill_t, delay_s) in enumerate(kills):
        next_t = kills[i + 1][1] if i + 1 < len(kills) else end
        row = failure(cluster, records, victim, kill_t, next_t)
        row["delayed_s"] = delay_s
        fails.append(row)
    result["failures"] = fails
    return result


def _faults(
    cluster: Cluster[Any], start: float, window_s: float, every_s: float
) -> list[tuple[str, float, float]]:
    """Kill and restart a node every ``every_s`` from ``start`` for ``window_s``: (victim,
    kill wall time, seconds the kill waited for the job to be back at full size)."""
    kills: list[tuple[str, float, float]] = []
    end = start + window_s
    slot = start
    last_kill = 0.0
    while slot < end - 1:
        _sleep_until(slot)
        if kills:  # wait until the job is back at full size (never fewer than 2 nodes)
            with contextlib.suppress(TimeoutError):
                back = functools.partial(cluster.at_full, last_kill)
                until(back, end - time.time(), "full world")
        if time.time() >= end - 1:
            break
        victim_slot = cluster.victims[len(kills) % len(cluster.victims)]
        last_kill = time.time()
        delay = last_kill - slot
        victim = cluster.kill(victim_slot)
        cluster.restart(victim_slot, len(kills) + 1)
        kills.append((victim, last_kill, delay))
        say(
            f"   kill {len(kills)}: {victim} at +{last_kill - start:.1f} s"
            + (f" (waited {delay:.1f} s for full size)" if delay > 1 else "")
            + f", load {load()}"
        )
        slot = max(slot + every_s, last_kill + 1)
    _sleep_until(end)
    return kills


def _sleep_until(t: float) -> None:
    left = t - time.time()
    if left > 0:
        time.sleep(left)


def _med(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def _range(values: list[float | None]) -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return "none"
    text = f"{statistics.median(got):.2f} s [{got[0]:.2f}–{got[-1]:.2f}]"
    if len(got) < len(values):
        text += f" ({len(values) - len(got)} of {len(values)} none)"
    return text


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| setup | failure-free s/step (steps/s) | steps in the faulty window (failure-free "
        "pace) | kills | **step efficiency** | time efficiency | rank-step efficiency "
        "| s/step by world, faulty window | fault → first step without the victim "
        "| fault → back at full world | survivors' pause at the regrow |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fails = r["failures"]

        def mark(value: float | None) -> str:
            if value is None:
                return ""
            return " ✓" if value >= TARGET_EFFICIENCY else " ✗"

        by_world = ", ".join(f"{w}: {v:.3f}" for w, v in r["step_s_by_world"].items())
        lines.append(
            f"| {r['label']} | {_s(r['baseline_step_s'], 3)} ({r['baseline_rate']:.2f}) "
            f"| {r['faulty_steps']} ({r['baseline_rate'] * r['window_s']:.0f}) "
            f"| {len(fails)} | **{_pct(r['efficiency'])}**{mark(r['efficiency'])} "
            f"| {_pct(r['time_efficiency'])}{mark(r['time_efficiency'])} "
            f"| {_pct(r['rank_efficiency'])} | {by_world} "
            f"| {_range([f['recover_s'] for f in fails])} "
            f"| {_range([f['full_s'] for f in fails])} "
            f"| {_range([f['regrow_pause_s'] for f in fails])} |"
        )
    return "\n".join(lines)


def failures_table(result: dict[str, Any]) -> str:
    lines = [
        "| # | victim | killed at | waited for full size | fault → first step without the "
        "victim (world) | fault → back at full world | survivors' pause at the regrow |",
        "|---|---|---|---|---|---|---|",
    ]
    start = result["failures"][0]["kill_t"] if result["failures"] else 0.0
    for i, f in enumerate(result["failures"], 1):
        world = f" ({f['recover_world']})" if f["recover_world"] is not None else ""
        lines.append(
            f"| {i} | {f['victim']} | +{f['kill_t'] - start:.0f} s | {_s(f['delayed_s'], 1)} "
            f"| {_s(f['recover_s'])}{world} | {_s(f['full_s'])} | {_s(f['regrow_pause_s'])} |"
        )
    return "\n".join(lines)


def describe(result: dict[str, Any]) -> str:
    extra = ""
    if result.get("progress") is not None:
        redone = result["faulty_steps"] - result["progress"]
        extra = f"; global step advanced by {result['progress']} ({redone} steps rerun)"
    if result.get("port_fallbacks"):
        extra += f"; {result['port_fallbacks']} restart(s) found the old port busy: a new one"
    return (
        f"{result['label']}: started in {result['startup_s']:.0f} s; failure-free "
        f"{result['baseline_steps']} steps in {result['baseline_s']:.0f} s (stalls "
        f"{result['baseline_stall_s']:.1f} s); faulty window {result['window_s']:.0f} s, "
        f"{result['faulty_steps']} steps, stalls {result['stall_s']:.1f} s{extra}; step sleep "
        f"{result['step_sleep']} s; restarted nodes: {result['restart_as']}; load average "
        f"{result['load_before']} before, "
        f"{result['load_after']} after; work dir {result['workdir']}."
    )


def report(results: list[dict[str, Any]]) -> str:
    parts = [table(results), ""]
    for r in results:
        parts += [describe(r), "", failures_table(r), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    parser.add_argument("--setups", default="in-process,torchrun-c10d")
    result_files.add_arguments(parser)
    args = parser.parse_args(argv)
    started = result_files.machine()
    results = run_all(args, [s for s in args.setups.split(",") if s], workdir=args.workdir)
    print(report(results))
    if results:
        built = training_results.efficiency(results, nodes=3, ranks=2, profile="fast")
        result_files.record(args, "bench.step_efficiency", argv, started, built)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every-s", type=float, default=60.0)
    parser.add_argument("--baseline-s", type=float, default=120.0)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument(
        "--restart-as",
        choices=RESTART_AS,
        default="same-address",
        help="a restarted node's identity (c10d has no agent: always a new torchrun)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep every log under this directory"
    )


def run_all(
    args: argparse.Namespace,
    setups: list[str],
    *,
    profile: str = "fast",
    ranks: int = 2,
    workdir: Path | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    results = []
    for setup in setups:
        if setup not in SETUPS:
            raise SystemExit(f"unknown setup {setup!r} (one of {', '.join(SETUPS)})")
        say(f"-- efficiency {setup}: {args.minutes} min, a kill every {args.every_s} s")
        try:
            result = run(
                setup,
                minutes=args.minutes,
                every_s=args.every_s,
                baseline_s=args.baseline_s,
                profile=profile,
                ranks=ranks,
                step_sleep=args.step_sleep,
                workdir=workdir,
                restart_as=args.restart_as,
            )
        except (TimeoutError, RuntimeError) as exc:
            say(f"   {setup} failed: {exc}")
            continue
        say(f"   {describe(result)} efficiency {_pct(result['efficiency'])}")
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
