"""HSDP as a strategy of the elastic engine: shard within a node, replicate across nodes,
lose a node with no rollback.

A node's local ranks hold one full copy of the model between them; every node holds one
such *replica*, so the job's mesh is ``nodes × <node mesh>``. The hook owns only the
dimension that spans nodes (``replicate``); inside a node the user's ``parallelize(model,
mesh)`` does what it likes on the node's mesh: its own ``fully_shard`` calls,
``MixedPrecisionPolicy``, ``reshard_after_forward``, tensor parallelism on a second node
dimension (``HSDP(node_mesh=(("shard", 2), ("tp", 4)))``; :func:`mesh_dim` finds a
dimension by its name). Without one, :func:`torchhook.fsdp.shard` (every Linear,
Embedding and Conv its own FSDP2 unit) is the default. When a node dies only the replicate
dimension shrinks: every surviving node still holds every shard, so the survivors go on
from memory at the step they were at. torchft draws the same line: fault tolerance along
the replicated dimension only.

Every step (``run``):

1. ``fn(model)``: forward and backward; the node's own collectives (FSDP, TP) run inside
   the node, so a dead node never blocks them;
2. the cross-node gradient all-reduce: each rank all-reduces its local gradients with the
   same local rank on every other node (one flat buffer per dtype), interruptibly;
3. the commit vote: an all-reduce over every rank that only completes once every rank
   holds fully reduced gradients (torchft's ``should_commit``); then the optimizer step.
   A rank that reduced but could not commit keeps its gradients as *pending* in that
   group; if another rank did apply the step, the next formation rolls it forward with
   them (``strategy.decide``), so no shard is ever a step behind another.

Reconfiguration (``setup``): FSDP2 and DTensor objects pin the process group they were
built on, so the old module is never reused. On leaving a group a rank keeps its local
shards, buffers and optimizer state as plain tensors; the new group builds a fresh module
on the meta device, parallelizes it on the new mesh, allocates it (``to_empty``) and
copies the kept tensors in: the local shapes do not change, because the node's mesh did
not. Ranks that are behind or new (``plan.receivers``) take local rank j's tensors and
optimizer state from ``plan.providers[j]`` over their replicate group, as flat tensors
(``torchhook.transfer``; no pickle). A shard with no
copy left anywhere raises ``NoSurvivingCopy``; a fresh start (no state anywhere) uses
``build_model`` as is, which must then be the same on every rank (seed it).

Requirements: every node runs the same number of local ranks; ``fn`` does forward and
backward only and returns the loss (this strategy steps and zeroes the optimizer, which it
rebuilds per group: read it from ``Elastic.optimizer``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchhook import transfer
from torchhook.errors import NoSurvivingCopy
from torchhook.fsdp import shard
from torchhook.groups import flatten, unflatten_into
from torchhook.parallel import Group, fsdp_no_sync
from torchhook.strategy import Plan
from torchhook.transfer import load_optimizer, optimizer_state

__all__ = ["HSDP", "mesh_dim"]

log = logging.getLogger("torchhook.elastic")
T = TypeVar("T")
Parallelize = Callable[[nn.Module, DeviceMesh], nn.Module]
REPLICATE = "replicate"


def mesh_dim(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The dimension ``name`` of a mesh the hook built: its dimensions carry a suffix
    (``shard-<suffix>``, :func:`node_mesh` says why)."""
    names = mesh.mesh_dim_names or ()
    found = [n for n in names if n.split("-", 1)[0] == name]
    if len(found) != 1:
        raise KeyError(f"mesh has no dimension {name!r}: {names}")
    return mesh[found[0]]


