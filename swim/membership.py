"""The member table and its state transitions: SWIM §4.2 suspicion with incarnation numbers,
as memberlist implements it, plus Lifeguard's refutation health.

Rules (hashicorp/memberlist @ 1b4c746 state.go ``aliveNode``, ``suspectNode``, ``deadNode``,
``refute``, ``mergeState``, ``resetNodes``; docs/design.md §5.6):
- Validate, decide, mutate. An alive, suspect or dead message passes the input checks
  (malformed, a claim on our address under another name, a known name claimed from a new
  address, judged by ``swim.claims``, the member limit); the ``PRECEDENCE`` table decides
  from whom it is about, what we know and how the incarnations compare: ignore, apply,
  confirm, refute, re-announce.
- The table in words is docs/design.md §5.6. A refutation sets our incarnation to
  max(own+1, accused+1) and raises our health score by 1 (``swim.awareness``); only the
  node itself ever raises its incarnation. A dead message sent by the member itself means
  it left.
- Dead and left members stay, gossiped to, for gossip_to_the_dead_time; they are reaped
  when the round-robin order wraps, which is then reshuffled (SWIM §4.3); new members land
  at a random place among those still to probe this round (drawn incrementally,
  ``swim.table``). ``coordinated_probes`` instead keeps the ring of ``swim.schedule``
  and reaps when the ring's round turns.
- Storage is copy-on-write over an optional shared ``MembershipSnapshot`` (``bootstrap``).
- Hostile or invalid input is dropped and counted before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum, IntEnum

from swim import push_pull, wire
from swim.claims import Claim, Claims
from swim.context import Context
from swim.effects import EventKind
from swim.failed import FailedMembers
from swim.member_state import MemberState
from swim.messages import Address, Alive, Dead, NodeStateType, PushNodeState, Suspect, ip_from_bytes
from swim.schedule import ProbeRing
from swim.shared import PushPullDiff
from swim.suspicion import Suspicion, Suspicions
from swim.table import MembershipSnapshot, MemberTable
from swim.wire import DropReason

__all__ = ["LEAVE_NOTIFY", "PRECEDENCE", "About", "Membership", "News", "Outcome"]

MAX_NAME_BYTES = 512
"""Longest node name accepted from the wire (memberlist has no bound; we need one)."""

LEAVE_NOTIFY = 1


class About(IntEnum):
    """Whom an alive, suspect or dead message is about."""

    US = 0
    MEMBER = 1
    RECLAIMED = 2
    """A member that left or died, announced alive from a new address by a claim that
    ``swim.claims`` lets take the name: a new process under the old name (alive only)."""


class News(IntEnum):
    """The message's incarnation against the one we know."""

    OLDER = 0
    SAME = 1
    NEWER = 2


class Outcome(Enum):
    IGNORE = "ignore"
    """Old news, or news that changes nothing."""
    APPLY = "apply"
    """Take the message's state and incarnation, gossip it on, report the change."""
    CONFIRM = "confirm"
    """Another accuser of an open suspicion: a confirmation (``swim.suspicion``); gossiped
    on if it counted."""
    REFUTE = "refute"
    """An accusation of us: outbid it with a new incarnation and gossip our alive."""
    REFUTE_IF_CHANGED = "refute_if_changed"
    """An alive about us at our incarnation: our own echo if meta and versions are ours
    (ignore), else a stale or forged version of us (refute)."""
    REANNOUNCE = "reannounce"
    """An accusation (suspect or dead) of an older incarnation of us: its sender missed our
    refutation; gossip our alive again, same incarnation (memberlist: ignore; design §5.6)."""


_ALIVE, _SUSPECT, _DEAD, _LEFT = (
    NodeStateType.ALIVE,
    NodeStateType.SUSPECT,
    NodeStateType.DEAD,
    NodeStateType.LEFT,
)
_IGNORE, _APPLY, _CONFIRM, _REFUTE, _REFUTE_IF_CHANGED, _REANNOUNCE = Outcome
_ALL_IGNORED = (_IGNORE, _IGNORE, _IGNORE)

