"""``swimctl demo --torch``: an elastic DDP job on loopback survives a node's death.

``nodes`` "nodes" (default 4), each a real agent and ``ranks_per_node`` trainers
(examples/elastic_ddp.py, CPU/gloo, one per local rank) in one process group of their own
(agent/training_nodes.py). Once the job trains at world size nodes x ranks, the last
node's process group is SIGKILLed (a dead host: agent and every rank at once); the
survivors drop all of its ranks on the agents' verdict and go on at world size
(nodes - 1) x ranks in the same processes. Prints step, world size and loss every few
steps, the recovery time, and whether every surviving rank stopped with the same
parameters and optimizer state. Every process is bounded (``timeout``) and is killed by
process group at the end, also on Ctrl-C, SIGTERM or error.

torch is never imported here: the trainers are subprocesses.
"""

from __future__ import annotations

import importlib.util
import math
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from agent.procs import until
from agent.training_nodes import ROOT, TrainingNode, start_nodes

SCRIPT = ROOT / "examples" / "elastic_ddp.py"
MAX_RANKS_PER_NODE = 8  # a GPU host's usual count; more would only be a CPU stress test
EVERY = 5  # print every EVERY-th step
STEPS_BEFORE = 15  # steps at the full world before the kill
STEPS_AFTER = 30  # steps at the shrunk world before stopping
MIN_GLOBAL_BATCH = 12  # examples/elastic_ddp.py's default, so the loss column stays familiar


def global_batch(nodes: int, ranks_per_node: int) -> int:
    """A global batch that every world size of the run divides (before and after the kill),
    so each rank gets an equal slice and the loss is the same function of the step in both
    worlds: the smallest multiple of lcm(before, after) that is at least 12."""
    base = math.lcm(nodes * ranks_per_node, (nodes - 1) * ranks_per_node)
    return base * math.ceil(MIN_GLOBAL_BATCH / base)


def check_shape(nodes: int, ranks_per_node: int) -> str | None:
    """Why this demo cannot run at this size, or None."""
    if nodes < 2:
        return f"--nodes must be at least 2 (one is killed, the others go on), not {nodes}"
    if not 1 <= ranks_per_node <= MAX_RANKS_PER_NODE:
        return f"--ranks-per-node must be 1..{MAX_RANKS_PER_NODE}, not {ranks_per_node}"
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


class _Printer:
    """Prints each EVERY-th step of one rank's log once, as a table row."""

    def __init__(self) -> None:
        self.shown: set[int] = set()
        print(f"  {'step':>5}  {'world':>5}  {'loss':>9}")

    def show(self, steps: list[dict[str, Any]]) -> None:
        for r in steps:
            step = int(r["step"])
            if step % EVERY == 0 and step not in self.shown:
                self.shown.add(step)
                print(f"  {step:>5}  {int(r['world']):>5}  {float(r['loss']):>9.5f}", flush=True)


