"""The NCCL branch of torchhook.groups, run on CPU with a stand-in backend.

The stand-in is gloo (real sockets, real processes) under another c10d name whose backend
claims ``supports_shrinking`` and implements ``shrink`` by forming a gloo group among the
survivors; it records every shrink. ``ProcessGroups("nccl", ...)`` drives it through the
same lines that drive NCCL on a GPU: the NCCL rules of torchhook.strategy, a device per
local rank, ``shrink_group(..., SHRINK_ABORT)`` from ``distributed_c10d``, abort as the
teardown of a failed group, completion polling, and a fresh HSDP mesh after a shrink.
What it cannot show: NCCL's timing, and what aborting a communicator does to kernels in
flight (gloo cannot abort; docs/training.md says so).

Six workers (3 nodes × 2 local ranks), forked by a fork server that imported this module.
The first group's store lives in a worker of the node that dies, as a formation store
lives with its leader: the shrink must not need it.
"""

from __future__ import annotations

import ast
import importlib
import json
import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torchhook needs torch (install the [torch] extra)")

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

import torchhook.groups
from agent.procs import stop, until
from torchhook.groups import (
    TORCH_NAMES,
    Accelerator,
    MembershipChanged,
    ProcessGroups,
    ShrinkFailed,
)
from torchhook.strategy import Layout, Node, RankInfo, decide

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload([__name__])

NAME = "standin"
PG_TIMEOUT = timedelta(seconds=10)  # a backstop: no step of this test may reach it
NODES = ("n0", "n1", "n2")
RANKS = 2
WAIT_S = 60.0

RECORD: list[dict[str, Any]] = []
"""This worker's stand-in calls (shrink, device, set_device)."""
FAIL_SHRINK_AFTER_S: float | None = None
"""When set: this worker's shrink forms the new group, then fails after this long (the
known NCCL hang, then an error once the parent is aborted)."""
_KEEP: list[Any] = []
"""Every stand-in backend stays alive here: the Python subclass is what c10d hands back
(and a gloo backend with a stuck op would block in its destructor)."""


class StandIn(ProcessGroupGloo):
    """gloo that claims to shrink, as NCCL ≥ 2.27 does."""

    @property
    def supports_shrinking(self) -> bool:
        return True

    def shrink(self, ranks: list[int], flags: int, options: Any) -> StandIn:
        RECORD.append({"call": "shrink", "exclude": list(ranks), "flags": flags})
        survivors = [r for r in range(self.size()) if r not in ranks]
        # the store the default group is registered with now: groups.shrink's fresh one
        store = PrefixStore("standin-shrink", c10d._get_default_store())
        new = _backend(store, survivors.index(self.rank()), len(survivors), PG_TIMEOUT)
        if FAIL_SHRINK_AFTER_S is not None:
            time.sleep(FAIL_SHRINK_AFTER_S)
            raise RuntimeError("stand-in: shrink aborted")
        return new


def _backend(store: Store, rank: int, size: int, timeout: timedelta) -> StandIn:
    backend = StandIn(store, rank, size, timeout)
    _KEEP.append(backend)
    return backend


def _device(local_rank: int) -> torch.device:
    RECORD.append({"call": "device", "local_rank": local_rank})
    return torch.device("cpu")


def _set_device(device: torch.device) -> None:
    RECORD.append({"call": "set_device", "device": str(device)})


STAND_IN = Accelerator(NAME, _device, False, _set_device)


# --- the worker -----------------------------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _layout(names: tuple[str, ...]) -> Layout:
    return Layout(tuple(Node(n, NODES.index(n), RANKS) for n in names))


def _sum(groups: ProcessGroups, value: float, group: Any = None) -> float:
    t = torch.tensor([value])
    groups.wait(dist.all_reduce(t, group=group, async_op=True), lambda: False, lambda: None)
    return float(t.item())


def _check_mesh(groups: ProcessGroups, nodes: int, tag: str) -> Any:
    """A nodes × RANKS mesh; its groups sum over the right ranks."""
    mesh = groups.mesh((nodes, RANKS), (f"replicate{tag}", f"shard{tag}"))
    rank = dist.get_rank()
    replicate, shard = mesh.get_group(0), mesh.get_group(1)
    got = (_sum(groups, rank, replicate), _sum(groups, rank, shard))
    want = (
        float(sum(range(rank % RANKS, nodes * RANKS, RANKS))),
        float(sum(range(rank - rank % RANKS, rank - rank % RANKS + RANKS))),
    )
    assert got == want, (tag, got, want)
    return mesh


