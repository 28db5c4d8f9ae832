"""Protocol invariants, checked while the world runs.

Rules checked (SWIM §4.2 "Suspicion mechanism"; memberlist state.go ``aliveNode``,
``suspectNode``, ``deadNode``, ``refute``; docs/design.md §5.6: "only a node raises its
own incarnation"):
1. A node's own incarnation never decreases (checked after every input it handles).
2. A live node never reports itself suspect or dead (only a leaving node may report
   that it left).
3. Per (observer, member), the incarnation in the observer's events never decreases,
   except when the member comes back after being reaped or after it left/died and is
   reclaimed from another address (memberlist ``DeadNodeReclaimTime``/left reclaim).
4. Precedence: an alive that clears a suspicion carries a strictly higher incarnation
   than the suspicion (Alive(i) overrides Suspect(j) only for i > j); a suspicion never
   replaces a death (Confirm overrides everything); a dead member rejoins only with a
   higher incarnation or a reclaimed address.

Cost: 1 is one attribute read per input (or per ``own_every``-th input: sampled, for
large N); 2–4 are per membership event (rare compared with packets). ``full=True`` adds,
after every input, a scan of the node's whole table against what its events said
(catches changes that emitted no event); ``full_every=K`` does that scan on every K-th
input only (sampled checks for large N).

A violation raises ``InvariantViolation`` with the seed, the virtual time and details.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swim import EventKind, MemberEvent, Node, NodeStateType

if TYPE_CHECKING:
    from simulations.model.world import World

_ALIVE, _SUSPECT, _DEAD, _LEFT = (
    NodeStateType.ALIVE,
    NodeStateType.SUSPECT,
    NodeStateType.DEAD,
    NodeStateType.LEFT,
)
_STATE_OF_EVENT = {
    EventKind.JOINED: _ALIVE,
    EventKind.UPDATED: _ALIVE,
    EventKind.ALIVE: _ALIVE,
    EventKind.SUSPECT: _SUSPECT,
    EventKind.DEAD: _DEAD,
    EventKind.LEFT: _LEFT,
}


class InvariantViolation(AssertionError):
    """A protocol invariant failed; the message names the seed, time and details."""

    def __init__(self, seed: int, time_ms: int, rule: str, details: str) -> None:
        super().__init__(f"invariant '{rule}' violated (seed={seed}, t={time_ms} ms): {details}")
        self.seed = seed
        self.time_ms = time_ms
        self.rule = rule
        self.details = details


class InvariantChecker:
    """Attach with ``InvariantChecker(world)``; it registers itself on the world."""

    def __init__(
        self, world: World, *, full: bool = False, full_every: int = 0, own_every: int = 1
    ) -> None:
        self.world = world
        self.full = full
        self.full_every = 1 if full else full_every
        self.own_every = 1 if full else max(1, own_every)
        self._own_countdown = self.own_every
        self.checked_inputs = 0
        self.checked_events = 0
        self.full_scans = 0
        self._own: list[int] = [node.incarnation for node in world.nodes]
        self._seen: dict[tuple[int, str], tuple[int, NodeStateType]] = {}
        self._countdown = self.full_every
        world.checker = self
        world.listeners.append(self)

    def _fail(self, rule: str, details: str) -> None:
        raise InvariantViolation(self.world.seed, self.world.now_ms, rule, details)

    # --- world callbacks ----------------------------------------------------------------

    def on_lifecycle(self, kind: str, idx: int) -> None:
        own = self._own
        while len(own) <= idx:
            own.append(0)
        if kind in ("restart", "join"):
            own[idx] = self.world.nodes[idx].incarnation
            for key in [k for k in self._seen if k[0] == idx]:
                del self._seen[key]

    def after_input(self, idx: int, node: Node) -> None:
        if self.own_every > 1:
            self._own_countdown -= 1
            if self._own_countdown > 0:
                return
            self._own_countdown = self.own_every
        self.checked_inputs += 1
        inc = node.incarnation
        own = self._own
        if idx >= len(own):
            own.extend([0] * (idx + 1 - len(own)))
        if inc < own[idx]:
            self._fail(
                "own incarnation never decreases",
                f"{node.name} went from incarnation {own[idx]} to {inc}",
            )
        own[idx] = inc
        if self.full_every:
            self._countdown -= 1
            if self._countdown <= 0:
                self._countdown = self.full_every
                self.scan(idx)

    def on_event(self, idx: int, event: MemberEvent) -> None:
        self.checked_events += 1
        world = self.world
        m = event.member
        observer = world.names[idx]
        kind = event.kind
        if m.name == observer:
            if kind in (EventKind.SUSPECT, EventKind.DEAD) or (
                kind == EventKind.LEFT and not world.leaving[idx]
            ):
                self._fail(
                    "a live node never declares itself failed",
                    f"{observer} reported itself {kind.value} at incarnation {m.incarnation}",
                )
            return
        key = (idx, m.name)
        if kind == EventKind.REAPED:
            self._seen.pop(key, None)
            return
        state = _STATE_OF_EVENT[kind]
        prev = self._seen.get(key)
        if prev is not None:
            self._check_transition(observer, m.name, prev, kind, m.incarnation)
        self._seen[key] = (m.incarnation, state)

    def _check_transition(
        self,
        observer: str,
        member: str,
        prev: tuple[int, NodeStateType],
        kind: EventKind,
        inc: int,
    ) -> None:
        prev_inc, prev_state = prev
        where = f"{observer}'s view of {member}: {prev_state.name.lower()}@{prev_inc}"
        if inc < prev_inc and not (kind == EventKind.JOINED and prev_state in (_DEAD, _LEFT)):
            self._fail(
                "per-member incarnation never decreases",
                f"{where} → {kind.value}@{inc}",
            )
        if kind == EventKind.ALIVE and prev_state == _SUSPECT and inc <= prev_inc:
            self._fail(
                "alive(i) clears suspect(j) only if i > j",
                f"{where} → alive@{inc}",
            )
        if kind == EventKind.SUSPECT and prev_state in (_DEAD, _LEFT):
            self._fail("suspect never overrides dead", f"{where} → suspect@{inc}")
        if (
            kind == EventKind.JOINED
            and prev_state == _DEAD
            and inc <= prev_inc
            and not self._reclaimable()
        ):
            self._fail("dead(i) is overridden only by alive(j > i)", f"{where} → joined@{inc}")

    def _reclaimable(self) -> bool:
        return self.world.config.dead_node_reclaim_time_ms > 0

    # --- full scans ---------------------------------------------------------------------

    def scan(self, idx: int) -> None:
        """Compare one node's whole table with what its events said so far."""
        self.full_scans += 1
        node = self.world.nodes[idx]
        me = node.member(node.name)
        if me is None or (me.state != _ALIVE and not self.world.leaving[idx]):
            state = "missing" if me is None else me.state.name.lower()
            self._fail("a live node sees itself alive", f"{node.name} sees itself {state}")
        for m in node.members():
            if m.name == node.name:
                continue
            prev = self._seen.get((idx, m.name))
            if prev is None:
                continue
            prev_inc, prev_state = prev
            if m.incarnation < prev_inc and not (
                m.state == _ALIVE and prev_state in (_DEAD, _LEFT)
            ):
                self._fail(
                    "per-member incarnation never decreases",
                    f"{node.name}'s table has {m.name}@{m.incarnation} "
                    f"({m.state.name.lower()}), its events said {prev_state.name.lower()}"
                    f"@{prev_inc}",
                )

    def scan_all(self) -> None:
        for idx in self.world.live_indices():
            self.scan(idx)
