"""What a wrong drop costs: a live node that gives its peers the evidence of a crash.

3 nodes × 2 ranks (examples/elastic_ddp.py or elastic_hsdp.py), each node's agent and
trainers in a network namespace of its own (tests/netns/training.py). Node n2's local rank
0 applies a ``reject`` fault (examples/job.py ``reject_rules``) at a step boundary: for
``--reject-ms`` every packet in and out of its link is rejected, TCP with a reset and the
rest with ICMP port unreachable, then the rules go and the node, which never stopped, is
reachable again. Its peers' collectives see resets and their agents' probes fail: with the
agents' ``job_early_drop`` on, the survivors leave n2 out of their views and re-form
without it, then regrow when it refutes; with it off they wait for the suspicion to end
in its refutation (a window longer than the fault) and re-form once, with n2.

``--fault blackout`` drops every packet of n2's link for ``--reject-ms`` instead (no reset,
no ICMP: to its peers a stopped node or a host without power) and compares the agents'
``job_stall_drop``: the survivors' ranks block on n2, their agents suspect it, and with
the switch on they leave it out and re-form without it until it refutes. Interleaved on
and off, per run:

- ``reduced_s``: fault → first step at the reduced world (None: the job never shrank);
- ``full_s``: fault → the step at which every rank trains at the full world again (the
  last rank's first full-world step after the fault);
- ``rolled_back``: steps taken again (last full-world step before the fault + 1 − the
  first step after it; 0: nobody lost work);
- ``deaths``: ``dead`` events about any member in any agent's log after the fault (a wrong
  drop must never become a false death).

    python -m bench.false_drop [--repeats 5] [--reject-ms 300] [--kind DDP]
        [--fault reject|blackout] [--workdir DIR]

Needs root (network namespaces, iptables); prints one JSON line per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from agent.procs import until
from bench import results as result_files
from bench import step_efficiency
from tests.netns.training import NsTraining

SCRIPTS = {"DDP": "examples/elastic_ddp.py", "HSDP": "examples/elastic_hsdp.py"}
NODES, RANKS = 3, 2


SWITCHES = {"reject": "job-early-drop", "blackout": "job-stall-drop"}
"""The agents' switch whose wrong drop each fault provokes."""


def measure(
    kind: str, switch_on: bool, reject_ms: int, work: Path, fault: str = "reject"
) -> dict[str, Any]:
    full, reduced = NODES * RANKS, (NODES - 1) * RANKS
    work.mkdir(parents=True, exist_ok=True)
    fault_file = work / "fault"
    flag = f"--{'' if switch_on else 'no-'}{SWITCHES[fault]}"
    with NsTraining(NODES, work, "fast", RANKS, (flag,)) as ns:
        cluster = ns.nodes
        victim = cluster[-1]
        for n in cluster:
            extra = ["--fault", fault, "--fault-file", str(fault_file)] if n is victim else []
            n.start_trainers(
                SCRIPTS[kind],
                *("--job", "bench", "--steps", "1000000", "--step-sleep", "0.02"),
                *("--pg-timeout", "60", "--min-nodes", "2", "--reject-ms", str(reject_ms)),
                *extra,
                timeout_s=300,
            )
        until(lambda: all(n.training_at(full) for n in cluster), 180, "full")
        time.sleep(1)
        fault_file.touch()
        until(lambda: any("fault" in r for r in victim.records()), 20, "the fault")
        fault_t = float(next(r for r in victim.records() if "fault" in r)["t"])

        def after(world: int) -> list[dict[str, Any]]:
            return [
                r
                for n in cluster
                for r in n.all_records()
                if "loss" in r and r["world"] == world and r["t"] > fault_t
            ]

        def all_back() -> bool:
            ranks = {(r["node"], r["local_rank"]) for r in after(full)}
            return len(ranks) == full

        until(all_back, 60, "every rank back at the full world")
        before = [
            r
            for n in cluster
            for r in n.all_records()
            if "loss" in r and r["world"] == full and r["t"] <= fault_t
        ]
        firsts: dict[tuple[str, int], dict[str, Any]] = {}
        for r in sorted(after(full), key=lambda r: float(r["t"]), reverse=True):
            firsts[(r["node"], r["local_rank"])] = r
        shrunk = after(reduced)
        first_after = min(
            (r for r in after(full) + shrunk), key=lambda r: float(r["t"]), default=None
        )
        deaths = sum(
            1
            for n in cluster
            for line in n.agent_log.read_text(errors="replace").splitlines()
            if " dead (incarnation" in line and _at(line) > fault_t
        )
        return {
            "kind": kind,
            "fault": fault,
            "switch": SWITCHES[fault],
            "drop": "on" if switch_on else "off",
            "reduced_s": (min(float(r["t"]) for r in shrunk) - fault_t if shrunk else None),
            "full_s": max(float(r["t"]) for r in firsts.values()) - fault_t,
            "rolled_back": (
                max(int(r["step"]) for r in before) + 1 - int(first_after["step"])
                if before and first_after
                else None
            ),
            "deaths": deaths,
            "workdir": str(work),
        }


def _at(line: str) -> float:
    """The wall time of an agent log line (``2026-12-05 23:59:01,123 [...``)."""
    try:
        stamp, ms = line[:23].split(",")
        return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    except ValueError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reject-ms", type=int, default=300)
    parser.add_argument("--kind", choices=sorted(SCRIPTS), default="DDP")
    parser.add_argument("--fault", choices=sorted(SWITCHES), default="reject")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with result_files.workdir(args.workdir, "swim-false-drop-") as root:
        for i in range(args.repeats):
            for on in (True, False):
                load = step_efficiency.load()
                try:
                    row = measure(args.kind, on, args.reject_ms, root / f"{i}-{on}", args.fault)
                except (TimeoutError, RuntimeError) as exc:
                    print(f"run {i} switch {on}: {exc}", file=sys.stderr, flush=True)
                    continue
                row["load"] = load
                print(json.dumps(row), flush=True)
                rows.append(row)
    for setting in ("on", "off"):
        runs = [r for r in rows if r["drop"] == setting]
        if not runs:
            continue
        shrank = [r["reduced_s"] for r in runs if r["reduced_s"] is not None]
        print(
            f"{SWITCHES[args.fault]} {setting}: {len(runs)} runs, shrank in {len(shrank)}"
            + (f" (median {statistics.median(shrank):.2f} s)" if shrank else "")
            + f"; full world again after {statistics.median(r['full_s'] for r in runs):.2f} s"
            f" median (max {max(r['full_s'] for r in runs):.2f}); rolled back at most "
            f"{max((r['rolled_back'] or 0) for r in runs)}; deaths {sum(r['deaths'] for r in runs)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
