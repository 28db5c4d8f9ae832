"""The pure parts of bench/mixed_efficiency.py: which fault hits which node, what each fault
cost (from the step records), and the result file and report of a run. No IO.

Records are the trainers' step-log lines of local rank 0 of every node (every incarnation
of it), each with ``t`` (wall time the step completed), ``step``, ``rank`` (global),
``world``, ``node``, ``pid`` and ``formations`` (how many groups that process trained in).
A global step is counted once, from the record of its group's rank 0
(bench/step_efficiency.py's ``count`` and ``pace``).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bench import results as result_files
from bench.step_efficiency import count, pace

__all__ = [
    "KINDS",
    "LABELS",
    "after_fault",
    "between_faults",
    "built",
    "built_figure_between",
    "kinds_of",
    "notes_of",
    "pace_between",
    "report",
    "schedule",
    "summary",
]

KINDS = ("power", "kill", "stop", "slow")
LABELS = {
    "power": "power loss",
    "kill": "SIGKILL",
    "stop": "SIGSTOP",
    "slow": "slowdown",
}
TARGET = 0.99
Record = Mapping[str, Any]


def kinds_of(text: str) -> tuple[str, ...]:
    """``--faults``: a comma-separated list of ``KINDS`` (each at most once, in the order
    given); ``ValueError`` names anything else."""
    got = tuple(k for k in text.split(",") if k)
    bad = [k for k in got if k not in KINDS]
    if bad or not got or len(set(got)) != len(got):
        raise ValueError(
            f"--faults: {text!r} is not a list of distinct kinds of {', '.join(KINDS)}"
        )
    return got


def schedule(i: int, kinds: Sequence[str], order: Sequence[str]) -> tuple[str, str]:
    """Fault ``i`` (from 0): its kind, rotating through ``kinds``, and its victim, the node
    at position ``i mod len(order)`` of the training group (``order``: global rank order,
    the leader first). A drafted spare takes the lost node's slot, so positions rotate
    over the slots; with 4 kinds and 3 nodes every kind meets every slot, the leader's
    included, within 12 faults."""
    if not kinds or not order:
        raise ValueError("schedule: no kinds or no training nodes")
    return kinds[i % len(kinds)], order[i % len(order)]


def after_fault(
    records: Iterable[Record], fault: Mapping[str, Any], until_t: float, full_world: int
) -> dict[str, Any]:
    """What one fault cost, from the records up to ``until_t`` (the next fault or the end).
    ``fault``: ``victim`` (name), ``t`` (the fault's wall time), ``spares`` (the names
    waiting as spares then). A record is *new* when it is after the fault, not the
    victim's, and from a process that trained in no group before the fault (a drafted
    spare) or in another group since. Returns: ``recover_s`` and ``recover_world`` (the
    first new record), ``same_world_s`` (the first new record at ``full_world``),
    ``drafted`` (a spare logged a new step), ``rolled_back`` (the last step completed
    before the first new one + 1 - the first new step: steps done again)."""
    t0 = float(fault["t"])
    recs = sorted(records, key=lambda r: float(r["t"]))
    before: dict[int, object] = {}
    for r in recs:
        if float(r["t"]) <= t0:
            before[int(r["pid"])] = r["formations"]
    new = [
        r
        for r in recs
        if t0 < float(r["t"]) <= until_t
        and r["node"] != fault["victim"]
        and (int(r["pid"]) not in before or r["formations"] != before[int(r["pid"])])
    ]
    out: dict[str, Any] = {
        "recover_s": None,
        "recover_world": None,
        "same_world_s": None,
        "drafted": any(r["node"] in fault.get("spares", ()) for r in new),
        "rolled_back": None,
    }
    if not new:
        return out
    first = new[0]
    out["recover_s"] = float(first["t"]) - t0
    out["recover_world"] = int(first["world"])
    same = next((r for r in new if int(r["world"]) == full_world), None)
    if same is not None:
        out["same_world_s"] = float(same["t"]) - t0
    old = [int(r["step"]) for r in recs if float(r["t"]) < float(first["t"]) and r["rank"] == 0]
    if old:
        out["rolled_back"] = max(old) + 1 - int(first["step"])
    return out


def summary(
    records: Sequence[dict[str, Any]], base: tuple[float, float], window: tuple[float, float]
) -> dict[str, Any]:
    """Step and rank-step efficiency of the faulty ``window`` against the failure-free
    rate in ``base`` (both (start, end) wall times), and how far the global step moved."""
    steps_b, rank_steps_b = count(records, *base)
    steps_f, rank_steps_f = count(records, *window)
    base_s, window_s = base[1] - base[0], window[1] - window[0]
    rate = steps_b / base_s if base_s > 0 else 0.0
    rank_rate = rank_steps_b / base_s if base_s > 0 else 0.0
    times = sorted(float(r["t"]) for r in records if r["rank"] == 0 and base[0] < r["t"] <= base[1])
    gaps = [b - a for a, b in itertools.pairwise(times)]
    normal = statistics.median(gaps) if gaps else 1.0
    stall_b, _ = pace(records, *base, normal)
    stall_f, by_world = pace(records, *window, normal)
    before = [int(r["step"]) for r in records if float(r["t"]) <= window[0]]
    inside = [int(r["step"]) for r in records if float(r["t"]) <= window[1]]
    return {
        "baseline_steps": steps_b,
        "baseline_rate": rate,
        "faulty_steps": steps_f,
        "window_s": window_s,
        "efficiency": steps_f / (rate * window_s) if rate else None,
        "rank_efficiency": rank_steps_f / (rank_rate * window_s) if rank_rate else None,
        "progress": max(inside) - max(before) if before and inside else None,
        "baseline_step_s": normal,
        "baseline_stall_s": stall_b,
        "stall_s": stall_f,
        "time_efficiency": 1 - stall_f / window_s if window_s > 0 else None,
        "step_s_by_world": by_world,
    }


SETTLE_S = 15.0
"""After a fault, the time the pace between faults leaves out: the recovery, the swap of
a slowed node (at most ~3.5 s) and the victim's restart on the same cores (~4-6 s)."""
GUARD_S = 2.0
"""Before the next fault, the time left out (the fault lands at a scheduled time)."""


