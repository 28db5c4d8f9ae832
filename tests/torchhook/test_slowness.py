"""The fail-slow rules (torchhook/slowness.py), as tables: windows of node figures in,
flags out. Noise (data-loader jitter, a GC pause, one spike window) must not flag."""

from __future__ import annotations

import math
import random

import pytest

from torchhook.slowness import (
    NOISE_FLOOR_MS,
    NodeState,
    judge,
    keep_at_least,
    window_figure,
)

FACTOR = 1.3
WINDOWS = 2


def run(
    windows: list[dict[str, float | None]],
    *,
    factor: float = FACTOR,
    k: int = WINDOWS,
    keep: int = 1,
) -> list[tuple[str, ...]]:
    """The flagged nodes after each window, carrying the states as the ranks do."""
    states: dict[str, NodeState] = {}
    out = []
    for figures in windows:
        verdict = judge(figures, states, factor=factor, windows=k, keep=keep)
        states = verdict.states
        out.append(verdict.flagged)
    return out


def steady(n: int, **nodes: float | None) -> list[dict[str, float | None]]:
    return [dict(nodes) for _ in range(n)]


def fig(samples: list[float]) -> float | None:
    return window_figure(samples)


R = random.Random(7)


def jittery(base: float, n: int = 10, spread: float = 0.2) -> list[float]:
    """Data-loader jitter: every step off by up to ``spread`` either way."""
    return [base * (1 + R.uniform(-spread, spread)) for _ in range(n)]


# fmt: off
CASES: list[tuple[str, list[dict[str, float | None]], list[tuple[str, ...]]]] = [
    ("all equal: nothing", steady(4, a=10.0, b=10.0, c=10.0), [(), (), (), ()]),
    ("3x slow node: flagged at the second window",
     steady(3, a=10.0, b=10.0, c=30.0), [(), ("c",), ("c",)]),
    ("1.5x slow node: flagged at the second window",
     steady(3, a=10.0, b=10.0, c=15.0), [(), ("c",), ("c",)]),
    ("just under the factor: nothing", steady(4, a=10.0, b=10.0, c=12.9), [(), (), (), ()]),
    ("two nodes: the slower one (reference is the faster)",
     steady(2, a=10.0, b=30.0), [(), ("b",)]),
    ("one spike window does not flag",
     [{"a": 10.0, "b": 10.0, "c": 40.0}, {"a": 10.0, "b": 10.0, "c": 10.0},
      {"a": 10.0, "b": 10.0, "c": 40.0}, {"a": 10.0, "b": 10.0, "c": 10.0}],
     [(), (), (), ()]),
    ("a GC pause in 3 of 10 steps: the lower quartile ignores it",
     steady(4, a=10.0, b=10.0, c=fig([10.0] * 7 + [300.0] * 3)), [(), (), (), ()]),
    ("starved of CPU in 7 of 10 steps for four windows: nothing",
     steady(4, a=10.0, b=10.0, c=fig([10.0] * 3 + [20.0] * 7)), [(), (), (), ()]),
    ("slow in every step, with noise on top: flagged",
     steady(2, a=fig(jittery(10.0)), b=fig(jittery(10.0)), c=fig(jittery(15.0))),
     [(), ("c",)]),
    ("data-loader jitter of 20% on every node: nothing",
     [{"a": fig(jittery(10.0)), "b": fig(jittery(10.0)), "c": fig(jittery(10.0))}
      for _ in range(30)], [()] * 30),
    ("tiny steps: under the noise floor nothing",
     steady(4, a=0.5, b=0.5, c=0.5 + NOISE_FLOOR_MS * 0.9), [(), (), (), ()]),
    ("one node: nothing to compare", steady(3, a=10.0), [(), (), ()]),
    ("no figure keeps the streak",
     [{"a": 10.0, "b": 10.0, "c": 30.0}, {"a": 10.0, "b": 10.0, "c": None},
      {"a": 10.0, "b": 10.0, "c": 30.0}], [(), (), ("c",)]),
    ("a flag clears after as many healthy windows",
     steady(2, a=10.0, b=10.0, c=30.0) + steady(3, a=10.0, b=10.0, c=10.0),
     [(), ("c",), ("c",), (), ()]),
    ("flagged, one fast window does not clear it",
     [*steady(2, a=10.0, b=10.0, c=30.0), {"a": 10.0, "b": 10.0, "c": 10.0},
      *steady(1, a=10.0, b=10.0, c=30.0)], [(), ("c",), ("c",), ("c",)]),
    ("a slow minority of two in five: both flagged, slowest first",
     steady(2, a=10.0, b=10.0, c=10.0, d=20.0, e=40.0), [(), ("e", "d")]),
    ("everyone slows down together: nothing",
     steady(2, a=10.0, b=10.0, c=10.0) + steady(2, a=30.0, b=30.0, c=30.0),
     [(), (), (), ()]),
]
# fmt: on


