"""A trainer's escape hatch: when the membership view drops a member of the current group,
every collective of that group that is in flight, or about to start, fails at once.

Gloo cannot abort a collective, and a dead peer's silence would hold it until the group
timeout; so the verdict comes from the agent's detector (``torchhook.client``'s watcher
thread calls ``GroupWatch.on_view``) and is applied here:

- DDP's gradient buckets go through ``comm_hook``: a Future this module hands out and
  fails with ``MembershipChanged`` when the verdict arrives; the all-reduce underneath is
  left to finish or fail on its own (the group is abandoned either way).
- Our own collectives wait in short slices that ask ``broken`` (``groups.ProcessGroups.wait``).
- A node the group formed with but our view has not shown yet is late gossip, not a loss:
  only nodes this rank has *seen* in the group and no longer sees count (``lost``).
- A group member that showed our group's token and now shows another moved on without
  us (we were stopped or cut off): that also breaks the group.

Thread safety: the watcher thread and the training thread share this object; every piece
of state is read and written under one lock, and a verdict never waits on the training
thread.
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


class GroupWatch:
    """Whether this rank's current group still stands, and the Futures to fail if not."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.verdict_time: float | None = None
        """Wall clock when the view last dropped a member of our group (for measurements)."""
        self._lock = threading.Lock()
        self._pending: list[torch.futures.Future[torch.Tensor]] = []
        self._broken = False
        self._running = False
        self._token = ""
        self._group_ids: frozenset[NodeId] = frozenset()
        self._seen: set[NodeId] = set()
        self._confirmed: set[str] = set()

    # --- the training thread ------------------------------------------------------------

    def arm(self, view: View, group_ids: frozenset[NodeId], token: str) -> None:
        """A new group ``token`` of nodes ``group_ids`` formed on ``view``: watch it."""
        with self._lock:
            self._group_ids = group_ids
            self._seen = {(m.name, m.registered_ms) for m in view.members} & group_ids
            self._token = token
            self._confirmed = set()
            self._broken = False
            # from here a verdict can interrupt the setup's collectives
            self._running = True

    def disarm(self) -> None:
        """The group is abandoned: later views are not verdicts about it."""
        with self._lock:
            self._running = False

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def group_ids(self) -> frozenset[NodeId]:
        return self._group_ids

    def differs(self, view: View) -> bool:
        """Does ``view`` differ from the group (a node more, or a seen node gone)?"""
        ids = {(m.name, m.registered_ms) for m in view.members}
        return bool(ids - self._group_ids or self.lost(ids))

    def lost(self, ids: set[NodeId]) -> set[NodeId]:
        """Group nodes that this rank's view showed and no longer shows. The group formed
        on the leader's view, which may list a node that our view does not show yet: that
        is late gossip, not a loss."""
        with self._lock:  # the watcher thread and the training thread both ask
            self._seen |= ids & self._group_ids
            return self._seen - ids

    def comm_hook(self, bucket: Any, world_size: int) -> torch.futures.Future[torch.Tensor]:
        """DDP's gradient all-reduce (mean), behind a Future a verdict can fail."""
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        with self._lock:
            if self._broken:
                out.set_exception(MembershipChanged("membership changed"))  # type: ignore[arg-type]
                return out
            self._pending.append(out)
        tensor = bucket.buffer().div_(world_size)
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

    # --- the watcher thread -------------------------------------------------------------

    def on_view(self, view: View) -> None:
        """A new view from the agent: break the group if it lost a member or moved on."""
        if not self._running:
            return
        ids = {(m.name, m.registered_ms) for m in view.members}
        lost = self.lost(ids)
        # a peer that showed our group's token and now shows another has moved on without
        # us (we were stopped, or cut off); one that never showed ours is only late gossip
        moved = False
        for m in view.members:
            if (m.name, m.registered_ms) not in self._group_ids or m.name == self.node:
                continue
            if m.group == self._token:
                self._confirmed.add(m.name)
            elif m.name in self._confirmed:
                moved = True
        if lost or moved:
            self.verdict_time = time.time()
            self.fail_pending(
                f"view {view.generation} dropped {sorted(n for n, _ in lost)}"
                if lost
                else "the group moved on without us"
            )

    def fail_pending(self, why: str) -> None:
        with self._lock:
            self._broken = True
            pending, self._pending = self._pending, []
            for fut in pending:
                if not fut.done():
                    fut.set_exception(MembershipChanged(why))  # type: ignore[arg-type]
        log.warning("abandoning group %s: %s", self._token, why)
