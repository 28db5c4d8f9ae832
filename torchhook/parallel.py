"""The parallelism plugged into the elastic engine: what a strategy owns, and plain DDP.

The engine (``torchhook.engine.Elastic``) owns the loop: membership, formation, verdicts,
the step-boundary control all-reduce, step/RNG/extra-state sync and the bounded
re-formation. A *strategy* owns only what differs between DDP, HSDP and FSDP:

- building the model and optimizer on a new group (``setup``), from the state it kept,
  from a provider rank, or from a checkpoint, and the step the group continues from;
- what it keeps when a group is left (``abandon``): nothing that pins the old group;
- how one step reduces (``run``: DDP's comm hook, HSDP's cross-node all-reduce and commit
  vote, FSDP's checkpoint after the step) and how gradient accumulation skips it
  (``no_sync``: DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``);
- ``shards``: what ``torchhook.strategy.decide`` needs to know (None: full state on every
  rank; R: rank j of every node holds shard j of R).

A strategy talks to the group only through ``Group``: its rank and layout, and waits that
a verdict can end (``wait``, ``broadcast_tensors``, and ``torchhook.transfer`` for
optimizer state, as flat tensors), so every
collective it issues is interruptible unless docs/training.md ("Collectives a verdict
cannot end") lists it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchhook import transfer
from torchhook.groups import ProcessGroups, flatten, unflatten_into
from torchhook.strategy import Layout, Plan

__all__ = ["DDP", "Group", "Parallelism", "micro_batches"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Group:
    """One formed group as a strategy sees it."""

    rank: int
    world_size: int
    layout: Layout
    token: str
    """Fresh per formation and the same on every rank: a unique name for its meshes."""
    node: str
    local_rank: int
    device: torch.device
    groups: ProcessGroups
    timeout_s: float
    """The group timeout (``pg_timeout_s``): the backstop of what a verdict cannot end."""
    wait: Callable[[Any], None]
    """Wait for a ``Work`` in short slices; raises ``MembershipChanged`` on a verdict."""
    comm_hook: Callable[[Any], torch.futures.Future[torch.Tensor]]
    """DDP's gradient all-reduce (mean) behind a Future a verdict can fail."""
    capture_state: Callable[[], bytes]
    """The engine's training state now, encoded (``state_wire``): what a checkpoint keeps."""
    mark: Callable[[str], None] = lambda name: None
    """Marks a phase of a re-formation (``torchhook.timeline``); a no-op between them."""

    def broadcast_tensors(
        self, tensors: list[torch.Tensor], source: int, group: Any = None
    ) -> None:
        """Broadcast ``tensors`` in place from global rank ``source``: one collective per
        dtype, all in flight at once, each wait interruptible."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        flats = [(flatten(ts), ts) for ts in by_dtype.values()]
        works = [dist.broadcast(flat, source, group=group, async_op=True) for flat, _ in flats]
        for work in works:
            self.wait(work)
        if self.rank != source:
            for flat, ts in flats:
                unflatten_into(flat, ts)

    @property
    def wire(self) -> torch.device | None:
        """Where state travels: this rank's GPU for NCCL, else the CPU (None)."""
        return self.device if self.device.type == "cuda" else None


