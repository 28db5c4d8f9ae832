"""The result files (bench/results.py) of bench/torch_recovery.py and bench/step_efficiency.py.

``recovery``: one row per strategy and fault (in-process DDP/HSDP on swim, torchrun + swim,
torchrun + stock c10d), statistics over the repeats from every run's record, the same-run
ratios of the median totals, and every run. ``power``: the same for a power loss beside
SIGKILL and SIGSTOP with every node in a network namespace (and the last two on loopback,
same run), with what reached the survivors from the victim (resets, ICMP) and what the
victim's cut dropped. ``efficiency``: one row per setup of the
step-efficiency run, its same-run ratios, and every kill of each setup.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench.results import column, figure, stat

MODES = {  # a mode's figure key
    "in-process DDP": "in-process-ddp",
    "in-process HSDP": "in-process-hsdp",
    "in-process DDP, namespaces": "in-process-ddp-ns",
    "in-process HSDP, namespaces": "in-process-hsdp-ns",
    "torchrun + swim": "torchrun-swim",
    "torchrun + c10d (stock)": "torchrun-c10d",
}
FAULTS = {
    "kill": "SIGKILL at a step boundary",
    "kill-in-backward": "SIGKILL inside backward",
    "stop": "SIGSTOP at a step boundary",
    "stop-in-backward": "SIGSTOP inside backward",
    "power": "power loss at a step boundary",
    "power-in-backward": "power loss inside backward",
}


def _stat(values: Sequence[float | None]) -> dict[str, float] | None:
    got = sorted(v for v in values if v is not None)
    if not got:
        return None
    return stat(statistics.median(got), lo=got[0], hi=got[-1])


def by_mode_and_fault(
    rows: Sequence[Mapping[str, Any]],
) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    """Rows grouped by (mode, fault), in the order they were measured."""
    out: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["mode"], r["fault"]), []).append(r)
    return out


def median_total(runs: Sequence[Mapping[str, Any]]) -> float | None:
    """Median fault -> first step (``total_s``) of the runs that got one; None if none did."""
    got = [r["total_s"] for r in runs if r["total_s"] is not None]
    return statistics.median(got) if got else None


def recovery(
    rows: Sequence[Mapping[str, Any]],
    *,
    nodes: int,
    ranks: int,
    profile: str,
    step_sleep_s: float,
    startup: Mapping[tuple[str, str], float] | None = None,
) -> dict[str, Any]:
    """question, title, method, figures, peers, ratios and tables of one invocation of
    bench/torch_recovery.py (``rows``: its per-run records; ``startup``: per group, when the
    runs do not carry ``startup_s``)."""
    full, reduced = nodes * ranks, (nodes - 1) * ranks
    groups = by_mode_and_fault(rows)
    figures: dict[str, Any] = {}
    table_rows = []
    for (mode, fault), runs in groups.items():
        key = _key(mode, fault)
        total = _stat([r["total_s"] for r in runs])
        window = float(runs[0].get("window_s") or 40.0)
        none = f"none within {window:.0f} s"
        figures[f"{key}.total_s"] = figure(
            f"{mode}, {FAULTS.get(fault, fault)}: fault → first step without the node, median",
            None if total is None else total["median"],
            "s",
            spread=None if total is None else [total["min"], total["max"]],
            runs=len(runs),
            text=none if total is None else None,
        )
        backs = [r["rolled_back"] for r in runs if r.get("rolled_back") is not None]
        if mode == "in-process HSDP" and backs:
            figures[f"{key}.rolled_back"] = figure(
                f"{mode}, {FAULTS.get(fault, fault)}: steps rolled back, most in any run",
                max(backs),
                "steps rolled back",
                0,
                runs=len(runs),
            )
        starts = [r["startup_s"] for r in runs if r.get("startup_s") is not None]
        in_process = mode.startswith("in-process")
        last = [r["last_verdict_s"] for r in runs if r.get("last_verdict_s") is not None]
        table_rows.append(
            {
                "mode": mode,
                "fault": fault,
                "verdict": _stat([r["verdict_s"] for r in runs]) if in_process else "n/o",
                "last_verdict": statistics.median(last) if last else None,
                "resume": _stat([r["resume_s"] for r in runs]) if in_process else "n/o",
                "total": total if total is not None else none,
                "rolled_back": max(backs) if backs else None,
                "startup": statistics.median(starts)
                if starts
                else (startup or {}).get((mode, fault)),
                "runs": len(runs),
            }
        )
    ratios = []
    for fault in ("kill", "stop"):
        ddp = groups.get(("in-process DDP", fault), [])
        tr = groups.get(("torchrun + swim", fault), [])
        c10d = groups.get(("torchrun + c10d (stock)", fault), [])
        for a, a_name, b, b_name in (
            (tr, "torchrun + swim", ddp, "in-process DDP"),
            (c10d, "torchrun + c10d", tr, "torchrun + swim"),
            (c10d, "torchrun + c10d", ddp, "in-process DDP"),
        ):
            ours, theirs = median_total(b), median_total(a)
            if not a or ours is None:
                continue
            label = f"{a_name} / {b_name}, {FAULTS[fault]}, fault → first step"
            if theirs is None:
                window = float(a[0].get("window_s") or 40.0)
                ratios.append(
                    {"label": label, "value": math.floor(window / ours), "bound": ">", "digits": 0}
                )
            else:
                ratios.append({"label": label, "value": round(theirs / ours, 1), "digits": 1})
    every = [
        {
            "mode": r["mode"],
            "fault": r["fault"],
            "verdict": r["verdict_s"],
            "last_verdict": r.get("last_verdict_s"),
            "resume": r["resume_s"],
            "total": r["total_s"],
            "rolled_back": r.get("rolled_back"),
            "victim_led": None if r.get("victim_led") is None else bool(r["victim_led"]),
        }
        for r in rows
    ]
    s3 = 3
    return {
        "question": f"training-recovery-{nodes}x{ranks}-{profile}",
        "title": f"Recovery by fault and strategy: {nodes} nodes × {ranks} ranks, `{profile}`",
        "method": (
            f"{nodes} nodes × {ranks} ranks on loopback (CPU/gloo), world {full} → {reduced}. "
            f"In-process (examples/elastic_ddp.py, examples/elastic_hsdp.py, a step sleeps "
            f"{step_sleep_s} s): the last node's local rank 0 logs the wall time, then "
            "SIGKILLs or SIGSTOPs the node's whole process group (agent and trainers) at a "
            "step boundary or inside backward. *Verdict*: a survivor's trainer sees its "
            f"agent drop the node; *first step*: the first step completed at world {reduced}. "
            f"torchrun: {nodes} nodes × `--nproc-per-node={ranks}` (bench/torchrun_recovery.py), "
            "where only the total is observable (n/o); stock c10d is watched for 40 s (90 s "
            f"after a SIGKILL). The agents run the `{profile}` profile."
        ),
        "figures": figures,
        "peers": sorted({m for m, _ in groups}),
        "ratios": ratios,
        "tables": [
            {
                "caption": "Each strategy and fault, s (median [range] over the runs)",
                "columns": [
                    column("mode", "strategy"),
                    column("fault", "fault"),
                    column("verdict", "fault → verdict"),
                    column("last_verdict", "last rank's verdict, median"),
                    column("resume", "verdict → first step"),
                    column("total", "fault → first step without the node"),
                    column("rolled_back", "steps rolled back (most)"),
                    column("startup", "start-up", 1),
                    column("runs", "runs"),
                ],
                "rows": table_rows,
            },
            {
                "caption": "Every run, s",
                "detail": True,
                "columns": [
                    column("mode", "strategy"),
                    column("fault", "fault"),
                    column("verdict", "fault → verdict", s3),
                    column("last_verdict", "last rank's verdict", s3),
                    column("resume", "verdict → first step", s3),
                    column("total", "total", s3),
                    column("rolled_back", "rolled back"),
                    column("victim_led", "the victim led the group"),
                ],
                "rows": every,
            },
        ],
    }


def _key(mode: str, fault: str) -> str:
    return f"{MODES.get(mode) or re.sub(r'[^a-z0-9]+', '-', mode.lower()).strip('-')}-{fault}"


def spares(
    built: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    spares: int,
    nodes: int,
    ranks: int,
    profile: str,
) -> dict[str, Any]:
    """``recovery`` or ``power`` for bench/torch_recovery.py ``--spares``: each case with
    ``spares`` spare nodes (modes ending ``, spare``: the first step is at the *same* world,
    a spare in the victim's place) beside the same case without one (the reduced world),
    in the same run; its own question, and the ratios spare / no spare."""
    out = dict(built)
    full, reduced = nodes * ranks, (nodes - 1) * ranks
    same = "fault → first step at the same world (a spare in its place)"
    for fig in out["figures"].values():
        if ", spare" in fig.get("label", "") and "first step without the node" in fig["label"]:
            fig["label"] = fig["label"].replace("fault → first step without the node", same)
    groups = by_mode_and_fault(rows)
    ratios = []
    for (mode, fault), runs in groups.items():
        if mode.endswith(", spare"):
            a, b = median_total(runs), median_total(groups.get((mode[:-7], fault), []))
            if a is not None and b:
                label = f"{mode[:-7]}, {FAULTS.get(fault, fault)}: with a spare / without"
                ratios.append({"label": f"{label}, fault → first step", "value": round(a / b, 2)})
    kind = "power" if out["question"].startswith("training-power") else "recovery"
    out |= {
        "question": f"training-spares-{kind}-{nodes}x{ranks}-{profile}",
        "title": f"Hot spares: {nodes} nodes × {ranks} ranks + {spares} spare, `{profile}`",
        "method": (
            f"{out['method']} Rows whose strategy ends in *spare*: {spares} more node(s) "
            f"wait as spares (`--target-nodes {nodes}`, `--spare`); the first step is the "
            f"first completed at world {full} after the fault, with the oldest spare in the "
            f"victim's place (without a spare: world {reduced}). Each case with and without "
            "a spare, repeats interleaved."
        ),
        "ratios": ratios + list(out.get("ratios", [])),
    }
    return out


def _sum(runs: Sequence[Mapping[str, Any]], *keys: str) -> int | None:
    got = [sum(int(r[k]) for k in keys) for r in runs if all(r.get(k) is not None for k in keys)]
    return sum(got) if got else None


def power(
    rows: Sequence[Mapping[str, Any]],
    *,
    nodes: int,
    ranks: int,
    profile: str,
    step_sleep_s: float,
) -> dict[str, Any]:
    """``recovery`` for bench/torch_recovery.py ``--netns`` (``rows`` with ``net`` and, in
    namespaces, the packet counts of tests/netns/training.py): its own question, the
    verdicts as figures, the counts as columns, and namespaces / loopback ratios."""
    out = recovery(rows, nodes=nodes, ranks=ranks, profile=profile, step_sleep_s=step_sleep_s)
    full, reduced = nodes * ranks, (nodes - 1) * ranks
    groups = by_mode_and_fault(rows)
    for (mode, fault), runs in groups.items():
        verdict = _stat([r["verdict_s"] for r in runs])
        if verdict is not None:
            out["figures"][f"{_key(mode, fault)}.verdict_s"] = figure(
                f"{mode}, {FAULTS.get(fault, fault)}: fault → verdict, median",
                verdict["median"],
                "s",
                spread=[verdict["min"], verdict["max"]],
                runs=len(runs),
            )
        resets = _sum(runs, "resets", "icmp")
        if resets is not None:
            out["figures"][f"{_key(mode, fault)}.resets"] = figure(
                f"{mode}, {FAULTS.get(fault, fault)}: TCP resets and ICMP from the victim "
                "at the survivors, all runs",
                resets,
                "packets",
                0,
                runs=len(runs),
            )
    main, every = out["tables"]
    for row in main["rows"]:
        runs = groups[(row["mode"], row["fault"])]
        row["resets"] = _sum(runs, "resets")
        row["icmp"] = _sum(runs, "icmp")
        dropped = [r["dropped_in"] + r["dropped_out"] for r in runs if r.get("dropped_in")]
        row["dropped"] = statistics.median(dropped) if dropped else None
    for row, run in zip(every["rows"], rows, strict=True):
        row["resets"] = run.get("resets")
        row["icmp"] = run.get("icmp")
        row["dropped"] = (
            None
            if run.get("dropped_in") is None
            else f"{run['dropped_in']} in, {run['dropped_out']} out"
        )
    counts = [
        column("resets", "TCP resets at the survivors (all runs)"),
        column("icmp", "ICMP at the survivors (all runs)"),
        column("dropped", "dropped at the victim (median)", 0),
    ]
    main["columns"][-2:-2] = counts
    every["columns"] += [
        column("resets", "resets"),
        column("icmp", "ICMP"),
        column("dropped", "dropped at the victim"),
    ]
    ratios = []
    for kind in ("DDP", "HSDP"):
        ns_mode, lo_mode = f"in-process {kind}, namespaces", f"in-process {kind}"
        pairs = [(ns_mode, f, lo_mode, f, "namespaces / loopback") for f in ("kill", "stop")]
        pairs += [(ns_mode, "power", ns_mode, "stop", "power loss / SIGSTOP, namespaces")]
        pairs += [(ns_mode, "power", ns_mode, "kill", "power loss / SIGKILL, namespaces")]
        for a_mode, a_fault, b_mode, b_fault, what in pairs:
            a = median_total(groups.get((a_mode, a_fault), []))
            b = median_total(groups.get((b_mode, b_fault), []))
            if a is not None and b:
                label = f"{kind}, {what}" + (f", {FAULTS[a_fault]}" if a_fault == b_fault else "")
                ratios.append({"label": f"{label}: fault → first step", "value": round(a / b, 2)})
    out |= {
        "question": f"training-power-{nodes}x{ranks}-{profile}",
        "title": (
            f"Power loss beside SIGKILL and SIGSTOP, nodes in network namespaces: {nodes} "
            f"nodes × {ranks} ranks, `{profile}`"
        ),
        "method": (
            f"{nodes} nodes × {ranks} ranks (CPU/gloo), world {full} → {reduced}, no spare. "
            "*Namespaces*: each node's agent and trainers in a network namespace of its own "
            "on one bridge (tests/netns/training.py), the agents bound to their host's "
            "address, the TCPStore and gloo traffic over the bridge. *Power loss*: at a step "
            "boundary the last node's local rank 0 drops every packet in and out of its "
            "node's link (iptables in its namespace, both rules committed at once), then "
            "SIGKILLs the node: the survivors hear nothing more, no reset and no ICMP. "
            "SIGKILL and SIGSTOP of the node's process group at a step boundary, in "
            "namespaces and on loopback, in the same run, repeats interleaved "
            f"(examples/elastic_ddp.py, examples/elastic_hsdp.py, a step sleeps "
            f"{step_sleep_s} s). *Verdict*: a survivor's trainer sees its agent drop the "
            f"node; *first step*: the first step completed at world {reduced}. Counting "
            "rules at every survivor count what arrived from the victim from just before "
            "the fault until the survivors moved on; the victim's DROP rules count what the "
            f"cut held back. The agents run the `{profile}` profile."
        ),
        "ratios": ratios,
    }
    return out


def efficiency(
    setups: Sequence[Mapping[str, Any]], *, nodes: int, ranks: int, profile: str
) -> dict[str, Any]:
    """question, title, method, figures, peers, ratios and tables of a step-efficiency run
    (``setups``: bench/step_efficiency.py ``run`` results)."""
    e = setups[0]
    figures: dict[str, Any] = {}
    rows = []
    kills = []
    for r in setups:
        fails = r["failures"]
        figures[f"{r['setup']}.efficiency"] = figure(
            f"{r['label']}: step efficiency",
            None if r["efficiency"] is None else round(100 * r["efficiency"], 1),
            "%",
            1,
            text="none" if r["efficiency"] is None else None,
        )
        rows.append(
            {
                "setup": r["label"],
                "step_s": r["baseline_step_s"],
                "steps": r["faulty_steps"],
                "expected": round(r["baseline_rate"] * r["window_s"]),
                "kills": len(fails),
                "efficiency": _pct(r["efficiency"]),
                "time_efficiency": _pct(r["time_efficiency"]),
                "rank_efficiency": _pct(r["rank_efficiency"]),
                "by_world": ", ".join(f"{w}: {v:.3f}" for w, v in r["step_s_by_world"].items()),
                "recover": _stat([f["recover_s"] for f in fails]) or "none",
                "full": _stat([f["full_s"] for f in fails]) or "none",
                "pause": _stat([f["regrow_pause_s"] for f in fails]) or "none",
            }
        )
        start = fails[0]["kill_t"] if fails else 0.0
        for i, f in enumerate(fails, 1):
            kills.append(
                {
                    "setup": r["label"],
                    "i": i,
                    "victim": f["victim"],
                    "at": round(f["kill_t"] - start),
                    "waited": f["delayed_s"],
                    "recover": f["recover_s"],
                    "world": f.get("recover_world"),
                    "full": f["full_s"],
                    "pause": f["regrow_pause_s"],
                }
            )
    by = {r["setup"]: r for r in setups}
    ratios = []
    ours = by.get("in-process")
    for other in ("torchrun-swim", "torchrun-c10d"):
        theirs = by.get(other)
        if ours is None or theirs is None:
            continue
        r = theirs
        for key, what in (
            ("efficiency", "steps"),
            ("time_efficiency", "time"),
            ("rank_efficiency", "rank-steps"),
        ):
            if ours.get(key) is not None and r.get(key):
                ratios.append(
                    {
                        "label": f"in-process DDP + swim / {r['label']}, {what} kept",
                        "value": round(ours[key] / r[key], 2),
                    }
                )
    return {
        "question": f"step-efficiency-{nodes}x{ranks}-{profile}",
        "title": f"Throughput kept with a node killed every minute: {nodes} nodes × {ranks} ranks",
        "method": (
            f"Each setup trains failure-free for {e['baseline_s']:.0f} s (its own baseline, "
            f"same run), then for {e['minutes']:g} min a node is SIGKILLed every "
            f"{e['every_s']:.0f} s and restarted at once (in-process: a new agent under the "
            "same name and address, as a rebooted host, and new trainers; torchrun: a new "
            "torchrun). Victims rotate over every node in-process (rank 0 included) and over "
            "the two nodes that do not host the rendezvous for torchrun. A step sleeps "
            f"{e['step_sleep']} s so that compute dominates, as on a GPU. *Step efficiency*: "
            "global steps in the faulty window / (failure-free steps per second × window); "
            "*time efficiency*: 1 − the time without progress / window; *rank-step "
            f"efficiency*: steps weighted by their world / {nodes * ranks}. On 2 cores a step "
            "at a reduced world is not slower, which real GPUs with a fixed global batch "
            "would not give; torchrun's toy worker keeps no checkpoint, so its steps count as "
            f"if each restart resumed for free. The agents run the `{profile}` profile."
        ),
        "figures": figures,
        "peers": [r["label"] for r in setups],
        "ratios": ratios,
        "tables": [
            {
                "caption": "Each setup (recovery columns in s: median [range] over the kills)",
                "columns": [
                    column("setup", "setup"),
                    column("step_s", "failure-free s/step", 3),
                    column("steps", "steps in the faulty window"),
                    column("expected", "at the failure-free pace"),
                    column("kills", "kills"),
                    column("efficiency", "step efficiency"),
                    column("time_efficiency", "time efficiency"),
                    column("rank_efficiency", "rank-step efficiency"),
                    column("by_world", "s/step by world"),
                    column("recover", "fault → first step without the node"),
                    column("full", "fault → back at full world"),
                    column("pause", "survivors' pause at the regrow"),
                ],
                "rows": rows,
            },
            {
                "caption": "Every kill",
                "detail": True,
                "columns": [
                    column("setup", "setup"),
                    column("i", "#"),
                    column("victim", "victim"),
                    column("at", "killed at, s"),
                    column("waited", "waited for full size, s", 1),
                    column("recover", "fault → first step without the node, s"),
                    column("world", "at world"),
                    column("full", "fault → back at full world, s"),
                    column("pause", "survivors' pause, s"),
                ],
                "rows": kills,
            },
        ],
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"