def between_faults(
    records: Iterable[Record], fault_ts: Sequence[float], end: float
) -> tuple[float, int] | None:
    """The failure-free pace inside the faulty window: the mean gap between global steps
    that start from ``SETTLE_S`` after each fault to ``GUARD_S`` before the next one (or
    ``end``), and how many gaps that is; None without any. A baseline taken before the
    faults can be measured at another load than the hour that follows (on a shared host
    it was 3.5 % slower once), so the window is also held against its own quiet parts."""
    times = sorted(float(r["t"]) for r in records if r["rank"] == 0)
    bounds = [*fault_ts, end]
    clean = [
        b - a
        for a, b in itertools.pairwise(times)
        for lo, hi in itertools.pairwise(bounds)
        if lo + SETTLE_S <= a and b <= hi - GUARD_S
    ]
    return (statistics.mean(clean), len(clean)) if clean else None


def pace_between(
    records: Sequence[Record], fault_ts: Sequence[float], end: float
) -> dict[str, Any]:
    """The result keys of ``between_faults``: its pace, its gap count, and the faulty
    window's steps against it (``efficiency_between_faults``)."""
    got = between_faults(records, fault_ts, end) if fault_ts else None
    if got is None:
        return {"between_faults_step_s": None, "efficiency_between_faults": None}
    step_s, n = got
    window_s = end - fault_ts[0]
    steps = sum(1 for r in records if r["rank"] == 0 and fault_ts[0] < float(r["t"]) <= end)
    return {
        "between_faults_step_s": step_s,
        "between_faults_steps": n,
        "efficiency_between_faults": steps / (window_s / step_s),
    }


def _stat(values: Iterable[float | None]) -> dict[str, float] | None:
    got = sorted(v for v in values if v is not None)
    if not got:
        return None
    return result_files.stat(statistics.median(got), lo=got[0], hi=got[-1])


def _pct(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 2)


