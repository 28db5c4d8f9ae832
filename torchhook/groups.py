"""Process-group plumbing for the elastic hooks: create, shrink, tear down, wait.

What to do is decided in ``torchhook.strategy`` (pure); this module does it with c10d.
Rules, each from torch 2.13's c10d (summarised in docs/training.md §5):

- One default group at a time. ``init`` creates it on a fresh store prefix (reusing keys
  across groups breaks them). With NCCL each local rank drives its own GPU:
  ``cuda:<local_rank>`` is set as the current device and passed as ``device_id``, which
  makes the communicator eager (created inside ``init``, not at the first collective).
- ``shrink``: ``torch.distributed.shrink_group(exclude, shrink_flags=SHRINK_ABORT)`` on the
  default group (only survivors call it; it aborts what is in flight on the old
  communicator and returns the new default group). Only backends whose
  ``supports_shrinking`` is true (NCCL ≥ 2.27); gloo raises ``TypeError``.
- ``teardown``: ``destroy`` (nothing in flight), ``abort`` (NCCL: ``ncclCommAbort`` ends
  kernels waiting on a dead peer; nothing may run on the aborted communicator, and the
  objects that used it, the DDP reducer, are dropped before), ``graveyard`` (gloo: its
  abort is a no-op and destroying a group with a stuck op blocks until the op times out,
  so the group object is kept alive, unregistered and unused, and the process must leave
  with ``os._exit``).
- ``wait``: a collective that a membership verdict can interrupt. Gloo: ``Work.wait`` in
  short slices (``wait(timeout)`` raises "timed out" and leaves the op running); NCCL:
  poll ``Work.is_completed()`` (with ``TORCH_NCCL_BLOCKING_WAIT`` unset, ``wait`` only
  orders the current CUDA stream after the op and returns at once), then ``wait`` to order
  the stream. Between slices: ``broken()`` raises, ``beat()`` keeps the heartbeat going.

NCCL environment that matters (set by the launcher; docs/training.md §3 says why):
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (our verdict aborts; the watchdog must not tear the
process down first), ``TORCH_NCCL_BLOCKING_WAIT`` unset (a blocking wait cannot be
interrupted), ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` (a communicator being created with a
dead peer can be aborted; ``ncclCommInitRank`` itself cannot, NVIDIA/nccl#289),
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` above the group timeout.

This path has run on CPU/gloo only; the NCCL branches are labelled in the README's status
table as not run on a GPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from torchhook.strategy import Teardown

log = logging.getLogger("torchhook.groups")
WAIT_SLICE = timedelta(milliseconds=20)
POLL_S = 0.002
"""NCCL completion polling: short, the op usually ends within microseconds of its peers."""
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
"""Settings the NCCL path expects (the module docstring says why); warned about, not set:
the launcher owns the environment."""


class MembershipChanged(RuntimeError):
    """A collective was abandoned because the view dropped a member."""


class ProcessGroups:
    """The default process group of one trainer, by backend."""

    def __init__(self, backend: str, local_rank: int) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        if backend == "nccl":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            for name, wanted in NCCL_ENV.items():
                if os.environ.get(name, "") != wanted:
                    log.warning(
                        "%s=%s is recommended for in-process recovery (docs/training.md §3)",
                        name,
                        wanted,
                    )
        else:
            self.device = torch.device("cpu")
        self.graveyard: list[Any] = []
        """Objects that must never be destructed (a stuck op would block): see ``exit``."""

    @property
    def held(self) -> bool:
        return dist.is_initialized()

    def supports_shrinking(self) -> bool:
        if not self.held:
            return False
        try:
            backend = dist.group.WORLD._get_backend(self.device)  # type: ignore[union-attr]
            return bool(getattr(backend, "supports_shrinking", False))
        except (RuntimeError, AttributeError):
            return False

    def init(self, store: Store, rank: int, world_size: int, timeout: timedelta) -> None:
        extra: dict[str, Any] = {"device_id": self.device} if self.backend == "nccl" else {}
        dist.init_process_group(
            self.backend,
            store=PrefixStore("pg", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **extra,
        )

    def shrink(self, exclude: list[int]) -> None:
        dist.shrink_group(exclude, shrink_flags=dist.SHRINK_ABORT)  # type: ignore[attr-defined]

    def teardown(self, how: Teardown, *keep: Any) -> None:
        """End the held group (if any) the way the strategy says; ``keep`` are objects
        tied to it that must share its fate (a formation store)."""
        if not self.held:
            return
        if how == "abort":
            dist.distributed_c10d._abort_process_group()
            return
        if how == "graveyard":
            # an abandoned op may still run in it: destructing it would block
            self.graveyard.append((dist.group.WORLD, *keep))
        dist.destroy_process_group()

    def wait(self, work: Any, broken: Callable[[], bool], beat: Callable[[], None]) -> None:
        if self.backend == "nccl":
            while not work.is_completed():
                if broken():
                    raise MembershipChanged("membership changed during a collective")
                time.sleep(POLL_S)
                beat()
            work.wait()
            return
        while True:
            if broken():
                raise MembershipChanged("membership changed during a collective")
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
            beat()


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding ``tensors`` (same dtype) back to back: one collective instead of
    one per tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flatten``'s buffer back into ``tensors``, in place."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