_RULES: tuple[tuple[About, NodeStateType, NodeStateType, tuple[Outcome, Outcome, Outcome]], ...] = (
    # about, what we know, the message: outcome for an (older, same, newer) incarnation
    (About.US, _ALIVE, _ALIVE, (_IGNORE, _REFUTE_IF_CHANGED, _REFUTE)),
    (About.US, _ALIVE, _SUSPECT, (_REANNOUNCE, _REFUTE, _REFUTE)),
    (About.US, _ALIVE, _DEAD, (_REANNOUNCE, _REFUTE, _REFUTE)),
    # we have left (Node.leave): nothing about us is news, but an old accusation still
    # re-announces our alive at our last incarnation (harmless: our dead one outranks it)
    (About.US, _LEFT, _ALIVE, _ALL_IGNORED),
    (About.US, _LEFT, _SUSPECT, (_REANNOUNCE, _IGNORE, _IGNORE)),
    (About.US, _LEFT, _DEAD, _ALL_IGNORED),
    (About.MEMBER, _ALIVE, _ALIVE, (_IGNORE, _IGNORE, _APPLY)),
    (About.MEMBER, _ALIVE, _SUSPECT, (_IGNORE, _APPLY, _APPLY)),
    (About.MEMBER, _ALIVE, _DEAD, (_IGNORE, _APPLY, _APPLY)),
    (About.MEMBER, _SUSPECT, _ALIVE, (_IGNORE, _IGNORE, _APPLY)),
    # memberlist, not the paper: a newer suspicion of a suspect only confirms the open one
    (About.MEMBER, _SUSPECT, _SUSPECT, (_IGNORE, _CONFIRM, _CONFIRM)),
    (About.MEMBER, _SUSPECT, _DEAD, (_IGNORE, _APPLY, _APPLY)),
    (About.MEMBER, _DEAD, _ALIVE, (_IGNORE, _IGNORE, _APPLY)),
    (About.MEMBER, _DEAD, _SUSPECT, _ALL_IGNORED),
    (About.MEMBER, _DEAD, _DEAD, _ALL_IGNORED),
    (About.MEMBER, _LEFT, _ALIVE, (_IGNORE, _IGNORE, _APPLY)),
    (About.MEMBER, _LEFT, _SUSPECT, _ALL_IGNORED),
    (About.MEMBER, _LEFT, _DEAD, _ALL_IGNORED),
    # a new process under a departed member's name: whatever its incarnation
    (About.RECLAIMED, _DEAD, _ALIVE, (_APPLY, _APPLY, _APPLY)),
    (About.RECLAIMED, _LEFT, _ALIVE, (_APPLY, _APPLY, _APPLY)),
)

PRECEDENCE: Mapping[tuple[About, NodeStateType, NodeStateType, News], Outcome] = {
    (about, known, message, news): outcome
    for about, known, message, outcomes in _RULES
    for news, outcome in zip(News, outcomes, strict=True)
}
"""SWIM §4.2 precedence as memberlist applies it: (about, the state we know, the state the
message claims, its incarnation against ours) -> what to do. We are only ever alive or, once
we have left, left; a reclaimed name is only ever dead or left and announced alive."""


def _news(incarnation: int, known: int) -> News:
    if incarnation > known:
        return News.NEWER
    return News.SAME if incarnation == known else News.OLDER


