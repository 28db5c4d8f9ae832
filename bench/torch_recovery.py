"""Training recovery after a node fault, in one run: in-process elastic DDP on swim vs
torchrun with the swim rendezvous vs torchrun with stock c10d.

In-process elastic DDP: four nodes on loopback, each a real agent and one trainer
(examples/elastic_ddp.py) in one process group (agent/training_nodes.py). Node n3 fails
on purpose at the next step after a fault file appears: it SIGKILLs or SIGSTOPs its whole
process group (agent included) at a step boundary (``kill``, ``stop``) or inside backward
(``kill-in-backward``), logging the wall time first. From the trainers' step logs:

- detection: fault → the membership verdict as the survivors' trainers saw it (``verdict_t``);
- resume: verdict → the first step completed at world 3;
- total: fault → the first step completed at world 3.

torchrun (3 nodes, world 3 → 2) is bench/torchrun_recovery.py's ``measure``: only the total
(fault → first step of a new group without the victim) is observable there; stock c10d is
watched over the same bounded windows as that module (40 s; 90 s after a SIGKILL).

    python -m bench.torch_recovery [--repeats 1] [--out BENCHMARKS.md | --no-write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent.training_nodes import TrainingNode as Node
from agent.training_nodes import start_nodes, until
from bench import torchrun_recovery

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/elastic_ddp.py"
PROFILES = ("fast", "local", "lan")
DDP_FAULTS = ("kill", "stop", "kill-in-backward")
TORCHRUN_FAULTS: tuple[torchrun_recovery.Scenario, ...] = ("kill", "stop")
TARGET_RESUME_S = 1.0  # in-process DDP: verdict → first step at world 3
TARGET_FAST_TOTAL_S = 3.0  # in-process DDP with the fast profile: fault → first step
TARGET_TORCHRUN_RESUME_S = 5.0  # torchrun + swim: verdict → first step of the new group


def _training_at(node: Node, world: int, steps: int = 3) -> bool:
    recent = node.steps()[-steps:]
    return len(recent) == steps and all(r["world"] == world for r in recent)


def _verdicts(records: list[dict[str, Any]], after: float) -> list[float]:
    return [float(v) for r in records if (v := r.get("verdict_t")) and v > after]


def measure_ddp(
    profile: str,
    fault: str,
    *,
    start_timeout_s: float = 150.0,
    window_s: float = 60.0,
) -> dict[str, Any]:
    """Four nodes train at world 4; n3 fails with ``fault``; time the survivors' verdict
    and their first step at world 3 (None if none within ``window_s``)."""
    with tempfile.TemporaryDirectory(prefix="swim-torchbench-") as tmp:
        work = Path(tmp)
        fault_file = work / "fault"
        nodes = start_nodes(["n0", "n1", "n2", "n3"], work, profile)
        survivors, victim = nodes[:3], nodes[3]
        try:
            started = time.monotonic()
            for n in nodes:
                extra = ["--fault", fault, "--fault-file", str(fault_file)] if n is victim else []
                n.start_trainers(
                    SCRIPT,
                    *("--job", "bench", "--steps", "1000000", "--step-sleep", "0.02"),
                    *("--pg-timeout", "60", "--min-nodes", "3", *extra),
                    timeout_s=start_timeout_s + window_s + 60,
                )
            until(lambda: all(_training_at(n, 4) for n in nodes), start_timeout_s, "world 4")
            startup_s = time.monotonic() - started
            fault_file.touch()
            until(lambda: any("fault" in r for r in victim.records()), 20, "the fault")
            fault_t = float(next(r["t"] for r in victim.records() if "fault" in r))
            row: dict[str, Any] = {
                "mode": "in-process DDP",
                "profile": profile,
                "fault": fault,
                "startup_s": startup_s,
                "window_s": window_s,
                "verdict_s": None,
                "resume_s": None,
                "total_s": None,
            }

            # with --min-nodes 3 the job may have trained at world 3 during startup too
            def at3(node: Node) -> list[dict[str, Any]]:
                return [r for r in node.steps() if r["world"] == 3 and r["t"] > fault_t]

            try:
                until(lambda: all(at3(n) for n in survivors), window_s, "survivors at world 3")
            except TimeoutError:
                return row
            after = [r for n in survivors for r in at3(n)]
            first = min(float(r["t"]) for r in after)
            verdicts = _verdicts(after, fault_t)
            row["total_s"] = first - fault_t
            if verdicts:
                row["verdict_s"] = min(verdicts) - fault_t
                row["resume_s"] = first - min(verdicts)
            # the survivors' agents need not agree at once: the last one to drop the victim
            last = [min(vs) for n in survivors if (vs := _verdicts(at3(n), fault_t))]
            if len(last) == len(survivors):
                row["last_verdict_s"] = max(last) - fault_t
            return row
        finally:
            for n in nodes:
                n.stop()


def measure_torchrun(
    profile: str, fault: torchrun_recovery.Scenario, backend: torchrun_recovery.Backend
) -> dict[str, Any]:
    window = 90.0 if (backend, fault) == ("c10d", "kill") else 40.0
    r = torchrun_recovery.measure(profile, fault, backend, window_s=window)
    return {
        "mode": "torchrun + swim" if backend == "swim" else "torchrun + c10d (stock)",
        "profile": r["profile"],
        "fault": fault,
        "startup_s": r["startup_s"],
        "window_s": window,
        "verdict_s": None,
        "resume_s": None,
        "total_s": r["recovery_s"],
    }


def _s(value: float | None, missing: str = "-") -> str:
    return missing if value is None else f"{value:.2f} s"


def _median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _spread(values: list[float | None], window_s: float) -> str:
    """The median, with the range when repeated, and how many runs saw no recovery."""
    got = sorted(v for v in values if v is not None)
    if not got:
        return f"none within {window_s:.0f} s" if values else "-"
    text = f"{statistics.median(got):.2f} s"
    if len(got) > 1:
        text += f" [{got[0]:.2f}–{got[-1]:.2f}]"
    if len(got) < len(values):
        text += f" ({len(values) - len(got)} of {len(values)} none within {window_s:.0f} s)"
    return text


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["mode"], r["profile"], r["fault"]), []).append(r)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | profile | fault | fault → verdict | verdict → first step without the victim "
        "| fault → first step without the victim | startup | runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (mode, profile, fault), runs in _groups(rows).items():
        window = float(runs[0]["window_s"])
        total = _spread([r["total_s"] for r in runs], window)
        if mode == "in-process DDP":
            verdict = _spread([r["verdict_s"] for r in runs], window)
            last = _median(r.get("last_verdict_s") for r in runs)
            if last is not None:
                verdict += f" (last survivor: {last:.2f} s)"
            resume = _spread([r["resume_s"] for r in runs], window)
        else:
            verdict = resume = "n/o"
        startup = _median(r["startup_s"] for r in runs)
        lines.append(
            f"| {mode} | {profile} | {fault} | {verdict} | {resume} | {total} "
            f"| {_s(startup)} | {len(runs)} |"
        )
    return "\n".join(lines)


def _ratio(c10d: list[dict[str, Any]], swim: list[dict[str, Any]]) -> str:
    ours = _median(r["total_s"] for r in swim)
    theirs = _median(r["total_s"] for r in c10d)
    if ours is None or not c10d:
        return "-"
    if theirs is None:
        window = float(c10d[0]["window_s"])
        return f"> {window / ours:.0f}x (c10d: none within {window:.0f} s)"
    return f"{theirs / ours:.1f}x"


def ratios(rows: list[dict[str, Any]], profiles: Iterable[str]) -> str:
    groups = _groups(rows)
    lines = [
        "| fault | swim profile | c10d total / torchrun+swim total "
        "| c10d total / in-process DDP total |",
        "|---|---|---|---|",
    ]
    for fault in TORCHRUN_FAULTS:
        c10d = groups.get(("torchrun + c10d (stock)", "-", fault), [])
        for profile in profiles:
            tr = groups.get(("torchrun + swim", profile, fault), [])
            ddp = groups.get(("in-process DDP", profile, fault), [])
            lines.append(f"| {fault} | {profile} | {_ratio(c10d, tr)} | {_ratio(c10d, ddp)} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]], profiles: Iterable[str]) -> str:
    groups = _groups(rows)
    out = []
    resumes = [r["resume_s"] for r in rows if r["mode"] == "in-process DDP"]
    worst = max((v for v in resumes if v is not None), default=None)
    missing = sum(1 for v in resumes if v is None)
    verdict = "met" if worst is not None and worst < TARGET_RESUME_S and not missing else "NOT met"
    out.append(
        f"- In-process DDP resumes within {TARGET_RESUME_S:.0f} s of the agent's verdict: "
        f"{verdict} (worst {_s(worst)} over {len(resumes)} runs"
        + (f", {missing} without a verdict→step time" if missing else "")
        + ")."
    )
    fast = [r["total_s"] for r in groups.get(("in-process DDP", "fast", "kill"), [])]
    if fast:
        got = [v for v in fast if v is not None]
        ok = len(got) == len(fast) and max(got) < TARGET_FAST_TOTAL_S
        out.append(
            f"- In-process DDP within {TARGET_FAST_TOTAL_S:.0f} s of the kill with the `fast` "
            f"profile: {'met' if ok else 'NOT met'} (totals "
            + ", ".join(_s(v) for v in fast)
            + ")."
        )
    ran_torchrun = any(mode == "torchrun + swim" for mode, _, _ in groups)
    for profile in profiles if ran_torchrun else []:
        for fault in TORCHRUN_FAULTS:
            tr = _median(r["total_s"] for r in groups.get(("torchrun + swim", profile, fault), []))
            det = _median(
                r["verdict_s"] for r in groups.get(("in-process DDP", profile, fault), [])
            )
            if tr is None:
                out.append(f"- torchrun + swim, {profile}, {fault}: no recovery observed.")
                continue
            if det is None:
                out.append(f"- torchrun + swim, {profile}, {fault}: total {_s(tr)}.")
                continue
            est = tr - det
            mark = "met" if est < TARGET_TORCHRUN_RESUME_S else "NOT met"
            out.append(
                f"- torchrun + swim within {TARGET_TORCHRUN_RESUME_S:.0f} s of the verdict, "
                f"{profile}, {fault}: {mark} (estimate: total {_s(tr)} − detection {_s(det)} "
                f"from the in-process rows = {_s(est)})."
            )
    return "\n".join(out)


def _ratios_section(rows: list[dict[str, Any]], profiles: Iterable[str]) -> str:
    if not any(r["mode"] != "in-process DDP" for r in rows):
        return ""  # --skip-torchrun: no c10d rows to compare with
    return f"Ratios (median totals; higher = swim faster):\n\n{ratios(rows, profiles)}\n\n"


def report(rows: list[dict[str, Any]], profiles: list[str], repeats: int, command: str) -> str:
    today = datetime.date.today().isoformat()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    title = "Training recovery after a node fault: in-process DDP, torchrun + swim, c10d"
    return f"""## {title} ({today})

