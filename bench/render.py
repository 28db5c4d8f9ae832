"""Render BENCHMARKS.md (and README.md's headline-figures block) from results/.

BENCHMARKS.md is generated, never edited by hand: one section per question, from the
newest result file of that question (bench/results.py), grouped by topic, with the method
stated once at the top and a table of contents. Each section gives the current figures
with their spread, what else ran in the same invocation and the same-run ratios, the
tables, notes about the run, when and on what it ran, and the command that reproduces it.

README.md may carry a block of headline figures between two markers::

    <!-- headline-figures:begin -->
    (generated table)
    <!-- headline-figures:end -->

which is filled from the same results, each figure linked to its BENCHMARKS.md section; a
README without the markers is left alone.

    python -m bench.render            # rewrite BENCHMARKS.md and README.md's block
    python -m bench.render --check    # exit 1 if either differs from what results/ gives
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import results
from bench.headlines import HEADLINES

__all__ = [
    "BEGIN",
    "END",
    "HEADLINES",
    "fill_readme",
    "headline_block",
    "main",
    "render",
    "slug",
]

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m bench.render"
BEGIN = "<!-- headline-figures:begin -->"
END = "<!-- headline-figures:end -->"

TOPICS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Detection and cost",
        "How long a crashed agent takes to be declared dead, by profile and cluster size, "
        "and what the agents cost meanwhile (CPU, memory, packets), next to serf.",
        ("detection-", "agent-cpu-", "urgent-probe-"),
    ),
    (
        "Packet loss",
        "How often heavy loss makes a small cluster declare a live member dead, per window, "
        "with its exact 95 % interval: swim next to serf on the same namespaced hosts, and "
        "the simulator beside them.",
        ("loss-",),
    ),
    (
        "Training recovery",
        "How long training stops when a node fails, by fault (SIGKILL, SIGSTOP, inside "
        "backward, power loss) and by strategy (in-process DDP and HSDP on swim, torchrun "
        "with the swim rendezvous, stock torchrun with c10d). A power loss is measured with "
        "every node in a network namespace of its own: the victim's packets are dropped "
        "before it dies, so the survivors get no reset, as from a host without power. "
        "Pure FSDP, which keeps no second copy of "
        "a shard, recovers by reloading the newest complete checkpoint, resharded "
        "(docs/training.md); it has no timed benchmark yet. Last, how long the agreement on "
        "a new group takes as the job grows, and how fast a rank's model and optimizer "
        "state reach a new one.",
        (
            "training-recovery-",
            "training-power-",
            "training-spares-",
            "training-early-drop-",
            "training-stall-drop-",
            "torchrun-recovery-",
            "formation-",
            "state-transfer-",
        ),
    ),
    (
        "Step efficiency",
        "The share of failure-free throughput a job keeps while a node is killed and "
        "restarted every minute, and how fast a slow node is flagged (and how often a job "
        "without one flags a node anyway).",
        ("step-efficiency-", "fail-slow"),
    ),
    (
        "Simulator speed",
        "How fast the simulator runs the shipped protocol core on a virtual clock.",
        ("sim-",),
    ),
    (
        "Hostile input",
        "A live agent under malformed, oversized and endless input: what it drops, what it "
        "costs, and whether anyone gets suspected.",
        ("hostile-",),
    ),
    (
        "Operations",
        "Figures an operator plans with: alert latency, and the agent's CPU share on a "
        "saturated host.",
        ("alert-", "cpu-weight", "starved-host-", "slurm-"),
    ),
)
OTHER = ("Other measurements", "Results of questions this page has no topic for yet.")
ORDER = (  # within a topic, these first; the rest by question id
    "detection-64-serf-local-swim-fast-swim-lan",
    "detection-8-32-64-serf-lan-swim-lan",
    "training-recovery-3x2-fast",
    "training-power-3x2-fast",
    "training-early-drop-3x2-fast",
    "training-stall-drop-3x2-fast",
    "training-spares-power-3x2-fast",
    "sim-scale-10000",
)

METHOD = """\
Every figure on this page was measured on one Linux host with 2 CPU cores, usually shared
with other work (each section gives the load average when its run started), with every
agent a separate process talking over loopback (or, where a section says so, over a bridge
between network namespaces on the same host): no real network, no real GPUs (training
runs on CPU with gloo). serf is Debian's 0.9.4, run the same way as swim's agent.

