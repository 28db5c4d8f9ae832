"""In-process elastic DDP with real agents, real trainer processes and real gloo.

Three nodes, two local ranks each (world 6: one agent and two trainers per node, in the
node's process group), train together; a node fails (SIGKILL or SIGSTOP of its process
group, inside backward), or one trainer of a live node hangs; the survivors go on at world
size 4 in the same processes; a new node, the stopped node or the hung trainer comes back
and the job grows back to world 6. Checked from every rank's step log: world sizes,
bit-identical parameters and optimizer state on every rank (a checksum printed at the
same step), and the loss curve against a failure-free single-process run of the same
global batches.
"""

from __future__ import annotations

import json
import os
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from agent.procs import until
from agent.training_nodes import TrainingNode, reference_curves, start_nodes

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")
pytestmark = pytest.mark.slow
SCRIPT = "examples/elastic_ddp.py"
RANKS = 2
LOSS_RTOL = 1e-4


def _common(tmp_path: Path) -> list[str]:
    return [
        "--job", "j", "--steps", "100000", "--stop-file", str(tmp_path / "stop"),
        "--step-sleep", "0.02", "--pg-timeout", "60", "--min-nodes", "2",
    ]  # fmt: skip


def _finish(nodes: list[TrainingNode], tmp_path: Path, extra_steps: int = 20) -> int:
    last = max(int(r["step"]) for n in nodes for r in n.all_records() if "loss" in r)
    stop_at = last + extra_steps
    (tmp_path / "stop").write_text(str(stop_at))
    until(lambda: all(None not in n.finals() for n in nodes), 60, "every trainer finishes")
    for n in nodes:
        assert all(t.wait(20) == 0 for t in n.trainers), n.tail()
    return stop_at


def _reference(steps: int, first_loss: float, names: list[str]) -> list[float]:
    """The failure-free curve from the init the job actually started from: the first
    formation's rank 0 (a node's local rank 0) broadcasts its init. Which node that was is
    not in the step log: a formation replaced before its first step (a view that grew an
    older member) hands the same state on under a new leader, so the step-0 loss decides."""

    def seed(node: str) -> int:
        return zlib.crc32(f"{node}/0".encode())  # examples/elastic_ddp.py rank_seed

    curves = reference_curves(SCRIPT, steps, [seed(n) for n in names])
    starts = [n for n, curve in zip(names, curves, strict=True) if _close(curve[0], first_loss)]
    assert len(starts) == 1, f"step 0's loss {first_loss} is not one node's init: {starts}"
    return curves[names.index(starts[0])]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= LOSS_RTOL * abs(b)


def _check_consistent(
    nodes: list[TrainingNode], stop_at: int, world: int, names: list[str]
) -> dict[str, Any]:
    finals = [f for n in nodes for f in n.finals()]
    assert all(f is not None and f["step"] == stop_at for f in finals), finals
    assert len({f["checksum"] for f in finals if f}) == 1, "parameters/optimizer differ"
    assert all(f["world"] == world for f in finals if f)
    losses: dict[int, float] = {}
    for r in (r for n in nodes for r in n.all_records() if "loss" in r):
        assert losses.setdefault(r["step"], r["loss"]) == r["loss"], "ranks disagree on a loss"
        # the job's own registered state came with the model (newcomers took the source's)
        assert r["counter"] == r["step"] + 1, r
    assert sorted(losses) == list(range(stop_at)), "every step ran exactly in order"
    reference = _reference(stop_at, losses[0], names)
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(stop_at))
    assert worst < LOSS_RTOL, f"loss curve off the failure-free run by {worst:.2e} (relative)"
    return {"worst_rel_loss_diff": worst}


def _first_at(nodes: list[TrainingNode], world: int, after: float) -> float:
    return min(
        float(r["t"])
        for n in nodes
        for r in n.all_records()
        if r.get("world") == world and "loss" in r and r["t"] > after
    )


