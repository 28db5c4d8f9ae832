"""In-process elastic DDP on gloo, driven by the local agent's job view.

When a member of the current group dies, the survivors leave the collective in flight,
form a new process group among themselves and keep training in the same processes; a new
node joins at a step boundary. The recipe and every pitfall it avoids are measured facts
from ``shared/research/torch-elastic.md`` (§0, B3, B4, "Recipe", "Pitfalls"):

- Escape comes from the membership verdict, never from gloo, which cannot abort
  (Pitfall 1): DDP gradients go through a comm hook whose Future a watcher fails when the
  view drops a member (B4), and our own collectives wait in short slices that check the
  verdict (B3). The PG timeout (``pg_timeout_s``) is only a backstop (Pitfall 9).
- A group whose op may still be stuck is never destructed (that blocks until the op times
  out, Pitfall 4): it goes to a graveyard, and ``exit()`` leaves with ``os._exit``.
  Exceptions from a dead group are not kept (Pitfall 3); ``torch._dynamo`` is imported
  before the first group exists (B4's pinned-PG leak).
- Every formation uses a new store (Pitfall 6), hosted by the view's oldest member
  (Pitfall 7): each trainer serves a small "directory" TCPStore whose port travels in its
  job registration; the leader creates a fresh store per formation and publishes its port
  in its directory under the view's fingerprint.
- Members agree on the group through the view fingerprint; a member with a different view
  waits for the same keys in vain, notices the view change and retries with the latest
  one (Pitfall 8). All ranks switch at the same step: a control all-reduce (MAX) of
  "my view differs from the group" opens every step (Horovod's check_host_updates, A2).
- State comes from the member with the highest step (ties: the oldest), which becomes
  rank 0: DDP's constructor broadcasts parameters and buffers from it, and we broadcast
  optimizer state, step, torch RNG and the caller's extra state (Pitfall 10). A member
  that was stopped and comes back carries an old step and so never overwrites the group.
- Split brain: a member of a previous group forms a new one only with a strict majority of
  that group (``quorum="majority"``, as torchft recommends, A2), so a partitioned minority
  waits instead of training on its own.

Data: the global batch of each step is fixed; ``shard(global_batch_size)`` gives this
rank's contiguous slice for the current world size, so a re-shard is implicit and, with a
batch divisible by every world size in use, the loss curve equals a failure-free run.
One trainer process per node registers in a job (the agent holds one registration per
job per node).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

# imported before any process group exists: the lazy import in the first DDP() pins that
# group forever and keeps its sockets open (research B4)
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.nn.parallel import DistributedDataParallel as DDP

from torchhook.client import Membership, View

log = logging.getLogger("torchhook.elastic")
T = TypeVar("T")
WAIT_SLICE = timedelta(milliseconds=20)
POLL_S = 0.01
DIRECTORY_OP = timedelta(seconds=1)
"""A directory request to a stopped host blocks for this long before the view is rechecked."""
GLOO_FAILURES = ("gloo", "Connection closed by peer", "Connection reset by peer", "Timed out")
RETRY_BACKOFF_S = 0.2
STORE_CONNECT = timedelta(seconds=0.5)
"""Connecting to a formation store or a directory: TCPStore retries a refused connection
until this runs out, and a gloo error can start a formation on a view that still lists a
dead leader; a short attempt, retried through the view, costs at most this after the
verdict (BENCHMARKS.md saw 3 s with 3 s)."""
HEARTBEAT_EVERY_S = 0.1
"""Heartbeats from wait loops are spaced out; one per step is always sent."""


class MembershipChanged(RuntimeError):
    """Raised out of a collective that was abandoned because the view dropped a member."""


class QuorumLost(RuntimeError):
    """This member cannot reach a majority of its last group (it is the minority side)."""


class _Retry(Exception):
    """A formation attempt that must start over with the latest view."""


class ElasticDDP:
    """Owns the process group, the DDP wrapper and the step counter of one trainer.

    Usage::

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
    ) -> None:
        if quorum not in ("majority", "any"):
            raise ValueError(f"quorum must be 'majority' or 'any', got {quorum!r}")
        if min_nodes < 1:
            raise ValueError("min_nodes must be >= 1")
        self.model = model
        self.optimizer = optimizer
        self.min_nodes = min_nodes
        self.quorum = quorum
        self.pg_timeout = timedelta(seconds=pg_timeout_s)
        self.formation_timeout_s = formation_timeout_s
        self.join_timeout_s = join_timeout_s
        self._extra_state = extra_state
        self._load_extra_state = load_extra_state
        self.step = 0
        self.rank = -1
        self.world_size = 0
        self.ddp: Any = None
        """The wrapped model the step function gets (a DDP module; None between groups)."""
        self.group_names: tuple[str, ...] = ()
        self.order: tuple[str, ...] = ()
        self._group_ids: frozenset[tuple[str, int]] = frozenset()
        self.group_token = ""
        self._confirmed: set[str] = set()
        self._last_beat = 0.0
        self.reconfigurations = 0
        self.last_formation_s = 0.0
        self.verdict_time: float | None = None
        """Wall clock when the view last dropped a member of our group (for measurements)."""
        self._directory = TCPStore(
            store_host, 0, is_master=True, wait_for_workers=False, timeout=self.pg_timeout
        )
        self._formation_store: TCPStore | None = None
        self._dir_clients: dict[tuple[str, int], TCPStore] = {}
        self._graveyard: list[Any] = []
        self._lock = threading.Lock()
        self._pending: list[torch.futures.Future[torch.Tensor]] = []
        self._broken = False
        self._running = False
        self.membership = Membership(
            job,
            control=control,
            store_port=self._directory.port,
            heartbeat_pause_ms=heartbeat_pause_ms,
        )
        self.node = self.membership.node
        self.membership.add_listener(self._on_view)

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
        the step counter advances only when ``fn`` returns."""
        while True:
            self._ensure_group()
            try:
                if self._control_says_switch():
                    self._teardown(stuck=False)
                    continue
                assert self.ddp is not None
                result = fn(self.ddp)
            except Exception as exc:
                if not self._group_failed(exc):
                    raise
                del exc
                # do not keep the exception: its frames pin the dead group (Pitfall 3)
                self._teardown(stuck=True)
                continue
            self.step += 1
            self._beat(force=True)
            return result

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """An all-reduce that a membership verdict can interrupt (MembershipChanged)."""
        self._wait(dist.all_reduce(tensor, op=op, async_op=True))
        return tensor

    def exit(self, code: int = 0) -> None:
        """Leave the process. With a stuck group in the graveyard a normal exit would block
        until its op times out (Pitfall 4), so this uses ``os._exit``."""
        self.membership.close()
        if self._graveyard:
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

    # --- verdicts (the watcher thread) -------------------------------------------------

    def _on_view(self, view: View) -> None:
        if not self._running:
            return
        ids = {(m.name, m.registered_ms) for m in view.members}
        lost = self._group_ids - ids
        # a peer that showed our group's token and now shows another has moved on without
        # us (we were stopped, or cut off); one that never showed ours is only late gossip
        moved = False
        for m in view.members:
            if (m.name, m.registered_ms) not in self._group_ids or m.name == self.node:
                continue
            if m.group == self.group_token:
                self._confirmed.add(m.name)
            elif m.name in self._confirmed:
                moved = True
        if lost or moved:
            self.verdict_time = time.time()
            self._fail_pending(
                f"view {view.generation} dropped {sorted(n for n, _ in lost)}"
                if lost
                else "the group moved on without us"
            )

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            self._broken = True
            pending, self._pending = self._pending, []
            for fut in pending:
                if not fut.done():
                    fut.set_exception(MembershipChanged(why))  # type: ignore[arg-type]
        log.warning("abandoning group %s: %s", self.group_token, why)

    def _group_failed(self, exc: BaseException) -> bool:
        """After an exception in a step: did the group fail (verdict, or a peer gone)?

        A peer's crash reaches the ranks wired to it as a gloo error before any verdict
        (B3); re-forming at once is right, because formation waits for a consistent view.
        Anything else is the caller's bug and propagates. The gloo errors have no type of
        their own (Pitfall 11), hence the message test."""
        if self._broken or isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        return any(mark in text for mark in GLOO_FAILURES)

    # --- collectives ------------------------------------------------------------------

    def _wait(self, work: Any) -> None:
        while True:
            if self._broken:
                raise MembershipChanged("membership changed during a collective")
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
            self._beat()

    def _comm_hook(self, _state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        with self._lock:
            if self._broken:
                out.set_exception(MembershipChanged("membership changed"))  # type: ignore[arg-type]
                return out
            self._pending.append(out)
        tensor = bucket.buffer().div_(self.world_size)
        fut = dist.all_reduce(tensor, async_op=True).get_future()

        def done(f: torch.futures.Future[Any]) -> None:
            with self._lock:
                if out.done():
                    return
                if out in self._pending:
                    self._pending.remove(out)
                try:
                    out.set_result(f.value()[0])
                except Exception as exc:
                    out.set_exception(RuntimeError(str(exc)))  # type: ignore[arg-type]

        fut.add_done_callback(done)
        return out

    def _control_says_switch(self) -> bool:
        """Step boundary: does any member see a view that differs from the group?"""
        view = self.membership.view
        differs = {(m.name, m.registered_ms) for m in view.members} != self._group_ids
        flag = torch.tensor([1 if differs else 0], dtype=torch.int32)
        self._wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        return bool(flag.item())

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
            except (_Retry, RuntimeError) as exc:
                # a peer that died during formation surfaces as a store or gloo error; the
                # first line says which (torch appends a C++ stack trace)
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.info("formation of %s retried: %s", view.fingerprint, first)
                del exc
                self._teardown(stuck=True)
                if self.membership.view.fingerprint == view.fingerprint:
                    time.sleep(RETRY_BACKOFF_S)  # same view: do not spin on a dead leader
        self.reconfigurations += 1
        self.last_formation_s = time.monotonic() - started

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
        deadline = time.monotonic() + self.formation_timeout_s
        leader = view.members[0]
        key = f"formation/{view.fingerprint}"
        if leader.name == self.node:
            store = self._host_formation(key)
        else:
            store = self._join_formation(view, key, deadline)
        log.debug("formation %s: store ready", view.fingerprint)
        try:
            token = store.get("token").decode()
            order = self._exchange_steps(store, view, deadline)
            rank = order.index(self.node)
            log.debug("formation %s: steps exchanged", view.fingerprint)
            dist.init_process_group(
                "gloo",
                store=PrefixStore("pg", store),
                rank=rank,
                world_size=len(order),
                timeout=self.pg_timeout,
            )
        finally:
            if leader.name == self.node:
                self._directory.delete_key(key)
        log.debug("formation %s: process group up", view.fingerprint)
        self._start_group(view, order, rank, token)

    def _host_formation(self, key: str) -> TCPStore:
        self._formation_store = TCPStore(
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.formation_timeout_s),
        )
        # a fresh token per formation, even for the same members (Pitfall 6)
        self._formation_store.set("token", os.urandom(8).hex())
        self._directory.set(key, str(self._formation_store.port))
        return self._formation_store

    def _join_formation(self, view: View, key: str, deadline: float) -> TCPStore:
        leader = view.members[0]
        directory = self._directory_of(leader.addr, leader.store_port)
        try:
            self._poll(lambda: directory.check([key]), view, deadline, f"leader {leader.name}")
        except _Retry:
            # a broken connection stays broken: connect afresh next time
            self._dir_clients.pop((leader.addr, leader.store_port), None)
            raise
        port = int(directory.get(key))
        store = self._connect_store(leader.addr, port, "formation store")
        store.set_timeout(timedelta(seconds=self.formation_timeout_s))
        return store

    def _directory_of(self, addr: str, port: int) -> TCPStore:
        client = self._dir_clients.get((addr, port))
        if client is None:
            client = self._connect_store(addr, port, "directory")
            client.set_timeout(DIRECTORY_OP)
            self._dir_clients[(addr, port)] = client
        return client

    def _connect_store(self, addr: str, port: int, what: str) -> TCPStore:
        """A TCPStore client, built on a helper thread while this one keeps beating.

        The constructor's handshake has no deadline: a leader whose process is stopped
        (SIGSTOP; the kernel still accepts the connection) would hold us, and our
        heartbeats, until it resumes, and the agent would flag us hung too. After
        ``STORE_CONNECT`` we give up on it (the thread ends when the peer resumes or dies)
        and retry through the view, which by then drops the stopped leader."""
        result: list[Any] = []

        def connect() -> None:
            try:
                result.append(TCPStore(addr, port, is_master=False, timeout=STORE_CONNECT))
            except (RuntimeError, OSError) as exc:
                result.append(exc)

        thread = threading.Thread(target=connect, name=f"connect-{what}", daemon=True)
        thread.start()
        deadline = time.monotonic() + STORE_CONNECT.total_seconds()
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(POLL_S)
            self._beat()
        if not result:
            raise _Retry(f"{what} at {addr}:{port}: no answer within {STORE_CONNECT}")
        if isinstance(result[0], BaseException):
            raise _Retry(f"{what} at {addr}:{port}: {result[0]}")
        store: TCPStore = result[0]
        return store

    def _exchange_steps(self, store: TCPStore, view: View, deadline: float) -> list[str]:
        """Publish our step; wait for everyone's; rank 0 is the highest step (ties: oldest)."""
        store.set(f"step/{self.node}", str(self.step))
        keys = [f"step/{n}" for n in view.names]
        self._poll(lambda: store.check(keys), view, deadline, "every member's step")
        steps = {n: int(store.get(f"step/{n}")) for n in view.names}
        source = max(view.names, key=lambda n: (steps[n], -view.names.index(n)))
        return [source, *(n for n in view.names if n != source)]

    def _poll(self, ready: Callable[[], bool], view: View, deadline: float, what: str) -> None:
        while True:
            try:
                if ready():
                    return
            except (RuntimeError, OSError) as exc:
                raise _Retry(f"waiting for {what}: {exc}") from None
            if self.membership.view.fingerprint != view.fingerprint:
                raise _Retry("the view changed")
            if time.monotonic() > deadline:
                raise _Retry(f"timed out waiting for {what}")
            self._beat()
            time.sleep(POLL_S)

    def _start_group(self, view: View, order: list[str], rank: int, token: str) -> None:
        self.rank, self.world_size = rank, len(order)
        self.order = tuple(order)
        log.debug("group %s: setting up the model", token)
        self.ddp = self._setup_model()
        self.group_names = tuple(view.names)
        self._group_ids = frozenset((m.name, m.registered_ms) for m in view.members)
        self.group_token = token
        self._confirmed = set()
        with self._lock:
            self._broken = False
        self._running = True
        self.membership.set_group(self.group_token)
        log.info(
            "group %s: rank %d of %d %s at step %d",
            self.group_token,
            rank,
            len(order),
            order,
            self.step,
        )

    def _setup_model(self) -> Any:
        """Make model and optimizer consistent in the new group; returns what ``run_step``
        hands to the step function. Subclasses (FSDP) override this."""
        for p in self.model.parameters():
            p.grad = None
        ddp = DDP(self.model)  # broadcasts parameters and buffers from rank 0
        # a lambda: DDP inspects annotations, which __future__ annotations turn into strings
        ddp.register_comm_hook(None, lambda state, bucket: self._comm_hook(state, bucket))
        self._sync_state()
        return ddp

    def _sync_state(self) -> None:
        payload: list[Any] = [None]
        if self.rank == 0:
            payload[0] = {
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "rng": torch.get_rng_state(),
                "extra": self._extra_state() if self._extra_state else None,
            }
        dist.broadcast_object_list(payload, src=0)
        state = payload[0]
        if self.rank != 0:
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            torch.set_rng_state(state["rng"])
            if self._load_extra_state is not None:
                self._load_extra_state(state["extra"])

    def _teardown(self, *, stuck: bool) -> None:
        self._running = False
        self.ddp = None
        if dist.is_initialized():
            if stuck:
                # an abandoned op may still run in it: destructing it would block (Pitfall 4)
                self._graveyard.append((dist.group.WORLD, self._formation_store))
            dist.destroy_process_group()
        self._formation_store = None
        self.rank, self.world_size = -1, 0
