"""``swimctl demo --torch --nodes 3 --ranks-per-node 2`` end to end: 3 agents + 6 trainers,
one node (agent + both its ranks) killed, the job goes on at world size 4 with identical
state on every surviving rank, and every process it started is gone afterwards.

One demo run only (the suite's time budget is tight); the refusals of bad shapes exit
before any process starts, so they are cheap to check too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.torch_demo import global_batch
from agent.training_nodes import ROOT

pytest.importorskip("torch", reason="the torch demo needs torch (pip install '.[torch]')")


def _processes_mentioning(needle: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def _demo(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "demo", "--torch", *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow
def test_torch_demo_3_nodes_x_2_ranks_survives_a_node_kill() -> None:
    # 3 agents + 6 trainers on a 2-core machine: generous, but bounded
    out = _demo("--nodes", "3", "--ranks-per-node", "2", timeout_s=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "3 nodes x 2 ranks = 6 trainers" in out.stdout, text
    assert "SIGKILL node2" in out.stdout, text
    before, after = out.stdout.split("SIGKILL node2", 1)
    row = re.compile(r"^\s+(\d+)\s+(\d+)\s+[0-9.]+$", re.MULTILINE)
    # the trainers may first train at world 4 (min 2 nodes) until the third node joins
    before_worlds = [int(w) for _, w in row.findall(before)]
    after_worlds = [int(w) for _, w in row.findall(after)]
    assert before_worlds and before_worlds[-1] == 6, text
    assert after_worlds and set(after_worlds) == {4}, text
    assert re.search(r"kill -> first step at world 4: [0-9.]+ s", out.stdout), text
    assert re.search(
        r"all 4 surviving ranks stopped at step \d+ with identical\s+"
        r"parameters and optimizer state \(checksum [0-9a-f]+\)",
        out.stdout,
    ), text
    assert _processes_mentioning("swim-torch-demo-") == []


@pytest.mark.parametrize(
    "args", [("--nodes", "1"), ("--ranks-per-node", "0"), ("--ranks-per-node", "9")]
)
def test_torch_demo_refuses_shapes_it_cannot_run(args: tuple[str, ...]) -> None:
    out = _demo(*args, timeout_s=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Error: --" in out.stderr
    assert "starting" not in out.stdout  # refused before any process started


def test_global_batch_divides_every_world_of_the_run() -> None:
    for nodes in range(2, 9):
        for ranks in range(1, 9):
            batch = global_batch(nodes, ranks)
            assert batch >= 12
            assert batch % (nodes * ranks) == 0 and batch % ((nodes - 1) * ranks) == 0
    assert global_batch(4, 1) == 12 and global_batch(3, 2) == 12  # the default batch