def built(result: Mapping[str, Any]) -> dict[str, Any]:
    """question, title, method, figures, tables and notes of a run (``result``: what
    bench/mixed_efficiency.py's ``run`` returns)."""
    f = result_files.figure
    r = result
    faults = r["faults"]
    shape = f"{r['nodes']}x{r['ranks']}-{r['profile']}-{r['spares']}spare"
    figures = {
        "efficiency_between_faults": built_figure_between(r),
        "efficiency": f(
            "step efficiency (steps kept)",
            _pct(r["efficiency"]),
            "%",
            2,
            text="none" if r["efficiency"] is None else None,
        ),
        "rank_efficiency": f(
            "rank-step efficiency",
            _pct(r["rank_efficiency"]),
            "%",
            2,
            text="none" if r["rank_efficiency"] is None else None,
        ),
        "faults": f("faults injected", len(faults), "faults", 0),
        "time_efficiency": f(
            "time efficiency (window less stalls)",
            _pct(r["time_efficiency"]),
            "%",
            2,
            text="none" if r["time_efficiency"] is None else None,
        ),
    }
    rows = []
    for kind in r["kinds"]:
        got = [x for x in faults if x["kind"] == kind]
        if not got:
            continue
        same = [x["same_world_s"] for x in got]
        st = _stat(same)
        figures[f"{kind}.same_world_s"] = f(
            f"{LABELS[kind]} → first step at the same world (median)",
            None if st is None else round(st["median"], 3),
            "s",
            2,
            spread=None if st is None else (st["min"], st["max"]),
            runs=len(got),
            text="never" if st is None else None,
        )
        rows.append(
            {
                "kind": LABELS[kind],
                "faults": len(got),
                "leader": sum(1 for x in got if x["leader"]),
                "same_world": st,
                "missed": sum(1 for v in same if v is None),
                "drafted": sum(1 for x in got if x["drafted"]),
                "rolled_back": _stat(x["rolled_back"] for x in got),
                "waited": _stat(x["waited_s"] for x in got),
            }
        )
    start = faults[0]["t"] if faults else 0.0
    detail = [
        {
            "i": i,
            "at": round(x["t"] - start),
            "kind": LABELS[x["kind"]],
            "victim": x["victim"] + (" (leader)" if x["leader"] else ""),
            "waited": round(x["waited_s"], 1),
            "same_world": x["same_world_s"],
            "world": x["recover_world"],
            "first": x["recover_s"],
            "drafted": x["drafted"],
            "rolled_back": x["rolled_back"],
            "dropped": x.get("dropped"),
        }
        for i, x in enumerate(faults, 1)
    ]
    c = result_files.column
    tables = [
        {
            "caption": "Per fault kind",
            "columns": [
                c("kind", "fault"),
                c("faults", "faults"),
                c("leader", "of them on the leader"),
                c("same_world", "fault → first step at the same world (s)", 2),
                c("missed", "no step at the same world before the next fault"),
                c("drafted", "spare drafted"),
                c("rolled_back", "steps rolled back", 0),
                c("waited", "waited for full size + spare before the fault (s)", 1),
            ],
            "rows": rows or [{"kind": "none"}],
        }
    ]
    if detail:
        tables.append(
            {
                "caption": "Every fault",
                "columns": [
                    c("i", "#"),
                    c("at", "at (s)"),
                    c("kind", "fault"),
                    c("victim", "victim"),
                    c("waited", "waited (s)", 1),
                    c("first", "fault → first step without the victim (s)", 2),
                    c("world", "at world"),
                    c("same_world", "fault → first step at the same world (s)", 2),
                    c("drafted", "spare drafted"),
                    c("rolled_back", "rolled back"),
                    c("dropped", "packets dropped at the victim (power)"),
                ],
                "rows": detail,
            }
        )
    return {
        "question": f"step-efficiency-mixed-{shape}",
        "title": (
            f"Throughput kept with one mixed fault a minute and {r['spares']} spare: "
            f"{r['nodes']} nodes × {r['ranks']} ranks"
        ),
        "method": (
            f"{r['nodes']} training nodes × {r['ranks']} ranks + {r['spares']} spare "
            f"(examples/elastic_ddp.py, profile {r['profile']}, target {r['nodes']} nodes, "
            "slow policy replace), every node's agent and trainers in a network namespace "
            f"of its own. Failure-free for {r['baseline_s']:.0f} s (the baseline, same run), "
            f"then for {r['minutes']:g} min one fault every {r['every_s']:.0f} s, kinds "
            f"rotating ({', '.join(LABELS[k] for k in r['kinds'])}) and victims rotating "
            "over the group's slots (the leader's included): power loss = every packet of "
            "the node's link dropped, then SIGKILL; SIGSTOP = the node frozen until the job "
            "goes on without it, then SIGKILLed; slowdown = the node's steps "
            f"{r['slow_factor']:g}× slower (an injected delay inside the step) until it is "
            "replaced. The victim is restarted (same name and address) and waits as the "
            f"spare (started {_started(r)}, back to normal once a spare: a "
            "rebooting host would not take the training nodes' CPU); a fault waits until "
            "the job is at full size with a spare. "
            f"A step is {r['step_work']} s of stand-in compute + {r['step_sleep']} s sleep. "
            "*Step efficiency*: global steps in the faulty window / (failure-free steps per "
            "second × window); *rank-step*: the same weighted by world size."
        ),
        "figures": figures,
        "tables": tables,
        "notes": [
            f"load average {r['load_before']} before, {r['load_after']} after",
            f"failure-free {r['baseline_steps']} steps in {r['baseline_s']:.0f} s; faulty "
            f"window {r['window_s']:.0f} s, {r['faulty_steps']} steps; global step advanced "
            f"by {r['progress']}; stalls (gaps over 4 failure-free steps) "
            f"{r['stall_s']:.1f} s in the window, {r['baseline_stall_s']:.1f} s in the "
            f"baseline; median step {r['baseline_step_s']:.3f} s failure-free, "
            + ", ".join(f"{v:.3f} s at world {w}" for w, v in r["step_s_by_world"].items())
            + " in the window outside stalls",
            *notes_of(r),
            *r.get("problems", []),
        ],
    }


