"""FSDP2 sharding and resharding checkpoints for the elastic hook.

When a node of a pure-FSDP job dies its parameter shard is gone, so the survivors cannot
carry on from memory: they form a new, smaller process group (``torchhook.engine`` does
that), build a fresh module, shard it (the user's ``parallelize``, :func:`shard` by default)
and call :meth:`Checkpointer.load_latest`,
which reloads the newest complete checkpoint resharded to the new world size, and train on
from that step. The steps taken since that checkpoint are lost (rollback).

Measured on torch 2.13.0+cpu, gloo, 2 cores (docs/training.md §5 has these facts with
their sources):

- ``fully_shard`` per Linear and on the root works on a CPU mesh with
  gloo; DCP saves at world 4 and loads at world 3 (shards 16×4 → 22/22/20) and the losses
  after resume equal an unsharded single-process reference.
- FSDP2/DTensor objects keep references to the process group they were built on after
  ``del model``, so the old group's sockets stay open. Never reuse a sharded module or its
  optimizer across groups: rebuild both, then load.
- Destroying a group with a stuck op blocks until that op times out,
  and the group timeout is the backstop. Every wait here is bounded by ``timeout_s`` and
  the checkpoint group is created with that timeout.
- For FSDP2 the order is fresh module → ``init_device_mesh`` →
  ``fully_shard`` → load the last checkpoint.

Rules of this module:

- Everything is collective: every rank of the current default group calls :func:`shard`,
  :meth:`Checkpointer.maybe_save` (with the same ``step``) and
  :meth:`Checkpointer.load_latest` in the same order.
- ``step`` means "optimizer steps completed"; ``load_latest`` returns it, and training
  resumes with step index ``step`` (0-based) of the deterministic data order.
- Saving is asynchronous: ``torch.distributed.checkpoint.async_save`` (thread executor)
  works on CPU/gloo in 2.13 — verified by ``tests/torchhook/test_fsdp.py``, no fallback
  was needed. It copies the state to fresh CPU tensors before returning (so training can
  mutate parameters right away) and writes from a background thread. The thread's
  collectives run on a separate gloo group made by the checkpointer, never on the default
  group: two threads issuing collectives on one group could interleave them in a
  different order on different ranks.
- A checkpoint is visible only when complete on every rank. DCP's save ends with a gather
  of every rank's write results to rank 0, which then writes ``.metadata``; only after
  that does rank 0 write the ``COMPLETE`` marker (temp file + ``os.replace``), and loads
  consider only marked directories. A save that a dead rank never finished is never
  marked and is ignored. ``latest`` in the directory names the newest marked checkpoint
  for people and scripts; ``load_latest`` scans the markers and does not trust it.
- At most one save is in flight; the next one first waits for it (bounded).
- Each checkpoint directory carries a nonce chosen by rank 0, so a save of the same step in
  a later group never writes into the directory of an earlier, abandoned attempt.
- When the default group has been replaced (shrink), the checkpointer drops its old
  checkpoint group and any in-flight save without waiting: that save may be stuck on the
  dead rank. Its thread ends when the old group's timeout (``timeout_s``) fires, and the
  interpreter's exit waits for it; leave with ``os._exit`` if that is too long.

HSDP
----
With HSDP every node holds a full copy of the model, sharded over its own ranks
(replicate across nodes × shard within a node). When a node dies only the replicate
dimension shrinks: the survivors still hold every shard in memory and go on from the
current step, with no rollback and no checkpoint read (torchft's fault tolerance covers
the replicated dimension only, for the same reason). ``torchhook.parallel_hsdp`` does
that, with the user's ``parallelize`` (default :func:`shard`) on the node's part of a
``nodes × ranks`` mesh. Pure FSDP (a 1-D
mesh over all ranks) has no second copy of a shard, so losing any rank loses part of the
model and optimizer state, and recovery must roll back to the last checkpoint with
:meth:`Checkpointer.load_latest` (``torchhook.parallel_fsdp``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

__all__ = ["CheckpointInfo", "Checkpointer", "complete_checkpoints", "is_linear_ish", "shard"]

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
EXTRA = "state.bin"
"""Beside the shards: the caller's extra bytes of that step (the engine's training state)."""
LATEST = "latest"
_PREFIX = "step-"
# Modules that own the bulk of a model's parameters; each becomes one FSDP unit so that
# only one of them is unsharded (all-gathered) at a time.
_LEAF_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
)


def is_linear_ish(module: nn.Module) -> bool:
    """Default sharding policy: Linear, Embedding and Conv layers."""
    return isinstance(module, _LEAF_TYPES)


def shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    policy: Callable[[nn.Module], bool] = is_linear_ish,
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to every submodule ``policy`` selects, then to the root.

    ``mesh`` defaults to a 1-D mesh over the current default group, on the device type of
    the module's parameters ("cpu" for the gloo tests). Pass a 2-D mesh for HSDP (see the
    module docstring). Collective: every rank calls it on an identically built module.
    """
    if mesh is None:
        mesh = init_device_mesh(_device_type(module), (dist.get_world_size(),))
    # fully_shard must see children before their parents; reversed pre-order does that.
    for sub in reversed(list(module.modules())[1:]):
        if policy(sub):
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _device_type(module: nn.Module) -> str:
    first = next(module.parameters(), None)
    return "cpu" if first is None else first.device.type


