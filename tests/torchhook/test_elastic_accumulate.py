"""Gradient accumulation through the engine's strategies, on a real 2-rank gloo group.

Each worker process joins a gloo group (store hosted by the test), sets up a strategy the
way the engine does (``DDP``; ``FSDP`` with a ``parallelize`` of the user's own; ``HSDP``
with tensor parallelism on a node dimension: their ``setup`` on a ``Group``), and computes
the
gradients of its 8 samples of a global batch of 16 twice: once in 4 micro-batches through
``micro_batches`` (the reduction skipped for all but the last), once in one backward. Both
must equal the gradients of the whole batch in one process; and after the first
micro-batch, the ranks' DDP gradients must still differ (the reduction really was skipped).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from datetime import timedelta
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torchhook needs torch (install the [torch] extra)")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from torchhook.groups import ProcessGroups
from torchhook.parallel import DDP, Group, Parallelism, micro_batches
from torchhook.parallel_fsdp import FSDP
from torchhook.parallel_hsdp import HSDP, mesh_dim
from torchhook.strategy import Layout, Node, Plan
from torchhook.verdicts import GroupWatch

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload([__name__])

WORLD = 2
BATCH = 16
MICRO = 4
TIMEOUT_S = 60.0


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 2, generator=g)


def _reference() -> list[list[float]]:
    model = _model()
    x, y = _data()
    torch.autograd.backward(F.mse_loss(model(x), y))
    return [p.grad.reshape(-1).tolist() for p in model.parameters() if p.grad is not None]


def _strategy(kind: str, tmp: str) -> Parallelism:
    if kind == "hsdp-tp":
        node_mesh = (("shard", 1), ("tp", WORLD))
        sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
        return HSDP(_model, sgd, parallelize=_tensor_parallel, node_mesh=node_mesh)
    if kind == "ddp":
        model = _model()
        return DDP(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return FSDP(
        _model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        checkpoint_dir=Path(tmp),
        checkpoint_every=1000,
        parallelize=_parallelize,
    )


def _parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The user's own policy: one unit per Linear, kept unsharded after forward."""
    for sub in model.modules():
        if isinstance(sub, nn.Linear):
            fully_shard(sub, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Tensor parallelism on the node's ``tp`` dimension, FSDP2 on its ``shard`` one."""
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, mesh_dim(mesh, "tp"), plan)
    fully_shard(model, mesh=mesh_dim(mesh, "shard"))
    return model


def _grads(model: nn.Module) -> list[list[float]]:
    out = []
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.full_tensor()
        out.append([] if g is None else g.reshape(-1).tolist())
    return out


