"""A trainer's escape hatch: when the membership view drops a member of the current group,
every collective of that group that is in flight, or about to start, fails at once.

Gloo cannot abort a collective, and a dead peer's silence would hold it until the group
timeout; so the verdict comes from the agent's detector (``torchhook.client``'s watcher
thread calls ``GroupWatch.on_view``) and is applied here:

- DDP's gradient buckets go through ``comm_hook``: a Future this module hands out and
  fails with ``MembershipChanged`` when the verdict arrives; the all-reduce underneath is
  left to finish or fail on its own (the group is abandoned either way).
- Our own collectives wait on an event that the op's completion and the verdict both set
  (``groups.ProcessGroups.wait`` with this object as its ``wakes``): no slice to run out.
- A node the group formed with but our view has not shown yet is late gossip, not a loss:
  only nodes this rank has *seen* in the group and no longer sees count (``lost``).
- A group member that showed our group's token and now shows another moved on without
  us (we were stopped or cut off): that also breaks the group.
- The watch itself ending (the agent gone, a bad frame, a listener's bug: ``on_closed``)
  breaks the group too: no verdict could arrive any more, so a collective in flight must
  not wait for the group timeout.

Thread safety: the watcher thread and the training thread share this object. ``_lock``
guards every field (``_running``, ``_broken``, ``_token``, ``_group_ids``, ``_seen``,
``_confirmed``, ``_pending``, ``_waiters``, ``_verdict_time``, ``_why``): each read and
write holds it, so a view is judged against one armed group, never half of an old one and
half of a new one.
Futures are completed *outside* the lock: completing a torch Future runs its callbacks
inline on the completing thread (DDP's continuation of the bucket, a user's ``then``), and
one that asks this object (``broken``) would deadlock on the non-reentrant lock. The order
that keeps every Future ending exactly once: a Future leaves ``_pending`` under the lock,
taken by exactly one party (the verdict, which takes them all, or its own all-reduce's
completion), and only that party completes it, after releasing the lock. A verdict never
waits on the training thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from torchhook.client import View
from torchhook.groups import MembershipChanged

__all__ = ["GroupWatch"]

log = logging.getLogger("torchhook.elastic")

NodeId = tuple[str, int]
"""A node's identity in a view: (name, registered_ms); a restarted node is a new one."""
Pending = list[torch.futures.Future[torch.Tensor]]