def _shrink(
    groups: ProcessGroups, old: Layout, new: Layout, node: str, local: int, store: Store, token: str
) -> int:
    infos = [RankInfo("g", old, 3, True, "g") for _ in range(new.world_size)]
    plan = decide(new, infos, backend="nccl", supports_shrinking=groups.supports_shrinking())
    assert plan.action == "shrink", plan
    rank = new.rank_of(node, local)
    groups.shrink(list(plan.exclude), store, token, rank, timeout_s=1.0)
    return rank


def _work(rank: int, port: int) -> None:
    global FAIL_SHRINK_AFTER_S
    c10d.Backend.register_backend(NAME, _backend, devices=["cpu"])
    hub = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=WAIT_S))
    node, local = NODES[rank // RANKS], rank % RANKS
    groups = ProcessGroups("nccl", local, accelerator=STAND_IN)
    # the first group's store: hosted by n1, the node that dies
    if rank == RANKS:
        first = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        hub.set("first", str(first.port))
    else:
        first = TCPStore("127.0.0.1", int(hub.get("first")), is_master=False)
    groups.init(first, rank, len(NODES) * RANKS, PG_TIMEOUT)
    assert groups.supports_shrinking()
    old_mesh = _check_mesh(groups, 3, "1")
    old_groups = [old_mesh.get_group(d) for d in range(2)]
    _emit(event="formed", rank=rank)
    if node == "n1":
        hub.wait(["never"])  # killed here
    # a collective the dead node never joins, ended by the verdict (here: a store key)
    pending = dist.all_reduce(torch.ones(1), async_op=True)
    try:
        groups.wait(pending, lambda: hub.check(["lost-n1"]), lambda: None)
        raise AssertionError("the collective completed without n1")
    except MembershipChanged:
        pass
    del pending
    _emit(event="interrupted", rank=rank)
    hub.wait(["killed-n1"])  # n1, and the store of the first group, are gone
    old, new = _layout(NODES), _layout(("n0", "n2"))
    started = time.monotonic()
    new_rank = _shrink(groups, old, new, node, local, PrefixStore("f2", hub), "g2")
    shrink_s = time.monotonic() - started
    # shrinking the default group destroyed every other group: the old mesh is dead
    gone = [g not in c10d._world.pg_names for g in old_groups]
    try:
        old_mesh.get_group(0)
        gone.append(False)
    except RuntimeError:  # "Could not resolve the process group registered under ..."
        gone.append(True)
    del old_groups, old_mesh
    assert dist.get_rank() == new_rank and dist.get_world_size() == 4, (rank, new_rank)
    assert c10d.get_process_group_ranks(None) == [0, 1, 2, 3]
    _check_mesh(groups, 2, "2")
    assert _sum(groups, 1.0) == 4.0
    _emit(
        event="shrunk",
        rank=rank,
        new_rank=new_rank,
        old_mesh_gone=gone,
        shrink_s=shrink_s,
        shrinks=groups.shrinks,
    )
    if node == "n2":
        hub.wait(["never"])  # killed here
    # the second loss: the shrink fails on new rank 0 after the others succeeded
    hub.wait(["lost-n2"])
    if new_rank == 0:
        FAIL_SHRINK_AFTER_S = 1.5
    started = time.monotonic()
    try:
        _shrink(groups, new, _layout(("n0",)), node, local, PrefixStore("f3", hub), "g3")
        raise AssertionError("the shrink succeeded on every rank")
    except ShrinkFailed:
        pass
    fallback_s = time.monotonic() - started
    assert not groups.held
    groups.init(PrefixStore("f4", hub), local, RANKS, PG_TIMEOUT)  # the re-form
    assert _sum(groups, 1.0) == 2.0
    _emit(event="reformed", rank=rank, fallback_s=fallback_s, record=RECORD)
    groups.teardown("abort")
    assert not groups.held


def _worker_main(rank: int, port: int, out: str) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 0
    try:
        _work(rank, port)
    except BaseException as exc:
        _emit(event="failed", rank=rank, error=f"{type(exc).__name__}: {exc}"[:2000])
        code = 3
    sys.stdout.flush()
    os._exit(code)  # a gloo group with an abandoned op must not hold up the exit


# --- the test side ----------------------------------------------------------------------


def test_every_torch_name_the_nccl_branch_uses_exists() -> None:
    for dotted in TORCH_NAMES:
        module, _, rest = dotted.partition(".")
        obj: Any = importlib.import_module(module)
        path = module
        for part in rest.split("."):
            try:
                obj = getattr(obj, part)
                path += f".{part}"
            except AttributeError:
                try:
                    obj = importlib.import_module(f"{path}.{part}")
                    path += f".{part}"
                except ImportError:
                    pytest.fail(f"{dotted}: torch {torch.__version__} has no {part!r}")
    source = Path(torchhook.groups.__file__).read_text()
    tree = ast.parse(source)
    used = {
        f"torch.distributed.distributed_c10d.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "c10d"
    }
    assert used <= set(TORCH_NAMES), used - set(TORCH_NAMES)
    # and every torch.distributed name it calls (torch 2.13 has no dist.SHRINK_ABORT)
    missing = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "dist"
        and not hasattr(dist, node.attr)
    }
    assert not missing, missing
    assert "type: ignore" not in source