def _work(cfg: dict[str, Any]) -> dict[str, Any]:
    rank = cfg["rank"]
    torch.set_num_threads(1)
    client = TCPStore("127.0.0.1", cfg["port"], is_master=False)
    dist.init_process_group(
        "gloo",
        store=PrefixStore("pg", client),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    tp = cfg["kind"] == "hsdp-tp"
    # HSDP with tensor parallelism: one node of two ranks, both fed the whole batch
    layout = Layout((Node("n0", 1, 2),)) if tp else Layout((Node("n0", 1, 1), Node("n1", 2, 1)))
    node, local_rank = ("n0", rank) if tp else (f"n{rank}", 0)
    watch = GroupWatch(node)
    group = Group(
        rank, WORLD, layout, "t0", node, local_rank, torch.device("cpu"),
        ProcessGroups("gloo", local_rank), TIMEOUT_S, lambda work: work.wait(),
        lambda bucket: watch.comm_hook(bucket, WORLD), lambda: b"",
    )  # fmt: skip
    strategy = _strategy(cfg["kind"], cfg["tmp"])
    plan = Plan("reform", (), 0, "fresh", 0, providers=(0, 1) if tp else (), receivers=(1,))
    strategy.setup(group, plan)
    x, y = _data()
    share = BATCH if tp else BATCH // WORLD
    rank = 0 if tp else rank
    mine_x, mine_y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    per = share // MICRO
    after_first: list[list[float]] = []

    def accumulated(model: nn.Module) -> None:
        for i in micro_batches(strategy.no_sync, MICRO):
            out = model(mine_x[i * per : (i + 1) * per])
            loss = F.mse_loss(out, mine_y[i * per : (i + 1) * per], reduction="sum")
            torch.autograd.backward(loss / (share * y.shape[1]))
            if i == 0 and cfg["kind"] == "ddp":
                after_first.extend(_grads(strategy.model or model))

    def whole(model: nn.Module) -> None:
        torch.autograd.backward(F.mse_loss(model(mine_x), mine_y))

    result: dict[str, Any] = {}
    for name, fn in (("accumulated", accumulated), ("whole", whole)):
        assert strategy.model is not None
        if tp:  # HSDP's run would step the optimizer: look at the gradients before
            fn(strategy.model)
        else:
            strategy.run(fn, group, 0)
        result[name] = _grads(strategy.model)
        for p in strategy.model.parameters():
            p.grad = None
    result["after_first"] = after_first
    assert strategy.model is not None
    meshes = {p.device_mesh for p in strategy.model.parameters() if isinstance(p, DTensor)}
    result["meshes"] = sorted(str(m.mesh_dim_names) for m in meshes)
    # what the names must be: each dimension's name, then its group's c10d name
    result["by_groups"] = sorted(
        str(tuple(f"{d.split('-')[0]}-{m.get_group(d).group_name}" for d in m.mesh_dim_names or ()))
        for m in meshes
    )
    return result


def _restore(cfg: dict[str, Any]) -> dict[str, Any]:
    """HSDP over 2 nodes × 1 rank: one step, then node 1's rank loses its state and
    re-forms as a receiver: it must take node 0's parameters and Adam moments (over
    ``torchhook.transfer``) and step identically."""
    rank = cfg["rank"]
    torch.set_num_threads(1)
    client = TCPStore("127.0.0.1", cfg["port"], is_master=False)
    dist.init_process_group(
        "gloo", store=PrefixStore("pg", client), rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    layout = Layout((Node("n0", 1, 1), Node("n1", 2, 1)))

    def group(token: str) -> Group:
        return Group(
            rank, WORLD, layout, token, f"n{rank}", 0, torch.device("cpu"),
            ProcessGroups("gloo", 0), TIMEOUT_S, lambda work: work.wait(),
            lambda bucket: torch.futures.Future(), lambda: b"",
        )  # fmt: skip

    hsdp = HSDP(_model, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    x, y = _data()

    def step(model: nn.Module) -> None:
        torch.autograd.backward(F.mse_loss(model(x), y))

    first = group("t1")
    hsdp.setup(first, Plan("reform", (), 0, "fresh", 0, providers=(0,)))
    hsdp.run(step, first, 0)
    # rank 1 forgets everything it held: its next module is uninitialized memory
    # (built on the meta device) and its optimizer fresh, unless it receives
    hsdp.abandon(failed=rank == 1)
    if rank == 1:
        hsdp._kept = None
    again = group("t2")
    hsdp.setup(again, Plan("reform", (), 1, "memory", 0, providers=(0,), receivers=(1,)))
    hsdp.run(step, again, 1)
    assert hsdp.model is not None and hsdp.optimizer is not None
    out = [_plain(p).reshape(-1).tolist() for p in hsdp.model.parameters()]
    moments = [
        _plain(v).reshape(-1).tolist()
        for st in hsdp.optimizer.state.values()
        for k, v in sorted(st.items())
        if k == "exp_avg"
    ]
    return {"params": out, "moments": moments}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _worker_main(cfg_json: str, out: str) -> None:
    """Writes its result, then leaves with ``os._exit`` at once: no group teardown (the
    test is over, and the process dies with its sockets)."""
    code = 0
    try:
        cfg = json.loads(cfg_json)
        result = _restore(cfg) if cfg["kind"] == "restore" else _work(cfg)
    except Exception as exc:  # reported to the test through the file
        result = {"error": f"{type(exc).__name__}: {exc}"}
        code = 3
    Path(out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(code)


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(
        torch.allclose(torch.tensor(u), torch.tensor(v), rtol=1e-5, atol=1e-7)
        for u, v in zip(a, b, strict=True)
    )


def _run(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs: list[ForkServerProcess] = []
    try:
        for rank in range(WORLD):
            cfg = {"rank": rank, "port": store.port, "kind": kind, "tmp": str(tmp_path)}
            out = tmp_path / f"r{rank}.json"
            proc = _FORKS.Process(target=_worker_main, args=(json.dumps(cfg), str(out)))
            proc.start()
            procs.append(proc)
        for proc in procs:
            proc.join(TIMEOUT_S)
        results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert all("error" not in r for r in results), results
    return results


def test_an_hsdp_receiver_takes_the_shards_and_optimizer_state(tmp_path: Path) -> None:
    results = _run(tmp_path, "restore")
    assert results[0]["moments"], "Adam's moments exist after a step"
    assert results[0] == results[1], "the receiver stepped from the provider's state"


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "hsdp-tp"])
def test_micro_batches_accumulate_to_the_whole_batch(tmp_path: Path, kind: str) -> None:
    results = _run(tmp_path, kind)
    reference = _reference()
    for r in results:
        assert _close(r["whole"], reference), "one backward over the rank's share"
        assert _close(r["accumulated"], reference), "micro-batches accumulate to the same"
    if kind == "hsdp-tp":  # the user's tensor parallelism on the node's dimensions
        # the node's mesh, named by its groups (parallel_hsdp.node_mesh)
        assert results[0]["meshes"] == results[0]["by_groups"], results[0]
        assert results[0]["meshes"][0].startswith("('shard-"), results[0]["meshes"]
        assert "'tp-" in results[0]["meshes"][0], results[0]["meshes"]
    if kind == "ddp":
        # inside no_sync the first micro-batch's gradients stay local: they differ by rank
        assert not _close(results[0]["after_first"], results[1]["after_first"])
