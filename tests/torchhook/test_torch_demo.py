"""``swimctl demo --torch`` end to end: 4 agents + 4 trainers, one node killed, the job goes
on at world size 3, and every process it started is gone afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.training_nodes import ROOT

pytest.importorskip("torch", reason="the torch demo needs torch (pip install '.[torch]')")
pytestmark = pytest.mark.slow


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


def test_torch_demo_survives_a_node_kill() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "demo", "--torch"],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SIGKILL node3" in out.stdout
    before, after = out.stdout.split("SIGKILL node3", 1)
    row = re.compile(r"^\s+(\d+)\s+(\d)\s+[0-9.]+$", re.MULTILINE)
    # the trainers may first train at world 3 (min 3 nodes) until the fourth joins
    before_worlds = [int(w) for _, w in row.findall(before)]
    after_worlds = [int(w) for _, w in row.findall(after)]
    assert before_worlds and before_worlds[-1] == 4, out.stdout
    assert after_worlds and set(after_worlds) == {3}, out.stdout
    assert re.search(r"kill -> first step at world 3: [0-9.]+ s", out.stdout), out.stdout
    assert _processes_mentioning("swim-torch-demo-") == []
