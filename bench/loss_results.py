"""The summary of bench/loss_windows.py's windows: rates with exact intervals, the
simulator's windows beside them, and the result file.

A rate is the share of windows with at least one live member declared dead (a window is
a binomial trial), with its exact Clopper–Pearson 95 % interval; a window's counts and
its 1-minute load average come from ``bench.loss_windows``. The simulator's windows run
the same 5-member ``lan`` world that its ``loss`` scenario builds
(``simulations.experiments.harness.build``), with lossy TCP (the iptables rules drop TCP
segments too), one window per seed: the loss window, a crash, the window after it, then
until the crash is dead everywhere.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from typing import Any

from bench import results

HOSTS = 5
VICTIM = 5
DETECT_TIMEOUT_S = 40.0
"""lan at 5 members: suspicion max = β·α·1 s = 24 s, plus the probe that finds the crash."""


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """The exact binomial interval for k successes in n trials (bisection on the CDF)."""
    if n <= 0:
        return (0.0, 1.0)
    a = (1 - conf) / 2

    def cdf(x: int, p: float) -> float:
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(x + 1))

    def solve(f: Callable[[float], bool]) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: 1 - cdf(k - 1, p) < a)
    upper = 1.0 if k == n else solve(lambda p: cdf(k, p) > a)
    return lower, upper


def sim_windows(loss: float, seeds: int, window_s: float, after_s: float) -> list[dict[str, Any]]:
    """One simulated window per seed (module docstring)."""
    from simulations.experiments.harness import Params, build, drive

    out = []
    for seed in range(1, seeds + 1):
        p = Params(nodes=HOSTS, seed=seed, config="lan", extra={"lossy_tcp": 1})
        sim = build(p, HOSTS, loss=loss)
        world, metrics = sim.world, sim.metrics
        drive(world, world.now_ms + int(window_s * 1000), None)
        steady = sum(1 for f in metrics.false_positives if f.kind == "dead")
        kill_ms = world.now_ms
        world.crash(VICTIM - 1)
        drive(world, kill_ms + int(after_s * 1000), None)
        after = sum(1 for f in metrics.false_positives if f.kind == "dead") - steady
        drive(world, kill_ms + int(DETECT_TIMEOUT_S * 1000), None)
        crash = metrics.crashes[-1]
        detect = None if crash.all_dead_ms is None else (crash.all_dead_ms - kill_ms) / 1000
        out.append(
            {"impl": "sim-lan", "loss": loss, "seed": seed, "steady_dead": steady,
             "after_dead": after, "detect_last_s": detect}
        )  # fmt: skip
    return out


WHAT = {
    "swim-lan": "ours, lan",
    "serf-lan": "serf agent -profile=lan",
    "sim-lan": "simulator, lan",
    "swim-lan-a5": "ours, lan + suspicion_mult 5",
    "sim-lan-a5": "simulator, lan + suspicion_mult 5",
    "sim-lan-a6": "simulator, lan + suspicion_mult 6",
    "swim-lan-before": "ours, lan, without the re-announcement",
    "sim-lan-before": "simulator, lan, without the re-announcement",
    "swim-lan-a5-before": "ours, α 5, without the re-announcement",
    "sim-lan-a5-before": "simulator, α 5, without the re-announcement",
    "swim-lan-a6-before": "ours, α 6, without the re-announcement",
}
"""What each implementation label measured, in the order the table lists them."""


def summarise(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    order = list(WHAT)
    keys = sorted(
        {(w["impl"], w["loss"]) for w in windows},
        key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k),
    )
    for impl, loss in keys:
        ws = [w for w in windows if w["impl"] == impl and w["loss"] == loss]
        n = len(ws)
        row: dict[str, Any] = {"impl": impl, "what": WHAT.get(impl, impl), "loss": loss}
        row["windows"] = n
        for phase in ("steady", "after"):
            k = sum(1 for w in ws if w[f"{phase}_dead"] > 0)
            lo, hi = clopper_pearson(k, n)
            row[f"{phase}_windows_dead"] = k
            row[f"{phase}_dead_events"] = sum(w[f"{phase}_dead"] for w in ws)
            row[f"{phase}_rate"] = k / n
            row[f"{phase}_ci"] = f"{lo:.3f}–{hi:.3f}"
            row[f"{phase}_ci_hi"] = hi
        detect = [w["detect_last_s"] for w in ws if w["detect_last_s"] is not None]
        row["detect_median_s"] = statistics.median(detect) if detect else None
        row["detect_max_s"] = max(detect) if detect else None
        row["undetected"] = n - len(detect)
        if "drop_rate" in ws[0]:
            row["drop_rate"] = statistics.mean(w["drop_rate"] for w in ws)
            probes = [w["failed_probes"] for w in ws if "failed_probes" in w]
            row["failed_probes_per_window"] = statistics.mean(probes) if probes else None
            refuted = [w["refutations"] for w in ws if "refutations" in w]
            row["refutations_per_window"] = statistics.mean(refuted) if refuted else None
            loads = [w["load_start"] for w in ws] + [w["load_end"] for w in ws]
            row["load"] = f"{statistics.median(loads):.1f} ({min(loads):.1f}–{max(loads):.1f})"
        rows.append(row)
    return rows


COLUMNS = [
    results.column("what", "what ran"),
    results.column("loss", "loss into each host", 2),
    results.column("windows", "windows"),
    results.column("drop_rate", "measured drop rate", 3),
    results.column("failed_probes_per_window", "failed probes / window", 1),
    results.column("refutations_per_window", "refutations / window", 1),
    results.column("steady_windows_dead", "windows with a false death"),
    results.column("steady_rate", "rate", 3),
    results.column("steady_ci", "95 % interval"),
    results.column("after_windows_dead", "after a kill: windows with a false death"),
    results.column("after_ci", "95 % interval"),
    results.column("detect_median_s", "crash dead everywhere, median s", 2),
    results.column("detect_max_s", "max s", 2),
    results.column("load", "load avg, median (range)"),
]


HEADLINE_IMPLS = ("swim-lan", "serf-lan", "sim-lan", "swim-lan-a5")
"""Rows that also get a figure (the table has every row)."""


def build_result(
    rows: list[dict[str, Any]], args: argparse.Namespace, lanes_used: int
) -> dict[str, Any]:
    figures: dict[str, results.Figure] = {}
    for r in rows:
        if r["impl"] not in HEADLINE_IMPLS:
            continue
        key = f"{r['impl']}-{round(r['loss'] * 100)}"
        figures[f"{key}.steady_rate"] = results.figure(
            f"{r['impl']} at {r['loss']:.0%}: windows with a false death", r["steady_rate"], "",
            3, spread=(float(r["steady_ci"].split("–")[0]), r["steady_ci_hi"]), runs=r["windows"],
        )  # fmt: skip
    table_rows = [{c["key"]: r.get(c["key"]) for c in COLUMNS} for r in rows]
    return {
        "question": "loss-windows-5-hosts",
        "title": "False deaths per window at 10–30 % loss on 5 hosts: swim lan, serf lan, "
        "simulator",
        "method": (
            f"5 hosts (network namespaces), independent loss into every host; windows of "
            f"{args.window_s:g} s with loss on, then SIGKILL of one host and "
            f"{args.after_kill_s:g} s more; {lanes_used} test beds at once. Simulator: the "
            "same 5-member lan world, lossy TCP, one window per seed. Rate: share of windows "
            "with at least one live member declared dead; exact 95 % interval."
        ),
        "figures": figures,
        "peers": sorted({r["impl"] for r in rows}),
        "tables": [{"caption": "False deaths per window", "columns": COLUMNS, "rows": table_rows}],
    }
