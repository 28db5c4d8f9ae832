"""In-process elastic FSDP2 on gloo: shrink/regrow by rebuilding, resharding and rolling back.

:class:`ElasticFSDP` is :class:`torchhook.elastic.ElasticDDP` (same formation protocol,
verdicts, quorum, graveyard) with a different model setup. Pure FSDP keeps one copy of each
parameter and optimizer shard, so a dead node takes its shards with it: the survivors
cannot go on from memory. Every new group therefore

1. builds a **fresh** module (``build_model``), shards it with :func:`torchhook.fsdp.shard`
   on a mesh over the new group, builds a **fresh** optimizer (``build_optimizer``);
2. loads the newest complete checkpoint with :meth:`Checkpointer.load_latest`, which
   reshards it to the new world size (DCP saves at world 4 and loads at world 3, losses
   equal the reference; docs/training.md §5);
3. sets ``step`` to that checkpoint's step on every rank (rank 0 chooses the checkpoint and
   broadcasts it, so all ranks agree). The steps taken after it are lost: the rollback.
   Without any checkpoint the group starts again from step 0 with ``build_model``'s init.

Old FSDP objects are never reused: FSDP2/DTensor objects keep the group they were built on
alive (docs/training.md §5), so the old module and optimizer are dropped on teardown and a new
:class:`Checkpointer` (with its own checkpoint group) is made per group.

Checkpoints: after every successful step whose count is a multiple of
``checkpoint_every``, inside :meth:`run_step` (so a failure while saving is handled like a
failure in the step). Saves are asynchronous. A *planned* switch (a node joins, or the
view changes while every member still answers the step-boundary all-reduce) first saves
the current step synchronously, so a regrow loses nothing; a failure rolls back to the
last complete checkpoint.

Escape from a dead peer: FSDP's all-gathers and reduce-scatters run inside forward and
backward and cannot be failed by the verdict the way a DDP comm hook can (gloo cannot abort), and
the socket cascade does not reach non-neighbour ranks because the FSDP objects pin the
dead group: escape must come from the verdict or a short PG timeout.
So a member blocked inside an FSDP collective leaves only by the PG timeout, which is why
``pg_timeout_s`` defaults to 15 s here (60 s for DDP). A death at a step boundary (in the
control all-reduce or our own ``all_reduce``) is escaped by the verdict as with DDP. Keep
``pg_timeout_s`` above the longest single collective of a healthy step (gloo timeouts are
per operation); it also bounds the checkpoint group and each wait for a save.

Requirements on the caller:

- ``build_model`` must return the same initial parameters on every rank (seed it): FSDP
  does not broadcast parameters, each rank keeps its slice of its own init.
- The step function gets the sharded module; it must take the optimizer from
  :attr:`optimizer` (rebuilt per group) and the data position from :attr:`step` (rolled
  back per group), both read inside the function, because a failed step is re-run in the
  new group.
- RNG state and other per-process state are not checkpointed or synced.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchhook.elastic import ElasticDDP
from torchhook.fsdp import Checkpointer, shard
from torchhook.strategy import Plan

__all__ = ["ElasticFSDP"]

log = logging.getLogger("torchhook.elastic_fsdp")
T = TypeVar("T")


class _SaveStuck(RuntimeError):
    """Waiting for the previous asynchronous save timed out: a peer is likely gone."""


class ElasticFSDP(ElasticDDP):
    """Owns the process group, the sharded model, its optimizer, checkpoints and the step.

    Usage::

        el = ElasticFSDP(build_model, build_optimizer, checkpoint_dir=shared_dir,
                         checkpoint_every=50, job="train")
        while el.step < total_steps:
            loss = el.run_step(lambda model: train_step(model, el.optimizer, el.step))
        el.exit(0)

    Attributes set per group: :attr:`model` (the sharded module, also what the step
    function gets), :attr:`optimizer`, :attr:`step`, :attr:`resumed_step` (the checkpoint
    step loaded at the last formation, None if none), :attr:`last_load_s`.
    """

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        *,
        checkpoint_dir: Path,
        checkpoint_every: int,
        keep: int = 2,
        job: str,
        control: str | Path | None = None,
        min_nodes: int = 1,
        quorum: str = "majority",
        pg_timeout_s: float = 15.0,
        formation_timeout_s: float = 30.0,
        join_timeout_s: float = 600.0,
        heartbeat_pause_ms: int = 30_000,
        store_host: str = "0.0.0.0",
        local_rank: int | None = None,
        local_world_size: int | None = None,
        backend: str | None = None,
    ) -> None:
        if checkpoint_every < 1 or keep < 1:
            raise ValueError("checkpoint_every and keep must be >= 1")
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
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.keep = keep
        self.checkpointer: Checkpointer | None = None
        self.resumed_step: int | None = None
        self.last_load_s = 0.0
        self._saved_step = -1

    # --- the training-loop API --------------------------------------------------------

    def run_step(self, fn: Callable[[Any], T]) -> T:
        """Run one step on the sharded model, then start a checkpoint if one is due.

        As with DDP, a membership change re-forms the group and runs the step again in the
        new group, but after a rollback: :attr:`step` is then the checkpoint's step."""

        def step_then_save(model: Any) -> T:
            result = fn(model)
            if (self.step + 1) % self.checkpoint_every == 0:
                self._save(self.step + 1)
            return result

        return super().run_step(step_then_save)

    def exit(self, code: int = 0) -> None:
        """Finish the in-flight save (bounded by ``pg_timeout_s``), then leave."""
        if self.checkpointer is not None and self.ddp is not None:
            try:
                self.checkpointer.close()
            except (Exception, CheckpointException) as exc:
                log.warning("last checkpoint not finished: %s", exc)
                del exc
                self.groups.graveyard.append(self.checkpointer)
        self.checkpointer = None
        super().exit(code)

    # --- hooks into ElasticDDP ----------------------------------------------------------

    def _setup_model(self, plan: Plan) -> Any:
        self._drop_model()
        began = time.monotonic()
        ckpt = Checkpointer(
            self.checkpoint_dir,
            every_steps=1,  # we decide when (every K steps, and at planned switches)
            keep=self.keep,
            timeout_s=self.pg_timeout.total_seconds(),
        )
        self.checkpointer = ckpt
        module = self._build_model()
        module = shard(module, self._fresh_mesh(_device_type(module)))
        optimizer = self._build_optimizer(module)
        try:
            loaded = ckpt.load_latest(module, optimizer)
        except CheckpointException as exc:
            # BaseException in DCP: make it a RuntimeError, which formation retries
            raise RuntimeError(f"loading the checkpoint failed: {exc}") from None
        self.model, self.optimizer = module, optimizer
        self.step = loaded if loaded is not None else 0
        self.resumed_step = loaded
        self._saved_step = self.step
        self.last_load_s = time.monotonic() - began
        log.info(
            "rank %d of %d: resumed at step %d (%s) in %.3f s",
            self.rank,
            self.world_size,
            self.step,
            "checkpoint" if loaded is not None else "no checkpoint: fresh init",
            self.last_load_s,
        )
        return module

    def _group_failed(self, exc: BaseException) -> bool:
        return isinstance(exc, _SaveStuck) or super()._group_failed(exc)

    def _on_abandon(self, failed: bool) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            if failed:
                # its group may have a save stuck on the dead rank: never destruct it
                # (it would block until the op times out); exit() leaves with os._exit
                self.groups.graveyard.append(ckpt)
            else:
                self._save_before_switch(ckpt)
        self._drop_model()

    # --- checkpoints ------------------------------------------------------------------

    def _save(self, step: int) -> None:
        assert self.checkpointer is not None
        try:
            self.checkpointer.maybe_save(step, self.model, self.optimizer)
        except TimeoutError:
            raise _SaveStuck(f"previous checkpoint still running before step {step}") from None
        except CheckpointException as exc:
            # the text tells a dead peer (gloo error, handled) from anything else (raised)
            raise RuntimeError(f"checkpoint of step {step} failed: {exc}") from None
        self._saved_step = step

    def _save_before_switch(self, ckpt: Checkpointer) -> None:
        """Planned switch: every member answered the step-boundary all-reduce, so save the
        current step (synchronously) and the next group resumes without a rollback."""
        try:
            if self.ddp is not None and self.step > self._saved_step:
                began = time.monotonic()
                ckpt.maybe_save(self.step, self.model, self.optimizer)
                ckpt.wait()
                log.info(
                    "saved step %d before the switch in %.3f s", self.step, time.monotonic() - began
                )
            ckpt.close()
        except (Exception, CheckpointException) as exc:
            log.warning("no checkpoint before the switch (rollback instead): %s", exc)
            del exc
            self.groups.graveyard.append(ckpt)

    def _fresh_mesh(self, device_type: str) -> DeviceMesh:
        """A 1-D mesh over the new group, named uniquely (the same name on every rank).

        DeviceMesh equality ignores the rank, so DTensor's caches, keyed by an equal mesh
        of an earlier group of the same size, hand back that group's rank-dependent
        results. Seen here: 3 -> 4 -> 3 members with new ranks loaded the wrong shards
        (losses off the reference) and DCP's next save plan missed a shard. A name of
        its own makes every group's mesh unequal to all earlier ones."""
        value = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0])
        dist.broadcast(value, src=0)
        name = f"elastic{int(value.item()):016x}"
        return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=(name,))

    def _drop_model(self) -> None:
        # drop our references to the old group's FSDP objects (they pin it)
        self.model, self.optimizer = self._no_model, self._no_optimizer


def _device_type(module: nn.Module) -> str:
    first = next(module.parameters(), None)
    return "cpu" if first is None else first.device.type