- **Detection** is timed from the SIGKILL of one agent to the moment other agents log it
  as dead (serf: failed): the *first observer* is the first survivor to do so, the *last
  observer* the last one, when the member is *dead everywhere*. Timestamps are taken by the
  benchmark as log lines arrive, the same way for both implementations. Medians are over
  the kills of a run, with their range in brackets; p99 is nearest-rank (below 100 kills,
  the maximum).
- **False dead (suspect) events** are about members that were not killed (or not yet).
- **CPU** is utime + stime per agent per second of a steady window (/proc); **packets and
  bytes** are UDP datagrams sent per agent per second (iptables counters per port).
- **Same run**: every section names what ran in the same invocation, one cluster at a
  time, on the same machine; its ratios compare those runs only. Figures from different
  sections were measured at different times and loads.

Each section ends with the date, the commit and the command that reproduce it, run from the
repository root in the project's environment (`scripts/setup.sh`). The figures are stored
as data in `results/` (one JSON file per question and run, format in `bench/results.py`);
this page is generated from the newest file of each question by `python -m bench.render`
and is not edited by hand."""


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def number(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def _with_unit(text: str, unit: str) -> str:
    if not unit:
        return text
    if unit in ("x", "×"):
        return f"{text}{unit}"
    return f"{text} {unit}"


def value_text(f: Mapping[str, Any]) -> str:
    """A figure's value with its unit, or its text."""
    if f.get("value") is None:
        return str(f["text"])
    return _with_unit(number(f["value"], f["digits"]), f["unit"])


def figure_text(f: Mapping[str, Any]) -> str:
    """``**0.71 s** (0.57–0.98 s over 20 runs; p99 0.98 s)``."""
    out = f"**{value_text(f)}**"
    extra = []
    d, unit = f["digits"], f["unit"]
    if f.get("spread") is not None and f["spread"][0] != f["spread"][1]:
        lo, hi = f["spread"]
        rng = _with_unit(f"{number(lo, d)}–{number(hi, d)}", unit)
        extra.append(rng + (f" over {f['runs']} runs" if f.get("runs") else ""))
    elif f.get("runs", 1) > 1:
        extra.append(f"{f['runs']} runs")
    if f.get("p99") is not None:
        extra.append(f"p99 {_with_unit(number(f['p99'], d), unit)}")
    return out + (f" ({'; '.join(extra)})" if extra else "")


def cell_text(cell: object, digits: int | None) -> str:
    d = 2 if digits is None else digits
    if cell is None:
        return "-"
    if isinstance(cell, str):
        return cell
    if isinstance(cell, bool):
        return "yes" if cell else "no"
    if isinstance(cell, int) and digits is None:
        return f"{cell:,}"
    if isinstance(cell, int | float):
        return number(cell, d)
    assert isinstance(cell, dict)
    main = cell.get("median", cell.get("mean"))
    text = "-" if main is None else number(main, d)
    if "min" in cell and "max" in cell:
        text += f" [{number(cell['min'], d)}–{number(cell['max'], d)}]"
    elif "max" in cell:
        text += f" (max {number(cell['max'], d)})"
    if "p99" in cell:
        text += f" (p99 {number(cell['p99'], d)})"
    return text


