"""Fail-slow detection with real agents, real trainer processes and real gloo.

Three nodes of one rank train with a stand-in compute of 10 ms slept inside each step
(examples/job.py ``--step-work``). First nobody is slow: no window flags anyone. Then
node n2 sleeps three times as long (``--slow-file``): above the quick factor, so within
one full window every rank flags it, the agents hear it (``jobs``: ``slow_flags``), and with
``slow_policy="exclude"`` n2 leaves (its trainer stops with ``SlowNodeExcluded``) while
n0 and n1 re-form without it and train on at world 2.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from agent.control import ControlClient
from agent.procs import until
from agent.training_nodes import TrainingNode, start_nodes

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")
pytestmark = pytest.mark.slow
SCRIPT = "examples/elastic_ddp.py"
WINDOW_STEPS = 5
WINDOWS = 3
"""Three slow windows for the two-window rule (at least 15 steps), so a flag within one
full window (at most 11) can only be the quick flag's."""
CLEAN_STEPS = 30
"""Steps at world 3 with nobody slow (6 windows) that must flag nobody."""
EXCLUDED_EXIT = 3  # examples/job.py


def _slow_job(nodes: list[TrainingNode]) -> dict[str, Any]:
    jobs = ControlClient(nodes[0].control, timeout_s=5).request("jobs")["jobs"]
    return next(j for j in jobs if j["job"] == "j")


def test_a_slow_node_is_flagged_then_excluded_and_none_is_flagged_before(
    tmp_path: Path,
) -> None:
    nodes = start_nodes(["n0", "n1", "n2"], tmp_path)
    slow_file = tmp_path / "slow"
    try:
        for n in nodes:
            extra = ["--slow-file", str(slow_file), "--slow-times", "3"] if n.name == "n2" else []
            n.start_trainers(
                SCRIPT,
                *("--job", "j", "--steps", "100000", "--stop-file", str(tmp_path / "stop")),
                *("--step-work", "0.01", "--min-nodes", "2", "--slow-policy", "exclude"),
                *("--slow-window-steps", str(WINDOW_STEPS), "--slow-windows", str(WINDOWS)),
                *extra,
            )
        first = [0]

        def clean_run() -> bool:
            at3 = [r for r in nodes[0].steps() if r["world"] == 3]
            first[0] = at3[0]["step"] if at3 else 0
            return len(at3) >= CLEAN_STEPS

        until(clean_run, 150, f"{CLEAN_STEPS} steps at world 3")
        clean = [r for n in nodes for r in n.steps() if r["world"] == 3]
        assert all(r["slow"] == [] for r in clean), [r for r in clean if r["slow"]][:3]
        assert _slow_job(nodes)["slow_flags"] == 0

        slow_file.touch()
        slowed_t = time.time()
        until(lambda: nodes[2].trainers[0].poll() is not None, 60, "n2 leaves")
        assert nodes[2].trainers[0].returncode == EXCLUDED_EXIT, nodes[2].tail()
        excluded = next(r for r in nodes[2].records() if "excluded" in r)
        assert "node n2 was flagged slow" in excluded["excluded"], excluded
        slowed_from = min(r["step"] for r in nodes[0].steps() if r["t"] > slowed_t)
        within = excluded["step"] - slowed_from
        # 3x is above the quick factor (2): the window the slowdown starts in may or may
        # not count, then one full window flags it (not WINDOWS of them)
        assert within <= 2 * WINDOW_STEPS + 1, within

        until(lambda: all(n.training_at(2) for n in nodes[:2]), 60, "n0, n1 train at 2")
        job = _slow_job(nodes)
        assert job["slow_flags"] == 1, job  # heard from n0's own trainer
        flagged = [r for n in nodes[:2] for r in n.steps() if r["slow"]]
        assert {tuple(r["slow"]) for r in flagged} == {("n2",)}
        stop_at = max(r["step"] for r in nodes[0].steps()) + 5
        (tmp_path / "stop").write_text(str(stop_at))
        for n in nodes[:2]:
            assert n.trainers[0].wait(60) == 0, n.tail()
        finals = [f for n in nodes[:2] for f in n.finals()]
        assert len({f["checksum"] for f in finals if f}) == 1, "parameters/optimizer differ"
        print(json.dumps({"flagged_within_steps": within, "clean_steps": len(clean) // 3}))
    finally:
        for n in nodes:
            n.stop()