@pytest.mark.parametrize(("windows", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_windows(windows: list[dict[str, float | None]], expected: list[tuple[str, ...]]) -> None:
    assert run(windows) == expected


def test_one_window_flags_with_k_1_and_k_3_needs_three() -> None:
    slow = steady(3, a=10.0, b=10.0, c=30.0)
    assert run(slow, k=1) == [("c",)] * 3
    assert run(slow, k=3) == [(), (), ("c",)]


def test_a_node_that_joins_later_takes_each_nodes_state_from_that_node() -> None:
    # the ranks of a, b, c have seen c slow once; a newcomer d knows nothing, but the
    # gathered states carry c's own view, so d judges as the others do
    first = judge({"a": 10.0, "b": 10.0, "c": 30.0}, {}, factor=FACTOR, windows=2, keep=1)
    carried = {n: first.states[n] for n in ("a", "b", "c")}
    figures: dict[str, float | None] = {"a": 10.0, "b": 10.0, "c": 30.0, "d": 10.0}
    second = judge(figures, carried, factor=FACTOR, windows=2, keep=1)
    assert second.flagged == ("c",) and second.newly == ("c",)


@pytest.mark.parametrize(
    ("nodes", "min_nodes", "majority", "keep"),
    [(3, 1, True, 2), (4, 1, True, 3), (2, 1, True, 2), (2, 1, False, 1), (5, 4, True, 4)],
)
def test_keep_at_least(nodes: int, min_nodes: int, majority: bool, keep: int) -> None:
    assert keep_at_least(nodes, min_nodes, majority) == keep


def test_exclude_keeps_the_quorum_slowest_first() -> None:
    figures: dict[str, float | None] = {"a": 10.0, "b": 10.0, "c": 10.0, "d": 20.0, "e": 40.0}
    states = {"d": NodeState(False, 1), "e": NodeState(False, 1)}
    both = judge(figures, states, factor=FACTOR, windows=2, keep=keep_at_least(5, 1, True))
    assert both.exclude == ("e", "d")
    one = judge(figures, states, factor=FACTOR, windows=2, keep=4)
    assert one.flagged == ("e", "d") and one.exclude == ("e",)
    # two nodes with a majority quorum: the one left would not be a majority
    pair = judge({"a": 10.0, "b": 30.0}, {"b": NodeState(False, 1)}, factor=FACTOR, windows=2,
                 keep=keep_at_least(2, 1, True))  # fmt: skip
    assert pair.flagged == ("b",) and pair.exclude == ()


def test_ratios_and_reference() -> None:
    v = judge({"a": 10.0, "b": 12.0, "c": 30.0}, {}, factor=FACTOR, windows=2, keep=1)
    assert v.reference_ms == 12.0
    assert v.ratios["c"] == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("samples", "figure"),
    [
        ([], None),
        ([5.0], 5.0),
        ([1.0, 2.0, 100.0], 1.0),
        ([math.nan, -1.0, 4.0], 4.0),
        ([10.0] * 7 + [300.0] * 3, 10.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 2.0),
    ],
)
def test_window_figure(samples: list[float], figure: float | None) -> None:
    assert window_figure(samples) == figure


QUICK = 2.0


# fmt: off
QUICK_CASES: list[tuple[str, list[dict[str, float | None]], list[tuple[str, ...]]]] = [
    ("3x slow node: flagged at the first window",
     steady(3, a=10.0, b=10.0, c=30.0), [("c",), ("c",), ("c",)]),
    ("exactly the quick factor: flagged at the first window",
     steady(2, a=10.0, b=10.0, c=20.0), [("c",), ("c",)]),
    ("just under the quick factor: the second window",
     steady(3, a=10.0, b=10.0, c=19.9), [(), ("c",), ("c",)]),
    ("1.5x slow node: the second window, as without the quick flag",
     steady(3, a=10.0, b=10.0, c=15.0), [(), ("c",), ("c",)]),
    ("one spike window under the quick factor does not flag",
     [{"a": 10.0, "b": 10.0, "c": 19.0}, {"a": 10.0, "b": 10.0, "c": 10.0},
      {"a": 10.0, "b": 10.0, "c": 19.0}, {"a": 10.0, "b": 10.0, "c": 10.0}],
     [(), (), (), ()]),
    ("a 30x pause in 6 of 10 steps: the lower quartile still ignores it",
     steady(2, a=10.0, b=10.0, c=fig([10.0] * 4 + [300.0] * 6)), [(), ()]),
    ("quick above the noise floor only",
     steady(2, a=0.5, b=0.5, c=0.5 + NOISE_FLOOR_MS * 0.9), [(), ()]),
    ("a quick flag clears after as many healthy windows",
     steady(1, a=10.0, b=10.0, c=30.0) + steady(3, a=10.0, b=10.0, c=10.0),
     [("c",), ("c",), (), ()]),
    ("flagged at once, one fast window does not clear it",
     [{"a": 10.0, "b": 10.0, "c": 30.0}, {"a": 10.0, "b": 10.0, "c": 10.0},
      {"a": 10.0, "b": 10.0, "c": 30.0}, {"a": 10.0, "b": 10.0, "c": 10.0}],
     [("c",), ("c",), ("c",), ("c",)]),
    ("one slow window, then a quick one: flagged (either way)",
     [{"a": 10.0, "b": 10.0, "c": 15.0}, {"a": 10.0, "b": 10.0, "c": 30.0}],
     [(), ("c",)]),
    ("two nodes: the slower one at once", steady(1, a=10.0, b=30.0), [("b",)]),
    ("everyone slows down together: nothing",
     steady(1, a=10.0, b=10.0, c=10.0) + steady(2, a=30.0, b=30.0, c=30.0), [(), (), ()]),
]
# fmt: on


@pytest.mark.parametrize(
    ("windows", "expected"), [c[1:] for c in QUICK_CASES], ids=[c[0] for c in QUICK_CASES]
)
def test_quick_windows(
    windows: list[dict[str, float | None]], expected: list[tuple[str, ...]]
) -> None:
    states: dict[str, NodeState] = {}
    out = []
    for figures in windows:
        verdict = judge(figures, states, factor=FACTOR, windows=WINDOWS, keep=1, quick_factor=QUICK)
        states = verdict.states
        out.append(verdict.flagged)
    assert out == expected


def test_quick_flag_is_newly_and_quick_and_carries_a_plain_state() -> None:
    # the state a quick flag leaves is the one a two-window flag leaves, so the gathered
    # states mean the same to every rank whichever rule set them
    v = judge({"a": 10.0, "b": 10.0, "c": 30.0}, {}, factor=FACTOR, windows=2, keep=1,
              quick_factor=QUICK)  # fmt: skip
    assert v.newly == ("c",) and v.quick == ("c",)
    assert v.states["c"] == NodeState(flagged=True, run=0)
    slow = judge({"a": 10.0, "b": 10.0, "c": 15.0}, {"c": NodeState(False, 1)}, factor=FACTOR,
                 windows=2, keep=1, quick_factor=QUICK)  # fmt: skip
    assert slow.newly == ("c",) and slow.quick == ()
    assert slow.states["c"] == v.states["c"]


def test_quick_off_is_the_two_window_rule() -> None:
    for _, windows, _ in QUICK_CASES + CASES:
        states: dict[str, NodeState] = {}
        old: dict[str, NodeState] = {}
        for figures in windows:
            off = judge(figures, states, factor=FACTOR, windows=WINDOWS, keep=1, quick_factor=0.0)
            plain = judge(figures, old, factor=FACTOR, windows=WINDOWS, keep=1)
            assert off == plain
            states, old = off.states, plain.states
    assert run(steady(2, a=10.0, b=10.0, c=30.0)) == [(), ("c",)]
