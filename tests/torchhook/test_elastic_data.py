"""Every sample of an epoch exactly once, across real node losses: ``Elastic.data`` with a
``DataLoader`` (two worker processes per trainer), real agents, trainers and gloo.

examples/elastic_data.py logs, per committed step, the sample indices each rank consumed
(read back from the loader's batches, which its workers built) and, per micro-batch taken,
an ``attempt`` record. "Exactly once" is counted over committed steps: the steps whose
updates the final model holds. With DDP no committed step is ever lost, so every step is
committed once, and the concatenation of the committed steps' indices (ranks in order)
is the job's sample stream: each epoch a permutation of the dataset, no gap, no repeat. A
step cut short by a node loss (an attempt of a group that never committed it) is taken
again, whole, in the next group, at its split.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from agent.procs import stop, until
from agent.training_nodes import ROOT, TrainingNode, start_nodes

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")

from torchhook.batching import FixedGlobalBatch
from torchhook.data import ElasticSampler

pytestmark = pytest.mark.slow
SCRIPT = "examples/elastic_data.py"
RANKS = 1
"""One rank per node: the GPT example test covers several ranks per node with a regrow."""
SAMPLES = 100  # not a multiple of the global batch: steps cross epoch boundaries
GLOBAL_BATCH = 24
MAX_MICRO_BATCH = 2
SEED = 3
LOSS_RTOL = 1e-4
REFERENCE_STEPS = 400
"""More steps than the run takes (about 110 here; the test asserts it stays below)."""


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--job", "j", "--steps", "100000", "--stop-file", str(tmp_path / "stop"),
        "--step-sleep", "0.02", "--pg-timeout", "60", "--min-nodes", "2",
        "--samples", str(SAMPLES), "--global-batch", str(GLOBAL_BATCH),
        "--max-micro-batch", str(MAX_MICRO_BATCH), "--seed", str(SEED), *extra,
    ]  # fmt: skip


def _stream(steps: int) -> list[int]:
    sampler = ElasticSampler(SAMPLES, FixedGlobalBatch(GLOBAL_BATCH), seed=SEED)
    return sampler.indices(0, steps * GLOBAL_BATCH)


def _start_reference(steps: int) -> subprocess.Popen[str]:
    """The failure-free curve, computed while the job runs (one process, the same stream)."""
    args = _args(Path("."))[4:]  # without --job and --steps
    return subprocess.Popen(
        [sys.executable, SCRIPT, "--reference", "--steps", str(steps), *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _reference(proc: subprocess.Popen[str], steps: int) -> list[float]:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    losses: list[float] = json.loads(out)
    assert len(losses) >= steps, f"the reference ran {len(losses)} steps, the job {steps}"
    return losses


def _kill(node: TrainingNode, fault_file: Path, world: int, others: list[TrainingNode]) -> None:
    fault_file.touch()
    until(lambda: any("fault" in r for r in node.records()), 20, f"{node.name} is killed")
    until(lambda: all(n.training_at(world) for n in others), 60, f"survivors train at {world}")


def _recovery(victim: TrainingNode, records: list[dict[str, Any]]) -> float:
    """From the planned SIGKILL to the survivors' first committed step after it (a new
    loader iterator, its workers started, is part of that step)."""
    fault = next(float(r["t"]) for r in victim.records() if "fault" in r)
    return round(min(float(r["t"]) for r in records if "loss" in r and r["t"] > fault) - fault, 3)


def _finish(nodes: list[TrainingNode], tmp_path: Path) -> int:
    last = max(int(r["step"]) for n in nodes for r in n.all_records() if "loss" in r)
    stop_at = last + 10
    (tmp_path / "stop").write_text(str(stop_at))
    until(lambda: all(None not in n.finals() for n in nodes), 60, "every trainer finishes")
    for n in nodes:
        assert all(t.wait(20) == 0 for t in n.trainers), n.tail()
    return stop_at


def _check_exactly_once(
    records: list[dict[str, Any]], stop_at: int, *, rollback: bool = False
) -> dict[str, Any]:
    """Every commit of a step (by one group) holds that step's slice of the stream, split
    over the group's ranks in order; the final history (each step's last commit) covers
    steps ``0..stop_at-1`` and so every full epoch once. Without ``rollback`` (DDP, HSDP)
    each step is committed by one group only; with it (FSDP) the steps after the
    checkpoint are committed again by the next group, with the same samples."""
    commits: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if "loss" in r:
            commits[(r["step"], r["token"])].append(r)
            assert r["counter"] == r["step"] + 1, r  # the job's own state travelled too
    stream = _stream(stop_at)
    final: dict[int, tuple[float, list[int], int]] = {}
    for (step, _), ranks in commits.items():
        ranks.sort(key=lambda r: r["rank"])
        world = ranks[0]["world"]
        # by every rank of one group, each rank once, in micro-batches of the bound
        assert [r["rank"] for r in ranks] == list(range(world)), (step, ranks)
        share = GLOBAL_BATCH // world
        assert all(r["micro_batches"] == -(-share // MAX_MICRO_BATCH) for r in ranks)
        assert all(len(r["indices"]) == share for r in ranks)
        indices = [i for r in ranks for i in r["indices"]]
        assert indices == stream[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH], step
        t = max(float(r["t"]) for r in ranks)
        if step not in final or final[step][0] < t:
            final[step] = (t, indices, world)
    assert sorted(final) == list(range(stop_at)), "every step committed, in order"
    again = sorted({s for s, _ in commits if sum(1 for k in commits if k[0] == s) > 1})
    assert rollback or not again, f"steps committed twice without a rollback: {again}"
    consumed = [i for s in range(stop_at) for i in final[s][1]]
    epochs = len(consumed) // SAMPLES
    for e in range(epochs):  # each index of each full epoch exactly once
        assert sorted(consumed[e * SAMPLES : (e + 1) * SAMPLES]) == list(range(SAMPLES)), e
    tail = consumed[epochs * SAMPLES :]
    assert len(set(tail)) == len(tail), "a repeat in the last, partial epoch"
    worlds: list[int] = []
    for s in range(stop_at):
        if not worlds or worlds[-1] != final[s][2]:
            worlds.append(final[s][2])
    # steps cut short: attempts of a group that never committed that step, taken again
    # whole by a later group (its commit holds the step's whole slice, checked above)
    cut: dict[tuple[int, str], set[int]] = defaultdict(set)
    for r in records:
        if "attempt" in r and (r["attempt"], r["token"]) not in commits:
            cut[(r["attempt"], r["token"])].update(r["indices"])
    for (step, _), taken in cut.items():
        assert taken <= set(final[step][1]), f"step {step} was not taken again whole"
    return {
        "worlds": worlds,
        "epochs": epochs,
        "cut_short": sorted(s for s, _ in cut),
        "committed_again": again,
    }


def test_ddp_two_node_losses_and_a_regrow_consume_each_sample_once(tmp_path: Path) -> None:
    """3 nodes x 1 rank, a DataLoader with 2 workers per rank: n2 is killed (SIGKILL of the
    node, inside the backward of a step's first micro-batch), n3 joins, n1 is killed:
    world sizes 3, 2, 3, 2, with 4 and 6 micro-batches per rank and step."""
    began = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - began, 1)

    nodes = start_nodes(["n0", "n1", "n2"], tmp_path, ranks=RANKS)
    n0, n1, n2 = nodes
    faults = {n.name: tmp_path / f"fault-{n.name}" for n in (n1, n2)}
    reference_run: subprocess.Popen[str] | None = None
    try:
        for n in nodes:
            extra = []
            if n.name in faults:
                extra = ["--fault", "kill-in-backward", "--fault-file", str(faults[n.name])]
            n.start_trainers(SCRIPT, *_args(tmp_path, *extra))
        until(lambda: all(n.training_at(3) for n in nodes), 150, "3 nodes train")
        phase("world6")
        reference_run = _start_reference(REFERENCE_STEPS)
        _kill(n2, faults["n2"], 2, [n0, n1])
        phase("world4")
        n3 = TrainingNode("n3", tmp_path, n0.port, ranks=RANKS)
        nodes.append(n3)
        n3.wait_ready()
        n3.start_trainers(SCRIPT, *_args(tmp_path))
        until(lambda: all(n.training_at(3) for n in (n0, n1, n3)), 120, "regrown to 3")
        phase("regrown")
        _kill(n1, faults["n1"], 2, [n0, n3])
        phase("world4_again")
        stop_at = _finish([n0, n3], tmp_path)
        phase("finished")
        records = [r for n in nodes for r in n.all_records()]
        result = _check_exactly_once(records, stop_at)
        # the job may start small while the nodes' trainers come up
        assert result["worlds"][-4:] == [3, 2, 3, 2], result
        assert len(result["cut_short"]) >= 2, "each node loss cut a step short"
        losses = {r["step"]: r["loss"] for r in records if "loss" in r}
        reference = _reference(reference_run, stop_at)
        worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(stop_at))
        assert worst < LOSS_RTOL, f"loss curve off the failure-free run by {worst:.2e}"
        phase("checked")
        recovery = {f"{v.name}_fault_to_next_step_s": _recovery(v, records) for v in (n2, n1)}
        print(json.dumps({**result, "steps": stop_at, "worst_rel_loss_diff": worst, **phases}))
        print(json.dumps(recovery))
    finally:
        for n in nodes:
            n.stop()
        if reference_run is not None:
            stop(reference_run, sig=signal.SIGKILL)


HSDP_SKIP = (
    "25-60 s of suite time; HSDP takes the sampler's position from the plan's source as DDP "
    "does (tested above); passes when run (drop this mark)"
)


@pytest.mark.parametrize(
    "strategy", ["fsdp", pytest.param("hsdp", marks=pytest.mark.skip(reason=HSDP_SKIP))]
)
def test_a_sharded_model_loses_a_node_and_each_sample_stays_once(
    tmp_path: Path, strategy: str
) -> None:
    """HSDP, 3 nodes x 2 ranks: n2 is killed inside a step; the replicas go on from memory
    with the sampler's position they hold (no step committed twice). FSDP2, 3 nodes x 1
    rank, a checkpoint every 4 steps: n2 is killed between checkpoints; the survivors
    reload the newest checkpoint, the sampler's position with it, and take the
    rolled-back steps again with the same samples (at the new split). Either way every
    index of every epoch is consumed once in the final history."""
    ranks = 2 if strategy == "hsdp" else 1
    nodes = start_nodes(["n0", "n1", "n2"], tmp_path, ranks=ranks)
    n0, n1, n2 = nodes
    fault = tmp_path / "fault"
    reference_run: subprocess.Popen[str] | None = None
    options = ["--strategy", strategy]
    if strategy == "fsdp":
        options += [
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4",
            "--pg-timeout", "15",
        ]  # fmt: skip
    try:
        for n in nodes:
            extra = ["--fault", "kill-in-backward", "--fault-file", str(fault)] if n is n2 else []
            n.start_trainers(SCRIPT, *_args(tmp_path, *options, *extra))
        until(lambda: all(n.training_at(3 * ranks) for n in nodes), 150, "3 nodes train")
        reference_run = _start_reference(REFERENCE_STEPS)
        _kill(n2, fault, 2 * ranks, [n0, n1])
        stop_at = _finish([n0, n1], tmp_path)
        records = [r for n in nodes for r in n.all_records()]
        result = _check_exactly_once(records, stop_at, rollback=strategy == "fsdp")
        assert result["worlds"][-2:] == [3 * ranks, 2 * ranks], result
        if strategy == "fsdp":
            assert result["committed_again"], "the steps after the checkpoint ran again"
        assert result["cut_short"], "the node loss cut a step short"
        final: dict[int, tuple[float, float]] = {}
        for r in (r for r in records if "loss" in r):
            if r["step"] not in final or final[r["step"]][0] < r["t"]:
                final[r["step"]] = (r["t"], r["loss"])
        reference = _reference(reference_run, stop_at)
        worst = max(abs(final[s][1] - reference[s]) / abs(reference[s]) for s in range(stop_at))
        assert worst < LOSS_RTOL, f"loss curve off the failure-free run by {worst:.2e}"
        print(json.dumps({**result, "steps": stop_at, "worst_rel_loss_diff": worst}))
    finally:
        for n in nodes:
            n.stop()
        if reference_run is not None:
            stop(reference_run, sig=signal.SIGKILL)
