"""Training recovery after a node fault, 3 nodes × 2 ranks, in one run: in-process elastic
DDP/HSDP on swim vs torchrun with the swim rendezvous vs torchrun with stock c10d, and the
step efficiency of each under a node failure every minute (bench/step_efficiency.py).

In-process: three nodes on loopback, each a real agent (profile ``fast`` by default) and two
trainers (examples/elastic_ddp.py or examples/elastic_hsdp.py, LOCAL_RANK 0 and 1) in one
process group (agent/training_nodes.py). Node n2 fails on purpose at the next step after a
fault file appears: its local rank 0 logs the wall time, then SIGKILLs or SIGSTOPs the
node's whole process group (agent and both trainers) at a step boundary (``kill``, ``stop``)
or inside backward (``kill-in-backward``, ``stop-in-backward``); world 6 → 4. From the
trainers' step logs:

- fault → verdict: to the earliest ``verdict_t`` of a survivor's trainer (when it saw its
  agent's view drop the node); in parentheses, the last survivor rank's;
- verdict → first step: to the first step completed at world 4;
- fault → first step: to the first step completed at world 4;
- rolled back: the last step completed at world 6 + 1 − the first step at world 4 (0: the
  survivors went on from the step they were at).

``--netns``: each node's agent and trainers in a network namespace of their own
(tests/netns/training.py), the TCPStore and gloo traffic over a bridge; faults ``kill``,
``stop`` and ``power`` there (``power``: the victim's rank 0 drops every packet of its
node's link, then SIGKILLs the node: the survivors see silence, no reset and no ICMP), and
``kill``, ``stop`` on loopback in the same run, for DDP and HSDP, repeats interleaved. Each
namespaced run counts at the survivors what arrived from the victim after the fault (TCP
resets, ICMP, packets) and at the victim the packets its cut dropped. Written as its own
question (bench/training_results.py ``power``); no torchrun, no step efficiency.

``--spares N``: every planned case twice, interleaved: as above, and with N more nodes
waiting as spares (``--target-nodes``, ``--spare``): the victim's place goes to the oldest
spare, and the first step is the first completed at the *same* world after the fault
(survivors and the spare). Written as its own question (bench/training_results.py
``spares``); no torchrun, no step efficiency. ``--lock FILE`` holds ``flock`` on FILE
during each run, so runs of other measurements that take it never overlap ours.

torchrun (3 nodes × ``--nproc-per-node=2``, world 6 → 4) is bench/torchrun_recovery.py's
``measure``: only the total (fault → first step of a new group without the victim) is
observable there; stock c10d is watched for 40 s (90 s after a SIGKILL: keep-alive expiry +
last call), as in that module.

    python -m bench.torch_recovery [--nodes 3 --ranks-per-node 2 --profile fast --repeats 5]
        [--netns] [--faults DDP:kill,HSDP:power:ns] [--spares 1] [--lock FILE]
        [--early-drop on,off] [--stall-drop on,off] [--small-group on,off]
        [--torchrun-repeats 3] [--no-torchrun]
        [--minutes 10 --every-s 60 --baseline-s 120]
        [--no-efficiency] [--efficiency-setups in-process,torchrun-c10d,torchrun-swim]
        [--workdir DIR] [--out REPORT.md] [--results DIR | --no-results]

It writes two result files under results/ (bench/training_results.py): the recovery rows and,
unless ``--no-efficiency``, the step efficiency; ``python -m bench.render`` renders them
into BENCHMARKS.md. ``--out`` writes the Markdown report to a file of your own.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agent.procs import until
from agent.training_nodes import TrainingNode, start_nodes
from bench import (
    agent_variants,
    early_drop_results,
    results,
    step_efficiency,
    torchrun_recovery,
    training_results,
)
from bench.torch_recovery_report import phase_offsets, phases_table, report, table, write_section
from tests.netns.training import NsTraining

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"DDP": "examples/elastic_ddp.py", "HSDP": "examples/elastic_hsdp.py"}
LOOPBACK, NETNS = "loopback", "ns"
IN_PROCESS: tuple[tuple[str, str, str], ...] = (
    ("DDP", "kill", LOOPBACK),
    ("DDP", "kill-in-backward", LOOPBACK),
    ("DDP", "stop", LOOPBACK),
    ("DDP", "stop-in-backward", LOOPBACK),
    ("HSDP", "kill-in-backward", LOOPBACK),
)
POWER: tuple[tuple[str, str, str], ...] = tuple(
    (kind, fault, net)
    for kind in ("DDP", "HSDP")
    for fault, net in (
        ("power", NETNS),
        ("kill", NETNS),
        ("stop", NETNS),
        ("kill", LOOPBACK),
        ("stop", LOOPBACK),
    )
)
"""``--netns``: power loss beside SIGKILL and SIGSTOP in namespaces, and the same two on
loopback, at the step boundary."""
TORCHRUN: tuple[tuple[torchrun_recovery.Backend, torchrun_recovery.Scenario], ...] = (
    ("swim", "kill"),
    ("swim", "stop"),
    ("c10d", "kill"),
    ("c10d", "stop"),
)
SPARE_MODE = ", spare"
"""A mode's suffix when a spare waits (``--spares``)."""
STEP_SLEEP_S = 0.02  # recovery rows: a short step, so the fault lands soon after the file


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def measure_inprocess(
    kind: str,
    fault: str,
    *,
    nodes: int = 3,
    ranks: int = 2,
    profile: str = "fast",
    start_timeout_s: float = 180.0,
    window_s: float = 60.0,
    workdir: Path | None = None,
    net: str = LOOPBACK,
    spares: int = 0,
    variant: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``nodes`` × ``ranks`` train at full world; the last node fails with ``fault``; time
    the survivors' verdict and their first step at the reduced world (None if none within
    ``window_s``). ``workdir``: keep the logs there (a temporary directory otherwise).
    ``net``: ``loopback`` or ``ns`` (a network namespace per node, with packet counts).
    ``spares``: that many more nodes wait as spares (``--target-nodes nodes``): the first
    step is then the first at the full world with a spare in the victim's place.
    ``variant``: the agents' switches for this row (bench/agent_variants.py); none set: the
    profile's defaults."""
    full, reduced = nodes * ranks, (nodes - 1) * ranks
    after_world = full if spares else reduced
    with results.workdir(workdir, "swim-torchbench-") as work:
        fault_file = work / "fault"
        agent_args = agent_variants.agent_args(work, variant or {})
        with _cluster(net, nodes + spares, work, profile, ranks, agent_args) as (cluster, ns):
            training, victim = cluster[:nodes], cluster[nodes - 1]
            # after the fault: the surviving nodes, and the oldest spare in the victim's place
            survivors = training[:-1] + cluster[nodes : nodes + 1]
            started = time.monotonic()
            for n in cluster:
                extra = ["--fault", fault, "--fault-file", str(fault_file)] if n is victim else []
                if spares:
                    extra += ["--target-nodes", str(nodes)]
                    extra += ["--spare"] if n not in training else []
                n.start_trainers(
                    SCRIPTS[kind],
                    *("--job", "bench", "--steps", "1000000", "--step-sleep", str(STEP_SLEEP_S)),
                    *("--pg-timeout", "60", "--min-nodes", str(nodes - 1), *extra),
                    timeout_s=start_timeout_s + window_s + 60,
                )
            until(lambda: all(n.training_at(full) for n in training), start_timeout_s, "full")
            startup_s = time.monotonic() - started
            time.sleep(1)
            if ns is not None:
                ns.watch(victim)
            fault_file.touch()
            until(lambda: any("fault" in r for r in victim.records()), 20, "the fault")
            fault_rec = next(r for r in victim.records() if "fault" in r)
            fault_t = float(fault_rec["t"])
            row: dict[str, Any] = {
                "mode": f"in-process {kind}"
                + (", namespaces" if ns is not None else "")
                + (SPARE_MODE if spares else "")
                + agent_variants.mode(variant or {}),
                "spares": spares,
                "fault": fault,
                "net": net,
                "cut_s": fault_rec.get("cut_s"),
                "startup_s": startup_s,
                "window_s": window_s,
                "verdict_s": None,
                "last_verdict_s": None,
                "resume_s": None,
                "total_s": None,
                "rolled_back": None,
                "victim_led": None,
                "workdir": str(work),
            }

            def after(node: TrainingNode) -> list[dict[str, Any]]:
                return [
                    r
                    for r in node.all_records()
                    if "loss" in r and r["world"] == after_world and r["t"] > fault_t
                ]

            def every_rank_moved_on() -> bool:
                return all(
                    {r["local_rank"] for r in after(n)} == set(range(ranks)) for n in survivors
                )

            try:
                until(every_rank_moved_on, window_s, f"survivors at world {after_world}")
            except TimeoutError:
                return row
            finally:
                if ns is not None:  # what reached the survivors up to here
                    row |= ns.counts(victim).as_row()
            steps = [r for n in survivors for r in after(n)]
            first = min(steps, key=lambda r: float(r["t"]))
            row["total_s"] = float(first["t"]) - fault_t
            per_rank: dict[tuple[str, int], float] = {}
            for r in steps:
                v = r.get("verdict_t")
                if v and v > fault_t:
                    key = (r["node"], r["local_rank"])
                    per_rank[key] = min(per_rank.get(key, v), v)
            # each survivor rank's first step at the reduced world carries its phases
            firsts: dict[tuple[str, int], dict[str, Any]] = {}
            for r in sorted(steps, key=lambda r: float(r["t"]), reverse=True):
                firsts[(r["node"], r["local_rank"])] = r
            row["phases_ms"] = phase_offsets(
                list(firsts.values()), min(per_rank.values(), default=fault_t)
            )
            if per_rank:
                row["verdict_s"] = min(per_rank.values()) - fault_t
                row["resume_s"] = float(first["t"]) - min(per_rank.values())
                if len(per_rank) == reduced:  # a drafted spare watched no group: no verdict
                    row["last_verdict_s"] = max(per_rank.values()) - fault_t
            last_full = [
                r
                for n in survivors
                if n in training
                for r in n.all_records()
                if "loss" in r and r["world"] == full and r["t"] <= fault_t
            ]
            if last_full:
                row["rolled_back"] = max(int(r["step"]) for r in last_full) + 1 - first["step"]
                # the victim led the group (rank 0, the formation directory): a harder case
                row["victim_led"] = (
                    max(last_full, key=lambda r: r["t"]).get("leader") == victim.name
                )
                row["first_step"] = int(first["step"])
                row["resumed"] = first.get("resumed")
            return row