class Membership:
    """The member table of one node, including the node itself."""

    def __init__(
        self, ctx: Context, local: MemberState, tell: Callable[[Address, bytes], None]
    ) -> None:
        self._ctx = ctx
        self.local_name = local.name
        self.claims = Claims(ctx, local.name, tell)
        """Known names claimed from other addresses (``swim.claims``)."""
        self._members = MemberTable(local)
        self._suspicions = Suspicions(ctx)
        self.push_pull = push_pull.OurSide(self._members)
        self.leaving = False
        self.failed = FailedMembers(ctx)
        """Members declared dead, for serf's reconnect (``swim.failed``)."""
        self._ring = ProbeRing(local.name) if ctx.config.coordinated_probes else None
        self._ring_round = 0
        # The table's own lookups, bound once: several per datagram, and a wrapper
        # method around each cost a Python call apiece.
        self.get: Callable[[str], MemberState | None] = self._members.get
        """A member's record, for reading only (it may be shared with other nodes)."""
        self.by_address: Callable[[Address], MemberState | None] = self._members.by_address
        """The member at ``address`` (the newest name there), for reading only."""

    # --- queries ------------------------------------------------------------------------

    @property
    def local(self) -> MemberState:
        return self._members.mutable(self.local_name)

    def __len__(self) -> int:
        return len(self._members)

    def states(self) -> list[MemberState]:
        """Every member, in a deterministic order (never set iteration). O(n)."""
        return list(self._members)

    def count(self, state: NodeStateType) -> int:
        return self._members.count(state)

    def any_alive_peer(self) -> bool:
        table = self._members
        live = table.count(NodeStateType.ALIVE) + table.count(NodeStateType.SUSPECT)
        return live - (0 if self.local.dead_or_left() else 1) > 0

    def bootstrap(self, snapshot: MembershipSnapshot) -> None:
        """Start from ``snapshot``: every member in it but us is alive; no events. If it
        holds exactly what we are, our startup alive is news to no one and is dropped (10,000
        nodes would otherwise gossip 10,000 useless alives 20 times each)."""
        self._members.bootstrap(snapshot)
        if self._ring is not None:
            self._ring.reset(m.name for m in self._members if not m.dead_or_left())
        seed, me = snapshot.get(self.local_name), self.local
        if seed is not None and (seed.address, seed.incarnation, seed.meta, seed.vsn) == (
            me.address,
            me.incarnation,
            me.meta,
            me.vsn,
        ):
            self._ctx.broadcasts.discard(self.local_name)

    def suspicion_deadline_ms(self, name: str) -> int | None:
        return self._suspicions.deadline_ms(name)

    def random_members(self, k: int, exclude: Callable[[MemberState], bool]) -> list[MemberState]:
        """Up to k distinct members not excluded, uniformly at random (util.go
        ``kRandomNodes``); O(k) expected, see ``MemberTable.random_members``."""
        return self._members.random_members(k, exclude, self._ctx.rng)

    def next_probe_target(self, round_no: int) -> MemberState | None:
        """Randomized round-robin, skipping ourselves and the dead (SWIM §4.3): each member
        is drawn once per round; when all were drawn the round wraps (``resetNodes``).
        With ``coordinated_probes``, the ring's target for ``round_no`` (``swim.schedule``)."""
        local = self.local_name
        if self._ring is not None:
            ring_round = round_no // (len(self._ring) or 1)
            if ring_round != self._ring_round:  # as the round robin reaps at its wrap
                self._ring_round = ring_round
                self._reap()
            target = self._members.get(self._ring.target(round_no) or local)
            return None if target is None or target.name == local else target
        return self._members.next_in_round(
            self._ctx.rng, lambda m: m.name == local or m.dead_or_left(), self._reap
        )

    def _reap(self) -> None:
        """state.go ``resetNodes``: forget the members dead or left for longer than
        ``gossip_to_the_dead_time_ms``. Only our own records can be dead or left (the shared
        base is all alive), so this scans O(changed members), not O(n)."""
        now = self._ctx.now_ms
        window = self._ctx.config.gossip_to_the_dead_time_ms
        for m in self._members.overrides():
            if m.dead_or_left() and now - m.state_change_ms > window and m.name != self.local_name:
                self._forget(m)

    def _forget(self, m: MemberState) -> None:
        self._members.remove(m.name)
        if self._ring is not None:
            self._ring.discard(m.name)
        self._suspicions.cancel(m.name)
        self.claims.forget(m.name)
        self._ctx.rtt.forget(m.name)
        self._ctx.event(EventKind.REAPED, m.snapshot())

    # --- broadcasting -------------------------------------------------------------------

    def _broadcast(self, name: str, msg: Alive | Suspect | Dead, notify: int | None = None) -> None:
        self._ctx.broadcasts.queue(wire.encode_message(msg), name=name, notify=notify)

    # --- transitions --------------------------------------------------------------------

    def apply_alive(self, a: Alive) -> None:
        """state.go ``aliveNode``: input checks, then the ``PRECEDENCE`` row."""
        ctx = self._ctx
        if not self._valid_alive(a):
            return
        is_local = a.node == self.local_name
        address = Address(ip_from_bytes(a.addr), a.port or self.local.address.port)
        if address == self.local.address and not is_local:
            # Someone claims our own address under another name: never true, never useful.
            ctx.drop(DropReason.REJECTED)
            ctx.notice("error", "address_conflict", f"{a.node} claims our address {address}")
            return
        about = About.US if is_local else About.MEMBER
        state = self._members.get(a.node)
        known = state is not None  # a first join is no recovery (``recovered_hold_ms``)
        if state is None:
            if len(self._members) >= ctx.config.max_members:
                ctx.drop(DropReason.LIMIT)
                return
            state = self._insert(a.node, address, a)
        elif state.address != address:
            if is_local and state.state == _LEFT:
                return  # nothing about us is news once we have left
            if self.claims.judge(a, address, state) is not Claim.RECLAIM:
                ctx.drop(DropReason.REJECTED)
                return
            about = About.RECLAIMED
        outcome = PRECEDENCE[about, state.state, _ALIVE, _news(a.incarnation, state.incarnation)]
        if outcome is _IGNORE:
            return
        if outcome is _REFUTE_IF_CHANGED and (a.meta, tuple(a.vsn)) == (state.meta, state.vsn):
            return
        if outcome is _REFUTE or outcome is _REFUTE_IF_CHANGED:
            self.refute(a.incarnation)
            ctx.notice("warning", "refute", f"refuting an alive message about us ({a.node})")
            return
        self._suspicions.cancel(a.node)
        self._broadcast(a.node, a)
        state = self._members.mutable(a.node)
        old_state, old_meta, old_inc = state.state, state.meta, state.incarnation
        if len(a.vsn) >= 6:
            state.vsn = tuple(a.vsn[:6])
        state.incarnation = a.incarnation
        state.meta = a.meta
        self._members.set_address(state, address)
        if state.state != _ALIVE:
            self._set_state(state, _ALIVE, ctx.now_ms)
        self.failed.forget(a.node)
        if known and (old_state != _ALIVE or (a.incarnation > old_inc and a.meta == old_meta)):
            self._suspicions.recovered(a.node)  # it refuted an accusation, or came back
        if old_state in (_DEAD, _LEFT):
            ctx.event(EventKind.JOINED, state.snapshot())
        elif old_state == _SUSPECT:
            ctx.stats.suspicions_refuted_by_others += 1
            ctx.event(EventKind.ALIVE, state.snapshot())
        elif old_meta != state.meta:
            ctx.event(EventKind.UPDATED, state.snapshot())

    def _valid_alive(self, a: Alive) -> bool:
        ctx = self._ctx
        if not a.node or len(a.node.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            ctx.drop(DropReason.MALFORMED)
            return False
        if len(a.addr) not in (4, 16) or len(a.meta) > 512:
            ctx.drop(DropReason.MALFORMED)
            return False
        if len(a.vsn) >= 3:
            pmin, pmax = a.vsn[0], a.vsn[1]
            if pmin == 0 or pmax == 0 or pmin > pmax:
                ctx.drop(DropReason.INVALID_VERSION)
                return False
        return True

    def _insert(self, name: str, address: Address, a: Alive) -> MemberState:
        # New members start "dead" so that becoming alive reports a join (state.go).
        state = MemberState(
            name,
            address,
            a.meta,
            0,
            NodeStateType.DEAD,
            self._ctx.now_ms,
            tuple(a.vsn[:6]) if len(a.vsn) >= 6 else (),
        )
        # The newest name at an address wins: a process restarted under another name at
        # the same address is the one that answers there now.
        self._members.insert(state, self._ctx.rng)
        return state

    def apply_suspect(self, s: Suspect) -> bool:
        """state.go ``suspectNode``: the ``PRECEDENCE`` row. True if it opened a suspicion."""
        ctx = self._ctx
        state = self._members.get(s.node)
        if state is None:
            return False
        about = About.US if s.node == self.local_name else About.MEMBER
        outcome = PRECEDENCE[about, state.state, _SUSPECT, _news(s.incarnation, state.incarnation)]
        if outcome is _IGNORE:
            return False
        if outcome is _REANNOUNCE:  # the accuser missed our refutation: say it again
            self._broadcast(s.node, self.local.alive())
            return False
        if outcome is _CONFIRM:
            if self._suspicions.confirm(s.node, state.state_change_ms, s.sender):
                self._broadcast(s.node, s)
            return False
        if outcome is _REFUTE:
            self.refute(s.incarnation)
            ctx.notice("warning", "refute", f"refuting a suspect message (from: {s.sender})")
            return False
        self._broadcast(s.node, s)
        if s.sender == self.local_name:
            ctx.stats.suspicions_raised += 1
        state = self._members.mutable(s.node)
        state.incarnation = s.incarnation
        self._set_state(state, _SUSPECT, ctx.now_ms)
        self._suspicions.start(state.name, state.state_change_ms, s.sender, len(self._members))
        ctx.event(EventKind.SUSPECT, state.snapshot())
        return True

    def _live_suspicion(self, name: str, state_change_ms: int) -> Suspicion | None:
        """The open suspicion of ``name`` if it is the one begun at ``state_change_ms``."""
        state = self._members.get(name)
        if state is None or (state.state, state.state_change_ms) != (_SUSPECT, state_change_ms):
            return None
        return self._suspicions.get(name)

    def needs_verify(self, name: str, state_change_ms: int) -> bool:
        """The suspicion is live and, with ``verify_unconfirmed_suspicion``, unconfirmed (fewer
        than k, or k is 0), held, or any with ``verify_confirmed_suspicion``."""
        c, live = self._ctx.config, self._live_suspicion(name, state_change_ms)
        if live is None or not c.verify_unconfirmed_suspicion:
            return False
        return live.unconfirmed or live.held or c.verify_confirmed_suspicion

    def hold_if_starved(self, name: str, state_change_ms: int) -> bool:
        """``Suspicions.hold_if_starved`` for the live suspicion (``starved_lag_ms``)."""
        live = self._live_suspicion(name, state_change_ms)
        return live is not None and self._suspicions.hold_if_starved(name, live, state_change_ms)

    def on_suspicion_timeout(self, name: str, state_change_ms: int) -> None:
        suspicion = self._live_suspicion(name, state_change_ms)
        state = self._members.get(name)
        if suspicion is None or state is None:
            return
        if suspicion.k > 0 and suspicion.confirmations < suspicion.k:
            # memberlist's "degraded timeout" metric: fewer confirmations than hoped for
            self._ctx.stats.suspicion_timeouts_degraded += 1
        self._ctx.notice(
            "info",
            "suspect_timeout",
            f"marking {name} as failed, suspect timeout reached "
            f"({suspicion.confirmations} peer confirmations)",
        )
        self._ctx.stats.deaths_declared += 1
        self.apply_dead(Dead(state.incarnation, name, self.local_name))

    def apply_dead(self, d: Dead) -> None:
        """state.go ``deadNode``: the ``PRECEDENCE`` row."""
        state = self._members.get(d.node)
        if state is None:
            return
        about = About.US if d.node == self.local_name else About.MEMBER
        outcome = PRECEDENCE[about, state.state, _DEAD, _news(d.incarnation, state.incarnation)]
        if outcome is _IGNORE:
            return
        if outcome is _REANNOUNCE:
            self._broadcast(d.node, self.local.alive())
            return
        if outcome is _REFUTE:
            self.refute(d.incarnation)
            self._ctx.notice("warning", "refute", f"refuting a dead message (from: {d.sender})")
            return
        self._declare_dead(d)

    def _set_state(self, state: MemberState, new: NodeStateType, now_ms: int) -> None:
        self._members.set_state(state, new, now_ms)
        if self._ring is not None:
            self._ring.update(state.name, new in (_ALIVE, _SUSPECT))

    def _declare_dead(self, d: Dead, notify: int | None = None) -> None:
        """The member is dead, or has left if the message is its own."""
        ctx = self._ctx
        self._suspicions.cancel(d.node)
        self._broadcast(d.node, d, notify=notify)
        state = self._members.mutable(d.node)
        state.incarnation = d.incarnation
        new = _LEFT if d.node == d.sender else _DEAD
        self._set_state(state, new, ctx.now_ms)
        if new == _DEAD and d.node != self.local_name:
            self.failed.remember(d.node, state.address)
        else:
            self.failed.forget(d.node)
        kind = EventKind.LEFT if state.state == _LEFT else EventKind.DEAD
        ctx.event(kind, state.snapshot())
        claim = self.claims.take(d.node) if d.node != self.local_name else None
        if claim is not None:  # a claim refused while it was live: judged again (swim.claims)
            self.apply_alive(claim)

    def refute(self, accused_incarnation: int) -> None:
        """state.go ``refute``: outbid the accusation and tell everyone we are alive."""
        me = self.local
        incarnation = max(me.incarnation + 1, accused_incarnation + 1)
        if incarnation > 0xFFFF_FFFF:
            self._ctx.notice("error", "incarnation_overflow", "incarnation would overflow")
            return
        me.incarnation = incarnation
        self._ctx.stats.refutations += 1
        self._ctx.awareness.apply_delta(1)
        self._broadcast(me.name, self.local.alive())

    def bump_local(self, meta: bytes | None = None) -> None:
        """A new local incarnation (startup, metadata update), gossiped as alive."""
        me = self.local
        me.incarnation += 1
        if meta is not None:
            me.meta = meta
        self._broadcast(me.name, self.local.alive())

    def merge(self, remote: Sequence[PushNodeState]) -> None:
        """state.go ``mergeState``: a pushed state is replayed as alive/dead/suspect."""
        for r in remote:
            if r.state == NodeStateType.ALIVE:
                self.apply_alive(Alive(r.incarnation, r.name, r.addr, r.port, r.meta, r.vsn))
            elif r.state == NodeStateType.LEFT:
                self.apply_dead(Dead(r.incarnation, r.name, r.name))
            else:
                self.apply_suspect(Suspect(r.incarnation, r.name, self.local_name))

    def merge_diff(self, remote: Sequence[PushNodeState], diff: PushPullDiff) -> None:
        """``merge`` of only the entries that can change anything (``swim.push_pull``)."""
        self.merge([remote[i] for i in self.push_pull.merge_picks(diff)])

    def force_left(self, name: str) -> None:
        """A failed member left, as if it said so (its incarnation, sender = itself); gossiped."""
        state = self._members.mutable(name)
        if state.state == NodeStateType.DEAD:
            # apply_dead ignores news about the already dead; replace the record directly
            self._set_state(state, NodeStateType.LEFT, self._ctx.now_ms)
            self.failed.forget(name)
            self._broadcast(name, Dead(state.incarnation, name, name))
            self._ctx.event(EventKind.LEFT, state.snapshot())
        else:
            self.apply_dead(Dead(state.incarnation, name, name))

    def leave(self) -> None:
        """We leave (LEFT from now on): our dead, gossiped with ``LEAVE_NOTIFY`` (leave_done)."""
        self.leaving = True
        me = self.local
        self._declare_dead(Dead(me.incarnation, me.name, me.name), notify=LEAVE_NOTIFY)
