"""The report of bench/torch_recovery.py: its Markdown section for BENCHMARKS.md.

Tables of the recovery rows (medians and maxima over the repeats, the recovery targets next
to them), same-run ratios, the step-efficiency part (bench/step_efficiency.py's report), every
run, and ``write_section``, which replaces the section in a file or appends it.
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench import step_efficiency

__all__ = ["SECTION", "report", "table", "write_section"]

SECTION = "Training recovery: 3 nodes × 2 ranks"
# the recovery targets: reported next to the numbers, nothing is tuned to them
TARGET_KILL_S = 0.6  # SIGKILL of a node (boundary or in backward) → first step, median
TARGET_STOP_S = 1.2  # SIGSTOP of a node → first step, median
TARGET_POWER_S = 0.9  # power loss of a node, no spare → first step, median
TARGET_RESUME_S = 0.15  # verdict → first step at the reduced world, from world 6


def _median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _spread(values: list[float | None], window_s: float) -> str:
    """Median and maximum over the repeats, and how many runs saw no recovery."""
    got = sorted(v for v in values if v is not None)
    if not got:
        return f"none within {window_s:.0f} s" if values else "-"
    text = f"{statistics.median(got):.2f} / {got[-1]:.2f} s"
    if len(got) < len(values):
        text += f" ({len(values) - len(got)} of {len(values)} none within {window_s:.0f} s)"
    return text


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["mode"], r["fault"]), []).append(r)
    return out


def _target(runs: list[dict[str, Any]]) -> str:
    mode, fault = runs[0]["mode"], runs[0]["fault"]
    if not mode.startswith("in-process"):
        return ""
    total = _median(r["total_s"] for r in runs)
    resume = _median(r["resume_s"] for r in runs)
    limit = TARGET_KILL_S if fault.startswith("kill") else TARGET_STOP_S
    if fault.startswith("power"):
        limit = TARGET_POWER_S
    marks = [f"total ≤ {limit} s: " + ("met" if total is not None and total <= limit else "NOT")]
    ok = resume is not None and resume <= TARGET_RESUME_S
    marks.append(f"resume ≤ {TARGET_RESUME_S} s: " + ("met" if ok else "NOT"))
    if "HSDP" in mode:
        back = [r["rolled_back"] for r in runs]
        ok = all(b == 0 for b in back)
        marks.append("0 rolled back: " + ("met" if ok else "NOT"))
    return "; ".join(marks)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | fault | fault → verdict (last rank) | verdict → first step at the reduced "
        "world | **fault → first step at the reduced world** | rolled back | target (medians) "
        "| startup | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, fault), runs in _groups(rows).items():
        window = float(runs[0]["window_s"])
        total = _spread([r["total_s"] for r in runs], window)
        if mode.startswith("in-process"):
            verdict = _spread([r["verdict_s"] for r in runs], window)
            last = _median(r["last_verdict_s"] for r in runs)
            if last is not None:
                verdict += f" ({last:.2f} s)"
            resume = _spread([r["resume_s"] for r in runs], window)
            back = [r["rolled_back"] for r in runs if r["rolled_back"] is not None]
            rolled = f"{max(back)} (max)" if back else "-"
        else:
            verdict = resume = rolled = "n/o"
        target = _target(runs)
        startup = _median(r["startup_s"] for r in runs)
        lines.append(
            f"| {mode} | {fault} | {verdict} | {resume} | **{total}** | {rolled} | {target} "
            f"| {'-' if startup is None else f'{startup:.1f} s'} | {len(runs)} |"
        )
    return "\n".join(lines)


def _n(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def runs_table(rows: list[dict[str, Any]]) -> str:
    """Every run, for the outliers."""
    lines = [
        "| mode | fault | fault → verdict | last rank's verdict | verdict → step | total "
        "| rolled back | victim led the group | work dir |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['fault']} | {s(r['verdict_s'])} | {s(r['last_verdict_s'])} "
            f"| {s(r['resume_s'])} | {s(r['total_s'])} | {_n(r['rolled_back'])} "
            f"| {_n(r['victim_led'])} | {r['workdir']} |"
        )
    return "\n".join(lines)


def _ratio(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> str:
    mine = _median(r["total_s"] for r in ours)
    other = _median(r["total_s"] for r in theirs)
    if mine is None or not theirs:
        return "-"
    if other is None:
        window = float(theirs[0]["window_s"])
        return f"> {window / mine:.0f}x (none within {window:.0f} s)"
    return f"{other / mine:.1f}x"


def ratios(rows: list[dict[str, Any]]) -> str:
    g = _groups(rows)
    lines = [
        "| fault | torchrun+swim / in-process DDP | c10d / torchrun+swim | c10d / in-process DDP |",
        "|---|---|---|---|",
    ]
    for fault in ("kill", "stop"):
        ddp = g.get(("in-process DDP", fault), [])
        tr = g.get(("torchrun + swim", fault), [])
        c10d = g.get(("torchrun + c10d (stock)", fault), [])
        lines.append(
            f"| {fault} (step boundary for in-process) | {_ratio(tr, ddp)} | {_ratio(c10d, tr)} "
            f"| {_ratio(c10d, ddp)} |"
        )
    return "\n".join(lines)


def efficiency_ratios(results: list[dict[str, Any]]) -> str:
    by = {r["setup"]: r for r in results}
    ours = by.get("in-process")
    if ours is None or ours["efficiency"] is None:
        return ""
    out = []
    for other in ("torchrun-swim", "torchrun-c10d"):
        r = by.get(other)
        if r is None:
            continue
        parts = []
        for key, what in (
            ("efficiency", "steps"),
            ("time_efficiency", "time"),
            ("rank_efficiency", "rank-steps"),
        ):
            if ours[key] is not None and r[key]:
                parts.append(f"{what} {ours[key] / r[key]:.2f}x")
        out.append(f"in-process DDP / {r['label']}: " + ", ".join(parts))
    return ("Same-run efficiency ratios: " + "; ".join(out) + ".\n\n") if out else ""


def phase_offsets(firsts: list[dict[str, Any]], verdict_t: float) -> dict[str, float]:
    """Per phase of the re-formation (``torchhook.timeline``, logged by the examples with
    the first step of a new group), the median over ranks of when it was reached, in ms
    after ``verdict_t`` (the earliest verdict)."""
    at: dict[str, list[float]] = {}
    for r in firsts:
        for name, offset in (r.get("phases") or {}).items():
            at.setdefault(name, []).append(1000 * (float(r["left_t"]) + offset - verdict_t))
    return {name: statistics.median(v) for name, v in at.items()}


def phases_table(rows: list[dict[str, Any]]) -> str:
    """Median over runs of each phase's median over ranks, per mode and fault."""
    groups: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in rows:
        if r.get("phases_ms"):
            groups.setdefault((r["mode"], r["fault"]), []).append(r["phases_ms"])
    lines = [
        "| mode | fault | phase: ms after the verdict (median over runs of the ranks' median) |",
        "|---|---|---|",
    ]
    for (mode, fault), runs in groups.items():
        names = {n for run in runs for n in run}
        medians = {n: statistics.median([run[n] for run in runs if n in run]) for n in names}
        cells = " · ".join(f"{n} {v:.0f}" for n, v in sorted(medians.items(), key=lambda i: i[1]))
        lines.append(f"| {mode} | {fault} | {cells} |")
    return "\n".join(lines) + "\n"


