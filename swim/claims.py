"""A known name announced alive from another address: who keeps the name, as a rule table.

A member restarted at a new address (a rescheduled container, a host renumbered by DHCP)
announces itself alive under its old name. Its old record still holds the old address.
memberlist (hashicorp/memberlist @ 1b4c746 state.go ``aliveNode``) lets the new address
take a name only from a member that left, or that died longer ago than
``DeadNodeReclaimTime`` (0 by default: never, so the name is free only once the dead
record is reaped after ``GossipToTheDeadTime``, and someone pushes the new alive again);
anything else is "[ERR] memberlist: Conflicting address", handed to the conflict delegate.
Serf's delegate (hashicorp/serf serf/serf.go ``handleNodeConflict``,
``resolveNodeConflict``; serf/internal_query.go ``handleConflict``) logs the conflict and,
on the node whose own name is claimed, runs a ``_serf_conflict`` query and shuts that node
down unless a majority of the answers hold its address (measured: RELIABILITY.md,
docs/runbook.md "A node came back at a new address").

Rules (``CLAIM_RULES``: the state we know the name in, and whether the claim's incarnation
is newer than the one we know -> ``Claim``):

- An alive record keeps its name: ``CONFLICT``. The claim is refused, logged as an error
  and counted (``NodeStats.address_conflicts``), as memberlist refuses it. This is a real
  name conflict as far as we can tell: two processes answer to one name, and names must
  be unique.
- A suspect record keeps it too, for now: ``HOLD`` (refused as memberlist does, logged as
  a warning, not counted). A suspect that someone claims from elsewhere is most likely a
  crashed process whose successor is already up; the verdict decides.
- A member that left gives its name up: ``RECLAIM`` (memberlist).
- A dead member's name goes to a claim that outbids the death verdict (a newer
  incarnation): ``RECLAIM``. Ours, not memberlist's: the claimant can only hold a higher
  incarnation than the dead one by having heard its old self accused and refuted it, so it
  is the one process alive under that name; and every later piece of stale gossip about
  the old incarnation is older news to the new record and changes nothing.
- A claim on a dead member that does not outbid it: ``WAIT`` (refused, not counted as a
  conflict), unless the member died longer ago than ``dead_node_reclaim_time_ms``
  (memberlist's reclaim, then ``RECLAIM``). On ``WAIT`` we tell the claimant the verdict
  directly (a dead message to the claim's address, at most once per name per probe
  interval), so it refutes with a higher incarnation and its next alive takes the name.
- A claim refused while the record was alive or suspect is remembered (``PendingClaims``: the newest
  per name, ``MAX_PENDING_CLAIMS`` names, for ``gossip_to_the_dead_time_ms``) and judged
  again the moment that record is declared dead or left, so a member restarted before the
  cluster noticed its old process die takes its name then, not a push-pull later.
- A claim on our own name from another address is always refused (``Membership``); we are
  the one alive under it.

Pure: time is the context's ``now_ms``; the tell goes out through the node's sender.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from swim import wire
from swim.context import Context
from swim.member_state import MemberState
from swim.messages import Address, Alive, Dead, NodeStateType

__all__ = ["CLAIM_RULES", "MAX_PENDING_CLAIMS", "Claim", "Claims"]

MAX_PENDING_CLAIMS = 1024
"""Names with a refused claim remembered at once. A rack of restarted hosts is tens of
names; beyond the bound the oldest claim is forgotten, and that claimant takes its name at
its next push-pull instead of at the death verdict."""


class Claim(Enum):
    """What to do with an alive for a known name from another address."""

    CONFLICT = "conflict"
    """An alive member holds the name: refuse, log an error, count, remember the claim."""
    HOLD = "hold"
    """A suspect holds it: refuse, log a warning, remember the claim for the verdict."""
    WAIT = "wait"
    """Its holder is dead but the claim does not outbid the verdict: refuse, and tell the
    claimant (unless dead past ``dead_node_reclaim_time_ms``: then ``RECLAIM``)."""
    RECLAIM = "reclaim"
    """The name moves to the claim's address (``About.RECLAIMED`` in ``PRECEDENCE``)."""


_ALIVE, _SUSPECT, _DEAD, _LEFT = (
    NodeStateType.ALIVE,
    NodeStateType.SUSPECT,
    NodeStateType.DEAD,
    NodeStateType.LEFT,
)

