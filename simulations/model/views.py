"""What the members see: one member's view of another, whether the live members agree,
and a log of every membership event in the order the world handled them.

Rules: read-only over a ``World`` (its nodes' public ``member``/``members``); members are
named by their number in the world, as everywhere in the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from swim import EventKind, MemberEvent, NodeStateType

if TYPE_CHECKING:
    from simulations.model.world import World


def state_of(world: World, observer: int, target: int) -> NodeStateType | None:
    """``target``'s state in ``observer``'s table (None: not in it)."""
    member = world.nodes[observer].member(world.names[target])
    return None if member is None else member.state


def all_see(
    world: World,
    target: int,
    states: Iterable[NodeStateType],
    observers: Iterable[int] | None = None,
) -> bool:
    """Every observer (default: every live member) but ``target`` has it in one of
    ``states``."""
    wanted = set(states)
    group = world.live_indices() if observers is None else observers
    return all(state_of(world, o, target) in wanted for o in group if o != target)


def converged(world: World, group: Iterable[int] | None = None) -> bool:
    """Every member of ``group`` (default: the live members) sees exactly the group as
    alive, and nothing else."""
    members = world.live_indices() if group is None else list(group)
    want = {world.names[i] for i in members}
    for i in members:
        alive = {m.name for m in world.nodes[i].members() if m.state == NodeStateType.ALIVE}
        if alive != want:
            return False
    return True


class EventLog:
    """A ``Listener`` keeping ``(observer, event)`` for every membership event."""

    def __init__(self, world: World) -> None:
        self.events: list[tuple[int, MemberEvent]] = []
        world.listeners.append(self)

    def on_event(self, idx: int, event: MemberEvent) -> None:
        self.events.append((idx, event))

    def on_lifecycle(self, kind: str, idx: int) -> None:
        pass

    def times(self, kind: EventKind, target: str, after_ms: int = 0) -> list[int]:
        """When any observer saw an event of ``kind`` about ``target`` since ``after_ms``."""
        return [
            e.at_ms
            for _, e in self.events
            if e.kind == kind and e.member.name == target and e.at_ms >= after_ms
        ]


__all__ = ["EventLog", "all_see", "converged", "state_of"]
