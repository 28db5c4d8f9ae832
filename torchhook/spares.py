"""A spare's side of the loop: wait outside the group until a formation lists this node.

A node beyond the job's target size (``Settings.target_nodes``; ``torchhook.roster`` has
the rules of who trains) runs the same program as a training node: it builds its model
and data pipeline, registers, and then waits here instead of forming a group. Rules:

- **Cheap waiting.** A spare joins no group and runs no collective. Each of its ranks
  reads the current leader's offer (local rank 0 of the view's oldest node: the
  ``formation`` key of its directory) with one request that never waits, every
  ``POLL_S``, and otherwise sleeps on its view (a new view ends the sleep at once). The
  read runs on a helper thread that the rank waits for at most ``READ_TIMEOUT``: a
  leader that lost power answers nothing and a TCPStore request to it blocks for as
  long as TCP retransmits, which must not stop the rank's heartbeat (its agent would
  flag it hung and the spare would leave the view just when it is needed). A read still
  stuck is not repeated on that leader for ``PASS_S``. A dead leader's directory refuses
  the connection, which ends the attempt at once (``torchhook.stores.connect_store``).
- **Following the leader's decision.** A dead node stays in the spare's view until its
  agent drops it, and with no trainer of its own in the group that agent may have no
  early evidence (agent/crash_evidence.py, agent/stall_evidence.py: a spare's job never
  stalls): it waits for the death verdict. So when the view's oldest member's directory
  refuses the connection (its process is gone: ``Refused``) or holds a read past
  ``READ_TIMEOUT`` (the process is stopped or the host lost power: passed for
  ``PASS_S``), the spare reads the next oldest member's offer, past at most
  ``MAX_PASSED`` such members, and follows the member whose offer lists it
  (``torchhook.formation`` rule 12): that leader already left the lost node out. A member
  passed by mistake (a leader only slow to answer) costs nothing: the spare follows only
  an offer that lists it, and reads that member again after ``PASS_S``.
- **Drafted.** Once an offer lists this node's registration, or this node is the oldest
  of the view (it leads: every training node is gone), the wait ends and the rank forms
  a group the usual way (``torchhook.formation``), receiving its state from the survivors
  (the plan lists it as a receiver: it holds no state).
- **Alive.** It heartbeats at every poll (its agent must not flag it hung) and tells its
  agent the node's role (``Membership.set_role``: local rank 0, on a change only; an
  agent that does not know the frame refuses it, which changes nothing).
- **Bounded.** The wait ends after ``spare_wait_s`` (``SpareWaitOver``) or when the agent
  is gone (``MembershipClosed``).
- ``spare=True``: a node that must not train at once watches the job without registering
  until its view lists ``target_nodes`` nodes (at most ``join_timeout_s``), then
  registers, so it is younger than every training node and the roster makes it a spare.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from torchhook.client import JobMember, Membership, MembershipClosed, View
from torchhook.errors import SpareWaitOver
from torchhook.formation import FORMATION_KEY, parse_offer, read
from torchhook.roster import wants_switch
from torchhook.stores import Refused, Retry, abandon
from torchhook.strategy import Layout

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from torchhook.formation import Formation

__all__ = ["POLL_S", "READ_TIMEOUT", "Spares", "await_target"]

log = logging.getLogger("torchhook.elastic")

POLL_S = 0.02
"""A waiting spare reads its leader's offer this often: one small request per rank, and
the delay it adds to a re-formation that drafts it (the leader waits for its claim)."""
READ_TIMEOUT = timedelta(seconds=0.25)
"""One read of the leader's directory: a stopped leader holds the read this long before
the spare looks at its view again (a dead leader's view change follows within a second)."""
MAX_PASSED = 8
"""Members with a refusing directory a spare looks past for its drafter, per poll: a crash
loses one node or a few; each costs one refused connection."""
PASS_S = 1.0
"""How long a spare passes a member whose directory held a read for ``READ_TIMEOUT``:
past the suspicion window of a stopped node with ``fast`` (it is dead by then, and out of
the view), and short enough that a leader that was only slow, and then offers a formation
that lists this spare, waits at most this for its claim (``formation_timeout_s`` is
seconds)."""
MAX_PASSED_KEPT = 64
"""Passed members remembered: one per member that stopped answering; past this many, a
new one is not remembered and is read again at the next poll."""
TARGET_POLL_S = 0.2
"""``spare=True``: how often a node waiting to register looks at the job's size."""


class Spares:
    """One rank's spare behaviour: the role it reports and the wait for a draft."""

    def __init__(
        self,
        target_nodes: int,
        membership: Membership,
        formation: Formation,
        beat: Callable[[], None],
        wait_s: float,
    ) -> None:
        self.target = target_nodes
        self.membership = membership
        self.formation = formation
        self.node = membership.node
        self._beat = beat
        self.wait_s = wait_s
        self.role = "training"
        """This node's role as last told to the agent."""
        self.waits = 0
        """Times this rank waited as a spare (for tests and measurements)."""
        self._client: tuple[tuple[str, int], TCPStore] | None = None
        self._passed: dict[tuple[str, int], float] = {}
        """Directories whose last read took ``READ_TIMEOUT`` (stuck, or timed out), by
        (address, port): until when (``time.monotonic``) ``_listed`` passes them."""
        if target_nodes and membership.local_rank == 0:
            with contextlib.suppress(MembershipClosed):
                membership.set_target(target_nodes)  # shown by the agent's ``jobs``

    def tell(self, role: str) -> None:
        """Tell the agent this node's role on a change (local rank 0 only)."""
        if role == self.role:
            return
        self.role = role
        if self.membership.local_rank != 0:
            return
        log.info("node %s is %s", self.node, "a spare" if role == "spare" else "training")
        with contextlib.suppress(MembershipClosed):
            self.membership.set_role(role)

    def differs(self, layout: Layout | None, view: View, lost: bool) -> bool:
        """Step boundary, with a target: would the leader form another layout?"""
        if layout is None:
            return True
        return wants_switch(layout, view.members, self.target, lost=lost)

    def wait_for_draft(self) -> str | None:
        """Return once an offer lists this node (the name of the member that offered it,
        for ``Formation.agree``), or it leads (None) (module docstring)."""
        deadline = time.monotonic() + self.wait_s
        told = False
        while time.monotonic() < deadline:
            self._beat()
            view = self.membership.view
            me = view.member(self.node)
            if me is not None and view.members[0].name == self.node:
                return None  # every training node is gone: this node leads
            drafter = None if me is None else self._drafter(view, (me.name, me.registered_ms))
            if drafter is not None:
                if told:
                    log.info("node %s drafted by %s", self.node, drafter)
                return drafter
            if not told and len(view.members) > self.target and any(m.group for m in view.members):
                # the job is at its target and trains without this node: it is a spare
                told = True
                self.waits += 1
                self.tell("spare")
            with contextlib.suppress(TimeoutError):
                self.membership.wait(_changed(view.fingerprint), POLL_S)
        raise SpareWaitOver(
            f"node {self.node} waited {self.wait_s} s as a spare without being drafted "
            "(spare_wait_s)"
        )

    def _drafter(self, view: View, me: tuple[str, int]) -> str | None:
        """The member whose offer lists ``me``: the view's oldest, or past members whose
        directories refuse (their processes are gone) the next oldest, at most
        ``MAX_PASSED`` of them; a directory that holds a read (stopped, or cut off) is
        passed the same way (module docstring)."""
        for leader in view.members[: MAX_PASSED + 1]:
            if leader.name == self.node:
                return None
            try:
                return leader.name if self._listed(leader, me) else None
            except (Refused, _Stuck):
                continue
        return None

    def _listed(self, leader: JobMember, me: tuple[str, int]) -> bool:
        """Whether ``leader``'s offer lists ``me``; ``Refused``: its directory is gone."""
        if leader.store_port == 0:
            return False
        key = (leader.addr, leader.store_port)
        until = self._passed.get(key)
        if until is not None:
            if time.monotonic() < until:
                raise _Stuck  # stopped or cut off: not read again for ``PASS_S``
            del self._passed[key]
        try:
            if self._client is None or self._client[0] != key:
                # the client of another member is kept until this one connects: a refusing
                # older member is tried at every poll, and the drafter's directory must not
                # get a new connection each time
                client = self.formation.connect(leader.addr, leader.store_port, "directory")
                client.set_timeout(READ_TIMEOUT)
                self._client = (key, client)
            raw = self._read_offer(key, self._client[1])
            offer = None if raw is None else parse_offer(raw)
        except (Retry, RuntimeError, OSError) as exc:
            # a dead or stopped leader: its view change follows; connect afresh then
            log.debug("spare %s: directory of %s: %s", self.node, leader.name, exc)
            if self._client is not None and self._client[0] == key:
                self._client = None
            if isinstance(exc, Refused):
                raise
            return False
        return offer is not None and me in offer.layout.ids

    def _read_offer(self, key: tuple[str, int], client: TCPStore) -> bytes | None:
        """The ``formation`` key on a helper thread, waited for at most ``READ_TIMEOUT``
        (None when there is none; ``_Stuck`` when the read takes that long: the read
        keeps its client, and ``key`` is passed for ``PASS_S``)."""
        result: list[bytes | BaseException | None] = []

        def run() -> None:
            try:
                result.append(read(client, FORMATION_KEY))
            except (RuntimeError, OSError) as exc:
                result.append(exc)

        reading = threading.Thread(target=run, name="spare-read", daemon=True)
        started = time.monotonic()
        reading.start()
        reading.join(READ_TIMEOUT.total_seconds())
        if not result or time.monotonic() - started >= READ_TIMEOUT.total_seconds():
            # held past the timeout (or timed out in the store client itself): stopped or
            # cut off, since a live server thread answers a read of one key at once
            if not result:
                abandon(reading)  # the process waits for it at exit (torchhook.stores)
            self._client = None
            now = time.monotonic()
            for ended in [k for k, t in self._passed.items() if t <= now]:
                del self._passed[ended]
            if len(self._passed) < MAX_PASSED_KEPT:
                self._passed[key] = now + PASS_S
            raise _Stuck
        got = result[0]
        if isinstance(got, BaseException):
            raise got
        return got


class _Stuck(Exception):
    """A directory held a read past ``READ_TIMEOUT``, or still holds an earlier one."""


def _changed(fingerprint: str) -> Callable[[View], bool]:
    return lambda v: v.fingerprint != fingerprint


def await_target(
    job: str,
    control: str | Path | None,
    target: int,
    timeout_s: float,
    local_rank: int,
    local_world_size: int,
) -> None:
    """``spare=True``: watch ``job`` without registering until its view lists ``target``
    nodes (``SpareWaitOver`` after ``timeout_s``)."""
    with Membership(
        job,
        control=control,
        register=False,
        local_rank=local_rank,
        local_world_size=local_world_size,
    ) as watch:
        try:
            watch.wait(lambda v: len(v.members) >= target, timeout_s)
        except TimeoutError:
            raise SpareWaitOver(
                f"the view of {job!r} did not reach target_nodes={target} within "
                f"{timeout_s} s (join_timeout_s): a spare registers only once it does"
            ) from None
