"""The roster's rules (torchhook/roster.py), one table row per case; every rule is covered."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from torchhook.roster import RULES, Rule, roster, spares_of, wants_switch
from torchhook.strategy import Layout, Node


class M(NamedTuple):
    name: str
    registered_ms: int
    ranks: int = 2


A, B, C, D, E = M("a", 1), M("b", 2), M("c", 3), M("d", 4), M("e", 5)
D1 = M("d", 4, 1)  # a node with another number of local ranks
A2 = M("a", 9)  # a returned a: a new registration, the youngest


def lay(*ms: M) -> Layout:
    return Layout(tuple(Node(*m) for m in ms))


class Case(NamedTuple):
    why: str
    prev: Layout | None
    view: tuple[M, ...]
    target: int
    trains: tuple[str, ...]
    spares: tuple[str, ...]
    rules: tuple[Rule, ...]


CASES = [
    Case("no target: every node trains", None, (A, B, C, D), 0, ("a", "b", "c", "d"), (),
         ("all",)),
    Case("first group: the target oldest", None, (A, B, C, D), 3, ("a", "b", "c"), ("d",),
         ("first",)),
    Case("first group short of the target", None, (A, B), 3, ("a", "b"), (), ("first",)),
    Case("at the target, nothing lost", lay(A, B, C), (A, B, C, D), 3, ("a", "b", "c"),
         ("d",), ("keep",)),
    Case("a middle node lost: the spare takes its slot", lay(A, B, C), (A, C, D), 3,
         ("a", "d", "c"), (), ("keep", "fill")),
    Case("rank 0's node lost: the spare becomes rank 0", lay(A, B, C), (B, C, D, E), 3,
         ("d", "b", "c"), ("e",), ("fill", "keep")),
    Case("two lost, one spare: fill the first slot, drop the second", lay(A, B, C), (A, D),
         3, ("a", "d"), (), ("keep", "fill", "shrink")),
    Case("no spare: shrink as without a target", lay(A, B, C), (A, C), 3, ("a", "c"), (),
         ("keep", "shrink")),
    Case("a spare of another size cannot fill the slot", lay(A, B, C), (A, C, D1), 3,
         ("a", "c", "d"), (), ("keep", "shrink", "grow")),
    Case("a returned node is the only spare: it takes the lost slot", lay(A, D, C),
         (C, D, A2), 3, ("a", "d", "c"), (), ("fill", "keep")),
    Case("below the target: a new node grows the group", lay(A, C), (A, C, D), 3,
         ("a", "c", "d"), (), ("keep", "grow")),
    Case("at the target a returning node waits", lay(B, D, C), (B, C, D, A2), 3,
         ("b", "d", "c"), ("a",), ("keep",)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.why for c in CASES])
def test_roster_table(case: Case) -> None:
    got = roster(case.prev, case.view, case.target)
    assert tuple(n.name for n in got.layout.nodes) == case.trains
    assert got.spares == case.spares
    assert got.rules == case.rules
    # nobody is both, nobody is lost, nobody trains twice
    names = [n.name for n in got.layout.nodes]
    assert len(names) == len(set(names))
    assert set(names) | set(got.spares) == {m.name for m in case.view}


def test_every_rule_is_in_the_table() -> None:
    seen = {r for c in CASES for r in c.rules}
    assert seen == set(RULES)


def test_survivors_keep_their_global_ranks() -> None:
    prev = lay(A, B, C)
    got = roster(prev, (A, C, D), 3).layout
    assert got.world_size == prev.world_size
    for m in (A, C):
        assert got.ranks_of(m.name) == prev.ranks_of(m.name)
    assert got.ranks_of("d") == prev.ranks_of("b")  # the lost node's replica row


def test_the_oldest_node_always_trains() -> None:
    """The leader (the view's oldest node) must be in the layout it offers."""
    for case in CASES:
        got = roster(case.prev, case.view, case.target)
        assert case.view[0].name in [n.name for n in got.layout.nodes], case.why


SWITCH = [
    # (why, layout, view, target, lost, switch)
    ("no target: a new node", lay(A, B, C), (A, B, C, D), 0, False, True),
    ("at the target: a new spare is no reason", lay(A, B, C), (A, B, C, D), 3, False, False),
    ("below the target: a new node grows the group", lay(A, B), (A, B, D), 3, False, True),
    ("a node lost", lay(A, B, C), (A, B, D), 3, True, True),
    ("an older node than the group's: it leads", lay(B, C, D), (A, B, C, D), 3, False, True),
    ("nothing new", lay(A, B, C), (A, B, C), 3, False, False),
]


@pytest.mark.parametrize("row", SWITCH, ids=[r[0] for r in SWITCH])
def test_wants_switch_table(row: tuple[str, Layout, tuple[M, ...], int, bool, bool]) -> None:
    _, layout, view, target, lost, switch = row
    assert wants_switch(layout, view, target, lost=lost) is switch


def test_spares_of() -> None:
    assert spares_of(lay(A, B), (A, B, C, D)) == ("c", "d")
    assert spares_of(lay(A, B), (A, M("b", 7))) == ("b",)  # a new registration is new
