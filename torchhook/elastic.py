"""In-process elastic DDP, driven by the local agent's job view.

When a node of the current group dies, the survivors leave the collective in flight, form
a new process group among themselves and keep training in the same processes; a new node
joins at a step boundary. A node runs one trainer process per local rank (one per GPU,
torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``); the view lists nodes, global ranks follow
(node join age, local rank), and a node enters and leaves with all of its ranks (agent
``jobs.py`` says why). The rules of the moving parts live next to them:
``torchhook.strategy`` (pure: layouts, shrink or reform, teardown, where the state comes
from), ``torchhook.formation`` (agreeing through stores), ``torchhook.groups`` (c10d
plumbing per backend), ``torchhook.verdicts`` (failing a group's collectives on a
verdict). This module is the training loop's side:

- Escape comes from the membership verdict, never from gloo, which cannot abort: DDP
  gradients go through a comm hook whose Future a watcher fails when the view drops a
  member of the group, and our own collectives wait in short slices that check the
  verdict. The group timeout (``pg_timeout_s``) is only a backstop.
- A peer's crash reaches the ranks wired to it as a connection error long before any
  probe times out. That is evidence, not a verdict: the trainer tells its agent which
  peers it lost (``Membership.report_lost``) and the agent probes them at once; only the
  agent's detector can drop them from the view.
- Exceptions from a dead group are not kept (their frames pin the group and keep its
  sockets open); ``torch._dynamo`` is imported before the first group exists (the lazy
  import in the first ``DDP()`` pins that group forever).
- All ranks switch at the same step: a control all-reduce (MAX) of "my view differs from
  the group" opens every step (Horovod's ``check_host_updates``).
- State comes from the lowest rank with the newest step (``strategy.decide``): it
  broadcasts parameters and buffers, optimizer state, step, torch RNG and the caller's
  extra state. A rank that was stopped and comes back carries an old step and so never
  overwrites the group. Rank 0 is the oldest node's local rank 0 (stable while it lives).
- Split brain: a member of a previous group forms a new one only with a strict majority
  of that group's nodes (``quorum="majority"``, as torchft recommends), so a partitioned
  minority waits instead of training on its own.
- Backends: ``gloo`` (CPU; a fresh group per formation) and ``nccl`` (one GPU per local
  rank, ``cuda:<local_rank>``; a failed group is shrunk in place when every survivor
  holds it and the backend supports shrinking, else aborted and formed afresh; a regrow
  is always a fresh group at a step boundary). The NCCL path has not run on a GPU here.

Data: the global batch of each step is fixed; ``shard(global_batch_size)`` gives this
rank's contiguous slice for the current world size, so a re-shard is implicit and, with a
batch divisible by every world size in use, the loss curve equals a failure-free run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

# imported before any process group exists: the lazy import in the first DDP() pins that
# group forever and keeps its sockets open
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import TCPStore
from torch.nn.parallel import DistributedDataParallel as DDP

from torchhook.client import Membership, MembershipClosed, View, local_place
from torchhook.formation import Formation, Retry
from torchhook.groups import MembershipChanged, ProcessGroups, flatten, unflatten_into
from torchhook.strategy import (
    Layout,
    Plan,
    RankInfo,
    decide,
    lost_peers,
    teardown_of,
    tears_down_at_failure,
)
from torchhook.verdicts import GroupWatch

__all__ = ["ElasticDDP", "MembershipChanged"]

log = logging.getLogger("torchhook.elastic")
T = TypeVar("T")
FAILURE_MARKS = (
    "gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out",
    "NCCL",
)
"""A dead peer surfaces as an untyped RuntimeError (gloo) whose text says so."""
RETRY_WAIT_S = 0.2
"""After a failed formation on an unchanged view: wait this long for a new view."""
HEARTBEAT_EVERY_S = 0.1
"""Heartbeats from wait loops are spaced out; one per step is always sent."""


class ElasticDDP:
    """Owns the process group, the DDP wrapper and the step counter of one trainer process.

    Usage (one process per local rank)::

        el = ElasticDDP(model, optimizer, job="train")
        while el.step < total_steps:
            lo, hi = el.shard(global_batch)
            loss = el.run_step(lambda ddp: train_step(ddp, batch(el.step)[lo:hi]))
        el.exit(0)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        job: str,
        control: str | Path | None = None,
        min_nodes: int = 1,
        quorum: str = "majority",
        pg_timeout_s: float = 60.0,
        formation_timeout_s: float = 30.0,
        join_timeout_s: float = 600.0,
        heartbeat_pause_ms: int = 30_000,
        extra_state: Callable[[], Any] | None = None,
        load_extra_state: Callable[[Any], None] | None = None,
        store_host: str = "0.0.0.0",
        local_rank: int | None = None,
        local_world_size: int | None = None,
        backend: str | None = None,
    ) -> None:
        """``local_rank``/``local_world_size`` default to torchrun's ``LOCAL_RANK`` and
        ``LOCAL_WORLD_SIZE`` (else 0 and 1). ``backend`` defaults to ``nccl`` when CUDA is
        available, else ``gloo``; with NCCL the model is moved to ``cuda:<local_rank>``."""
        if quorum not in ("majority", "any"):
            raise ValueError(f"quorum must be 'majority' or 'any', got {quorum!r}")
        if min_nodes < 1:
            raise ValueError("min_nodes must be >= 1")
        local_rank, local_world_size = local_place(local_rank, local_world_size)
        self.groups = ProcessGroups(
            backend or ("nccl" if torch.cuda.is_available() else "gloo"), local_rank
        )
        self.device = self.groups.device
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.min_nodes = min_nodes
        self.quorum = quorum
        self.pg_timeout = timedelta(seconds=pg_timeout_s)
        self.join_timeout_s = join_timeout_s
        self._extra_state = extra_state
        self._load_extra_state = load_extra_state
        self.step = 0
        self.rank = -1
        self.world_size = 0
        self.ddp: Any = None
        """The wrapped model the step function gets (a DDP module; None between groups)."""
        self.layout: Layout | None = None
        """The current group's nodes and their ranks."""
        self.group_names: tuple[str, ...] = ()
        self.order: tuple[str, ...] = ()
        """Node names in rank order (``order[0]`` holds rank 0)."""
        self.group_token = ""
        self.last_plan: Plan | None = None
        self._addrs: dict[str, str] = {}
        self._has_state = False
        self._applied_in = ""
        """Token of the group in which this rank applied its last step or took its state."""
        self._held_failed = False
        self._last_beat = 0.0
        self.reconfigurations = 0
        self.last_formation_s = 0.0
        self._formation_store: TCPStore | None = None
        self.formation = Formation(
            lambda: self.membership.view,
            local_rank=local_rank,
            beat=self._beat,
            timeout_s=formation_timeout_s,
            store_host=store_host,
            op_timeout=self.pg_timeout,
        )
        self.membership = Membership(
            job,
            control=control,
            store_port=self.formation.directory_port,
            heartbeat_pause_ms=heartbeat_pause_ms,
            local_rank=local_rank,
            local_world_size=local_world_size,
        )
        self.node = self.membership.node
        self.local_rank = self.membership.local_rank
        self.watch = GroupWatch(self.node)
        """Fails this group's collectives when the view drops one of its nodes."""
        self.membership.add_listener(self.watch.on_view)

    # --- the training-loop API --------------------------------------------------------

    def shard(self, global_batch_size: int) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of a global batch (contiguous, sizes differ by <= 1)."""
        self._ensure_group()
        base, extra = divmod(global_batch_size, self.world_size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def run_step(self, fn: Callable[[Any], T]) -> T:
        """Run one training step (forward, backward, optimizer step) on the DDP model.

        A membership change re-forms the group and runs the step again, in the new group;
        the step counter advances only when ``fn`` returns. So ``fn`` must finish every
        collective (including its own ``all_reduce`` of the loss) before it changes local
        state (``optimizer.step()``): a step that fails after the optimizer step would be
        applied twice on this rank when it runs again."""
        while True:
            self._ensure_group()
            try:
                if self._control_says_switch():
                    self._abandon(failed=False)
                    continue
                result = fn(self.ddp)
            except Exception as exc:
                if not self._group_failed(exc):
                    raise
                lost = None if self.watch.broken else self._lost_peers(str(exc))
                # do not keep the exception: its frames pin the dead group
                del exc
                self._report_lost(lost)
                self._abandon(failed=True)
                continue
            self.step += 1
            self._applied_in = self.group_token
            self._beat(force=True)
            return result

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """An all-reduce that a membership verdict can interrupt (MembershipChanged)."""
        self._wait(dist.all_reduce(tensor, op=op, async_op=True))
        return tensor

    def exit(self, code: int = 0) -> None:
        """Leave the process. With a stuck group in the graveyard a normal exit would block
        until its op times out, so this uses ``os._exit``."""
        self.membership.close()
        if self.groups.graveyard:
            logging.shutdown()
            os._exit(code)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(code)

    def _beat(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_beat >= HEARTBEAT_EVERY_S:
            self._last_beat = now
            self.membership.heartbeat(self.step)

    @property
    def verdict_time(self) -> float | None:
        """Wall clock when the view last dropped a member of our group (for measurements)."""
        return self.watch.verdict_time

    # --- failures -----------------------------------------------------------------------

    def _group_failed(self, exc: BaseException) -> bool:
        """After an exception in a step: did the group fail (verdict, or a peer gone)?
        Anything else is the caller's bug and propagates. Gloo's errors have no type of
        their own (and an interrupted DDP hook surfaces as "Unable to cast ... to
        Tensor"), hence the flag first and the text last."""
        if self.watch.broken or isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        return any(mark in text for mark in FAILURE_MARKS)

    def _lost_peers(self, error: str) -> list[str]:
        return lost_peers(error, self.order, self.node, self._addrs)

    def _report_lost(self, lost: list[str] | None) -> None:
        if not lost:
            return
        with contextlib.suppress(MembershipClosed):
            self.membership.report_lost(lost)

    # --- collectives ------------------------------------------------------------------

    def _wait(self, work: Any) -> None:
        self.groups.wait(work, lambda: self.watch.broken, self._beat)

    def _control_says_switch(self) -> bool:
        """Step boundary: does any member see a view that differs from the group?"""
        differs = self.watch.differs(self.membership.view)
        flag = torch.tensor([1 if differs else 0], dtype=torch.int32, device=self.device)
        self._wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        return bool(flag.item())

    # --- leaving a group --------------------------------------------------------------

    def _abandon(self, *, failed: bool) -> None:
        """Stop using the group. Gloo releases it at once after a failure (its closed
        sockets make peers not wired to the dead rank fail too); otherwise the group is
        kept until the next plan says whether to shrink it or tear it down."""
        self.watch.disarm()
        self.ddp = None
        self._held_failed = self._held_failed or failed
        self._on_abandon(failed)
        if failed and tears_down_at_failure(self.groups.backend):
            self._release()

    def _release(self) -> None:
        self.groups.teardown(
            teardown_of(self.groups.backend, self._held_failed), self._formation_store
        )
        self._formation_store = None
        self._held_failed = False

    def _on_abandon(self, failed: bool) -> None:
        """Subclasses drop their own objects that use the group (FSDP modules)."""

    # --- forming a group --------------------------------------------------------------

    def _ensure_group(self) -> None:
        if self.ddp is not None:
            return
        started = time.monotonic()
        deadline = started + self.join_timeout_s
        while True:
            view = self._wait_for_usable_view(deadline)
            log.debug("forming on view %d %s %s", view.generation, view.fingerprint, view.names)
            try:
                self._form(view)
                break
            except (Retry, RuntimeError) as exc:
                # a peer that died during formation surfaces as a store or gloo error; the
                # first line says which (torch appends a C++ stack trace)
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                unreachable = isinstance(exc, Retry) and exc.unreachable
                log.info("formation on %s retried: %s", view.fingerprint, first)
                del exc
                self._abandon(failed=True)
                if unreachable:  # do not spin on a dead leader, but go on at a new view
                    self._await_new_view(view.fingerprint)
        self.reconfigurations += 1
        self.last_formation_s = time.monotonic() - started

    def _await_new_view(self, fingerprint: str) -> None:
        """After a failed formation: do not spin on a dead leader, but go on at a new view."""
        with contextlib.suppress(TimeoutError):
            self.membership.wait(lambda v: v.fingerprint != fingerprint, RETRY_WAIT_S)

    def _wait_for_usable_view(self, deadline: float) -> View:
        def usable(v: View) -> bool:
            return self.node in v and len(v.members) >= self.min_nodes and self._has_quorum(v)

        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no usable view of {self.membership.job!r} within {self.join_timeout_s} s "
                    f"(min_nodes={self.min_nodes}, last group {list(self.group_names)})"
                )
            try:
                return self.membership.wait(usable, min(remaining, 1.0))
            except TimeoutError:
                self._beat()

    def _has_quorum(self, view: View) -> bool:
        if self.quorum == "any" or not self.group_names:
            return True
        kept = sum(1 for n in self.group_names if n in view)
        return 2 * kept > len(self.group_names)

    def _form(self, view: View) -> None:
        agreed = self.formation.agree(
            view, self.node, self.local_rank, self._rank_info(), self._decide
        )
        plan = agreed.plan
        log.debug("formation on %s: plan %s", view.fingerprint, plan)
        if plan.action == "shrink":
            self.groups.shrink(
                list(plan.exclude), agreed.store, agreed.token, agreed.rank, beat=self._beat
            )
            self._held_failed = False
        else:
            self._release()
            self.groups.init(agreed.store, agreed.rank, agreed.layout.world_size, self.pg_timeout)
        self._formation_store = agreed.store
        log.debug("formation on %s: process group up", view.fingerprint)
        self._start_group(view, agreed.layout, agreed.rank, agreed.token, plan)

    def _rank_info(self) -> RankInfo:
        held = self.groups.held
        return RankInfo(
            self.group_token if held else "",
            self.layout if held else None,
            self.step,
            self._has_state,
            self._applied_in,
        )

    def _decide(self, layout: Layout, infos: list[RankInfo]) -> Plan:
        return decide(
            layout,
            infos,
            backend=self.groups.backend,
            supports_shrinking=self.groups.supports_shrinking(),
        )

    def _start_group(self, view: View, layout: Layout, rank: int, token: str, plan: Plan) -> None:
        self.rank, self.world_size = rank, layout.world_size
        self.layout = layout
        self.order = self.group_names = tuple(n.name for n in layout.nodes)
        self._addrs = {m.name: m.addr for m in view.members}
        self.group_token = token
        self.last_plan = plan
        self.watch.arm(view, layout.ids, token)
        log.debug("group %s: setting up the model", token)
        self.ddp = self._setup_model(plan)
        self._has_state = True
        self._applied_in = token  # every rank of the group now holds the same state
        self.membership.set_group(self.group_token)
        log.info(
            "group %s: rank %d of %d (%s) at step %d, %s from rank %d",
            self.group_token,
            rank,
            layout.world_size,
            " ".join(f"{n.name}x{n.ranks}" for n in layout.nodes),
            self.step,
            plan.action,
            plan.source,
        )

    def _setup_model(self, plan: Plan) -> Any:
        """Make model and optimizer consistent in the new group; returns what ``run_step``
        hands to the step function. Subclasses (FSDP, HSDP) override this."""
        for p in self.model.parameters():
            p.grad = None
        self.step = plan.step
        if plan.receivers:
            # the source is not always rank 0 (the newest step wins), so we broadcast
            # ourselves, interruptibly, instead of DDP's init sync from rank 0
            self._broadcast_tensors([*self.model.parameters(), *self.model.buffers()], plan.source)
            self._sync_state(plan.source)
        device_ids = [self.device] if self.device.type == "cuda" else None
        ddp = DDP(self.model, device_ids=device_ids, init_sync=False)
        # a lambda: DDP inspects annotations, which __future__ annotations turn into strings
        ddp.register_comm_hook(
            None, lambda _, bucket: self.watch.comm_hook(bucket, self.world_size)
        )
        return ddp

    def _broadcast_tensors(self, tensors: list[torch.Tensor], source: int) -> None:
        """One broadcast per dtype of everything in ``tensors`` (in place), interruptible."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        flats = [(flatten(ts), ts) for ts in by_dtype.values()]
        works = [dist.broadcast(flat, source, async_op=True) for flat, _ in flats]
        for work in works:
            self._wait(work)
        for flat, ts in flats:
            unflatten_into(flat, ts)

    def _sync_state(self, source: int) -> None:
        """Optimizer state, RNG and the caller's extra state, from the source."""
        payload: list[Any] = [None]
        if self.rank == source:
            payload[0] = {
                "optimizer": self.optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "extra": self._extra_state() if self._extra_state else None,
            }
        device = self.device if self.device.type == "cuda" else None
        dist.broadcast_object_list(payload, src=source, device=device)
        state = payload[0]
        if self.rank != source:
            self.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
            if self._load_extra_state is not None:
                self._load_extra_state(state["extra"])
