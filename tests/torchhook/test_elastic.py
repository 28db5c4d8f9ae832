"""In-process elastic DDP with real agents, real trainer processes and real gloo.

Four nodes (agent + trainer each) train together; one fails mid-step; the survivors go on
at world size 3 in the same processes; a fifth node joins and all go on at world size 4.
Checked from the trainers' step logs: world sizes, bit-identical parameters and optimizer
state on every final member (a checksum printed at the same step), and the loss curve
against a failure-free single-process run of the same global batches.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.torchhook.nodes import ROOT, Node, start_nodes, until

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")
pytestmark = pytest.mark.slow
SCRIPT = "examples/elastic_ddp.py"
LOSS_RTOL = 1e-4


def _common(tmp_path: Path) -> list[str]:
    return [
        "--job", "j", "--steps", "100000", "--stop-file", str(tmp_path / "stop"),
        "--step-sleep", "0.02", "--pg-timeout", "60",
    ]  # fmt: skip


def _training_at(node: Node, world: int) -> bool:
    steps = node.steps()
    return len(steps) >= 3 and all(r["world"] == world for r in steps[-3:])


def _finish(nodes: list[Node], tmp_path: Path, extra_steps: int = 20) -> int:
    last = max(int(r["step"]) for n in nodes for r in n.steps())
    stop_at = last + extra_steps
    (tmp_path / "stop").write_text(str(stop_at))
    until(lambda: all(n.final() is not None for n in nodes), 60, "every trainer finishes")
    for n in nodes:
        assert n.trainer is not None and n.trainer.wait(20) == 0, n.trainer_log.read_text()[-3000:]
    return stop_at


def _reference(steps: int, first_leader: str) -> list[float]:
    seed = zlib.crc32(first_leader.encode())
    out = subprocess.run(
        [sys.executable, SCRIPT, "--reference", "--steps", str(steps), "--seed", str(seed)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=True,
    )  # fmt: skip
    losses: list[float] = json.loads(out.stdout)
    return losses


def _check_consistent(nodes: list[Node], stop_at: int) -> dict[str, Any]:
    finals = [n.final() for n in nodes]
    assert all(f is not None and f["step"] == stop_at for f in finals), finals
    assert len({f["checksum"] for f in finals if f}) == 1, "parameters/optimizer differ"
    assert all(f["world"] == len(nodes) for f in finals if f)
    losses: dict[int, float] = {}
    leaders = []
    for n in nodes:
        for r in n.steps():
            losses[r["step"]] = r["loss"]
            leaders.append((r["t"], r["leader"]))
    assert sorted(losses) == list(range(stop_at)), "every step ran exactly in order"
    reference = _reference(stop_at, min(leaders)[1])
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(stop_at))
    assert worst < LOSS_RTOL, f"loss curve off the failure-free run by {worst:.2e} (relative)"
    return {"worst_rel_loss_diff": worst}


def _recovery(survivors: list[Node], victim: Node) -> dict[str, float]:
    fault = next(r for r in victim.records() if "fault" in r)
    first = min(r["t"] for n in survivors for r in n.steps() if r["world"] == 3)
    verdicts = [r["verdict_t"] for n in survivors for r in n.steps() if r["world"] == 3]
    verdict = min(v for v in verdicts if v is not None) if any(verdicts) else first
    return {"fault_to_step_s": first - fault["t"], "verdict_to_step_s": first - verdict}


@pytest.mark.parametrize("fault", ["kill-in-backward", "stop-in-backward", "stop"])
def test_node_failure_shrinks_then_a_new_node_regrows(tmp_path: Path, fault: str) -> None:
    nodes = start_nodes(["n0", "n1", "n2", "n3"], tmp_path)
    fault_file = tmp_path / "fault"
    try:
        for n in nodes:
            extra = ["--fault", fault, "--fault-file", str(fault_file)] if n.name == "n3" else []
            n.start_trainer(SCRIPT, *_common(tmp_path), "--min-nodes", "3", *extra)
        survivors, victim = nodes[:3], nodes[3]
        until(lambda: all(_training_at(n, 4) for n in nodes), 120, "4-node group trains")
        fault_file.touch()
        until(lambda: any("fault" in r for r in victim.records()), 20, "the fault happens")
        until(lambda: all(_training_at(n, 3) for n in survivors), 60, "survivors train at 3")
        timing = _recovery(survivors, victim)
        newcomer = Node("n4", tmp_path, nodes[0].port)
        nodes.append(newcomer)
        newcomer.wait_ready()
        newcomer.start_trainer(SCRIPT, *_common(tmp_path))
        final = [*survivors, newcomer]
        until(lambda: all(_training_at(n, 4) for n in final), 90, "regrown to 4")
        stop_at = _finish(final, tmp_path)
        result = _check_consistent(final, stop_at)
        print(json.dumps({"fault": fault, **timing, **result, "steps": stop_at}))
    finally:
        for n in nodes:
            n.stop()


def test_hung_trainer_on_a_live_host_is_excluded_then_rejoins(tmp_path: Path) -> None:
    """SIGSTOP of the trainer alone: SWIM sees a healthy host; the agent's phi over the
    trainer's heartbeats flags it hung and peers drop it. When it wakes up it has an old
    step, finds that its group moved on, and rejoins without overwriting anyone."""
    nodes = start_nodes(["n0", "n1", "n2", "n3"], tmp_path)
    try:
        for n in nodes:
            n.start_trainer(
                SCRIPT, *_common(tmp_path), "--min-nodes", "3", "--heartbeat-pause-ms", "3000"
            )
        until(lambda: all(_training_at(n, 4) for n in nodes), 120, "4-node group trains")
        hung = nodes[3]
        pid = int(hung.steps()[-1]["pid"])  # the trainer itself, not its `timeout` wrapper
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        until(lambda: all(_training_at(n, 3) for n in nodes[:3]), 60, "others train at 3")
        went_on = max(r["step"] for r in nodes[0].steps())
        os.kill(pid, signal.SIGCONT)
        until(lambda: all(_training_at(n, 4) for n in nodes), 90, "the woken trainer rejoins")
        stop_at = _finish(nodes, tmp_path)
        assert stop_at > went_on
        result = _check_consistent(nodes, stop_at)
        print(
            json.dumps(
                {"hung_to_world3_s": _first_at(nodes[:3], 3, stopped_at) - stopped_at, **result}
            )
        )
    finally:
        for n in nodes:
            n.stop()


def _first_at(nodes: list[Node], world: int, after: float) -> float:
    return min(
        float(r["t"]) for n in nodes for r in n.steps() if r["world"] == world and r["t"] > after
    )
