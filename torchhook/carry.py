"""The training state across groups, as the elastic engine carries it: the part of
``torchhook.engine`` that talks to ``torchhook.state``.

After the strategy has set up a new group (model and optimizer), in this order:

1. a new optimizer (HSDP and FSDP build one per group): every registered scheduler is
   rebuilt over it (``TrainingState.rebind``), and schedulers asked for before the first
   optimizer existed (``Elastic.scheduler``) are registered now, before any state moves,
   so every rank of a group holds the same registry when the snapshot arrives;
2. the snapshot (registered objects, RNG): from the plan's source when some rank receives
   or rolls a pending step forward (a rank that rolled forward missed the caller's
   per-step updates), broadcast with waits a verdict can end; or, where the strategy
   resumed from a checkpoint (FSDP), the one saved beside it, on every rank;
3. every data feed (``Elastic.data``, ``torchhook.feed``) is reconfigured to the new rank
   and world size, its sampler's position having just arrived with the snapshot;
4. ``on_reset(old, new)``, from the process's second group on (its first has no old
   world); its errors are fatal (``ResetCallbackError``).

And when a step commits, every feed advances its sampler by the step (:meth:`Carry.committed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

from torchhook.feed import DataFeed
from torchhook.parallel import Group, Parallelism
from torchhook.state import TrainingState, World
from torchhook.state_wire import broadcast_snapshot, decode
from torchhook.strategy import Plan

__all__ = ["Carry"]

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Carry:
    """One trainer's ``TrainingState`` across its groups (the module docstring's order)."""

    def __init__(self, state: TrainingState) -> None:
        self.state = state
        self.pending: dict[str, SchedulerFactory] = {}
        """Schedulers to register over the first optimizer the strategy builds."""
        self._bound: torch.optim.Optimizer | None = None
        self._world: World | None = None
        self.feeds: list[DataFeed] = []

    def data(
        self,
        source: Iterable[Any],
        name: str,
        no_sync: Callable[[], AbstractContextManager[None]],
        *,
        formed: bool,
    ) -> DataFeed:
        """A feed over ``source``, its sampler registered in the state (``torchhook.feed``)."""
        feed = DataFeed.register(
            source, name, self.state, no_sync, formed=formed, count=len(self.feeds)
        )
        self.feeds.append(feed)
        return feed

    def committed(self) -> None:
        """A step committed: every feed advances its sampler by one step."""
        for feed in self.feeds:
            feed.committed()

    def after_setup(
        self, group: Group, plan: Plan, parallelism: Parallelism, nodes: tuple[str, ...], step: int
    ) -> None:
        optimizer = parallelism.optimizer
        if optimizer is not None and optimizer is not self._bound:
            self.state.rebind(optimizer)
            for name, factory in self.pending.items():
                self.state.scheduler(name, factory, optimizer)
            self.pending.clear()
            self._bound = optimizer
        if (plan.receivers or plan.roll_forward) and parallelism.syncs_from_source():
            mine = self.state.capture() if group.rank == plan.source else None
            snapshot = broadcast_snapshot(mine, plan.source, device=group.wire, wait=group.wait)
            if group.rank != plan.source:
                self.state.restore(snapshot)
        elif (saved := parallelism.saved_state()) is not None:
            self.state.restore(decode(saved))
        for feed in self.feeds:
            feed.reconfigure(group.rank, group.world_size)
        old, self._world = self._world, World(group.world_size, group.rank, nodes, step)
        if old is not None:
            self.state.reset(old, self._world)