@pytest.mark.parametrize("fault", ["kill-in-backward", "stop-in-backward"])
def test_a_node_fails_its_ranks_leave_together_and_the_job_regrows(
    tmp_path: Path, fault: str
) -> None:
    nodes = start_nodes(["n0", "n1", "n2"], tmp_path, ranks=RANKS)
    fault_file = tmp_path / "fault"
    try:
        for n in nodes:
            extra = ["--fault", fault, "--fault-file", str(fault_file)] if n.name == "n2" else []
            n.start_trainers(SCRIPT, *_common(tmp_path), *extra)
        survivors, victim = nodes[:2], nodes[2]
        until(lambda: all(n.training_at(6) for n in nodes), 150, "3 nodes x 2 ranks train")
        fault_file.touch()
        until(lambda: any("fault" in r for r in victim.records()), 20, "the fault happens")
        fault_t = next(float(r["t"]) for r in victim.records() if "fault" in r)
        until(lambda: all(n.training_at(4) for n in survivors), 60, "survivors train at 4")
        timing = {"fault_to_world4_s": _first_at(survivors, 4, fault_t) - fault_t}
        if fault == "kill-in-backward":
            back = TrainingNode("n3", tmp_path, nodes[0].port, ranks=RANKS)
            nodes.append(back)
            back.wait_ready()
            back.start_trainers(SCRIPT, *_common(tmp_path))
            final = [*survivors, back]
        else:  # the stopped node resumes: its trainers find the group moved on and rejoin
            victim.signal_all(signal.SIGCONT)
            final = nodes
        until(lambda: all(n.training_at(6) for n in final), 120, "regrown to 6")
        stop_at = _finish(final, tmp_path)
        result = _check_consistent(final, stop_at, world=6, names=[n.name for n in nodes])
        print(json.dumps({"fault": fault, **timing, **result, "steps": stop_at}))
    finally:
        for n in nodes:
            n.stop()


def test_one_hung_trainer_takes_its_node_out_then_back(tmp_path: Path) -> None:
    """SIGSTOP of one trainer: SWIM sees a healthy host; the agent's phi over that rank's
    heartbeats flags the node hung and peers drop all of its ranks (its other rank too).
    When the trainer wakes up it has an old step, finds that its group moved on, and the
    node rejoins without overwriting anyone."""
    nodes = start_nodes(["n0", "n1", "n2"], tmp_path, ranks=RANKS)
    try:
        for n in nodes:
            n.start_trainers(SCRIPT, *_common(tmp_path), "--heartbeat-pause-ms", "3000")
        until(lambda: all(n.training_at(6) for n in nodes), 150, "3 nodes x 2 ranks train")
        hung = nodes[2]
        pid = hung.trainer_pid(local_rank=1)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        until(lambda: all(n.training_at(4) for n in nodes[:2]), 60, "others train at 4")
        went_on = max(r["step"] for r in nodes[0].steps())
        os.kill(pid, signal.SIGCONT)
        until(lambda: all(n.training_at(6) for n in nodes), 90, "the node rejoins")
        stop_at = _finish(nodes, tmp_path)
        assert stop_at > went_on
        result = _check_consistent(nodes, stop_at, world=6, names=[n.name for n in nodes])
        hung_to_world4 = _first_at(nodes[:2], 4, stopped_at) - stopped_at
        print(json.dumps({"hung_to_world4_s": hung_to_world4, **result}))
    finally:
        for n in nodes:
            n.stop()


def test_a_bug_in_the_step_function_stops_the_trainer_at_once(tmp_path: Path) -> None:
    """An exception from the step function that is not a group failure is not retried
    (formerly: re-formed for up to 600 s): the trainer stops with ``StepFailed`` naming the
    step and the cause."""
    (node,) = start_nodes(["n0"], tmp_path, ranks=1)
    try:
        node.start_trainers(
            SCRIPT, "--job", "j", "--steps", "100", "--fault", "bug", "--fault-step", "3"
        )
        until(lambda: any("fault" in r for r in node.records()), 60, "the bug fires")
        fired = next(float(r["t"]) for r in node.records() if "fault" in r)
        code = node.trainers[0].wait(30)
        stopped = time.time()
        log = node.tail()
        assert code != 0, log
        assert "StepFailed: step 3 raised ValueError: a planned bug" in log, log
        assert [r["step"] for r in node.steps()] == [0, 1, 2], "no step after the bug"
        print(json.dumps({"bug_to_exit_s": round(stopped - fired, 2)}))
    finally:
        node.stop()
