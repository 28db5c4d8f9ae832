"""bench/compare_serf.py's result file (bench/results.py): detection and cost per cluster.

One row per cluster that ran (implementation, profile, N), with the statistics of its kills;
the same-run ratios to the first cluster of each size (the baseline ``--runs`` names
first), and ``fast`` against ``lan`` where both ran. The question id comes from the sizes
and the runs, so a rerun of the same command answers the same question.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.results import column, figure

Row = Mapping[str, Any]
"""impl, profile, n, kills, converge_s, converge_ready_s; first_suspect_s, first_dead_s,
last_dead_s, suspicion_s, spread_s as statistics ({median, min, max, p99}); false_dead,
false_suspect, startup_false_dead, startup_false_suspect; cpu_ms, rss_mib_mean,
rss_mib_max, pkts, bytes (per agent per second)."""


def question(sizes: Sequence[int], runs: Sequence[tuple[str, str]]) -> str:
    spelled = "-".join(f"{impl}-{profile}" for impl, profile in runs)
    return f"detection-{'-'.join(str(n) for n in sizes)}-{spelled}"


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def title(sizes: Sequence[int], runs: Sequence[tuple[str, str]]) -> str:
    names = _and([f"{impl} `{profile}`" for impl, profile in runs])
    return f"Detection, CPU and traffic at {_and([str(n) for n in sizes])} agents: {names}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 2)


def _median(row: Row, key: str) -> float | None:
    s = row.get(key)
    return None if s is None else s.get("median")


def build(
    rows: Sequence[Row],
    runs: Sequence[tuple[str, str]],
    sizes: Sequence[int],
    *,
    kills: int,
    settle_s: float,
    window_s: float,
) -> dict[str, Any]:
    """question, title, method, figures, peers, ratios and tables of one invocation."""
    figures: dict[str, Any] = {}
    for r in rows:
        key, who = f"{r['impl']}-{r['profile']}-{r['n']}", f"{r['impl']} `{r['profile']}`"
        last = r["last_dead_s"] or {}
        figures[f"{key}.last_dead_s"] = figure(
            f"{who}, {r['n']} agents: kill → dead everywhere, median",
            last.get("median"),
            "s",
            spread=[last["min"], last["max"]] if "min" in last else None,
            p99=last.get("p99"),
            runs=r["kills"],
            text=None if last.get("median") is not None else "not dead everywhere",
        )
        figures[f"{key}.cpu_ms"] = figure(
            f"{who}, {r['n']} agents: CPU per agent", r["cpu_ms"], "ms per agent-second"
        )
    by = {(r["impl"], r["profile"], r["n"]): r for r in rows}
    base_impl, base_profile = runs[0]
    ratios: list[dict[str, Any]] = []
    ratio_rows: list[dict[str, Any]] = []
    for n in sizes:
        base = by.get((base_impl, base_profile, n))
        for impl, profile in runs[1:]:
            s = by.get((impl, profile, n))
            if s is None or base is None:
                continue
            cells = {
                "run": f"{impl} `{profile}` / {base_impl} `{base_profile}`",
                "n": n,
                "last": _ratio(_median(s, "last_dead_s"), _median(base, "last_dead_s")),
                "p99": _ratio(
                    (s["last_dead_s"] or {}).get("p99"), (base["last_dead_s"] or {}).get("p99")
                ),
                "first": _ratio(_median(s, "first_dead_s"), _median(base, "first_dead_s")),
                "cpu": _ratio(s["cpu_ms"], base["cpu_ms"]),
                "pkts": _ratio(s["pkts"], base["pkts"]),
                "bytes": _ratio(s["bytes"], base["bytes"]),
            }
            ratio_rows.append(cells)
            for what, key in (("dead everywhere, median", "last"), ("CPU", "cpu")):
                if cells[key] is not None:
                    ratios.append(
                        {"label": f"{cells['run']}, {n} agents, {what}", "value": cells[key]}
                    )
        lan, fast = by.get(("swim", "lan", n)), by.get(("swim", "fast", n))
        if lan is not None and fast is not None:
            for what, key in (("CPU", "cpu_ms"), ("UDP packets", "pkts"), ("UDP bytes", "bytes")):
                value = _ratio(fast[key], lan[key])
                if value is not None:
                    ratios.append(
                        {"label": f"swim `fast` / swim `lan`, {n} agents, {what}", "value": value}
                    )

    def median_p99(v: Mapping[str, float] | None) -> dict[str, float] | None:
        return None if v is None else {k: v[k] for k in ("median", "p99") if k in v}

    clusters = [
        dict(r)
        | {
            "false": f"{r['false_dead']} ({r['false_suspect']})",
            "startup": f"{r['startup_false_dead']} ({r['startup_false_suspect']})",
            "rss": f"{r['rss_mib_mean']:.1f} ({r['rss_mib_max']:.1f})",
            "load": (
                f"{r['load_1m_converged']:.1f}, {r['load_1m_end']:.1f}"
                if "load_1m_end" in r
                else None
            ),
            "p99": (r["last_dead_s"] or {}).get("p99"),
            "first_suspect": {k: v for k, v in (r["first_suspect_s"] or {}).items() if k != "p99"}
            or None,
            "last": {k: v for k, v in (r["last_dead_s"] or {}).items() if k != "p99"} or None,
        }
        for r in rows
    ]
    tables: list[dict[str, Any]] = [
        {
            "caption": "Each cluster (detection in s: median [range] over the kills)",
            "columns": [
                column("impl", "impl"),
                column("profile", "profile"),
                column("n", "N"),
                column("kills", "kills"),
                column("first_suspect", "first suspicion"),
                column("first_dead_s", "first observer"),
                column("last", "dead everywhere"),
                column("p99", "dead everywhere, p99"),
                column("false", "false dead (suspect)"),
                column("startup", "same, during start-up"),
                column("cpu_ms", "CPU ms/agent-s"),
                column("rss", "RSS MiB mean (max)"),
                column("pkts", "UDP packets/agent-s", 1),
                column("bytes", "UDP bytes/agent-s", 0),
                column("converge_ready_s", "joined, s after the last agent was ready"),
                column("load", "box load (1 min): converged, end"),
            ],
            "rows": clusters,
        },
        {
            "caption": "Where the time goes, s (median, p99 over the kills): to the first "
            "suspicion anywhere, the suspicion window (to the first death), the spread (to "
            "the last survivor's)",
            "columns": [
                column("impl", "impl"),
                column("profile", "profile"),
                column("n", "N"),
                column("to_suspicion", "to suspicion"),
                column("suspicion", "suspicion"),
                column("spread", "spread"),
                column("total", "total"),
            ],
            "rows": [
                {
                    "impl": r["impl"],
                    "profile": r["profile"],
                    "n": r["n"],
                    "to_suspicion": median_p99(r["first_suspect_s"]),
                    "suspicion": median_p99(r["suspicion_s"]),
                    "spread": median_p99(r["spread_s"]),
                    "total": median_p99(r["last_dead_s"]),
                }
                for r in rows
            ],
        },
    ]
    if ratio_rows:
        tables.append(
            {
                "caption": "Same-run ratios (below 1: faster or cheaper)",
                "columns": [
                    column("run", "run"),
                    column("n", "N"),
                    column("last", "dead everywhere, median"),
                    column("p99", "dead everywhere, p99"),
                    column("first", "first observer, median"),
                    column("cpu", "CPU"),
                    column("pkts", "packets"),
                    column("bytes", "bytes"),
                ],
                "rows": ratio_rows,
            }
        )
    return {
        "question": question(sizes, runs),
        "title": title(sizes, runs),
        "method": (
            f"Each cluster of N agents on loopback converges, settles for {settle_s:g} s, is "
            f"measured over a {window_s:g} s steady window (CPU, memory, packets), then loses "
            f"{kills} agents to SIGKILL one at a time (at most N − 2), the newest first. "
            f"Clusters ran one after another in one invocation: "
            + ", ".join(f"{i} `{p}`" for i, p in runs)
            + f" at N = {', '.join(str(n) for n in sizes)}."
        ),
        "figures": figures,
        "peers": [f"{i} `{p}`" for i, p in runs],
        "ratios": ratios,
        "tables": tables,
    }