def report(
    rows: list[dict[str, Any]],
    efficiency: list[dict[str, Any]],
    args: argparse.Namespace,
    command: str,
    loads: tuple[str, str],
    elapsed_s: float,
    step_sleep_s: float,
) -> str:
    today = datetime.date.today().isoformat()
    nodes, ranks = args.nodes, args.ranks_per_node
    full, reduced = nodes * ranks, (nodes - 1) * ranks
    tr_runs = "" if args.no_torchrun else f" ({args.torchrun_repeats} for torchrun)"
    text = f"""## {SECTION}

Current numbers for training recovery (the 4 nodes × 1 rank sections above are history).
Date {today}. Command: `{command}` ({elapsed_s / 60:.0f} min). Machine: 2 CPU cores shared
with other work (load average 1 / 5 / 15 min: {loads[0]} before, {loads[1]} after), CPU/gloo,
loopback only; agents on the `{args.profile}` profile. Everything below ran in this one
invocation.

**Recovery after a node fault.** {nodes} nodes × {ranks} ranks, world {full} → {reduced}. In-process
(examples/elastic_ddp.py, examples/elastic_hsdp.py; step sleep {step_sleep_s} s): the last
node's local rank 0 logs the wall time, then SIGKILLs/SIGSTOPs the node's whole process group
(agent + both trainers) at the step boundary (`kill`, `stop`) or inside backward
(`*-in-backward`). *Fault → verdict*: to the earliest `verdict_t` of a survivor rank (its
trainer saw the agent's view drop the node; in parentheses the median of the last survivor
rank's); *verdict → first step*: to the first step completed at world {reduced};
*fault → first step*: the sum, what training lost; *rolled back*: last step completed at
world {full} + 1 − first step at world {reduced}. Cells are median / max over
{args.repeats} runs{tr_runs}. torchrun: 3 nodes ×
`--nproc-per-node=2` (bench/torchrun_recovery.py), only the total is observable (n/o);
c10d is watched for 40 s (90 s after a SIGKILL). Targets: SIGKILL → first step
median ≤ {TARGET_KILL_S} s, SIGSTOP ≤ {TARGET_STOP_S} s, verdict → first step ≤
{TARGET_RESUME_S} s, HSDP node loss 0 steps rolled back.

{table(rows)}

Same-run ratios of the median totals (higher = the first faster):

{ratios(rows)}

Reference point (not run here): torchft with its most aggressive settings trained at the
reduced world 1.1 s after a SIGKILL/SIGSTOP inside a step and 0.2 s after one between steps
(CPU/gloo, 4 replicas).
"""
    if efficiency:
        e = efficiency[0]
        restart = next((r["restart_as"] for r in efficiency if r["restart_as"] != "-"), "-")
        target = f"{100 * step_efficiency.TARGET_EFFICIENCY:.0f} %"
        stall = step_efficiency.STALL_STEPS
        text += f"""
**Step efficiency.** {nodes} nodes × {ranks} ranks; each setup first trains failure-free
for {e["baseline_s"]:.0f} s (its own baseline, same run), then for {e["minutes"]:g} min a
node is SIGKILLed every {e["every_s"]:.0f} s (or, if the job is not back at full size by
then, as soon as it is: never fewer than 2 training nodes) and restarted at once: a new
agent joining a live node {_restart_text(restart)}, and new trainers with the same
arguments; torchrun: a new torchrun with the same arguments (for swim its agent restarted
the same way). Victims rotate n2, n1, n0 in-process (n0 is the oldest node: rank 0, state
source); node2, node1 for torchrun (node0 hosts c10d's store / swim's rendezvous endpoint).
Each step sleeps {e["step_sleep"]} s, so that a step is dominated by this "compute" as a GPU
step is and the 2 cores are not the bottleneck (the failure-free s/step shows the overhead
on top). Three ways to count what is kept (target ≥ {target}):

- *step efficiency* (the targets' definition): global steps completed in the faulty window /
  (failure-free steps/s × window). On this machine it can exceed 100 %: a step at world
  {reduced} is faster than one at world {full} (fewer processes on 2 cores; the s/step by world
  column), which real GPUs with a fixed global batch would not give.
- *time efficiency*: 1 − stalls / window, a stall being a gap between consecutive global
  steps longer than {stall} failure-free steps (less one step): the time the job made no
  progress, whatever its world size.
- *rank-step efficiency*: steps weighted by their world / {full}, the samples a job with a fixed
  per-rank batch keeps: it also charges the time at the reduced world while the restarted
  node comes back (process start, torch import on the shared cores).

torchrun's toy worker keeps no checkpoint: its steps are counted as if each restart resumed
for free. Recovery columns: median [min–max] over the kills; *survivors' pause at the
regrow*: the gap between the last step at the reduced world and the first one back at full
size.

{step_efficiency.report(efficiency)}
{efficiency_ratios(efficiency)}"""
    text += f"""
Where the time goes, verdict → first step (`torchhook.timeline`): *left* the old group,
a usable *view*, the formation *agreed*, the process *group* built, HSDP's *mesh* and
*model* (rebuilt on the new mesh, kept state copied in), *setup* and the training state
*carried*, the step-boundary *control* all-reduce, HSDP's node *barrier*, the step
function (*fn*), HSDP's cross-node gradient all-reduce (*reduced*) and commit vote
(*voted*), the completed *step* (HSDP's optimizer step is after the vote). A rank that lost
a peer's connection before the verdict left the group earlier (negative).

{phases_table(rows)}
Every run:

{runs_table(rows)}
"""
    return text


def _restart_text(mode: str) -> str:
    return {
        "same-address": "under the same name and on the same address, as a rebooted host",
        "new-address": "under the same name on a new port",
        "new-name": "under a new name",
    }.get(mode, mode)


def write_section(path: Path, text: str) -> None:
    """Replace the section titled ``SECTION`` in ``path`` (up to the next ``## ``), or
    append it."""
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(rf"^## {re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old, count=1)
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new.rstrip("\n") + "\n")