@dataclass(frozen=True, order=True)
class CheckpointInfo:
    """A complete checkpoint: what its ``COMPLETE`` marker says. Orders by step, then time."""

    step: int
    saved_at: float
    path: Path
    world_size: int


def complete_checkpoints(directory: Path) -> list[CheckpointInfo]:
    """Marked checkpoints under ``directory``, oldest first. Unmarked ones are not listed."""
    found: list[CheckpointInfo] = []
    if not directory.is_dir():
        return found
    for path in directory.glob(_PREFIX + "*"):
        info = _read_marker(path)
        if info is not None:
            found.append(info)
    return sorted(found)


def _read_marker(path: Path) -> CheckpointInfo | None:
    try:
        raw = json.loads((path / MARKER).read_text())
        return CheckpointInfo(int(raw["step"]), float(raw["saved_at"]), path, int(raw["world"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no marker, or a torn or foreign one: not a complete checkpoint


def _atomic_write(path: Path, text: str) -> None:
    _atomic_write_bytes(path, text.encode())


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # the rename itself is durable only once the directory entry is synced
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Checkpointer:
    """Asynchronous DCP checkpoints of a sharded model and its optimizer.

    ``directory`` must be shared by all ranks (all of them read each other's shards when
    the world size changes). ``every_steps`` is the save interval K, ``keep`` the number of
    complete checkpoints kept (>= 2 leaves the previous one intact while a newer one is
    being loaded), ``timeout_s`` bounds every wait and is the timeout of the checkpoint
    group's collectives. :meth:`maybe_save` and :meth:`load_latest` are collective; the
    checkpoint group is created on first use and again after the default group changed.
    """

    def __init__(
        self,
        directory: Path,
        every_steps: int,
        keep: int = 2,
        *,
        timeout_s: float = 120.0,
        wait: Callable[[Any], None] | None = None,
    ) -> None:
        if every_steps < 1 or keep < 1 or timeout_s <= 0:
            raise ValueError("every_steps and keep must be >= 1, timeout_s > 0")
        self._wait: Callable[[Any], None] = wait or (lambda work: work.wait())
        """How our own broadcasts (nonce, choice) wait: the elastic engine passes one a
        verdict can end; DCP's collectives inside a save or load wait on their own."""
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.keep = keep
        self.timeout_s = timeout_s
        self._pg: dist.ProcessGroup | None = None
        self._pending: Future[CheckpointInfo | None] | None = None
        self.loaded_path: Path | None = None
        """The checkpoint the last ``load_latest`` loaded (None: none loaded)."""
        self._pending_step = -1

    def maybe_save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: bytes | None = None,
    ) -> bool:
        """Start an asynchronous save if ``step`` is a multiple of K; True if one started.

        Waits (bounded) for the previous save first. A previous save that failed is logged
        and skipped; the new one is attempted anyway.
        """
        if step <= 0 or step % self.every_steps:
            return False
        self._finish_previous()
        pg = self._group()
        path = self.directory / f"{_PREFIX}{step:010d}-{self._nonce(pg)}"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        started = async_save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=pg
        )
        if not isinstance(started, Future):  # only the staging-response variant is not
            raise TypeError(f"unexpected async_save result {type(started).__name__}")
        chained = self._chain_marker(started, path, step, extra)
        self._pending, self._pending_step = chained, step
        return True

    def wait(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Finish the in-flight save, if any; re-raise its error.

        Returns the checkpoint it completed (on rank 0; other ranks get None because only
        rank 0 writes the marker). Raises ``TimeoutError`` after ``timeout_s`` (default: the
        checkpointer's), leaving the save in flight.
        """
        if self._pending is None:
            return None
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            info = self._pending.result(timeout=limit)
        except FutureTimeout:
            raise TimeoutError(
                f"checkpoint of step {self._pending_step} still running after {limit}s"
            ) from None
        finally:
            if self._pending.done():
                self._pending = None
        return info

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
        """Load the newest complete checkpoint into a freshly sharded model and optimizer
        (its ``extra`` bytes, if saved, are in ``loaded_path / EXTRA``).

        DCP reshards to the current world size. Returns the checkpoint's step, or None
        (nothing loaded) when there is no complete checkpoint. Rank 0 picks the checkpoint
        and broadcasts its name, so all ranks load the same one even if another marker
        appears meanwhile (a save of the old group that did finish on every rank).
        """
        self._finish_previous()
        pg = self._group()
        newest = complete_checkpoints(self.directory)[-1:] if dist.get_rank() == 0 else []
        # the choice as a tensor (its step, then its path's bytes): two broadcasts whose
        # waits the engine can end, unlike broadcast_object_list
        raw = str(newest[0].path).encode() if newest else b""
        head = torch.tensor([newest[0].step if newest else -1, len(raw)], dtype=torch.int64)
        self._wait(dist.broadcast(head, group_src=0, group=pg, async_op=True))
        step, size = int(head[0]), int(head[1])
        if step < 0:
            return None
        buf = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(size, dtype=torch.uint8)
        )
        self._wait(dist.broadcast(buf, group_src=0, group=pg, async_op=True))
        path = Path(buf.numpy().tobytes().decode())
        self.loaded_path = path
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # DCP loads in place into these very dicts, resharding to the current world size
        load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=pg)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return step

    def close(self) -> None:
        """Finish the in-flight save (bounded) and forget the checkpoint group."""
        try:
            if self._group_is_current():
                self.wait()
        finally:
            self._pending, self._pg = None, None

    def _finish_previous(self) -> None:
        if not self._group_is_current():
            # The default group was replaced: a save still in flight may be stuck on a dead
            # rank, and waiting for it would cost the whole old group's timeout.
            self._pending, self._pg = None, None
            return
        try:
            self.wait()
        except TimeoutError:
            raise  # stuck for timeout_s: a peer is likely gone, which the caller must handle
        except Exception as err:  # a failed save must not stop training; the next one retries
            log.warning("checkpoint of step %d failed: %s", self._pending_step, err)

    def _group_is_current(self) -> bool:
        if self._pg is None:
            return False
        try:
            # destroy_process_group() unregisters every group, ours included
            dist.get_process_group_ranks(self._pg)
        except (KeyError, ValueError, RuntimeError):
            return False
        return True

    def _group(self) -> dist.ProcessGroup:
        if not self._group_is_current():
            timeout = timedelta(seconds=self.timeout_s)
            group = dist.new_group(backend="gloo", timeout=timeout)
            assert group is not None  # every rank is a member of a new_group over all ranks
            self._pg = group
        assert self._pg is not None
        return self._pg

    def _nonce(self, pg: dist.ProcessGroup) -> str:
        # secrets, not torch's RNG: the user's random state must not change when we save
        value = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0])
        self._wait(dist.broadcast(value, group_src=0, group=pg, async_op=True))
        return f"{int(value.item()):016x}"

    def _chain_marker(
        self, started: Future[object], path: Path, step: int, extra: bytes | None
    ) -> Future[CheckpointInfo | None]:
        """A future that completes after DCP's save *and* rank 0's marker write."""
        done: Future[CheckpointInfo | None] = Future()
        world, rank = dist.get_world_size(), dist.get_rank()

        def on_saved(fut: Future[object]) -> None:
            try:
                fut.result()
                done.set_result(self._commit(path, step, world, extra) if rank == 0 else None)
            except BaseException as err:
                done.set_exception(err)

        started.add_done_callback(on_saved)
        return done

    def _commit(self, path: Path, step: int, world: int, extra: bytes | None) -> CheckpointInfo:
        """Rank 0, after DCP's save returned there. Every rank's shard is on disk by then:
        DCP's last step gathers all ranks' write results to rank 0 before ``.metadata``.
        ``extra`` (the training state's snapshot) goes in before the marker."""
        if extra is not None:
            _atomic_write_bytes(path / EXTRA, extra)
        info = CheckpointInfo(step, time.time(), path, world)
        record = {"step": step, "saved_at": info.saved_at, "world": world}
        _atomic_write(path / MARKER, json.dumps(record))
        newest = complete_checkpoints(self.directory)[-1]  # ours, unless a later step exists
        _atomic_write(self.directory / LATEST, newest.path.name + "\n")
        self._prune(newest)
        return info

    def _prune(self, newest: CheckpointInfo) -> None:
        keep_paths = {c.path for c in complete_checkpoints(self.directory)[-self.keep :]}
        for path in self.directory.glob(_PREFIX + "*"):
            if path in keep_paths:
                continue
            info = _read_marker(path)
            # unmarked directories older than the newest checkpoint are abandoned attempts;
            # newer unmarked ones may be another group's save still being written
            if info is not None or _step_of(path) < newest.step:
                shutil.rmtree(path, ignore_errors=True)


def _step_of(path: Path) -> int:
    try:
        return int(path.name[len(_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return -1