class GroupWatch:
    """Whether this rank's current group still stands, and the Futures to fail if not."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._pending: Pending = []
        self._broken = False
        self._running = False
        self._token = ""
        self._group_ids: frozenset[NodeId] = frozenset()
        self._seen: set[NodeId] = set()
        self._confirmed: set[str] = set()
        self._verdict_time: float | None = None
        self._why = ""
        self._waiters: set[threading.Event] = set()
        """Events of the collectives waiting now (``groups.ProcessGroups.wait``), one per
        thread that waits: set by the verdict, so a wait ends without polling."""

    # --- the training thread ------------------------------------------------------------

    def arm(self, view: View, group_ids: frozenset[NodeId], token: str) -> None:
        """A new group ``token`` of nodes ``group_ids`` formed on ``view``: watch it."""
        seen = {(m.name, m.registered_ms) for m in view.members} & group_ids
        with self._lock:
            self._group_ids = group_ids
            self._seen = seen
            self._token = token
            self._confirmed = set()
            self._broken = False
            self._why = ""
            # from here a verdict can interrupt the setup's collectives
            self._running = True

    def disarm(self) -> None:
        """The group is abandoned: later views are not verdicts about it."""
        with self._lock:
            self._running = False

    def add(self, event: threading.Event) -> None:
        """A collective waits on ``event``: the verdict sets it (at once if it is in)."""
        with self._lock:
            self._waiters.add(event)
            broken = self._broken
        if broken:
            event.set()

    def discard(self, event: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(event)

    @property
    def broken(self) -> bool:
        with self._lock:
            return self._broken

    @property
    def group_ids(self) -> frozenset[NodeId]:
        with self._lock:
            return self._group_ids

    @property
    def verdict_time(self) -> float | None:
        """Wall clock when the view last dropped a member of our group (for measurements)."""
        with self._lock:
            return self._verdict_time

    def differs(self, view: View) -> bool:
        """Does ``view`` differ from the group (a node more, or a seen node gone)? A suspect
        outside the group is no node more: growing toward a member that may be dead costs
        a formation it cannot join; once it refutes (alive) it is one. So a group formed
        without a node that another agent left out early (agent/crash_evidence.py) does
        not switch back while our view still lists the node as suspect."""
        ids = {(m.name, m.registered_ms) for m in view.members}
        alive = {(m.name, m.registered_ms) for m in view.members if m.status != "suspect"}
        with self._lock:
            return bool(alive - self._group_ids or self._lost(ids))

    def lost(self, ids: set[NodeId]) -> set[NodeId]:
        """Group nodes that this rank's view showed and no longer shows. The group formed
        on the leader's view, which may list a node that our view does not show yet: that
        is late gossip, not a loss."""
        with self._lock:  # the watcher thread and the training thread both ask
            return self._lost(ids)

    def _lost(self, ids: set[NodeId]) -> set[NodeId]:
        self._seen |= ids & self._group_ids
        return self._seen - ids

    def comm_hook(self, bucket: Any, world_size: int) -> torch.futures.Future[torch.Tensor]:
        """DDP's gradient all-reduce (mean), behind a Future a verdict can fail."""
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        with self._lock:
            broken, why = self._broken, self._why
            if not broken:
                self._pending.append(out)
        if broken:  # no bucket is touched and no collective starts on a broken group
            failed = MembershipChanged(f"membership changed: {why}")
            out.set_exception(failed)  # type: ignore[arg-type]
            return out
        tensor = bucket.buffer().div_(world_size)
        fut = dist.all_reduce(tensor, async_op=True).get_future()

        def done(f: torch.futures.Future[Any]) -> None:
            with self._lock:
                if out not in self._pending:
                    return  # a verdict took it and fails it
                self._pending.remove(out)
            try:
                result = f.value()[0]
            except Exception as exc:
                out.set_exception(RuntimeError(str(exc)))  # type: ignore[arg-type]
            else:
                out.set_result(result)

        fut.add_done_callback(done)
        return out

    # --- the watcher thread -------------------------------------------------------------

    def on_view(self, view: View) -> None:
        """A new view from the agent: break the group if it lost a member or moved on."""
        ids = {(m.name, m.registered_ms) for m in view.members}
        with self._lock:
            if not self._running or self._broken:
                return  # no group, or its verdict is in: its Futures are failed already
            lost = self._lost(ids)
            # a peer that showed our group's token and now shows another has moved on
            # without us (we were stopped, or cut off); one that never showed ours is only
            # late gossip
            moved = False
            for m in view.members:
                if (m.name, m.registered_ms) not in self._group_ids or m.name == self.node:
                    continue
                if m.group == self._token:
                    self._confirmed.add(m.name)
                elif m.name in self._confirmed:
                    moved = True
            if not (lost or moved):
                return
            self._verdict_time = time.time()
            why = (
                f"view {view.generation} dropped {sorted(n for n, _ in lost)}"
                if lost
                else "the group moved on without us"
            )
            token, pending = self._break(why)
        _fail(pending, token, why)

    def on_closed(self, error: BaseException) -> None:
        """The watch ended (``torchhook.client.Membership`` calls this once): no verdict
        can arrive any more, so the group is broken now rather than at the group timeout."""
        self.fail_pending(f"the watch of the membership ended: {error}")

    def fail_pending(self, why: str) -> None:
        """Break the group and fail every Future in flight with ``MembershipChanged``."""
        with self._lock:
            token, pending = self._break(why)
        _fail(pending, token, why)

    def _break(self, why: str) -> tuple[str, Pending]:
        """Under the lock: mark the group broken and take its pending Futures."""
        if not self._broken:
            self._why = why
        self._broken = True
        pending, self._pending = self._pending, []
        for event in self._waiters:  # setting an event runs no callback: safe under the lock
            event.set()
        return self._token, pending


def _fail(pending: Pending, token: str, why: str) -> None:
    """Outside the lock: these Futures were taken from ``_pending``, so nothing else
    completes them."""
    for fut in pending:
        fut.set_exception(MembershipChanged(why))  # type: ignore[arg-type]
    log.warning("abandoning group %s: %s", token, why)