CLAIM_RULES: Mapping[tuple[NodeStateType, bool], Claim] = {
    # (the state we know, the claim's incarnation is newer than ours) -> claim
    (_ALIVE, False): Claim.CONFLICT,
    (_ALIVE, True): Claim.CONFLICT,
    (_SUSPECT, False): Claim.HOLD,
    (_SUSPECT, True): Claim.HOLD,
    (_DEAD, False): Claim.WAIT,
    (_DEAD, True): Claim.RECLAIM,
    (_LEFT, False): Claim.RECLAIM,
    (_LEFT, True): Claim.RECLAIM,
}
"""Who keeps a name claimed from another address (the rules in the module docstring)."""


@dataclass(slots=True)
class _Pending:
    claim: Alive
    seen_ms: int


class Claims:
    """Judges claims on known names from other addresses, remembers refused ones, and
    tells a claimant that waits on a death verdict what that verdict is."""

    def __init__(self, ctx: Context, local_name: str, tell: Callable[[Address, bytes], None]):
        self._ctx = ctx
        self._local_name = local_name
        self._tell = tell
        self._pending: dict[str, _Pending] = {}
        self._told_ms: dict[str, int] = {}

    def judge(self, a: Alive, address: Address, state: MemberState) -> Claim:
        """The claim ``a`` (from ``address``) on ``state``'s name, which ``state`` holds at
        another address: the row of ``CLAIM_RULES``, with its log line, count and tell."""
        ctx = self._ctx
        claim = CLAIM_RULES[state.state, a.incarnation > state.incarnation]
        if claim is Claim.WAIT and self._reclaimable(state):
            claim = Claim.RECLAIM
        if claim is Claim.RECLAIM:
            self._pending.pop(a.node, None)
            ctx.notice(
                "info",
                "address_reclaimed",
                f"{a.node} moves from {state.address} ({state.state.name.lower()}) to "
                f"{address} (incarnation {a.incarnation})",
            )
            return claim
        if claim is Claim.CONFLICT:
            ctx.stats.address_conflicts += 1
            ctx.notice(
                "error",
                "address_conflict",
                f"conflicting address for {a.node}: ours {state.address} (alive), theirs "
                f"{address}; refused, names must be unique (docs/runbook.md, 'A node came "
                "back at a new address')",
            )
        elif claim is Claim.HOLD:
            ctx.notice(
                "warning",
                "address_claim_held",
                f"{a.node} claimed from {address} while suspect at {state.address}: "
                "refused until the suspicion ends",
            )
        if claim is not Claim.WAIT:
            if state.name != self._local_name:
                self._remember(a)
            return claim
        self._tell_verdict(a.node, address, state)
        return claim

    def take(self, name: str) -> Alive | None:
        """The claim remembered for ``name`` if still fresh (and forget it), to be judged
        again now that its holder is dead or has left."""
        pending = self._pending.pop(name, None)
        if pending is None:
            return None
        if self._ctx.now_ms - pending.seen_ms > self._ctx.config.gossip_to_the_dead_time_ms:
            return None
        return pending.claim

    def forget(self, name: str) -> None:
        self._pending.pop(name, None)
        self._told_ms.pop(name, None)

    def _remember(self, a: Alive) -> None:
        pending = self._pending
        pending.pop(a.node, None)  # re-inserted last: the dict's order is the age order
        if len(pending) >= MAX_PENDING_CLAIMS:
            del pending[next(iter(pending))]
        pending[a.node] = _Pending(a, self._ctx.now_ms)

    def _reclaimable(self, state: MemberState) -> bool:
        """memberlist's DeadNodeReclaimTime: dead for longer than the reclaim time."""
        reclaim_ms = self._ctx.config.dead_node_reclaim_time_ms
        return reclaim_ms > 0 and self._ctx.now_ms - state.state_change_ms > reclaim_ms

    def _tell_verdict(self, name: str, address: Address, state: MemberState) -> None:
        """Send the claimant the death verdict it has to outbid, at most once per name per
        probe interval (one packet per claim received, so no amplification)."""
        ctx = self._ctx
        told = self._told_ms.get(name)
        if told is not None and ctx.now_ms - told < ctx.config.probe_interval_ms:
            return
        if told is None and len(self._told_ms) >= MAX_PENDING_CLAIMS:
            del self._told_ms[next(iter(self._told_ms))]
        self._told_ms[name] = ctx.now_ms
        ctx.notice(
            "info",
            "address_claim_waits",
            f"{name} at {address} claims the name of a dead member at {state.address} "
            f"without outbidding incarnation {state.incarnation}: telling it so",
        )
        self._tell(address, wire.encode_message(Dead(state.incarnation, name, self._local_name)))