class Parallelism(Protocol):
    """What the engine asks of a strategy (the module docstring says who owns what)."""

    @property
    def model(self) -> nn.Module | None:
        """The local module (sharded for HSDP/FSDP); None while no group holds one."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    def shards(self, local_world_size: int) -> int | None: ...

    def syncs_from_source(self) -> bool:
        """Whether receivers take step, RNG and extra state from ``plan.source`` (False:
        the strategy restores them itself, FSDP from its checkpoint)."""

    def pending_in(self) -> str:
        """HSDP: the group whose reduced gradients this rank holds unapplied, else ""."""

    def saved_state(self) -> bytes | None:
        """The training state saved with what ``setup`` resumed from (FSDP: the
        checkpoint's), to load on every rank; None: nothing to load."""

    def setup(self, group: Group, plan: Plan) -> int:
        """Build model and optimizer on ``group`` following ``plan``; the step to go on from."""

    def run(self, fn: Callable[[Any], T], group: Group, step: int) -> T:
        """One step: ``fn`` on what the user's step function gets, then what the strategy
        adds (reduce, commit, optimizer step, checkpoint)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward inside skips the gradient reduction (accumulate a micro-batch)."""

    def abandon(self, failed: bool) -> None:
        """Leave the group: keep the state, drop every object that uses the group.
        ``failed=False``: a planned switch, every rank is at the same step boundary."""

    def close(self) -> None:
        """The process is leaving (finish what is in flight, bounded)."""


class DDP:
    """Data parallel: every rank holds the whole model and optimizer (the user's objects,
    kept across groups, so an LR scheduler bound to the optimizer stays valid). Receivers
    take parameters, buffers and optimizer state from ``plan.source``; the wrapper is
    rebuilt per group with a comm hook a verdict can fail. The step function gets the
    ``DistributedDataParallel`` wrapper; it steps the optimizer itself, after its last
    collective (``Elastic.run_step`` says why)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model = model
        self._optimizer = optimizer
        self._wrapper: DistributedDataParallel | None = None

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def shards(self, local_world_size: int) -> int | None:
        return None

    def syncs_from_source(self) -> bool:
        return True

    def pending_in(self) -> str:
        return ""

    def saved_state(self) -> bytes | None:
        return None

    def setup(self, group: Group, plan: Plan) -> int:
        self._model.to(group.device)  # keeps the Parameter objects the optimizer holds
        for p in self._model.parameters():
            p.grad = None
        if plan.receivers:
            # the source is not always rank 0 (the newest step wins), so we broadcast
            # ourselves, interruptibly, instead of DDP's init sync from rank 0
            tensors = [*self._model.parameters(), *self._model.buffers()]
            group.broadcast_tensors([t.data for t in tensors], plan.source)
            # the optimizer state as flat tensors (torchhook.transfer), never a pickle
            mine = self._optimizer.state_dict() if group.rank == plan.source else None
            state = transfer.broadcast(mine, plan.source, device=group.wire, wait=group.wait)
            if group.rank != plan.source:
                self._optimizer.load_state_dict(state)
        device_ids = [group.device] if group.device.type == "cuda" else None
        wrapper = DistributedDataParallel(self._model, device_ids=device_ids, init_sync=False)
        # a lambda: DDP inspects annotations, which __future__ annotations turn into strings
        wrapper.register_comm_hook(None, lambda _, bucket: group.comm_hook(bucket))
        self._wrapper = wrapper
        return plan.step

    def run(self, fn: Callable[[Any], T], group: Group, step: int) -> T:
        assert self._wrapper is not None, "run before setup"
        result = fn(self._wrapper)
        group.mark("fn")
        return result

    def no_sync(self) -> AbstractContextManager[None]:
        if self._wrapper is None:
            return contextlib.nullcontext()
        return self._wrapper.no_sync()

    def abandon(self, failed: bool) -> None:
        self._wrapper = None  # its reducer pins the group

    def close(self) -> None:
        self._wrapper = None


@contextlib.contextmanager
def fsdp_no_sync(module: nn.Module | None) -> Iterator[None]:
    """FSDP2: no reduce-scatter in backward while inside (gradients accumulate unsharded)."""
    setter = getattr(module, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


def micro_batches(no_sync: Callable[[], AbstractContextManager[None]], n: int) -> Iterator[int]:
    """``0..n-1``; the backward of every micro-batch but the last runs inside
    ``no_sync()`` (a strategy's ``Parallelism.no_sync``), so gradients are reduced once,
    after the last."""
    if n < 1:
        raise ValueError(f"micro_batches needs n >= 1, got {n}")
    for i in range(n):
        with no_sync() if i < n - 1 else contextlib.nullcontext():
            yield i
