"""Pure FSDP2 as a strategy of the elastic engine: rebuild, reshard, roll back to the last
checkpoint.

Pure FSDP keeps one copy of each parameter and optimizer shard, so a dead node takes its
shards with it: the survivors cannot go on from memory. Every new group therefore

1. builds a fresh module (``build_model``), applies the user's ``parallelize(module,
   mesh)`` on a 1-D mesh over the new group (default :func:`torchhook.fsdp.shard`: every
   Linear, Embedding and Conv its own unit) and builds a fresh optimizer;
2. loads the newest complete checkpoint with :meth:`Checkpointer.load_latest`, which
   reshards it to the new world size (DCP saves at world 4 and loads at world 3, losses
   equal the reference; docs/training.md §5);
3. goes on from that checkpoint's step on every rank (rank 0 chooses the checkpoint). The
   steps taken after it are lost: the rollback. Without any checkpoint the group starts
   again from step 0 with ``build_model``'s init, which must be the same on every rank.

Old FSDP objects are never reused (they pin their group), and each group gets a new
:class:`Checkpointer` with its own checkpoint group.

Checkpoints: of every step count that is a multiple of ``checkpoint_every``, started when
the next step begins (so the engine's training state saved beside the shards includes
what the caller updated after the step), inside ``run`` (a failure while saving is handled
like a failure in the step). Saves are asynchronous. A planned switch (a node joins, or
the view changes while every member still answers the step-boundary all-reduce) first
saves the current step synchronously, so a regrow loses nothing. A save or load that
fails because a peer is gone re-forms the group; one that fails otherwise stops the job
(``CheckpointFailed``). The engine's training state (``TrainingState``: the caller's
registered objects and RNG) is saved beside the shards and loaded with them.

Escape: FSDP's all-gathers and reduce-scatters run inside forward and backward, and DCP's
inside a save or load; a verdict cannot end them (gloo cannot abort), so a member blocked
in one leaves by the group timeout: keep ``pg_timeout_s`` short here (15 s in the
example) but above the longest collective of a healthy step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchhook.errors import CheckpointFailed, GroupLost, is_group_failure
from torchhook.fsdp import EXTRA, Checkpointer, shard
from torchhook.parallel import Group, fsdp_no_sync
from torchhook.strategy import Plan

__all__ = ["FSDP"]

log = logging.getLogger("torchhook.elastic")
T = TypeVar("T")
Parallelize = Callable[[nn.Module, DeviceMesh], nn.Module]


class SaveStuck(GroupLost):
    """Waiting for the previous asynchronous save timed out: a peer is likely gone."""


class FSDP:
    """``build_model()`` (the same init on every rank), ``build_optimizer(module)``,
    optional ``parallelize(module, mesh)``; checkpoints every ``checkpoint_every`` steps
    into ``checkpoint_dir`` (shared by all nodes), keeping ``keep`` complete ones.
    ``resumed_step`` and ``last_load_s`` describe the last formation."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        *,
        checkpoint_dir: Path,
        checkpoint_every: int,
        keep: int = 2,
        parallelize: Parallelize | None = None,
    ) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._build_model = build_model
        self._build_optimizer = build_optimizer
        self._parallelize: Parallelize = parallelize or (lambda m, mesh: shard(m, mesh))
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.keep = keep
        self.checkpointer: Checkpointer | None = None
        self.resumed_step: int | None = None
        self.last_load_s = 0.0
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._group: Group | None = None
        self._step = 0
        self._saved_step = -1
        self._saved_state: bytes | None = None

    @property
    def model(self) -> nn.Module | None:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def shards(self, local_world_size: int) -> int | None:
        return None  # no second copy: the plan's state source is unused, the checkpoint wins

    def syncs_from_source(self) -> bool:
        return False

    def pending_in(self) -> str:
        return ""

    def saved_state(self) -> bytes | None:
        return self._saved_state

    def run(self, fn: Callable[[Any], T], group: Group, step: int) -> T:
        assert self._model is not None, "run before setup"
        # a due checkpoint starts before the step, not after the last one: the caller
        # updates its per-step state (scheduler, sampler) after ``run_step`` returns, and
        # the training state saved with the shards must include that
        self._step = step
        if step % self.checkpoint_every == 0 and step > self._saved_step:
            self._save(step)
        result = fn(self._model)
        self._step = step + 1
        return result

    def no_sync(self) -> AbstractContextManager[None]:
        return fsdp_no_sync(self._model)

    def setup(self, group: Group, plan: Plan) -> int:
        self._drop()
        began = time.monotonic()
        self._group = group
        ckpt = Checkpointer(
            self.checkpoint_dir,
            every_steps=1,  # we decide when (every K steps, and at planned switches)
            keep=self.keep,
            timeout_s=group.timeout_s,
            wait=group.wait,
        )
        self.checkpointer = ckpt
        module = self._build_model()
        # named by the formation's token: DTensor caches keyed by an equal mesh of an
        # earlier group of the same size would hand back that group's shards (§5, fact 9)
        mesh = init_device_mesh(
            _device_type(module), (group.world_size,), mesh_dim_names=(f"shard-{group.token}",)
        )
        module = self._parallelize(module, mesh)
        optimizer = self._build_optimizer(module)
        try:
            loaded = ckpt.load_latest(module, optimizer)
        except CheckpointException as exc:
            raise _checkpoint_error("loading the newest checkpoint", exc) from None
        self._model, self._optimizer = module, optimizer
        self._step = self._saved_step = loaded if loaded is not None else 0
        extra = None if ckpt.loaded_path is None else ckpt.loaded_path / EXTRA
        self._saved_state = extra.read_bytes() if extra is not None and extra.exists() else None
        self.resumed_step = loaded
        self.last_load_s = time.monotonic() - began
        log.info(
            "rank %d of %d: resumed at step %d (%s) in %.3f s",
            group.rank,
            group.world_size,
            self._step,
            "checkpoint" if loaded is not None else "no checkpoint: fresh init",
            self.last_load_s,
        )
        return self._step

    def abandon(self, failed: bool) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            if failed:
                # its group may have a save stuck on the dead rank: never destruct it (it
                # would block until the op times out); the engine leaves with os._exit
                self._bury(ckpt)
            else:
                self._save_before_switch(ckpt)
        self._drop()

    def close(self) -> None:
        """Finish the in-flight save (bounded by the checkpoint group's timeout)."""
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None and self._model is not None:
            try:
                ckpt.close()
            except (Exception, CheckpointException) as exc:
                log.warning("last checkpoint not finished: %s", exc)
                del exc
                self._bury(ckpt)
        self._drop()

    def _save(self, step: int) -> None:
        assert self.checkpointer is not None and self._model is not None
        assert self._optimizer is not None
        try:
            extra = self._group.capture_state() if self._group is not None else None
            self.checkpointer.maybe_save(step, self._model, self._optimizer, extra)
        except TimeoutError:
            raise SaveStuck(f"previous checkpoint still running before step {step}") from None
        except CheckpointException as exc:
            raise _checkpoint_error(f"saving step {step}", exc) from None
        self._saved_step = step

    def _save_before_switch(self, ckpt: Checkpointer) -> None:
        """Planned switch: every member answered the step-boundary all-reduce, so save the
        current step (synchronously) and the next group resumes without a rollback."""
        try:
            model, optimizer = self._model, self._optimizer
            if model is not None and optimizer is not None and self._step > self._saved_step:
                began = time.monotonic()
                extra = self._group.capture_state() if self._group is not None else None
                ckpt.maybe_save(self._step, model, optimizer, extra)
                ckpt.wait()
                log.info(
                    "saved step %d before the switch in %.3f s",
                    self._step,
                    time.monotonic() - began,
                )
            ckpt.close()
        except (Exception, CheckpointException) as exc:
            log.warning("no checkpoint before the switch (rollback instead): %s", exc)
            del exc
            self._bury(ckpt)

    def _bury(self, ckpt: Checkpointer) -> None:
        if self._group is not None:
            self._group.groups.graveyard.append(ckpt)

    def _drop(self) -> None:
        # drop our references to the old group's FSDP objects (they pin it)
        self._model, self._optimizer = None, None


def _checkpoint_error(what: str, exc: BaseException) -> Exception:
    """A lost peer (gloo's text inside DCP's per-rank failures) re-forms; anything else is
    a checkpoint that cannot work (a full disk, a foreign directory): fatal."""
    text = str(exc)
    first = text.splitlines()[0] if text else type(exc).__name__
    if is_group_failure(RuntimeError(text)):
        return GroupLost(f"{what} failed, a peer is gone: {first}")
    return CheckpointFailed(f"{what} failed: {first}")


def _device_type(module: nn.Module) -> str:
    first = next(module.parameters(), None)
    return "cpu" if first is None else first.device.type
