"""Process-group plumbing for the elastic hooks: create, shrink, tear down, wait.

What to do is decided in ``torchhook.strategy`` (pure); this module does it with c10d.
Rules, each from torch 2.13's c10d (summarised in docs/training.md §5):

- One default group at a time. ``init`` creates it on a fresh store prefix (reusing keys
  across groups breaks them). With NCCL each local rank drives its own GPU:
  ``cuda:<local_rank>`` is set as the current device and passed as ``device_id``, which
  makes the communicator eager (created inside ``init``, not at the first collective).
- ``shrink``: ``shrink_group(exclude, shrink_flags=SHRINK_ABORT)`` on the default group
  (both from ``torch.distributed.distributed_c10d``: torch 2.13 does not re-export them
  from ``torch.distributed``). Only survivors call it; it aborts what is in flight on the
  old communicator and returns the new default group. Only backends whose
  ``supports_shrinking`` is true (NCCL ≥ 2.27); gloo raises ``TypeError``. Three torch
  2.13 facts shape it (``shrink_group``'s source and docstring): (1) shrinking the
  default group destroys every other group ("rank reassignment makes them
  inconsistent"), so an HSDP mesh must be built again (``mesh``); (2) the new group keeps
  the old group's store (it clones it) and group names restart at 0, so the old store's
  host must be alive and new subgroups would reuse old keys: the old group is moved onto
  a fresh prefix of this formation's store first; (3) the new default group's rank table
  keeps the survivors' *old* global ranks while ``get_rank()`` returns the new ones, and
  ``split_group`` (what ``DeviceMesh`` uses on a GPU-bound group) reads that table: it is
  reset to the identity. A shrink is bounded (``SHRINK_TIMEOUT_S``: with NCCL ≥ 2.31 the
  survivors' destroy of the parent after an abortive shrink can wait forever for the
  excluded ranks, pytorch/pytorch#194679) and confirmed through the formation store: if
  it failed or timed out on any rank, every rank aborts what it holds and the next
  formation re-forms from scratch (``ShrinkFailed``).
- ``teardown``: ``destroy`` (nothing in flight), ``abort`` (NCCL: ``ncclCommAbort`` ends
  kernels waiting on a dead peer; nothing may run on the aborted communicator, and the
  objects that used it, the DDP reducer, are dropped before), ``graveyard`` (gloo: its
  abort is a no-op and destroying a group with a stuck op blocks until the op times out,
  so the group objects, the default group and every subgroup of a mesh, are kept alive,
  unregistered and unused, and the process must leave with ``os._exit``; an HSDP step's
  cross-node reduce runs in a subgroup, and destructing even an idle gloo subgroup costs
  milliseconds a re-formation waits for).
- ``wait``: a collective that a membership verdict can interrupt. Gloo: sleep on one
  event that the op's future and the verdict (``wakes``) both set, waking every
  ``WAIT_SLICE`` only to beat; NCCL: poll ``Work.is_completed()`` (with
  ``TORCH_NCCL_BLOCKING_WAIT`` unset, ``wait`` only orders the current CUDA stream after
  the op and returns at once), then ``wait`` to order the stream. Between polls:
  ``broken()`` raises, ``beat()`` keeps the heartbeat going.

NCCL environment that matters (set by the launcher; docs/training.md §3 says why):
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (our verdict aborts; the watchdog must not tear the
process down first), ``TORCH_NCCL_BLOCKING_WAIT`` unset (a blocking wait cannot be
interrupted), ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` (a communicator being created with a
dead peer can be aborted; ``ncclCommInitRank`` itself cannot, NVIDIA/nccl#289),
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` above the group timeout.

The NCCL branch runs on CPU in tests/torchhook/test_nccl_path.py with a stand-in backend
(gloo underneath, claiming ``supports_shrinking``); it has not run on a GPU, and the
README's status table says so. Each backend's c10d name and devices are an ``Accelerator``
(``ACCELERATORS``), which is what lets the stand-in take NCCL's place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchhook.errors import MembershipChanged as MembershipChanged  # its old home
from torchhook.strategy import Teardown

log = logging.getLogger("torchhook.groups")
WAIT_SLICE = timedelta(milliseconds=20)
POLL_S = 0.002
"""NCCL completion polling: short, the op usually ends within microseconds of its peers."""
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
"""Settings the NCCL path expects (the module docstring says why); warned about, not set:
the launcher owns the environment."""
SHRINK_TIMEOUT_S = 10.0
"""Bound on one shrink, and on the wait for every rank's outcome. ``ncclCommShrink``
reuses the parent's connections and takes well under a second; the known hang (survivors
waiting forever in the parent's destroy, NCCL ≥ 2.31) never ends, so a shrink this slow
is that hang and a fresh group (a few seconds) is cheaper than waiting longer."""
SHRINK_GRACE_S = 5.0
"""After aborting the parent of a stuck shrink: how long its thread gets to unwind."""
SHRINK_ENV = "TORCHHOOK_SHRINK"
"""``TORCHHOOK_SHRINK=0`` never shrinks (always abort and re-form): for an NCCL whose
shrink misbehaves."""

TORCH_NAMES: tuple[str, ...] = (
    "torch.cuda.set_device",
    "torch.distributed.init_process_group",
    "torch.distributed.destroy_process_group",
    "torch.distributed.is_initialized",
    "torch.distributed.get_world_size",
    "torch.distributed.distributed_c10d.shrink_group",
    "torch.distributed.distributed_c10d.SHRINK_ABORT",
    "torch.distributed.distributed_c10d._abort_process_group",
    "torch.distributed.distributed_c10d._get_default_group",
    "torch.distributed.distributed_c10d.get_process_group_ranks",
    "torch.distributed.distributed_c10d._world",
    "torch.distributed.distributed_c10d._World.pg_map",
    "torch.distributed.distributed_c10d._World.pg_group_ranks",
    "torch.distributed.distributed_c10d.ProcessGroup.abort",
    "torch.distributed.distributed_c10d.ProcessGroup._get_backend",
    "torch._C._distributed_c10d.Backend.supports_shrinking",
    "torch._C._distributed_c10d.Backend.shrink",
    "torch._C._distributed_c10d.Work.is_completed",
    "torch._C._distributed_c10d.PrefixStore",
    "torch.distributed.device_mesh.init_device_mesh",
)
"""Every torch name the NCCL branch calls (several are private, and torch moves them):
tests/torchhook/test_nccl_path.py resolves each in the installed torch and checks that
every ``c10d.<name>`` this module uses is listed."""


@dataclass(frozen=True, slots=True)
class Accelerator:
    """How a backend of ``torchhook.strategy`` (its rules are keyed "gloo" and "nccl")
    maps onto c10d: the backend name ``init_process_group`` gets, this local rank's device,
    whether the group is bound to it (``device_id``: an eager communicator), and how the
    device is made current."""

    c10d: str
    device: Callable[[int], torch.device]
    bind_device: bool
    set_device: Callable[[torch.device], None] | None


def _cuda(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank)


def _cpu(local_rank: int) -> torch.device:
    return torch.device("cpu")


ACCELERATORS: dict[str, Accelerator] = {
    "gloo": Accelerator("gloo", _cpu, False, None),
    "nccl": Accelerator("nccl", _cuda, True, torch.cuda.set_device),
}


class ShrinkFailed(RuntimeError):
    """A shrink failed or timed out on some rank of the new group. Every rank of it then
    holds no group, so the next formation forms a fresh one."""


class ShrinkStuck(Exception):
    """A shrink still ran after its parent communicator was aborted: torch's process-group
    state belongs to that thread, so this process cannot form another group. Fatal."""


class ProcessGroups:
    """The default process group of one trainer, by backend.

    ``accelerator`` defaults to ``ACCELERATORS[backend]``; a test passes a stand-in to run
    the NCCL rules on another c10d backend."""

    def __init__(
        self, backend: str, local_rank: int, *, accelerator: Accelerator | None = None
    ) -> None:
        if backend not in ACCELERATORS:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        self.accelerator = accelerator or ACCELERATORS[backend]
        self.device = self.accelerator.device(local_rank)
        if self.accelerator.set_device is not None:
            self.accelerator.set_device(self.device)
        if backend == "nccl":
            for name, wanted in NCCL_ENV.items():
                if os.environ.get(name, "") != wanted:
                    log.warning(
                        "%s=%s is recommended for in-process recovery (docs/training.md §3)",
                        name,
                        wanted,
                    )
        self.allow_shrink = os.environ.get(SHRINK_ENV, "1") != "0"
        self.shrinks = 0
        """Shrinks done in place (each destroyed every other group: see ``mesh``)."""
        self.graveyard: list[Any] = []
        """Objects that must never be destructed (a stuck op would block): see ``exit``."""

    @property
    def held(self) -> bool:
        return dist.is_initialized()

    def supports_shrinking(self) -> bool:
        if not self.held or not self.allow_shrink:
            return False
        try:
            backend = c10d._get_default_group()._get_backend(self.device)
        except RuntimeError:
            return False
        # not in torch's type stubs; torch's own shrink_group reads it the same way
        return bool(getattr(backend, "supports_shrinking", False))

    def init(self, store: Store, rank: int, world_size: int, timeout: timedelta) -> None:
        dist.init_process_group(
            self.accelerator.c10d,
            store=PrefixStore("pg", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=self.device if self.accelerator.bind_device else None,
        )

    def shrink(
        self,
        exclude: list[int],
        store: Store,
        token: str,
        rank: int,
        *,
        beat: Callable[[], None] = lambda: None,
        timeout_s: float = SHRINK_TIMEOUT_S,
    ) -> None:
        """Drop ``exclude`` (old global ranks) from the default group in place; ``store``,
        ``token`` and ``rank`` are this formation's (fresh store, new group, new rank).
        Returns once every survivor holds the shrunk group; else raises ``ShrinkFailed``
        with no group held (the module docstring lists the torch facts this works around).
        ``beat`` runs between waits (the trainer's heartbeat)."""
        old = c10d._get_default_group()
        survivors = old.size() - len(exclude)
        name, _ = c10d._world.pg_map[old]
        # shrink_group clones the old group's store for the new one: give it a fresh one
        c10d._world.pg_map[old] = (name, PrefixStore(f"pg/{token}", store))
        done: list[BaseException | None] = []

        def run() -> None:
            try:
                c10d.shrink_group(exclude, shrink_flags=c10d.SHRINK_ABORT)
                done.append(None)
            except BaseException as exc:  # reported to the caller, in its thread
                done.append(exc)

        thread = threading.Thread(target=run, name="torchhook-shrink", daemon=True)
        thread.start()
        if not _join(thread, timeout_s, beat):
            log.warning("shrink still running after %.1f s: aborting its parent", timeout_s)
            with contextlib.suppress(RuntimeError):
                old.abort()
            if not _join(thread, SHRINK_GRACE_S, beat):
                self._outcome(store, token, rank, ok=False)
                raise ShrinkStuck(
                    f"a shrink of the process group did not end {SHRINK_GRACE_S} s after its "
                    f"parent was aborted; restart the trainers ({SHRINK_ENV}=0 disables "
                    "shrinking)"
                )
        error = done[0] if done else None
        ok = bool(done) and error is None
        if ok:
            # the survivors' new ranks, as get_rank() and the backend have them
            new = c10d._get_default_group()
            c10d._world.pg_group_ranks[new] = {r: r for r in range(new.size())}
        else:
            log.warning("shrink failed: %s", error)
        del error  # the exception's frames would pin the old group
        done.clear()
        if self._outcome(store, token, rank, ok=ok) and _all_ok(store, token, survivors, beat):
            self.shrinks += 1
            return
        if self.held:
            c10d._abort_process_group()
        raise ShrinkFailed("the process group could not be shrunk on every rank; re-forming")

    @staticmethod
    def _outcome(store: Store, token: str, rank: int, *, ok: bool) -> bool:
        with contextlib.suppress(RuntimeError):
            store.set(f"shrink/{token}/{rank}", "1" if ok else "0")
        return ok

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A device mesh over the current default group, built afresh: call it after every
        formation. A shrink destroyed every group but the default one, so an HSDP mesh of
        the old group is gone (its groups unregistered and aborted); the new one's groups
        come from the shrunk group, whose rank table ``shrink`` made consistent."""
        world = dist.get_world_size()
        if c10d.get_process_group_ranks(None) != list(range(world)):
            raise RuntimeError("the default group's rank table is not 0..world-1")
        return init_device_mesh(self.device.type, shape, mesh_dim_names=names)

    def teardown(self, how: Teardown, *keep: Any) -> None:
        """End the held group (if any) the way the strategy says; ``keep`` are objects
        tied to it that must share its fate (a formation store)."""
        if not self.held:
            return
        if how == "abort":
            c10d._abort_process_group()
            return
        if how == "graveyard":
            # an abandoned op may still run in any of them (HSDP's cross-node reduce runs
            # in a subgroup): destructing one would block until its op times out, and even
            # an idle gloo group costs ms to destruct (threads joined, sockets closed)
            self.graveyard.append((dist.group.WORLD, *registered_groups(), *keep))
        dist.destroy_process_group()

    def wait(
        self,
        work: Any,
        broken: Callable[[], bool],
        beat: Callable[[], None],
        wakes: Wakes | None = None,
    ) -> None:
        """Until ``work`` completes; ``MembershipChanged`` once ``broken()``. Gloo: the
        wait sleeps on an event that the op's completion and the verdict (``wakes``, which
        gloo needs) both set, so neither waits for the end of a slice; NCCL polls every
        ``POLL_S``."""
        if self.backend == "nccl":
            while not work.is_completed():
                if broken():
                    raise MembershipChanged("membership changed during a collective")
                time.sleep(POLL_S)
                beat()
            work.wait()
            return
        if wakes is None:
            raise TypeError("ProcessGroups.wait: a gloo wait needs wakes (the group's watch)")
        _wait_woken(work, broken, beat, wakes)


class Wakes(Protocol):
    """Who sets a waiting collective's event on a verdict (``verdicts.GroupWatch``):
    ``add`` sets it at once if the verdict is already in."""

    def add(self, event: threading.Event) -> None: ...

    def discard(self, event: threading.Event) -> None: ...


def _wait_woken(
    work: Any, broken: Callable[[], bool], beat: Callable[[], None], wakes: Wakes
) -> None:
    """Gloo: sleep on one event set by the op's future (success or failure) or by the
    verdict, waking every ``WAIT_SLICE`` only to beat."""
    event = threading.Event()
    wakes.add(event)
    try:
        work.get_future().add_done_callback(lambda _: event.set())
        while True:
            if broken():
                raise MembershipChanged("membership changed during a collective")
            if event.wait(WAIT_SLICE.total_seconds()):
                if broken():
                    raise MembershipChanged("membership changed during a collective")
                work.wait()  # completed: returns, or raises the op's own error
                return
            beat()
    finally:
        wakes.discard(event)


def registered_groups() -> list[Any]:
    """Every process group c10d holds besides the default one (a mesh's subgroups)."""
    return [pg for pg in c10d._world.pg_map if pg is not dist.group.WORLD]


def _join(thread: threading.Thread, seconds: float, beat: Callable[[], None]) -> bool:
    """Wait up to ``seconds`` for ``thread``, beating between slices; True if it ended."""
    deadline = time.monotonic() + seconds
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(min(WAIT_SLICE.total_seconds(), max(0.0, deadline - time.monotonic())))
        beat()
    return not thread.is_alive()


def _all_ok(store: Store, token: str, survivors: int, beat: Callable[[], None]) -> bool:
    """Every survivor's shrink outcome, read from the formation store within
    ``SHRINK_TIMEOUT_S``: True only if each one succeeded."""
    keys = [f"shrink/{token}/{r}" for r in range(survivors)]
    deadline = time.monotonic() + SHRINK_TIMEOUT_S
    try:
        while not store.check(keys):
            if time.monotonic() >= deadline:
                return False  # a rank that never answered
            time.sleep(WAIT_SLICE.total_seconds())
            beat()
        return all(store.get(k) == b"1" for k in keys)
    except RuntimeError:  # the store's host died
        return False


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
