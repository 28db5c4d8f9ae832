"""The elastic training loop: one engine, with the parallelism plugged in.

When a node of the current group dies, the survivors leave the collective in flight, form
a new process group among themselves and keep training in the same processes; a new node
joins at a step boundary. A node runs one trainer process per local rank; the view lists
nodes, global ranks follow (node join age, local rank), and a node enters and leaves with
all of its ranks (agent ``jobs.py`` says why). The parts, each owning one concern, are in
docs/design.md §2.5: settings, membership (``client``), formation, pure rules
(``strategy``), c10d plumbing (``groups``), verdicts, errors, and the parallelism strategy
(``parallel*``); this module is the loop that drives them.

Rules of the loop:

- Escape comes from the membership verdict, never from gloo, which cannot abort: DDP
  gradients go through a comm hook whose Future the watcher fails, and every collective
  the engine and the strategies issue waits in short slices that check the verdict
  (docs/training.md lists the few that cannot). The group timeout is a backstop only.
- A peer's crash reaches the ranks wired to it as a connection error long before any
  probe times out. That is evidence, not a verdict: the trainer tells its agent which
  peers it lost (``Membership.report_lost``) and the agent probes them at once.
- Exceptions from a dead group are not kept (their frames pin the group and keep its
  sockets open); ``torch._dynamo`` is imported before the first group exists (the lazy
  import in the first ``DDP()`` pins that group forever).
- All ranks switch at the same step: a control all-reduce (MAX) of "my view differs from
  the group" opens every step (Horovod's ``check_host_updates``).
- State comes from the newest step (``strategy.decide``); the strategy restores the model
  and optimizer, the engine the step, torch's RNG and the caller's extra state from
  ``plan.source``. A rank that was stopped and comes back never overwrites the group.
- Split brain: with ``quorum="majority"`` a member of a previous group forms a new one only
  with a strict majority of that group's nodes.
- Failures are typed (``torchhook.errors``): a lost group re-forms, anything else stops
  the job at once. Re-forming has a budget (``reform_attempts``, ``reform_timeout_s``)
  with backoff; no loop here is unbounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, TypeVar

import torch

# imported before any process group exists: the lazy import in the first DDP() pins that
# group forever and keeps its sockets open
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import TCPStore

from torchhook.batching import split_evenly
from torchhook.carry import Carry
from torchhook.client import Membership, MembershipClosed, View, local_place
from torchhook.errors import ReformBudgetSpent, classify
from torchhook.feed import DataFeed
from torchhook.formation import Formation, Retry
from torchhook.groups import ProcessGroups, ShrinkFailed, ShrinkStuck
from torchhook.pace import Pace
from torchhook.parallel import Group, Parallelism, micro_batches
from torchhook.roster import roster
from torchhook.settings import ReformBudget, Settings
from torchhook.spares import Spares, await_target
from torchhook.state import Rebuilt, ResetCallbackError, SnapshotError, Stateful, TrainingState
from torchhook.state_wire import encode
from torchhook.stores import TcpNet
from torchhook.strategy import (
    Layout,
    Plan,
    RankInfo,
    decide,
    lost_peers,
    teardown_of,
    tears_down_at_failure,
)
from torchhook.timeline import Timeline
from torchhook.usable import await_new_view, wait_for_usable_view
from torchhook.verdicts import GroupWatch

__all__ = ["PASS_THROUGH", "Elastic"]

log = logging.getLogger("torchhook.elastic")
T = TypeVar("T")
S = TypeVar("S", bound=Stateful)
PASS_THROUGH: tuple[type[BaseException], ...] = (
    MembershipClosed,
    ResetCallbackError,
    SnapshotError,
    ShrinkStuck,
)
"""Fatal as they are, with their own message: the agent is gone (``MembershipLost``), an
``on_reset`` callback or a snapshot failed, a shrink cannot be undone."""
HEARTBEAT_EVERY_S = 0.1
"""Heartbeats from wait loops are spaced out; one per step is always sent."""
DEFAULT_PAUSE_S = 600.0
"""A pause without ``max_s`` ends (for the agent) after this long."""


class Elastic:
    """The elastic loop of one trainer process, with ``parallelism`` (``DDP``, ``HSDP``,
    ``FSDP``) plugged in.

    Usage (one process per local rank)::

        el = Elastic(DDP(model, optimizer), Settings(job="train"))
        while el.step < total_steps:
            loss = el.run_step(lambda ddp: train_step(ddp, batch_for(el.step, el.rank)))
        el.exit(0)

    ``state``: the rest of the training state (``torchhook.state.TrainingState``:
    registered objects such as the LR scheduler and the sampler, RNG, ``on_reset``
    callbacks); default: the RNG only. Receivers of a new group take it from the plan's
    source rank; schedulers are rebuilt over a new optimizer.
    """

    def __init__(
        self,
        parallelism: Parallelism,
        settings: Settings,
        *,
        state: TrainingState | None = None,
    ) -> None:
        self.settings = settings
        self.parallelism = parallelism
        self.state = TrainingState() if state is None else state
        self._carry = Carry(self.state)
        local_rank, local_world_size = local_place(settings.local_rank, settings.local_world_size)
        backend = settings.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.groups = ProcessGroups(backend, local_rank)
        self.device = self.groups.device
        self.pg_timeout = timedelta(seconds=settings.pg_timeout_s)
        self.step = 0
        self.rank = -1
        self.world_size = 0
        self.layout: Layout | None = None
        """The current group's nodes and their ranks."""
        self.group_names: tuple[str, ...] = ()
        self.order: tuple[str, ...] = ()
        """Node names in rank order (``order[0]`` holds rank 0)."""
        self.group_token = ""
        self.last_plan: Plan | None = None
        self.reconfigurations = 0
        self.last_formation_s = 0.0
        self._group: Group | None = None
        self._addrs: dict[str, str] = {}
        self._has_state = False
        self._applied_in = ""
        """Token of the group in which this rank applied its last step or took its state."""
        self._held_failed = False
        self._last_beat = 0.0
        self._formation_store: TCPStore | None = None
        self.timeline = Timeline()
        """Phases of the last re-formation, verdict to first step (for measurements)."""
        if settings.spare:  # register once the job is at its target: younger than its nodes
            await_target(settings.job, settings.control, settings.target_nodes,
                         settings.join_timeout_s, local_rank, local_world_size)  # fmt: skip
        # in order of need: directory store (rank 0's port is registered), membership, formation
        directory = (
            TcpNet().serve(settings.store_host, self.pg_timeout) if local_rank == 0 else None
        )
        self.membership = Membership(
            settings.job,
            control=settings.control,
            store_port=0 if directory is None else directory.port,
            heartbeat_pause_ms=settings.heartbeat_pause_ms,
            local_rank=local_rank,
            local_world_size=local_world_size,
        )
        self.formation = Formation(
            self._view,
            local_rank=local_rank,
            beat=self._beat,
            timeout_s=settings.formation_timeout_s,
            store_host=settings.store_host,
            op_timeout=self.pg_timeout,
            directory=directory,
            choose=lambda v: roster(self.layout, v.members, settings.target_nodes).layout,
        )
        self.node = self.membership.node
        self.local_rank = self.membership.local_rank
        self.watch = GroupWatch(self.node)
        """Fails this group's collectives when the view drops one of its nodes."""
        # the watch ending (the agent gone) breaks the group too: no verdict could come
        self.membership.add_listener(self.watch.on_view, on_closed=self.watch.on_closed)
        self.pace = Pace(settings, self.membership, self._wait, self._beat)  # fail-slow
        self.spares = Spares(settings.target_nodes, self.membership, self.formation, self._beat,
                             settings.spare_wait_s)  # fmt: skip

    # --- the training-loop API --------------------------------------------------------

    @property
    def model(self) -> nn.Module | None:
        """The local module (sharded for HSDP/FSDP; rebuilt per group there)."""
        return self.parallelism.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer (rebuilt per group for HSDP/FSDP: read it inside the step)."""
        return self.parallelism.optimizer

    def shard(self, global_batch_size: int) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of a global batch (contiguous, sizes differ by <= 1)."""
        self._ensure_group()
        sizes = split_evenly(global_batch_size, self.world_size)  # torchhook.batching's rule
        lo = sum(sizes[: self.rank])
        return lo, lo + sizes[self.rank]

    def run_step(self, fn: Callable[[Any], T]) -> T:
        """Run one training step: ``fn`` gets the model (DDP: the wrapper; HSDP/FSDP: the
        sharded module), then the strategy adds its part (HSDP: the cross-node reduce,
        the commit and the optimizer step; FSDP: the checkpoint).

        A lost group re-forms and the step runs again, in the new group; the step counter
        advances only when the step returns. So ``fn`` must finish every collective
        (including its own ``all_reduce`` of the loss) before it changes local state
        (``optimizer.step()``): a step that fails after the optimizer step would be
        applied twice on this rank when it runs again. Anything that is not a group
        failure stops the job (``torchhook.errors``)."""
        for _ in range(self.settings.reform_attempts):
            self._ensure_group()
            assert self._group is not None
            try:
                if self._control_says_switch():
                    self._abandon(failed=False)
                    continue
                self.timeline.mark("control")
                with self.pace.step(self._group, self.step):  # may exclude a slow node
                    result = self.parallelism.run(fn, self._group, self.step)
            except Exception as exc:
                if isinstance(exc, PASS_THROUGH):
                    self._abandon(failed=True)
                    raise
                fatal = classify(exc, verdict=self.watch.broken, where=f"step {self.step}")
                if fatal is not None:
                    self._abandon(failed=True)
                    if fatal is exc:
                        raise
                    raise fatal from exc
                lost = None if self.watch.broken else self._lost_peers(str(exc))
                del exc  # its frames pin the dead group
                self._report_lost(lost)
                self._abandon(failed=True)
                continue
            self.step += 1
            self.timeline.close()
            self._carry.committed()  # the data feeds advance (torchhook.feed)
            self._applied_in = self.group_token
            self._beat(force=True)
            return result
        raise ReformBudgetSpent(
            f"step {self.step}: the group changed {self.settings.reform_attempts} times "
            "(reform_attempts) before the step could finish"
        )

    def scheduler(self, name: str, factory: Callable[[torch.optim.Optimizer], S]) -> Rebuilt[S]:
        """``factory(optimizer)`` (an LR scheduler) over the strategy's optimizer, in
        ``state`` under ``name``, rebuilt over every new optimizer. HSDP and FSDP build the
        optimizer only with the first group: then this forms it. Call it on every rank
        before the first step; step the returned object (``.step()``)."""
        optimizer = self.parallelism.optimizer
        if optimizer is not None:
            return self.state.scheduler(name, factory, optimizer)
        self._carry.pending[name] = factory
        self._ensure_group()
        return self.state.rebuilt(name)

    def data(self, loader: Iterable[Any], name: str = "data") -> DataFeed:
        """``loader`` (a ``DataLoader`` with ``batch_sampler=ElasticSampler(...)``, or the
        sampler) across world changes: its position travels in ``state`` under ``name``,
        it is reconfigured at every group and advanced when a step commits. In the step
        function: ``for x, y in feed.batches():`` (torchhook.feed has the rules). Call it
        on every rank before :meth:`scheduler` and the first step."""
        formed = self.reconfigurations > 0
        return self._carry.data(loader, name, self.parallelism.no_sync, formed=formed)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """An all-reduce that a membership verdict can interrupt (MembershipChanged)."""
        self._wait(dist.all_reduce(tensor, op=op, async_op=True))
        return tensor

    def accumulate(self) -> AbstractContextManager[None]:
        """Backward inside adds up a micro-batch (DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``); the last runs outside (:meth:`micro_batches`)."""
        return self.parallelism.no_sync()

    def micro_batches(self, n: int) -> Iterator[int]:
        """``0..n-1``; every micro-batch but the last accumulates (:meth:`accumulate`),
        inside the step function: ``for i in el.micro_batches(4): loss(i).backward()``."""
        return micro_batches(self.parallelism.no_sync, n)

    def paused(self, reason: str, max_s: float = DEFAULT_PAUSE_S) -> AbstractContextManager[None]:
        """``with el.paused("checkpoint", max_s=300):`` this rank is paused on purpose (an
        evaluation, a sync checkpoint): no hang verdict until the block ends or ``max_s``
        passes (docs/training.md §8). A no-op with a client that cannot pause."""
        pause = getattr(self.membership, "paused", None)
        return contextlib.nullcontext() if pause is None else pause(reason, max_s)

    def exit(self, code: int = 0) -> None:
        """Leave the process. With a stuck group in the graveyard a normal exit would block
        until its op times out, so this uses ``os._exit``."""
        self.parallelism.close()
        self.membership.close()
        if self.groups.graveyard:
            logging.shutdown()
            os._exit(code)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(code)

    @property
    def verdict_time(self) -> float | None:
        """Wall clock when the view last dropped a member of our group (for measurements)."""
        return self.watch.verdict_time

    def _view(self) -> View:
        return self.membership.view

    def _beat(self, *, force: bool = False) -> None:
        if (now := time.monotonic()) - self._last_beat >= HEARTBEAT_EVERY_S or force:
            self._last_beat = now
            self.membership.heartbeat(self.step)

    # --- failures -----------------------------------------------------------------------

    def _lost_peers(self, error: str) -> list[str]:
        return lost_peers(error, self.order, self.node, self._addrs)

    def _report_lost(self, lost: list[str] | None) -> None:
        with contextlib.suppress(MembershipClosed):
            if lost:
                self.membership.report_lost(lost)

    def _wait(self, work: Any) -> None:
        with self.pace.waiting():  # a wait for peers is not this rank's compute time
            self.groups.wait(work, lambda: self.watch.broken, self._beat, self.watch)

    def _control_says_switch(self) -> bool:
        """Step boundary: does any member see a view that differs from the group?"""
        view = self.membership.view
        differs = self.watch.differs(view)
        if differs and self.settings.target_nodes:  # a new spare is no reason to switch
            lost = bool(self.watch.lost({(m.name, m.registered_ms) for m in view.members}))
            differs = self.spares.differs(self.layout, view, lost)
        flag = torch.tensor([1 if differs else 0], dtype=torch.int32, device=self.device)
        self._wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        return bool(flag.item())

    # --- leaving a group --------------------------------------------------------------

    def _abandon(self, *, failed: bool) -> None:
        """Stop using the group. Gloo releases it at once after a failure (its closed
        sockets make peers not wired to the dead rank fail too); otherwise the group is
        kept until the next plan says whether to shrink it or tear it down."""
        self.timeline.open("left")
        self.watch.disarm()
        self._group = None
        self._held_failed = self._held_failed or failed
        self.parallelism.abandon(failed)
        self.timeline.mark("kept")
        if failed and tears_down_at_failure(self.groups.backend):
            self._release()
        self.timeline.mark("released")

    def _release(self) -> None:
        self.groups.teardown(
            teardown_of(self.groups.backend, self._held_failed), self._formation_store
        )
        self._formation_store = None
        self._held_failed = False

    # --- forming a group: bounded by the re-formation budget ----------------------------

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        s = self.settings
        drafter = None  # a spare follows the member whose offer listed it (formation rule 12)
        if s.target_nodes and self.layout is None:
            drafter = self.spares.wait_for_draft()  # torchhook.spares: until an offer lists us
        started = time.monotonic()
        view_deadline = started + s.join_timeout_s
        budget = ReformBudget(s, time.monotonic)
        for attempt in range(1, s.reform_attempts + 1):
            view = wait_for_usable_view(
                self.membership, self.node, s, self.group_names, view_deadline, self._beat
            )
            self.timeline.mark("view")
            log.debug("forming on view %d %s %s", view.generation, view.fingerprint, view.names)
            try:
                self._form(view, drafter)
            except Exception as exc:
                unreachable = isinstance(exc, Retry) and exc.unreachable
                retryable = isinstance(exc, (Retry, ShrinkFailed))
                fatal: BaseException | None = None
                if isinstance(exc, PASS_THROUGH):
                    fatal = exc
                elif not retryable:
                    fatal = classify(exc, verdict=False, where="forming")
                # the first line says why (torch appends a C++ stack trace)
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self._abandon(failed=True)
                if fatal is not None:
                    if fatal is exc:
                        raise
                    raise fatal from exc
                del exc  # its frames pin the group
                log.info(
                    "formation on %s failed (attempt %d): %s", view.fingerprint, attempt, first
                )
                if s.target_nodes and self.layout is None:  # a spare: wait for the next draft
                    drafter = self.spares.wait_for_draft()
                    continue
                await_new_view(
                    self.membership, view.fingerprint, budget.failed(first, unreachable=unreachable)
                )
                continue
            self.reconfigurations += 1
            self.last_formation_s = time.monotonic() - started
            return
        raise ReformBudgetSpent(f"no group formed in {s.reform_attempts} attempts")

    def _form(self, view: View, drafter: str | None = None) -> None:
        agreed = self.formation.agree(
            view, self.node, self.local_rank, self._rank_info(), self._decide, drafter
        )
        plan = agreed.plan
        self.timeline.mark("agreed")
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
        self.timeline.mark("group")
        self._start_group(view, agreed.layout, agreed.rank, agreed.token, plan)

    def _rank_info(self) -> RankInfo:
        held = self.groups.held
        return RankInfo(
            self.group_token if held else "",
            self.layout if held else None,
            self.step,
            self._has_state,
            self._applied_in,
            self.parallelism.pending_in(),
        )

    def _decide(self, layout: Layout, infos: list[RankInfo]) -> Plan:
        return decide(
            layout,
            infos,
            backend=self.groups.backend,
            supports_shrinking=self.groups.supports_shrinking(),
            shards=self.parallelism.shards(self.membership.local_world_size),
        )

    def _start_group(self, view: View, layout: Layout, rank: int, token: str, plan: Plan) -> None:
        self.rank, self.world_size = rank, layout.world_size
        self.layout = layout
        self.order = self.group_names = tuple(n.name for n in layout.nodes)
        self._addrs = {m.name: m.addr for m in view.members}
        self.group_token = token
        self.last_plan = plan
        self.watch.arm(view, layout.ids, token)
        world = layout.world_size
        group = Group(
            rank, world, layout, token, self.node, self.local_rank, self.device, self.groups,
            self.settings.pg_timeout_s, self._wait,
            lambda bucket: self.pace.bucket(self.watch.comm_hook(bucket, world)),
            lambda: encode(self.state.capture()), self.timeline.mark,
        )  # fmt: skip
        self.step = self.parallelism.setup(group, plan)
        self.timeline.mark("setup")
        # schedulers, the snapshot from the source or a checkpoint, on_reset (carry.py)
        self._carry.after_setup(group, plan, self.parallelism, self.order, self.step)
        self.timeline.mark("carried")
        self._group = group
        self._has_state = True
        self._applied_in = token  # every rank of the group now holds the same state
        self.membership.set_group(token)
        self.spares.tell("training")
        nodes = " ".join(f"{n.name}x{n.ranks}" for n in layout.nodes)
        log.info("group %s: rank %d of %d (%s) at step %d, %s from rank %d", token, rank, world,
                 nodes, self.step, plan.action, plan.source)  # fmt: skip