def _run(nodes: list[TrainingNode], workdir: Path, ranks: int) -> int:
    full, shrunk = len(nodes) * ranks, (len(nodes) - 1) * ranks
    stop_file = workdir / "stop"
    # Bounds scale with the process count: on a small machine each trainer's torch import
    # and gloo setup share the same few cores.
    form_s = 60 + 15 * full
    trainer_limit_s = 240 + 15 * full
    batch = global_batch(len(nodes), ranks)
    for n in nodes:
        n.start_trainers(
            SCRIPT,
            *("--job", "demo", "--steps", "1000000", "--stop-file", str(stop_file)),
            *("--step-sleep", "0.05", "--pg-timeout", "60"),
            # the job may go on without one node (and may start before the last one is up)
            *("--min-nodes", str(len(nodes) - 1), "--global-batch", str(batch)),
            timeout_s=trainer_limit_s,
        )
    print(
        f"== {len(nodes)} nodes x {_count(ranks, 'rank')} = {full} trainers "
        f"(examples/elastic_ddp.py, gloo, global batch {batch}) form one DDP group ..."
    )
    took = until(lambda: all(n.training_at(full, 3) for n in nodes), form_s, f"world {full}")
    print(f"training at world size {full} after {took:.1f} s\n")
    watched, victim, survivors = nodes[0], nodes[-1], nodes[:-1]
    printer = _Printer()
    first = int(watched.steps()[-1]["step"])

    def progressed(target: int) -> bool:
        steps = watched.steps()
        printer.show(steps)
        return int(steps[-1]["step"]) >= target

    until(lambda: progressed(first + STEPS_BEFORE), 60 + 5 * full, f"steps at world {full}")
    what = f"agent + {_count(ranks, 'trainer')}, process group {victim.pgid}"
    print(f"  -- SIGKILL {victim.name} ({what})")
    killed_at = time.time()
    victim.signal_all(signal.SIGKILL)  # reaped with the others at the end

    def after_kill() -> list[dict[str, Any]]:
        # (the job may have trained at the shrunk world while the last node was starting)
        return [
            r
            for n in survivors
            for r in n.all_records()
            if r.get("world") == shrunk and "loss" in r and float(r["t"]) > killed_at
        ]

    until(lambda: progressed(0) and bool(after_kill()), 90, f"a step at world {shrunk}")
    resumed = min(float(r["t"]) for r in after_kill())
    verdicts = [float(v) for r in after_kill() if (v := r.get("verdict_t")) and v > killed_at]
    resumed_step = min(int(r["step"]) for r in after_kill())
    until(lambda: progressed(resumed_step + STEPS_AFTER), 90, f"steps at world {shrunk}")
    last = max(int(r["step"]) for n in survivors for r in n.all_records() if "loss" in r)
    stop_file.write_text(str(last + 2))
    until(lambda: all(n.trainers_done() for n in survivors), 60, "the survivors stop")
    printer.show(watched.steps())
    print()
    print(f"the job went on at world size {shrunk} from step {resumed_step}:")
    print(f"  kill -> first step at world {shrunk}: {resumed - killed_at:.2f} s")
    if verdicts:
        verdict = min(verdicts)
        print(f"  kill -> agents' verdict seen by the trainers: {verdict - killed_at:.2f} s")
        print(f"  verdict -> first step at world {shrunk}: {resumed - verdict:.2f} s")
    finals = [f for n in survivors for f in n.finals()]
    done = [f for f in finals if f is not None]
    checksums = {f["checksum"] for f in done}
    if len(done) != shrunk or len(checksums) != 1 or len({f["step"] for f in done}) != 1:
        print(
            f"Error: {len(done)} of {shrunk} surviving ranks wrote a final record, "
            f"with {len(checksums)} different checksum(s): {sorted(checksums)}",
            file=sys.stderr,
        )
        return 1
    print(f"  all {shrunk} surviving ranks stopped at step {done[0]['step']} with identical")
    print(f"  parameters and optimizer state (checksum {checksums.pop()})")
    return 0


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Hold off Ctrl-C and SIGTERM while the nodes are killed and reaped, so a second
    signal cannot cut the cleanup short and leave processes behind."""
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def run_torch_demo(profile: str = "local", nodes: int = 4, ranks_per_node: int = 1) -> int:
    if (problem := check_shape(nodes, ranks_per_node)) is not None:
        print(f"Error: {problem}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("torch") is None:
        print(
            "Error: `swimctl demo --torch` needs PyTorch; install it with pip install '.[torch]'",
            file=sys.stderr,
        )
        return 2
    if not SCRIPT.exists():
        print(f"Error: {SCRIPT} not found (run from a source checkout)", file=sys.stderr)
        return 2

    def on_term(_sig: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # one path for Ctrl-C and SIGTERM: the finally below

    previous = signal.signal(signal.SIGTERM, on_term)
    started: list[TrainingNode] = []
    try:
        with tempfile.TemporaryDirectory(prefix="swim-torch-demo-") as tmp:
            workdir = Path(tmp)
            print(
                f"== starting {nodes} agents on 127.0.0.1 "
                f"(profile {profile}, {_count(ranks_per_node, 'rank')} each, "
                f"logs in {tmp})"
            )
            try:
                # start_nodes stops what it started if it fails or is interrupted
                names = [f"node{i}" for i in range(nodes)]
                started = start_nodes(names, workdir, profile, ranks_per_node)
                return _run(started, workdir, ranks_per_node)
            except (TimeoutError, RuntimeError) as exc:
                print(f"Error: {exc} (logs in {tmp})", file=sys.stderr)
                for n in started:
                    print(n.tail(1500), file=sys.stderr)
                return 1
            finally:
                with _signals_ignored():
                    for n in started:
                        n.stop()
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
