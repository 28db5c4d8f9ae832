"""The operator's parameter table (docs/tuning.md): what each profile resolves to at a
cluster size, computed from the formulas the node itself uses, and what the simulator
measured for it (command line: ``python -m simulations.params``).

Rules:
- Computed columns call the same functions as ``swim.Node`` (``swim.formulas``,
  ``swim.suspicion_window_ms``): nothing is re-derived here.
- Measured columns read a ``simulations.scaling`` result directory (cells.csv, runs.csv):
  latency from the clean condition; false positives as dead declarations about healthy
  members per condition with the healthy member-hours they were counted over (a 0 is
  "none in that many hours", not a rate); bandwidth as UDP + TCP bytes sent per member
  per second in the clean condition (payload; IPv4 + UDP headers add 28 B per packet).
- ``--compare`` condenses a scaling result (SWIM against the all-to-all baseline) into one
  row per (variant, n), with the baseline's computed rows (computed.csv) where it was not
  simulated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from simulations.reports.files import read_csv
from swim import (
    PROFILES,
    Config,
    push_pull_scale_ms,
    retransmit_limit,
    suspicion_window_ms,
)

NODES = (10, 100, 1_000, 10_000)


def computed_row(profile: str, n: int, rtt_ms: int) -> dict[str, Any]:
    c = Config.profile(profile)
    min_ms, max_ms, k = suspicion_window_ms(c, n, rtt_ms)
    timeout = f"{c.probe_timeout_ms:,}"
    if c.adaptive_probe_timeout:
        timeout += f" (adaptive {c.probe_timeout_min_ms}–{c.probe_timeout_max_ms})"
    return {
        "profile": profile,
        "n": n,
        "probe_interval_ms": c.probe_interval_ms,
        "probe_timeout_ms": timeout,
        "indirect_checks": c.indirect_checks,
        "suspicion_min_s": min_ms / 1000,
        "suspicion_max_s": max_ms / 1000,
        "confirmations_k": k,
        "retransmit_limit": retransmit_limit(c.retransmit_mult, n),
        "gossip": f"{c.gossip_interval_ms} ms × {c.gossip_nodes}",
        "push_pull_s": push_pull_scale_ms(c.push_pull_interval_ms, n) / 1000,
    }


COMPUTED_COLS = {
    "profile": "profile",
    "n": "n",
    "probe_interval_ms": "probe interval (ms)",
    "probe_timeout_ms": "probe timeout (ms)",
    "indirect_checks": "indirect probes",
    "suspicion_min_s": "suspicion min (s)",
    "suspicion_max_s": "suspicion max (s)",
    "confirmations_k": "k",
    "retransmit_limit": "retransmit limit",
    "gossip": "gossip",
    "push_pull_s": "push-pull (s)",
}


def _text(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(rows: list[dict[str, Any]], cols: dict[str, str]) -> list[str]:
    lines = ["| " + " | ".join(cols.values()) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_text(r.get(k)) for k in cols) + " |" for r in rows]
    return lines


# --- measured ---------------------------------------------------------------------------


def measured_rows(*result_dirs: Path) -> list[dict[str, Any]]:
    """The operator's table from one or more ``simulations.scaling`` result dirs; a later
    dir's (profile, n, condition) cell, with its runs, replaces an earlier one's (e.g. the
    loss conditions re-run with lossy TCP over a sweep whose clean runs still stand)."""
    cells_by: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    runs_by: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for result_dir in result_dirs:
        for c in read_csv(result_dir / "cells.csv"):
            cells_by[(c["variant"], c["n"], c["condition"])] = c
        fresh: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
        for r in read_csv(result_dir / "runs.csv"):
            fresh.setdefault((r["variant"], r["n"], r["condition"]), []).append(r)
        runs_by.update(fresh)
    cells = list(cells_by.values())
    runs = [r for group in runs_by.values() for r in group]
    by_cell = {(c["variant"], c["n"], c["condition"]): c for c in cells}
    keys = sorted({(c["variant"], c["n"]) for c in cells}, key=_order)
    rows = []
    for variant, n in keys:
        clean = by_cell.get((variant, n, "clean"), {})
        row: dict[str, Any] = {"profile": variant, "n": n}
        row["median_s"] = clean.get("all_dead_median_s")
        row["p99_s"] = clean.get("all_dead_p99_s")
        row["crashes"] = clean.get("crashes")
        for cond in ("loss1", "loss10"):
            mine = [r for r in runs if (r["variant"], r["n"], r["condition"]) == (variant, n, cond)]
            if not mine:
                continue
            fp = sum(r["fp_dead_about_healthy_members"] for r in mine)
            hours = sum(r["healthy_member_hours"] for r in mine)
            cell = by_cell.get((variant, n, cond), {})
            row[f"fp_{cond}"] = f"{fp} in {hours:,.1f} h"
            row[f"suspect_{cond}"] = cell.get("fp_suspect_about_healthy")
            row[f"median_{cond}_s"] = cell.get("all_dead_median_s")
        udp = clean.get("bytes_per_member_per_s") or 0.0
        tcp = clean.get("stream_bytes_per_member_per_s") or 0.0
        row["pkts_per_s"] = clean.get("pkts_per_member_per_s")
        row["bytes_per_s"] = udp + tcp if clean else None
        rows.append(row)
    return rows


def _order(key: tuple[str, int]) -> tuple[int, int]:
    variant, n = key
    rank = PROFILES.index(variant) if variant in PROFILES else len(PROFILES)
    return rank, n


MEASURED_COLS = {
    "profile": "profile",
    "n": "n",
    "median_s": "detection median (s)",
    "p99_s": "detection p99 (s)",
    "median_loss10_s": "median at 10% loss (s)",
    "fp_loss1": "false deaths, 1% loss",
    "fp_loss10": "false deaths, 10% loss",
    "suspect_loss10": "false suspicions, 10% loss",
    "pkts_per_s": "packets/member/s",
    "bytes_per_s": "bytes/member/s (UDP+TCP)",
}


def _pair(cell: dict[str, Any], a: str, b: str) -> str:
    x, y = cell.get(a), cell.get(b)
    return "—" if x is None or y is None else f"{_text(x)} / {_text(y)}"


def compare_rows(result_dir: Path) -> list[dict[str, Any]]:
    cells = read_csv(result_dir / "cells.csv")
    by = {(c["variant"], c["n"], c["condition"]): c for c in cells}
    variants = list(dict.fromkeys(c["variant"] for c in cells))
    rows: list[dict[str, Any]] = []
    for variant in variants:
        for n in sorted({c["n"] for c in cells if c["variant"] == variant}):
            clean = by.get((variant, n, "clean"), {})
            row: dict[str, Any] = {"variant": variant, "n": n}
            row["pkts"] = clean.get("pkts_per_member_per_s")
            row["cluster"] = clean.get("pkts_cluster_per_s")
            udp, tcp = (
                clean.get("bytes_per_member_per_s"),
                clean.get("stream_bytes_per_member_per_s"),
            )
            row["bytes"] = None if udp is None else udp + (tcp or 0.0)
            for cond in ("clean", "loss10", "slow1"):
                cell = by.get((variant, n, cond), {})
                row[f"det_{cond}"] = _pair(cell, "all_dead_median_s", "all_dead_p99_s")
            row["healthy_slow1"] = by.get((variant, n, "slow1"), {}).get("healthy_dead_p99_s")
            for cond in ("loss10", "slow1"):
                cell = by.get((variant, n, cond), {})
                row[f"fp_{cond}"] = _pair(
                    cell, "fp_dead_about_healthy", "fp_dead_about_healthy_at_healthy"
                )
            rows.append(row)
    computed = result_dir / "computed.csv"
    for r in read_csv(computed) if computed.exists() else []:
        rows.append(
            {
                "variant": r["variant"] + " (computed)",
                "n": r["n"],
                "pkts": r["pkts_per_member_per_s"],
                "cluster": r["pkts_cluster_per_s"],
                "bytes": r["bytes_per_member_per_s"],
            }
        )
    return rows


COMPARE_COLS = {
    "variant": "variant",
    "n": "n",
    "pkts": "packets/member/s",
    "cluster": "packets/s, cluster",
    "bytes": "bytes/member/s",
    "det_clean": "detection median / p99 (s)",
    "det_loss10": "at 10% loss (s)",
    "det_slow1": "with 1 slow member (s)",
    "healthy_slow1": "with 1 slow member, p99 at healthy observers (s)",
    "fp_loss10": "false deaths at 10% loss (all / healthy observers)",
    "fp_slow1": "false deaths with 1 slow member (all / healthy observers)",
}
