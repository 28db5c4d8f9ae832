"""In-process elastic HSDP: shard within a node, replicate across nodes, lose a node with no
rollback.

A node's local ranks hold one full copy of the model between them (FSDP2 over a mesh of
the node's ranks: rank j holds shard j); every node holds one such *replica*, so the
job's mesh is ``nodes × ranks`` (replicate × shard). When a node dies, only the replicate
dimension shrinks: every surviving node still holds every shard, so the survivors go on
from memory at the step they were at, with no checkpoint read and no step rolled back.
Pure FSDP (``ElasticFSDP``, one shard group over all ranks) has no second copy of a
shard and must reload a checkpoint. torchft draws the same line: fault tolerance along
the replicated dimension only.

Every step (``run_step``):

1. the step-boundary control all-reduce (as in ``ElasticDDP``);
2. ``fn(model)``: forward and backward. FSDP's own collectives run inside the node (all-
   gather, reduce-scatter over the node's ranks), so a dead node never blocks them;
3. the cross-node gradient all-reduce: each rank all-reduces its gradient shard with the
   same shard on every other node (one flat buffer per step), interruptibly, like all of
   our collectives: a verdict ends it at once;
4. the commit vote: an all-reduce over every rank that only completes once every rank
   holds fully reduced gradients (torchft's ``should_commit``); then the optimizer step.
   A rank that reduced but could not commit keeps its gradients as *pending* in that
   group; if another rank did apply the step, the next formation rolls it forward with
   them (``strategy.decide``), so no shard is ever a step behind another.

Reconfiguration (``_setup_model``): FSDP2 and DTensor objects pin the process group they
were built on, so the old module is never reused. On leaving a group, a rank keeps its
local shards, buffers and optimizer state (plain tensors); the new group builds a fresh
module on the meta device, shards it on the new mesh, allocates it (``to_empty``) and
copies the kept shards in: the shard shapes do not change, because the shard group (the
node) did not. Ranks that are behind or new (``plan.receivers``) get shard j, its buffers
and optimizer state from ``plan.providers[j]`` over their replicate group. Step, RNG and
the caller's extra state come from ``plan.source``. A shard with no copy left anywhere
(``plan.restore == "checkpoint"``, which node-granular exclusion only allows when every
node of the last group is gone) raises; a fresh start (no state anywhere) uses
``build_model`` as is, which must then be the same on every rank (seed it).

Requirements: every node runs the same number of local ranks (the mesh is a matrix);
``fn`` does forward and backward only and returns the loss (this class steps and zeroes
the optimizer, :attr:`optimizer` is rebuilt per group); the data position comes from
:attr:`step`. Gradient accumulation across ``run_step`` calls is not supported.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchhook.elastic import ElasticDDP
from torchhook.fsdp import shard
from torchhook.groups import flatten, unflatten_into
from torchhook.strategy import Layout, Plan, RankInfo, decide

__all__ = ["ElasticHSDP"]

log = logging.getLogger("torchhook.elastic_hsdp")
T = TypeVar("T")


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


class ElasticHSDP(ElasticDDP):
    """Owns the process groups, the HSDP-sharded model, its optimizer and the step.

    Usage (one process per local rank, the same number on every node)::

        el = ElasticHSDP(build_model, build_optimizer, job="train")
        while el.step < total_steps:
            lo, hi = el.shard(global_batch)
            loss = el.run_step(lambda model: forward_backward(model, batch(el.step)[lo:hi]))
        el.exit(0)
    """

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        *,
        job: str,
        control: str | Path | None = None,
        min_nodes: int = 1,
        quorum: str = "majority",
        pg_timeout_s: float = 60.0,
        formation_timeout_s: float = 30.0,
        join_timeout_s: float = 600.0,
        heartbeat_pause_ms: int = 30_000,
        store_host: str = "0.0.0.0",
        local_rank: int | None = None,
        local_world_size: int | None = None,
        backend: str | None = None,
    ) -> None:
        # placeholders until the first group: the real module only exists sharded
        self._no_model = nn.Module()
        self._no_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        super().__init__(
            self._no_model,
            self._no_optimizer,
            job=job,
            control=control,
            min_nodes=min_nodes,
            quorum=quorum,
            pg_timeout_s=pg_timeout_s,
            formation_timeout_s=formation_timeout_s,
            join_timeout_s=join_timeout_s,
            heartbeat_pause_ms=heartbeat_pause_ms,
            store_host=store_host,
            local_rank=local_rank,
            local_world_size=local_world_size,
            backend=backend,
        )
        self._build_model = build_model
        self._build_optimizer = build_optimizer
        self._kept: _Kept | None = None
        self._replicas: Any = None
        """This rank's replicate group: the same local rank on every node."""
        self._pending_in = ""

    # --- the training-loop API --------------------------------------------------------

    def run_step(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn`` (forward and backward) on the sharded model, reduce gradients across
        nodes, commit and step the optimizer. A membership change re-forms the group and
        runs the step again in the new group, from memory (no rollback)."""

        def step(model: Any) -> T:
            result = fn(model)
            self._reduce_across_nodes()
            self._pending_in = self.group_token
            self._commit()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self._pending_in = ""
            return result

        return super().run_step(step)

    def _reduce_across_nodes(self) -> None:
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        if not grads or self.layout is None or len(self.layout.nodes) == 1:
            return
        # one flat buffer: one collective per step, one point where it can be cut
        flat = flatten(grads)
        self._wait(dist.all_reduce(flat, group=self._replicas, async_op=True))
        unflatten_into(flat.div_(len(self.layout.nodes)), grads)

    def _commit(self) -> None:
        vote = torch.ones(1, device=self.device)
        self._wait(dist.all_reduce(vote, async_op=True))

    # --- hooks into ElasticDDP ----------------------------------------------------------

    def _rank_info(self) -> RankInfo:
        base = super()._rank_info()
        return RankInfo(
            base.group, base.layout, base.step, base.has_state, base.applied_in, self._pending_in
        )

    def _decide(self, layout: Layout, infos: list[RankInfo]) -> Plan:
        # decide() refuses a layout whose nodes do not all have this many ranks
        return decide(
            layout,
            infos,
            backend=self.groups.backend,
            supports_shrinking=self.groups.supports_shrinking(),
            shards=self.membership.local_world_size,
        )

    def _on_abandon(self, failed: bool) -> None:
        # a setup that failed half-way leaves a half-restored module: keep the state we had
        if self.model is not self._no_model and self._kept is None:
            self._kept = _Kept(self.model, self.optimizer, grads=bool(self._pending_in))
        # drop every object that pins the old group (FSDP modules, DTensor state, meshes)
        self.model, self.optimizer, self._replicas = self._no_model, self._no_optimizer, None

    def _setup_model(self, plan: Plan) -> Any:
        if plan.restore == "checkpoint":
            raise RuntimeError(
                "HSDP: no surviving copy of some shard at the newest step; "
                "restart from a checkpoint (ElasticFSDP reloads one)"
            )
        assert self.layout is not None
        shards = len(self.layout.ranks_of(self.node))
        mesh = self._fresh_mesh(shards)
        self._replicas = mesh.get_group(0)
        fresh = plan.restore == "fresh"
        with contextlib.nullcontext() if fresh else torch.device("meta"):
            module = self._build_model()
        module = shard(module.to(self.device) if fresh else module, mesh[mesh.mesh_dim_names[1]])  # type: ignore[index]
        if not fresh:
            module.to_empty(device=self.device)
        optimizer = self._build_optimizer(module)
        self.model, self.optimizer = module, optimizer
        if not fresh:
            self._restore(plan, shards)
        self.step = plan.step
        if plan.receivers:
            self._sync_rng(plan.source)
        self._kept = None
        self._pending_in = ""  # rolled forward or superseded by the plan's step
        return module

    def _restore(self, plan: Plan, shards: int) -> None:
        kept = self._kept if self.rank not in plan.receivers else None
        params = list(self.model.parameters())
        if kept is not None:
            with torch.no_grad():
                for p, saved in zip(params, kept.params, strict=True):
                    _local(p).copy_(saved)
                for b, saved in zip(self.model.buffers(), kept.buffers, strict=True):
                    b.copy_(saved)
            self._load_optimizer(kept.optimizer, kept.groups)
            if self.rank in plan.roll_forward and kept.grads is not None:
                for p, g in zip(params, kept.grads, strict=True):
                    p.grad = None if g is None else _like(p, g)
                self.optimizer.step()
                self.optimizer.zero_grad()
                log.info("rank %d: applied step %d's pending gradients", self.rank, self.step)
        # a replicate group where someone is behind or new gets shard j from its provider
        receiving = {r % shards for r in plan.receivers}
        j = self.local_rank
        if j not in receiving:
            return
        source = plan.providers[j]
        with torch.no_grad():
            for t in [*(_local(p) for p in params), *self.model.buffers()]:
                self._wait(dist.broadcast(t, source, group=self._replicas, async_op=True))
        payload: list[Any] = [None]
        if self.rank == source:
            states = _optimizer_locals(self.optimizer, params)
            cpu = [{k: _copy(v, torch.device("cpu")) for k, v in st.items()} for st in states]
            payload[0] = (cpu, _hyperparameters(self.optimizer))
        device = self.device if self.device.type == "cuda" else None
        dist.broadcast_object_list(payload, src=source, group=self._replicas, device=device)
        if self.rank != source:
            states, groups = payload[0]
            self._load_optimizer(states, groups)

    def _load_optimizer(self, states: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(saved)
        for p, state in zip(self.model.parameters(), states, strict=True):
            # copies: the kept state must stay intact should this setup fail half-way
            copied = {k: _copy(v, self.device) for k, v in state.items()}
            self.optimizer.state[p] = {
                k: _like(p, v) if _is_shard_state(p, v) else v for k, v in copied.items()
            }

    def _sync_rng(self, source: int) -> None:
        payload: list[Any] = [torch.get_rng_state() if self.rank == source else None]
        device = self.device if self.device.type == "cuda" else None
        dist.broadcast_object_list(payload, src=source, device=device)
        torch.set_rng_state(payload[0])

    def _fresh_mesh(self, shards: int) -> DeviceMesh:
        """A ``nodes × ranks`` mesh over the new group, named uniquely (the same name on
        every rank): DeviceMesh equality ignores the rank, so DTensor's caches, keyed by an
        equal mesh of an earlier group, would hand back that group's results."""
        value = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], device=self.device)
        dist.broadcast(value, src=0)
        name = f"{int(value.item()):016x}"
        assert self.layout is not None
        # built afresh per group: a shrink destroys every group but the default one
        return self.groups.mesh(
            (len(self.layout.nodes), shards), (f"replicate{name}", f"shard{name}")
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