def built_figure_between(r: Mapping[str, Any]) -> dict[str, Any]:
    """The figure ``efficiency_between_faults`` of a run."""
    value = r.get("efficiency_between_faults")
    return result_files.figure(
        "step efficiency against the failure-free pace between faults (same hour)",
        _pct(value),
        "%",
        2,
        text="none" if value is None else None,
    )


def notes_of(r: Mapping[str, Any]) -> list[str]:
    """The notes on the pace between faults and on the restarts' cost."""
    return [*_pace_note(r), *_restart_note(r)]


def _pace_note(r: Mapping[str, Any]) -> list[str]:
    """The pace between faults, and (``baseline_rate``) the baseline's beside it."""
    if r.get("between_faults_step_s") is None:
        return []
    note = (
        f"failure-free pace between faults ({SETTLE_S:g} s after each fault to {GUARD_S:g} s "
        f"before the next): {1000 * r['between_faults_step_s']:.2f} ms a step over "
        f"{r['between_faults_steps']} steps"
    )
    if r.get("baseline_rate"):
        note += (
            f", against {1000 / r['baseline_rate']:.2f} ms in the baseline before the faults; "
            "the step efficiency against the baseline is above 100 % when the baseline ran "
            "slower (another load), so the figure against the pace between faults is the one "
            "to quote"
        )
    return [note]


def _started(r: Mapping[str, Any]) -> str:
    """How the restarted victims started (bench/restart_sched.py)."""
    ways = {
        "idle": "as SCHED_IDLE",
        "fork": "forked as SCHED_IDLE from processes that imported their modules before the "
        "measurement (bench/forkserver.py)",
        "nice": f"at nice {r['restart_nice']}" if r.get("restart_nice") else "at nice 0",
    }
    scheds = str(r.get("restart_sched", "nice")).split(",")
    text = " or ".join(dict.fromkeys(ways.get(s, s) for s in scheds))
    return text + (", in turn" if len(set(scheds)) > 1 else "")


def _restart_note(r: Mapping[str, Any]) -> list[str]:
    """bench/mixed_restarts.py's figure, where the run has it (and per way of starting)."""
    if not r.get("restarts") or r.get("restart_lost_s") is None or not r.get("window_s"):
        return []
    share = r["restart_lost_s"] / r["window_s"]
    notes = [
        f"{r['restarts']} victims restarted on the same 2 cores as the training nodes cost "
        f"{r['restart_lost_s']:.1f} s of training while they started (restart to "
        f"waiting as a spare; bench/mixed_restarts.py): {100 * share:.2f} points of the "
        "step efficiency, which a victim restarting on a host of its own would not cost"
    ]
    by = r.get("restart_by_sched") or {}
    if len(by) > 1:
        notes.append(
            "per way of starting (bench/restart_sched.py), same run: "
            + "; ".join(
                f"{sched}: {row['restarts']} restarts, {row['lost_s']:.1f} s lost "
                f"({row['lost_s'] / row['restarts']:.2f} s each)"
                for sched, row in sorted(by.items())
            )
        )
    return notes


def report(result: Mapping[str, Any]) -> str:
    """The run as Markdown: the two figures, then every table."""
    b = built(result)
    lines = [f"## {b['title']}", "", b["method"], ""]
    for fig in b["figures"].values():
        value = fig.get("text") if fig["value"] is None else f"{fig['value']} {fig['unit']}"
        lines.append(f"- {fig['label']}: **{value}**")
    for t in b["tables"]:
        lines += ["", f"{t['caption']}:", ""]
        cols = t["columns"]
        lines.append("| " + " | ".join(str(col["label"]) for col in cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in t["rows"]:
            lines.append("| " + " | ".join(_cell(row.get(col["key"])) for col in cols) + " |")
    lines += ["", *(f"- {n}" for n in b["notes"])]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict):
        med, lo, hi = value.get("median"), value.get("min"), value.get("max")
        return f"{med:.2f} [{lo:.2f}–{hi:.2f}]"
    return str(value)