Command: `{command}`. Machine: 2 CPU cores shared with other jobs (load average {load} at
the end of the run), CPU/gloo, loopback only; {repeats} run(s) per row (median, range in
brackets when repeated). All rows ran in the same invocation.

In-process DDP: 4 nodes (agent + `examples/elastic_ddp.py` trainer in one process group),
node n3 SIGKILLs/SIGSTOPs its whole process group at a step boundary (`kill`, `stop`) or
inside backward (`kill-in-backward`); world 4 → 3. *Fault → verdict*: the fault's logged wall
time to the earliest `verdict_t` (when a survivor's trainer saw its agent drop the member;
in parentheses, when the last survivor's did);
*verdict → first step*: to the first step completed at world 3. torchrun: 3 nodes, world
3 → 2 (`bench/torchrun_recovery.py`), where only the total is observable (n/o); stock c10d
is watched for 40 s (90 s after a SIGKILL: keep-alive expiry + last call).

{table(rows)}

{_ratios_section(rows, profiles)}Targets:

{targets(rows, profiles)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="only print the report")
    args = parser.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    plan: list[tuple[str, str, str]] = []  # (mode, profile, fault)
    for profile in profiles:
        plan += [("ddp", profile, f) for f in DDP_FAULTS]
    if not args.skip_torchrun:
        for profile in profiles:
            plan += [("swim", profile, f) for f in TORCHRUN_FAULTS]
        plan += [("c10d", "local", f) for f in TORCHRUN_FAULTS]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    began = time.monotonic()
    for mode, profile, fault in plan:
        for _ in range(args.repeats):
            print(f"-- {mode} {profile} {fault} ...", file=sys.stderr, flush=True)
            scenario: torchrun_recovery.Scenario = "kill" if fault == "kill" else "stop"
            backend: torchrun_recovery.Backend = "swim" if mode == "swim" else "c10d"
            for attempt in (1, 2):  # a start that never forms its first group is retried once
                try:
                    if mode == "ddp":
                        row = measure_ddp(profile, fault)
                    else:
                        row = measure_torchrun(profile, scenario, backend)
                    break
                except (TimeoutError, AssertionError) as exc:
                    print(f"   attempt {attempt}: {exc}", file=sys.stderr, flush=True)
                    failures.append(f"{mode} {profile} {fault} (attempt {attempt}): {exc}")
            else:
                continue
            print(f"   {row}", file=sys.stderr, flush=True)
            rows.append(row)
    print(f"-- done in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    command = "python -m bench.torch_recovery " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(rows, profiles, args.repeats, command.strip())
    if failures:
        text += "\nStarts that never trained at full size (retried once):\n\n"
        text += "".join(f"- {f}\n" for f in failures)
    print(text)
    if not args.no_write:
        with args.out.open("a") as fh:
            fh.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