def table_text(t: Mapping[str, Any]) -> list[str]:
    cols = t["columns"]
    lines = [
        "| " + " | ".join(str(c["label"]) for c in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in t["rows"]:
        cells = [cell_text(row.get(c["key"]), c.get("digits")) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    if t.get("detail"):
        return ["<details>", f"<summary>{t['caption']}</summary>", "", *lines, "", "</details>"]
    return [f"{t['caption']}:", "", *lines]


def ratio_text(r: Mapping[str, Any]) -> str:
    value = number(r["value"], r.get("digits", 2))
    return f"{r['label']}: {'> ' if r.get('bound') == '>' else ''}{value}x"


def provenance(r: Mapping[str, Any]) -> str:
    m = r["machine"]
    where = f"{m['cpus']} CPU cores"
    if m.get("load_avg_start") is not None:
        where += ", load average " + " / ".join(f"{x:.2f}" for x in m["load_avg_start"])
        where += " at the start"
    if m.get("note"):
        where += f"; {m['note']}"
    commit = f"commit `{r['commit']}`" if r["commit"] else "no commit recorded"
    text = f"Measured {r['date'][:10]} at {commit} on {where}."
    if r["source"] != "measured":
        text += f" Figures {r['source']}."
    return text + f" Reproduce: `{r['command']}`."


def section(r: Mapping[str, Any]) -> list[str]:
    lines = [f"### {r['title']}", "", r["method"], ""]
    lines += [f"- {f['label']}: {figure_text(f)}" for f in r["figures"].values()]
    lines.append("")
    if r["peers"]:
        lines += ["Same run: " + ", ".join(r["peers"]) + ".", ""]
    if r["ratios"]:
        lines += ["Same-run ratios, the first over the second:", ""]
        lines += [f"- {ratio_text(x)}" for x in r["ratios"]]
        lines.append("")
    for t in r["tables"]:
        lines += [*table_text(t), ""]
    if r["notes"]:
        lines += ["Notes on this run:", ""]
        lines += [f"- {n}" for n in r["notes"]]
        lines.append("")
    lines += [provenance(r), ""]
    return lines


def _topic(question: str) -> int:
    for i, (_, _, prefixes) in enumerate(TOPICS):
        if question.startswith(prefixes):
            return i
    return len(TOPICS)


def grouped(found: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, list[str]]]:
    topics = [*((t, intro) for t, intro, _ in TOPICS), OTHER]
    buckets: list[list[str]] = [[] for _ in topics]
    for q in found:
        buckets[_topic(q)].append(q)
    out = []
    for (title, intro), qs in zip(topics, buckets, strict=True):
        qs.sort(key=lambda q: (ORDER.index(q) if q in ORDER else len(ORDER), q))
        if qs:
            out.append((title, intro, qs))
    return out


def render(found: Mapping[str, Mapping[str, Any]]) -> str:
    """BENCHMARKS.md for these results (question → newest result)."""
    groups = grouped(found)
    lines = ["# Benchmarks", "", METHOD, "", "## Contents", ""]
    for title, _, qs in groups:
        lines.append(f"- [{title}](#{slug(title)})")
        lines += [f"  - [{found[q]['title']}](#{slug(found[q]['title'])})" for q in qs]
    lines.append("")
    for title, intro, qs in groups:
        lines += [f"## {title}", "", intro, ""]
        for q in qs:
            lines += section(found[q])
    return "\n".join(lines).rstrip("\n") + "\n"


def _short(f: Mapping[str, Any]) -> str:
    text = value_text(f)
    if f.get("p99") is not None:
        text += f" (p99 {_with_unit(number(f['p99'], f['digits']), f['unit'])})"
    return text


def headline_block(found: Mapping[str, Mapping[str, Any]]) -> str:
    """The table between README.md's markers (without the markers)."""
    lines = ["| question | current figure | same run |", "|---|---|---|"]
    for h in HEADLINES:
        r = found.get(h.question)
        if r is None:
            continue
        figs = r["figures"]
        main = ", ".join(_short(figs[k]) for k in h.figures)
        peers = (
            "; ".join(
                f"{name} {', '.join(_short(figs[k]) for k in keys)}" for name, keys in h.peers
            )
            or "-"
        )
        link = f"BENCHMARKS.md#{slug(r['title'])}"
        lines.append(f"| [{h.label}]({link}) | **{main}** | {peers} |")
    return "\n".join(lines) + "\n"


def fill_readme(text: str, block: str) -> str:
    """``text`` with the block between the markers replaced; unchanged without markers."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        return text
    return text[: begin + len(BEGIN)] + "\n" + block + text[end:]


def outputs(results_dir: Path, bench_md: Path, readme: Path) -> dict[Path, tuple[str | None, str]]:
    """Each file this renders: (its text now or None, what the results give)."""
    found = results.newest(results_dir)
    out: dict[Path, tuple[str | None, str]] = {}
    out[bench_md] = (bench_md.read_text() if bench_md.exists() else None, render(found))
    if readme.exists():
        old = readme.read_text()
        out[readme] = (old, fill_readme(old, headline_block(found)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--results", type=Path, default=results.DIR)
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for path, (old, new) in outputs(args.results, args.out, args.readme).items():
        if old == new:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(new)
            print(f"wrote {path}")
    if args.check and stale:
        names = ", ".join(str(p) for p in stale)
        print(f"{names}: not what results/ gives; run `{COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
