"""``swimctl demo --torch``: a 4-node elastic DDP job on loopback survives a node's death.

Four "nodes", each a real agent and one trainer (examples/elastic_ddp.py, CPU/gloo) in one
process group of their own. Once the job trains at world size 4, the last node's process
group is SIGKILLed (a dead host); the survivors drop it on the agents' verdict and go on at
world size 3 in the same processes. Prints step, world size and loss every few steps, and
the recovery time. Every process is bounded (``timeout``) and is killed by process group
at the end, also on Ctrl-C or error.

torch is never imported here: the trainers are subprocesses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from agent.control import ControlClient, ControlError
from agent.demo import agent_command, free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "elastic_ddp.py"
NODES = 4
POLL_S = 0.05
EVERY = 5  # print every EVERY-th step
STEPS_BEFORE = 15  # steps at world 4 before the kill
STEPS_AFTER = 30  # steps at world 3 before stopping
TRAINER_LIMIT_S = 300  # hard bound on every trainer (timeout -s KILL)


class DemoNode:
    """One agent and its trainer, in a process group of their own (the agent leads it)."""

    def __init__(self, name: str, workdir: Path, profile: str, join_port: int | None) -> None:
        self.name = name
        self.port = free_port()
        self.control = workdir / f"{name}.sock"
        self.steps_path = workdir / f"{name}.steps.jsonl"
        self.trainer_log = workdir / f"{name}.trainer.log"
        agent_log = workdir / f"{name}.agent.log"
        args = agent_command(name, self.port, self.control, profile, join_port)
        with agent_log.open("wb") as out:
            self.agent = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, process_group=0
            )
        self.pgid = self.agent.pid
        self.trainer: subprocess.Popen[bytes] | None = None

    def ready(self) -> bool:
        if self.agent.poll() is not None:
            raise RuntimeError(f"agent {self.name} exited with {self.agent.returncode}")
        try:
            ControlClient(self.control, timeout_s=2).request("info")
            return True
        except ControlError:
            return False

    def start_trainer(self, stop_file: Path) -> None:
        cmd = [
            *("timeout", "--foreground", "-s", "KILL", str(TRAINER_LIMIT_S)),
            *(sys.executable, str(SCRIPT), "--control", str(self.control)),
            *("--log", str(self.steps_path), "--job", "demo", "--steps", "1000000"),
            *("--stop-file", str(stop_file), "--step-sleep", "0.05"),
            *("--min-nodes", "3", "--pg-timeout", "60"),
        ]
        with self.trainer_log.open("ab") as out:
            self.trainer = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, process_group=self.pgid
            )

    def records(self) -> list[dict[str, Any]]:
        if not self.steps_path.exists():
            return []
        out = []
        for line in self.steps_path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a torn last line
                out.append(json.loads(line))
        return out

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if "loss" in r]

    def kill(self) -> None:
        """SIGKILL the whole node (a stopped process dies of SIGKILL too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)

    def reap(self) -> None:
        self.kill()
        for proc in (self.trainer, self.agent):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


class _Printer:
    """Prints each EVERY-th step of one node's log once, as a table row."""

    def __init__(self) -> None:
        self.shown: set[int] = set()
        print(f"  {'step':>5}  {'world':>5}  {'loss':>9}")

    def show(self, steps: list[dict[str, Any]]) -> None:
        for r in steps:
            step = int(r["step"])
            if step % EVERY == 0 and step not in self.shown:
                self.shown.add(step)
                print(f"  {step:>5}  {int(r['world']):>5}  {float(r['loss']):>9.5f}", flush=True)


def _at_world(node: DemoNode, world: int, steps: int) -> bool:
    recent = node.steps()[-steps:]
    return len(recent) == steps and all(r["world"] == world for r in recent)


def _run(nodes: list[DemoNode], workdir: Path) -> int:
    stop_file = workdir / "stop"
    for n in nodes:
        n.start_trainer(stop_file)
    print(f"== {NODES} trainers (examples/elastic_ddp.py, gloo) form one DDP group ...")
    started = time.monotonic()
    _until(lambda: all(_at_world(n, NODES, 3) for n in nodes), 180, f"world {NODES}")
    print(f"training at world size {NODES} after {time.monotonic() - started:.1f} s\n")
    watched, victim, survivors = nodes[0], nodes[-1], nodes[:-1]
    printer = _Printer()
    first = int(watched.steps()[-1]["step"])

    def progressed(target: int) -> bool:
        printer.show(watched.steps())
        return int(watched.steps()[-1]["step"]) >= target

    _until(lambda: progressed(first + STEPS_BEFORE), 60, "steps at world 4")
    print(f"  -- SIGKILL {victim.name} (agent + trainer, process group {victim.pgid})")
    killed_at = time.time()
    victim.kill()

    def at3() -> list[dict[str, Any]]:
        # (the job may have trained at world 3 while the 4th node was still starting)
        return [
            r
            for n in survivors
            for r in n.steps()
            if r["world"] == NODES - 1 and float(r["t"]) > killed_at
        ]

    _until(lambda: progressed(0) and bool(at3()), 90, f"a step at world {NODES - 1}")
    resumed = min(float(r["t"]) for r in at3())
    verdicts = [float(v) for r in at3() if (v := r.get("verdict_t")) and v > killed_at]
    resumed_step = min(int(r["step"]) for r in at3())
    _until(lambda: progressed(resumed_step + STEPS_AFTER), 90, f"steps at world {NODES - 1}")
    last = max(int(r["step"]) for n in survivors for r in n.steps())
    stop_file.write_text(str(last + 2))
    with contextlib.suppress(TimeoutError):
        _until(
            lambda: all(n.trainer is not None and n.trainer.poll() is not None for n in survivors),
            30,
            "",
        )
    printer.show(watched.steps())
    print()
    print(f"the job went on at world size {NODES - 1} from step {resumed_step}:")
    print(f"  kill -> first step at world {NODES - 1}: {resumed - killed_at:.2f} s")
    if verdicts:
        verdict = min(verdicts)
        print(f"  kill -> agents' verdict seen by the trainers: {verdict - killed_at:.2f} s")
        print(f"  verdict -> first step at world {NODES - 1}: {resumed - verdict:.2f} s")
    finals = [r for n in survivors for r in n.records() if r.get("final")]
    if len(finals) == len(survivors) and len({r["checksum"] for r in finals}) == 1:
        print(f"  all {len(finals)} survivors stopped at step {finals[0]['step']} with identical")
        print("  parameters and optimizer state")
    return 0


def run_torch_demo(profile: str = "local") -> int:
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
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    nodes: list[DemoNode] = []
    try:
        with tempfile.TemporaryDirectory(prefix="swim-torch-demo-") as tmp:
            workdir = Path(tmp)
            print(f"== starting {NODES} agents on 127.0.0.1 (profile {profile}, logs in {tmp})")
            try:
                nodes.append(DemoNode("node0", workdir, profile, None))
                _until(nodes[0].ready, 30, "agent node0")
                nodes += [
                    DemoNode(f"node{i}", workdir, profile, nodes[0].port) for i in range(1, NODES)
                ]
                _until(lambda: all(n.ready() for n in nodes), 30, "agents")
                return _run(nodes, workdir)
            except (TimeoutError, RuntimeError) as exc:
                print(f"Error: {exc} (logs in {tmp})", file=sys.stderr)
                for n in nodes:
                    with contextlib.suppress(OSError):
                        tail = n.trainer_log.read_text()[-1500:]
                        print(f"--- {n.trainer_log.name}\n{tail}", file=sys.stderr)
                return 1
            finally:
                for n in nodes:
                    n.reap()
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
