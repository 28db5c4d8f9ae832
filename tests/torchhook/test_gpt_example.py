"""The GPT example (examples/gpt/train_elastic.py) with real agents, trainers and gloo.

Three nodes with two local ranks each (one agent and two trainer processes per node, each
trainer with DataLoader worker processes) train the example's GPT with the user's own FSDP2
``parallelize`` under HSDP, to a fixed number of steps. One node is killed as a whole
(SIGKILL of its agent, trainers and loader workers) while the job trains, then started
again under the same name; it rejoins. Checked from every rank's step log: the world went
6 → 4 → 6, every step ran once and in order on the nodes that lived through it (HSDP loses
no step), and the loss at every step equals the failure-free run's.

The failure-free run is examples/gpt/reference.py: one process, the whole global batch per
step, the same samples (the sampler's stream) in the same order. It is equal to the elastic
run by construction up to the order of floating-point sums: the global batch (24) divides
every world size used (6, 4), so each rank's mean loss weighs the same and the mean of the
ranks' gradients is the whole batch's gradient. The sums (FSDP's reduce-scatter inside a
node, the all-reduce across nodes, the batch mean) are taken in another order, so the
losses differ in the last bits of float32; 1e-4 relative bounds that drift over the run
(measured: below 1e-6), while a step taken on other samples, a step taken twice or skipped,
or a learning rate that did not travel moves the loss by more than 1e-3.

While the restarted node boots (importing torch takes seconds on a loaded host), the test
holds the survivors' trainers with SIGSTOP, well below the hang threshold (30 s), so that
the regrow lands before the fixed last step on any machine; they go on at SIGCONT and
switch to world 6 at their next step boundary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.control import ControlClient, ControlError
from agent.procs import until
from agent.training_nodes import ROOT, TrainingNode, start_nodes

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")
pytestmark = pytest.mark.slow
SCRIPT = "examples/gpt/train_elastic.py"
STEPS = 40
KILL_AFTER = 8
"""The node dies once rank 0 has logged this many steps (while the job trains)."""
LOSS_RTOL = 1e-4
JOB = "gpt"


def _args() -> list[str]:
    return ["--job", JOB, "--steps", str(STEPS), "--nodes", "3", "--min-nodes", "2"]


def _last_step(node: TrainingNode) -> int:
    steps = node.steps(0)
    return int(steps[-1]["step"]) if steps else 0


def _job_nodes(node: TrainingNode) -> int:
    """Nodes in the job's view, as ``node``'s agent sees it."""
    try:
        jobs = ControlClient(node.control, timeout_s=2).request("jobs")["jobs"]
    except ControlError:
        return 0
    return next((int(j["nodes"]) for j in jobs if j["job"] == JOB), 0)


def _worlds(records: list[dict[str, Any]]) -> list[int]:
    """World sizes in step order, consecutive repeats folded."""
    out: list[int] = []
    for r in records:
        if not out or out[-1] != r["world"]:
            out.append(r["world"])
    return out


def _alive_in_groups(pgids: set[int]) -> list[int]:
    """Processes (a trainer's loader workers included) still in the nodes' process groups."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_a_node_is_killed_and_regrown_and_the_loss_curve_is_the_failure_free_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # six trainers share a few cores
    reference_run = subprocess.Popen(
        [sys.executable, "examples/gpt/reference.py", "--steps", str(STEPS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    nodes = start_nodes(["n0", "n1", "n2"], tmp_path, ranks=2)
    everyone = list(nodes)
    try:
        for n in nodes:
            n.start_trainers(SCRIPT, *_args(), timeout_s=150)
        n0, n1, n2 = nodes
        until(lambda: _last_step(n0) >= KILL_AFTER, 120, "3 nodes x 2 ranks train")
        n2.signal_all(signal.SIGKILL)  # the whole node: agent, trainers, loader workers
        killed_t = time.time()
        survivors = [n0, n1]
        until(lambda: all(n.training_at(4, 2) for n in survivors), 60, "2 nodes x 2 ranks train")
        held = [n.trainer_pid(lr) for n in survivors for lr in range(n.ranks)]
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            (tmp_path / "again").mkdir()
            back = TrainingNode("n2", tmp_path / "again", n0.port, ranks=2)
            everyone.append(back)
            back.wait_ready()
            back.start_trainers(SCRIPT, *_args(), timeout_s=150)
            until(lambda: _job_nodes(n0) == 3, 60, "the restarted n2 registered in the job")
        finally:
            for pid in held:
                os.kill(pid, signal.SIGCONT)
        final = [*survivors, back]
        until(lambda: all(n.trainers_done() for n in final), 60, "every trainer finishes")
        for n in final:
            assert all(t.returncode == 0 for t in n.trainers), n.tail()
        reference = json.loads(reference_run.communicate(timeout=60)[0])

        # every rank that lived through the run logged every step once, in order
        lived = [n.steps(lr) for n in survivors for lr in range(n.ranks)]
        for steps in lived:
            assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
            assert _worlds(steps) == [6, 4, 6], _worlds(steps)
        # the restarted node joined at a step boundary and ran the rest at world 6
        for lr in range(back.ranks):
            joined = back.steps(lr)
            assert joined and {r["world"] for r in joined} == {6}
            assert [r["step"] for r in joined] == list(range(joined[0]["step"], STEPS + 1))
        # every rank of a step reports the same loss, and it is the failure-free one
        losses: dict[int, float] = {}
        records = [r for n in [*nodes, back] for r in n.all_records() if "loss" in r]
        for r in records:
            assert losses.setdefault(r["step"], r["loss"]) == r["loss"], r
        worst = max(abs(losses[s] - reference[s - 1]) / reference[s - 1] for s in losses)
        assert worst < LOSS_RTOL, f"loss off the failure-free run by {worst:.2e} (relative)"
        first4 = min(r["t"] for r in records if r["world"] == 4)
        print(json.dumps({"kill_to_world4_s": round(first4 - killed_t, 3), "worst_rel": worst}))
    finally:
        reference_run.kill()
        reference_run.wait()
        pgids = {n.pgid for n in everyone}
        for n in everyone:
            n.stop()
        # the trainers' loader workers went with their node's process group
        until(lambda: not _alive_in_groups(pgids), 10, "no process left in the nodes' groups")
