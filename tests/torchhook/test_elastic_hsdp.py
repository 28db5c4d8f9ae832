"""In-process elastic HSDP with real agents, real trainer processes and real gloo.

Three nodes with two local ranks each train one model sharded within each node and
replicated across nodes (a 3 × 2 mesh). One node dies as a whole, inside backward. The
survivors go on as a 2 × 2 mesh from memory: no checkpoint exists at all, no step is
rolled back or repeated, and every logged loss equals the unsharded single-process
reference. Every surviving replica ends with the same shards and optimizer state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.procs import until
from agent.training_nodes import reference_losses, start_nodes

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")
pytestmark = pytest.mark.slow
SCRIPT = "examples/elastic_hsdp.py"
SEED = 5
LOSS_RTOL = 1e-4


def test_a_node_dies_and_the_replicas_go_on_from_memory(tmp_path: Path) -> None:
    nodes = start_nodes(["n0", "n1", "n2"], tmp_path, ranks=2)
    fault_file = tmp_path / "fault"
    args = [
        "--job", "h", "--steps", "100000", "--stop-file", str(tmp_path / "stop"),
        "--step-sleep", "0.02", "--min-nodes", "2", "--seed", str(SEED),
    ]  # fmt: skip
    try:
        for n in nodes:
            extra = ["--fault", "kill-in-backward", "--fault-file", str(fault_file)]
            n.start_trainers(SCRIPT, *args, *(extra if n.name == "n2" else []))
        survivors, victim = nodes[:2], nodes[2]
        until(lambda: all(n.training_at(6) for n in nodes), 150, "a 3 x 2 mesh trains")
        fault_file.touch()
        until(lambda: any("fault" in r for r in victim.records()), 20, "the fault happens")
        fault = next(r for r in victim.records() if "fault" in r)
        until(lambda: all(n.training_at(4) for n in survivors), 60, "a 2 x 2 mesh trains")
        stop_at = max(r["step"] for n in survivors for r in n.all_records() if "loss" in r) + 4
        (tmp_path / "stop").write_text(str(stop_at))
        until(lambda: all(None not in n.finals() for n in survivors), 60, "survivors finish")
        for n in survivors:
            assert all(t.wait(20) == 0 for t in n.trainers), n.tail()

        reference = reference_losses(SCRIPT, stop_at, SEED)
        worst = 0.0
        for n in survivors:
            for lr in range(n.ranks):
                steps = n.steps(lr)
                # no rollback, no repeat: every step exactly once, in order, from the first
                # this rank ran (with --min-nodes 2, two nodes may start before the third
                # registers; it then joins the group at the step the group is at)
                began = steps[0]["step"]
                assert began == steps[0]["resumed"], steps[0]
                assert [r["step"] for r in steps] == list(range(began, stop_at)), (n.name, lr)
                after = [r for r in steps if r["world"] == 4 and r["t"] > fault["t"]]
                assert after and {r["restore"] for r in after} == {"memory"}, after[:1]
                assert after[0]["resumed"] == after[0]["step"], "went on at the step it was at"
                before = [r for r in steps if r["world"] == 6 and r["t"] < fault["t"]]
                if before and before[-1]["rank"] == after[0]["rank"]:
                    # kept its place: an equal node mesh, so DTensor's cached sharding
                    # decisions are reused (parallel_hsdp.node_mesh)
                    assert before[-1]["mesh"] == after[0]["mesh"], (before[-1], after[0])
                for r in steps:
                    assert r["counter"] == r["step"] + 1, r  # the job's registered state
                    rel = abs(r["loss"] - reference[r["step"]]) / abs(reference[r["step"]])
                    worst = max(worst, rel)
        assert worst < LOSS_RTOL, f"loss curve off the reference by {worst:.2e} (relative)"
        # every replica of shard j (local rank j on each node) holds the same state
        for lr in range(2):
            finals = [n.finals()[lr] for n in survivors]
            assert len({f["checksum"] for f in finals if f}) == 1, (lr, finals)
        assert not any(tmp_path.rglob("*.distcp")), "nothing was checkpointed"
        first = min(
            r["t"] for n in survivors for r in n.steps() if r["world"] == 4 and r["t"] > fault["t"]
        )
        print(json.dumps({"fault_to_world4_s": first - fault["t"], "worst_rel_loss": worst}))
    finally:
        for n in nodes:
            n.stop()