class _Kept:
    """One rank's state between groups: plain local tensors, no FSDP or DTensor objects
    (those would pin the old group)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, grads: bool) -> None:
        params = list(model.parameters())
        self.params = [_local(p).detach() for p in params]
        self.buffers = [b.detach() for b in model.buffers()]
        self.grads = [_local_or_none(p.grad) for p in params] if grads else None
        self.optimizer = _optimizer_locals(optimizer, params)
        self.groups = _hyperparameters(optimizer)


class HSDP:
    """``build_model()`` (unsharded; called on the meta device except at a fresh start),
    ``build_optimizer(module)``, optional ``parallelize(module, node_mesh)`` and
    ``node_mesh`` (the dimensions inside a node, default one ``shard`` dimension over the
    node's ranks)."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        *,
        parallelize: Parallelize | None = None,
        node_mesh: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        if node_mesh is not None:
            dims = tuple(node_mesh)
            if not dims or any(size < 1 or not name or "-" in name for name, size in dims):
                raise ValueError(f"node_mesh must be (name, size >= 1) pairs, got {dims}")
            if REPLICATE in [name for name, _ in dims]:
                raise ValueError(f"node_mesh: {REPLICATE!r} is the hook's dimension")
        self._build_model = build_model
        self._build_optimizer = build_optimizer
        self._parallelize: Parallelize = parallelize or (lambda m, mesh: shard(m, mesh))
        self._node_mesh = None if node_mesh is None else tuple(node_mesh)
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._replicas: Any = None
        self._node_groups: list[Any] = []  # node dimensions with more than one rank
        """This rank's replicate group: the same local rank on every node."""
        self._nodes = 0
        self._kept: _Kept | None = None
        self._pending_in = ""

    @property
    def model(self) -> nn.Module | None:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def shards(self, local_world_size: int) -> int | None:
        if self._node_mesh is not None:
            product = 1
            for _, size in self._node_mesh:
                product *= size
            if product != local_world_size:
                raise ValueError(
                    f"node_mesh {self._node_mesh} spans {product} ranks, the node has "
                    f"{local_world_size}"
                )
        return local_world_size

    def syncs_from_source(self) -> bool:
        return True

    def pending_in(self) -> str:
        return self._pending_in

    def saved_state(self) -> bytes | None:
        return None

    # --- one step -----------------------------------------------------------------------

    def run(self, fn: Callable[[Any], T], group: Group, step: int) -> T:
        assert self._model is not None and self._optimizer is not None, "run before setup"
        self._node_barrier(group)
        group.mark("barrier")
        result = fn(self._model)
        group.mark("fn")
        self._reduce_across_nodes(group)
        group.mark("reduced")
        self._pending_in = group.token
        vote = torch.ones(1, device=group.device)  # the commit vote
        group.wait(dist.all_reduce(vote, async_op=True))
        group.mark("voted")
        self._optimizer.step()
        self._optimizer.zero_grad()
        self._pending_in = ""
        return result

    def no_sync(self) -> AbstractContextManager[None]:
        # the cross-node reduce runs once per step anyway; inside the node, FSDP2's
        return fsdp_no_sync(self._model)

    def _node_barrier(self, group: Group) -> None:
        """An interruptible all-reduce over each node dimension before the step's FSDP2
        collectives, which no verdict can end. A collective can complete on some ranks
        and not on others when a peer dies inside it (it sent what one rank needed, not
        what another needed): the engine's step-boundary all-reduce may have let this
        rank through while a node peer left the group. Without the barrier this rank would
        then wait in an FSDP2 all-gather for that peer until the group timeout; with it,
        it waits here, where the verdict that made the peer leave ends the wait. The
        barrier cannot complete while a node peer is missing: an all-reduce needs every
        rank's part."""
        for g in self._node_groups:
            group.wait(dist.all_reduce(torch.zeros(1, device=group.device), group=g, async_op=True))

    def _reduce_across_nodes(self, group: Group) -> None:
        assert self._model is not None
        grads = [_local(p.grad) for p in self._model.parameters() if p.grad is not None]
        if not grads or self._nodes <= 1:
            return
        # one flat buffer per dtype: few collectives per step, each a point to cut
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            flat = flatten(same)
            group.wait(dist.all_reduce(flat, group=self._replicas, async_op=True))
            unflatten_into(flat.div_(self._nodes), same)

    # --- leaving and forming groups -----------------------------------------------------

    def abandon(self, failed: bool) -> None:
        # a setup that failed half-way leaves a half-restored module: keep the state we had
        if self._model is not None and self._optimizer is not None and self._kept is None:
            self._kept = _Kept(self._model, self._optimizer, grads=bool(self._pending_in))
        # drop every object that pins the old group (FSDP modules, DTensor state, meshes)
        self._model, self._optimizer, self._replicas = None, None, None
        self._node_groups = []

    def close(self) -> None:
        self._model, self._optimizer, self._replicas = None, None, None
        self._node_groups = []

    def setup(self, group: Group, plan: Plan) -> int:
        if plan.restore == "checkpoint":
            raise NoSurvivingCopy(
                "HSDP: no node holds some shard at the newest step (every node of the last "
                "group is gone); restart from a checkpoint (FSDP reloads one)"
            )
        shards = len(group.layout.ranks_of(group.node))
        self._nodes = len(group.layout.nodes)
        dims = self._node_mesh or (("shard", shards),)
        names = tuple(f"{n}-{group.token}" for n in (REPLICATE, *(d for d, _ in dims)))
        # built afresh per group (a shrink destroys every group but the default one),
        # named by the formation's token (fresh, the same on every rank); the module gets
        # the node's part, named by its groups (node_mesh says why)
        mesh = group.groups.mesh((self._nodes, *(s for _, s in dims)), names)
        group.mark("mesh")
        self._replicas = mesh.get_group(names[0])
        self._node_groups = [
            mesh.get_group(n) for n, (_, size) in zip(names[1:], dims, strict=True) if size > 1
        ]
        fresh = plan.restore == "fresh"
        with contextlib.nullcontext() if fresh else torch.device("meta"):
            module = self._build_model()
        group.mark("built")
        local_mesh = node_mesh(mesh, names[1:], tuple(d for d, _ in dims))
        module = self._parallelize(module.to(group.device) if fresh else module, local_mesh)
        group.mark("sharded")
        if not fresh:
            module.to_empty(device=group.device)
        group.mark("allocated")
        self._model, self._optimizer = module, self._build_optimizer(module)
        group.mark("model")
        if not fresh:
            self._restore(group, plan, shards)
        self._kept = None
        self._pending_in = ""  # rolled forward or superseded by the plan's step
        return plan.step

    def _restore(self, group: Group, plan: Plan, shards: int) -> None:
        assert self._model is not None and self._optimizer is not None
        kept = self._kept if group.rank not in plan.receivers else None
        params = list(self._model.parameters())
        if kept is not None:
            with torch.no_grad():
                for p, saved in zip(params, kept.params, strict=True):
                    _local(p).copy_(saved)
                for b, saved in zip(self._model.buffers(), kept.buffers, strict=True):
                    b.copy_(saved)
            self._load_optimizer(kept.optimizer, kept.groups, group.device)
            if group.rank in plan.roll_forward and kept.grads is not None:
                for p, g in zip(params, kept.grads, strict=True):
                    p.grad = None if g is None else _like(p, g)
                self._optimizer.step()
                self._optimizer.zero_grad()
                log.info("rank %d: applied step %d's pending gradients", group.rank, plan.step)
        # a replicate group where someone is behind or new gets shard j from its provider
        if group.local_rank not in {r % shards for r in plan.receivers}:
            return
        source = plan.providers[group.local_rank]
        with torch.no_grad():
            tensors = [*(_local(p) for p in params), *self._model.buffers()]
            group.broadcast_tensors(tensors, source, group=self._replicas)
        # the optimizer state as flat tensors over the replicate group, never a pickle
        mine = optimizer_state(self._optimizer) if group.rank == source else None
        got = transfer.broadcast(
            mine, source, group=self._replicas, device=group.wire, wait=group.wait
        )
        if group.rank != source:
            load_optimizer(self._optimizer, got)

    def _load_optimizer(
        self, states: list[dict[str, Any]], groups: list[dict[str, Any]], device: torch.device
    ) -> None:
        assert self._model is not None and self._optimizer is not None
        for pg, saved in zip(self._optimizer.param_groups, groups, strict=True):
            pg.update(saved)
        for p, state in zip(self._model.parameters(), states, strict=True):
            # copies: the kept state must stay intact should this setup fail half-way
            copied = {k: _copy(v, device) for k, v in state.items()}
            self._optimizer.state[p] = {
                k: _like(p, v) if _is_shard_state(p, v) else v for k, v in copied.items()
            }


def node_mesh(mesh: DeviceMesh, names: tuple[str, ...], dims: tuple[str, ...]) -> DeviceMesh:
    """The node's part of ``mesh`` (its dimensions ``names``) as a mesh of its own, its
    dimension ``d`` named ``d-<the c10d name of this rank's group along it>``.

    DTensor caches its sharding decisions by mesh *equality* (ranks, shape, dimension
    names; not the groups), and a cached result carries the mesh of the call that filled
    the cache. An equal mesh of an earlier group must therefore mean the same groups:
    a group is looked up by its c10d name whenever it is used, and a process's place in
    its node's mesh is fixed by its local rank, so equal ranks and equal group names make
    the earlier mesh an alias of this one. c10d numbers groups in creation order from 0
    again after each teardown, so a node that keeps its place in the job (every node
    before the one lost) gets equal meshes and reuses the cache: the first step after a
    re-formation skips some 35 sharding propagations of the optimizer step (tens of ms
    of CPU each re-formation; measured in BENCHMARKS.md "Training recovery"). A node
    whose ranks or groups changed gets a new name, so nothing is reused."""
    sub = mesh[names] if len(names) > 1 else mesh[names[0]]
    groups = [mesh.get_group(n) for n in names]
    named = tuple(f"{d}-{g.group_name}" for d, g in zip(dims, groups, strict=True))
    return DeviceMesh.from_group(
        groups if len(groups) > 1 else groups[0], mesh.device_type, sub.mesh, mesh_dim_names=named
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _local(t)


def _optimizer_locals(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[dict[str, Any]]:
    """Per parameter, its optimizer state with every DTensor replaced by its local shard."""
    return [
        {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
        for p in params
    ]


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _is_shard_state(p: torch.Tensor, v: Any) -> bool:
    """Optimizer state shaped like the parameter's shard (Adam's moments), not a scalar."""
    if not isinstance(v, torch.Tensor) or not isinstance(p, DTensor):
        return False
    return v.dim() > 0 and v.shape == p.to_local().shape


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``p``'s kind (a DTensor on p's mesh and placements)."""
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return local


def _copy(v: Any, device: torch.device) -> Any:
    return v.to(device, copy=True) if isinstance(v, torch.Tensor) else v
