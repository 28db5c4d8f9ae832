"""Who trains and who waits: the job's target size and its spares. Pure rules, no I/O.

A job may have a *target size* in nodes (``Settings.target_nodes``; 0: every node of the
view trains). Nodes of the view beyond the target are *spares*: registered, model and
data pipeline built, heartbeating, but outside the process group (no collectives). The
leader of a formation (the oldest node of its view, ``torchhook.formation``) calls
:func:`roster` with the layout of the group it held last and its view; every other rank
follows the layout it offers, so only the leader needs these inputs.

Rules (:data:`RULES` names them; tests/torchhook/test_roster.py iterates the table):

1. ``all``: no target (0): every node of the view, oldest registration first (the layout
   without spares).
2. ``first``: the leader holds no previous layout (the job's first group, or every
   training node is gone): the ``target`` oldest nodes of the view, oldest first.
3. ``keep``: every node of the previous layout still in the view (same registration)
   keeps its slot, so the survivors keep their global ranks.
4. ``fill``: each slot whose node is gone, in slot order, goes to the oldest spare with
   the same number of local ranks (same world size, same layout: for HSDP the spare is
   the lost node's replica row). Oldest first, because every node then trains before
   every younger one, and the oldest node of a view, which leads the formation, always
   trains (a leader outside its own layout could not form it).
5. ``shrink``: a lost slot with no spare to fill it is dropped (ranks after it move down,
   as without spares).
6. ``grow``: below the target, the oldest remaining nodes are appended (a node that
   joins or returns while the job is short); at the target, a returning node is a spare.

:func:`wants_switch` is the step-boundary half: all ranks of a group switch at the same
step when any of them sees a view that the leader would turn into another layout. With a
target, a new node is a reason only while the group is below the target, or when it is
older than every node of the group (then it leads, and must be in a group).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from torchhook.strategy import Layout, Node, ViewMember

__all__ = ["RULES", "Roster", "Rule", "roster", "spares_of", "wants_switch"]

Rule = Literal["all", "first", "keep", "fill", "shrink", "grow"]
RULES: tuple[Rule, ...] = ("all", "first", "keep", "fill", "shrink", "grow")


@dataclass(frozen=True, slots=True)
class Roster:
    layout: Layout
    """The nodes that train, in slot (global rank) order."""
    spares: tuple[str, ...]
    """Nodes of the view that wait, oldest first."""
    rules: tuple[Rule, ...]
    """The rules that applied (for tests and logs)."""


def _node(m: ViewMember) -> Node:
    return Node(m.name, m.registered_ms, m.ranks)


def roster(prev: Layout | None, members: Sequence[ViewMember], target: int) -> Roster:
    """The training layout for ``members`` (a view: oldest registration first)."""
    nodes = [_node(m) for m in members]
    if target <= 0:
        return Roster(Layout(tuple(nodes)), (), ("all",))
    rules: list[Rule] = []
    if prev is None or not prev.nodes:
        chosen = nodes[:target]
        rules.append("first")
    else:
        present = {(n.name, n.registered_ms) for n in nodes}
        in_prev = prev.ids
        spares = [n for n in nodes if (n.name, n.registered_ms) not in in_prev]
        chosen = []
        for slot in prev.nodes:
            if (slot.name, slot.registered_ms) in present:
                chosen.append(slot)
                if "keep" not in rules:
                    rules.append("keep")
                continue
            fit = next((s for s in spares if s.ranks == slot.ranks), None)
            if fit is not None:
                spares.remove(fit)
                chosen.append(fit)
                rules.append("fill")
            else:
                rules.append("shrink")
        for extra in spares:
            if len(chosen) >= target:
                break
            chosen.append(extra)
            rules.append("grow")
    ids = {(n.name, n.registered_ms) for n in chosen}
    waiting = tuple(n.name for n in nodes if (n.name, n.registered_ms) not in ids)
    return Roster(Layout(tuple(chosen)), waiting, tuple(rules))


def spares_of(layout: Layout, members: Iterable[ViewMember]) -> tuple[str, ...]:
    """Members of a view outside ``layout`` (the spares a group sees), oldest first."""
    ids = layout.ids
    return tuple(m.name for m in members if (m.name, m.registered_ms) not in ids)


def wants_switch(layout: Layout, members: Sequence[ViewMember], target: int, *, lost: bool) -> bool:
    """Step boundary: would the leader form another layout from this view? ``lost``: a
    node of the group that this rank's view showed is gone."""
    if lost:
        return True
    ids = layout.ids
    new = [m for m in members if (m.name, m.registered_ms) not in ids]
    if not new:
        return False
    if target <= 0 or len(layout.nodes) < target:
        return True
    oldest = members[0]
    return (oldest.name, oldest.registered_ms) not in ids