def test_shrink_in_place_rebuilds_the_mesh_and_a_failed_shrink_reforms(tmp_path: Path) -> None:
    hub = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outs = [tmp_path / f"rank{r}.out" for r in range(len(NODES) * RANKS)]
    procs: list[ForkServerProcess] = []

    def events(kind: str) -> dict[int, dict[str, Any]]:
        found = {}
        for out in outs:
            for line in out.read_text().splitlines():
                with_json = json.loads(line) if line.startswith("{") else {}
                if with_json.get("event") == "failed":
                    raise AssertionError(f"{with_json}\n{out.read_text()[-3000:]}")
                if with_json.get("event") == kind:
                    found[with_json["rank"]] = with_json
        return found

    def kill(ranks: list[int]) -> None:
        stop(*(procs[r].pid or 0 for r in ranks), sig=signal.SIGKILL)

    try:
        for rank, out in enumerate(outs):
            out.write_bytes(b"")
            proc = _FORKS.Process(target=_worker_main, args=(rank, hub.port, str(out)))
            proc.start()
            procs.append(proc)
        until(lambda: len(events("formed")) == 6, WAIT_S, "a 3 x 2 group with its mesh")
        hub.set("lost-n1", "1")  # the verdict first: the interrupted wait is the test's
        until(lambda: len(events("interrupted")) == 4, WAIT_S, "the verdict ends a collective")
        kill([2, 3])
        hub.set("killed-n1", "1")
        until(lambda: len(events("shrunk")) == 4, WAIT_S, "the survivors shrink")
        shrunk = events("shrunk")
        assert {r: e["new_rank"] for r, e in shrunk.items()} == {0: 0, 1: 1, 4: 2, 5: 3}
        assert all(e["old_mesh_gone"] == [True] * 3 for e in shrunk.values()), shrunk
        kill([4, 5])
        hub.set("lost-n2", "1")
        until(lambda: len(events("reformed")) == 2, WAIT_S, "n0 falls back and re-forms")
        reformed = events("reformed")
        for rank, e in reformed.items():
            calls = [c for c in e["record"] if c["call"] == "shrink"]
            assert calls == [
                {"call": "shrink", "exclude": [2, 3], "flags": c10d.SHRINK_ABORT},
                {"call": "shrink", "exclude": [2, 3], "flags": c10d.SHRINK_ABORT},
            ], calls
            assert e["record"][:2] == [
                {"call": "device", "local_rank": rank},
                {"call": "set_device", "device": "cpu"},
            ]
        for proc in procs[:2]:
            proc.join(timeout=10)
            assert proc.exitcode == 0, events("failed")
        print(
            json.dumps(
                {
                    "shrink_s": max(e["shrink_s"] for e in shrunk.values()),
                    "fallback_s": max(e["fallback_s"] for e in reformed.values()),
                }
            )
        )
    finally:
        stop(*(p.pid for p in procs if p.pid is not None and p.is_alive()), sig=signal.SIGKILL)
        for proc in procs:
            proc.join(timeout=10)