@contextlib.contextmanager
def _cluster(
    net: str, nodes: int, work: Path, profile: str, ranks: int, agent_args: tuple[str, ...] = ()
) -> Iterator[tuple[list[TrainingNode], NsTraining | None]]:
    """The nodes on loopback, or each in a network namespace of its own; every process
    stopped by pid (and every namespace removed) on the way out, errors included."""
    if net == NETNS:
        with NsTraining(nodes, work, profile, ranks, agent_args) as ns:
            yield ns.nodes, ns
        return
    if net != LOOPBACK:
        raise ValueError(f"net must be {LOOPBACK!r} or {NETNS!r}, got {net!r}")
    names = [f"n{i}" for i in range(nodes)]
    cluster = start_nodes(names, work, profile, ranks, agent_args=agent_args)
    try:
        yield cluster, None
    finally:
        for n in cluster:
            n.stop()


def measure_torchrun(
    profile: str,
    fault: torchrun_recovery.Scenario,
    backend: torchrun_recovery.Backend,
    nproc_per_node: int,
    workdir: Path | None = None,
) -> dict[str, Any]:
    window = 90.0 if (backend, fault) == ("c10d", "kill") else 40.0
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    r = torchrun_recovery.measure(
        profile,
        fault,
        backend,
        nproc_per_node=nproc_per_node,
        window_s=window,
        start_timeout_s=180.0,
        workdir=workdir,
    )
    return {
        "mode": "torchrun + swim" if backend == "swim" else "torchrun + c10d (stock)",
        "fault": fault,
        "startup_s": r["startup_s"],
        "window_s": window,
        "verdict_s": None,
        "last_verdict_s": None,
        "resume_s": None,
        "total_s": r["recovery_s"],
        "rolled_back": None,
        "victim_led": None,
        "workdir": str(workdir) if workdir else "(removed)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--profile", default="fast")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torchrun-repeats", type=int, default=3)
    parser.add_argument(
        "--faults", default=None, help="e.g. DDP:kill,HSDP:kill-in-backward,DDP:power:ns"
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="power loss beside SIGKILL and SIGSTOP, namespaces and loopback (no torchrun, "
        "no step efficiency)",
    )
    agent_variants.add_arguments(parser)
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="with N spare nodes too (--target-nodes): every case with and without them, "
        "interleaved (its own result file; no torchrun, no step efficiency)",
    )
    parser.add_argument(
        "--lock",
        type=Path,
        default=None,
        help="hold flock(2) on this file during each run (not between runs): measurements "
        "of others that take the same lock never overlap one of ours",
    )
    parser.add_argument("--no-torchrun", action="store_true")
    parser.add_argument("--no-efficiency", action="store_true")
    parser.add_argument(
        "--efficiency-setups",
        default="in-process,torchrun-c10d",
        help=f"of {','.join(step_efficiency.SETUPS)}",
    )
    step_efficiency.add_arguments(parser)  # --minutes --every-s --baseline-s --step-sleep
    parser.add_argument("--out", type=Path, default=None, help="write the report there")
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    started = results.machine()
    command = "python -m bench.torch_recovery " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    plan = list(POWER if args.netns else IN_PROCESS)
    if args.faults:
        plan = [_planned(f) for f in args.faults.split(",") if f]
    if args.netns or args.spares:
        args.no_torchrun = args.no_efficiency = True
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    loads = step_efficiency.load(), ""
    say(f"-- load average {loads[0]}")
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []

    def attempt(label: str, i: int, fn: Any, *fn_args: Any) -> None:
        for n in (1, 2):  # a start that never trains at full size is retried once
            work = None if args.workdir is None else args.workdir / f"{label}-{i + 1}.{n}"
            try:
                with _locked(args.lock):
                    row = fn(*fn_args, work)
            except (TimeoutError, AssertionError, RuntimeError) as exc:
                say(f"   {label} #{i + 1} attempt {n}: {exc}")
                failures.append(f"{label} #{i + 1} (attempt {n}): {exc}")
                continue
            say(f"   {row}")
            rows.append(row)
            return

    def inprocess(
        kind: str, fault: str, net: str, spares: int, variant: dict[str, str], work: Path | None
    ) -> dict[str, Any]:
        return measure_inprocess(
            kind,
            fault,
            nodes=args.nodes,
            ranks=args.ranks_per_node,
            profile=args.profile,
            workdir=work,
            net=net,
            spares=spares,
            variant=variant,
        )

    switched = list(agent_variants.variants(args))
    for i in range(args.repeats):  # interleaved: load swings spread over every row alike
        cases = itertools.product(plan, sorted({0, args.spares}), switched)
        for (kind, fault, net), spares, variant in cases:
            label = f"{kind.lower()}-{fault}-{net}" + (f"-{spares}spare" if spares else "")
            label += agent_variants.mode(variant).replace(", ", "-").replace(" ", "-")
            say(f"-- in-process {label} #{i + 1} (load {step_efficiency.load()})")
            attempt(label, i, inprocess, kind, fault, net, spares, variant)
    if not args.no_torchrun:
        for backend, scenario in TORCHRUN:
            for i in range(args.torchrun_repeats):
                say(f"-- torchrun {backend} {scenario} #{i + 1} (load {step_efficiency.load()})")
                profile = args.profile if backend == "swim" else "local"
                attempt(
                    f"torchrun-{backend}-{scenario}",
                    i,
                    measure_torchrun,
                    profile,
                    scenario,
                    backend,
                    args.ranks_per_node,
                )
    if rows:  # the recovery rows, before the long efficiency runs
        say(table(rows))
        say(phases_table(rows))
    efficiency: list[dict[str, Any]] = []
    if not args.no_efficiency:
        setups = [s for s in args.efficiency_setups.split(",") if s]
        efficiency = step_efficiency.run_all(
            args, setups, profile=args.profile, ranks=args.ranks_per_node, workdir=args.workdir
        )
    elapsed = time.monotonic() - began
    loads = loads[0], step_efficiency.load()
    say(f"-- done in {elapsed:.0f} s, load average {loads[1]}")
    text = report(rows, efficiency, args, command.strip(), loads, elapsed, STEP_SLEEP_S)
    if failures:
        text += "\nStarts that never trained at full size (retried once):\n\n"
        text += "".join(f"- {f}\n" for f in failures)
    print(text)
    if args.out is not None:
        write_section(args.out, text)
    shape = {"nodes": args.nodes, "ranks": args.ranks_per_node, "profile": args.profile}
    if rows:
        build = training_results.power if args.netns else training_results.recovery
        built = build(rows, step_sleep_s=STEP_SLEEP_S, **shape)
        if args.spares:
            built = training_results.spares(built, rows, spares=args.spares, **shape)
        for switch in agent_variants.SWITCHES:
            if len({v[switch] for v in switched}) > 1:
                built = early_drop_results.switch(built, rows, switch, **shape)
        notes = [f"Never trained at full size (retried once): {f}" for f in failures]
        results.record(args, "bench.torch_recovery", argv, started, built, notes)
    if efficiency:
        results.record(
            args,
            "bench.torch_recovery",
            argv,
            started,
            training_results.efficiency(efficiency, **shape),
        )
    return 0


@contextlib.contextmanager
def _locked(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _planned(text: str) -> tuple[str, str, str]:
    """``KIND:FAULT`` or ``KIND:FAULT:NET`` (``loopback`` by default, or ``ns``)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in SCRIPTS:
        raise SystemExit(f"--faults: {text!r} is not KIND:FAULT[:NET] with KIND of {list(SCRIPTS)}")
    net = parts[2] if len(parts) == 3 else LOOPBACK
    if net not in (LOOPBACK, NETNS):
        raise SystemExit(f"--faults: {text!r}: NET must be {LOOPBACK} or {NETNS}")
    return parts[0], parts[1], net


if __name__ == "__main__":
    raise SystemExit(main())
