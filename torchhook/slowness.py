"""Fail-slow verdicts: which nodes of a training group are slow, from every rank's figures.

Pure: inputs in, verdict out (no torch, no clock, no IO). ``torchhook.pace`` measures the
figures and shares them (one all-gather per window inside the group), so every rank of the
group calls ``judge`` with the same inputs and reaches the same verdict: no central judge.

A node that is alive but slow (a throttled GPU, a bad NIC, a noisy neighbour) slows every
synchronous step of the job; studies of large jobs find it in most of them (Alibaba's
FALCON, ByteDance's ByteRobust). The rules, each against a kind of noise:

- A rank's *window figure* is the lower quartile of its per-step compute times
  (milliseconds) over the window (``window_figure``). Noise on a step time is only ever
  positive (a garbage-collection pause, a data-loader stall, a descheduled process), while
  a slow node is slow on every step, its fastest ones too: so the lower quartile ignores
  noise in up to three quarters of a window's steps and still moves with a real slowdown.
  The price: a node slow in fewer than about three quarters of its steps is not flagged.
- A node's figure is the largest of its ranks' figures: a synchronous step waits for the
  node's slowest rank, whatever the others do.
- The reference is the *lower median* of the node figures (``statistics.median_low``):
  with two nodes it is the faster one, and a slow minority never moves it.
- A node is slow in a window when its figure is at least ``factor`` times the reference
  and at least ``NOISE_FLOOR_MS`` above it (timer and scheduler granularity make tiny
  steps look different).
- Hysteresis, per node: ``windows`` slow windows in a row flag it, ``windows`` healthy
  windows in a row clear the flag; a window without the node's figure changes nothing. So
  one spike window never flags a node, and a node near the threshold does not flap.
- Quick flag: a node whose figure in one window is at least ``quick_factor`` times the
  reference (and ``NOISE_FLOOR_MS`` above it) is flagged in that window, without waiting
  for ``windows`` slow ones (0: no quick flag). Its lower quartile that far up means three
  quarters of its steps were that slow: not a spike of a few steps, which the quartile
  ignores, and a second window would only confirm it while the whole job runs at the slow
  node's pace. Clearing keeps the hysteresis (``windows`` healthy windows), so a node
  flagged at once does not flap either.
- A node's state (flagged, run) comes from its own ranks (the gathered figures carry it):
  a node that joined the group later has no history of the others, but every rank reads
  each node's state from that node and so still judges the same way.
- ``exclude`` lists the flagged nodes to leave out, slowest first, only while the others
  keep ``keep_at_least`` nodes (``min_nodes``, and a strict majority for a quorum).
- At least two node figures are needed: one node has nothing to compare with.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "NOISE_FLOOR_MS",
    "NodeState",
    "Verdict",
    "judge",
    "keep_at_least",
    "window_figure",
]

NOISE_FLOOR_MS = 2.0
"""A node is not slow by less than this (ms per step): below it, the host's timer and
scheduler granularity, not the node, make the difference."""


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node's fail-slow state: flagged or not, and ``run``, the windows in a row that
    contradict the flag (slow ones while not flagged, healthy ones while flagged)."""

    flagged: bool = False
    run: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    """One window's outcome for every node that had a state or a figure."""

    states: dict[str, NodeState]
    ratios: dict[str, float]
    """Node figure / reference, for the nodes with a figure (empty without a reference)."""
    reference_ms: float | None
    flagged: tuple[str, ...]
    """Flagged nodes after this window, slowest first."""
    newly: tuple[str, ...]
    """Nodes flagged in this window (not before it)."""
    cleared: tuple[str, ...]
    """Nodes whose flag this window cleared."""
    exclude: tuple[str, ...]
    """Flagged nodes to leave out of the next group (policy ``exclude``), slowest first."""
    quick: tuple[str, ...] = ()
    """Of ``newly``, the nodes flagged by the quick rule (one window at ``quick_factor``)."""


def window_figure(samples_ms: Iterable[float]) -> float | None:
    """A rank's figure for one window: the lower quartile of its step times (the smallest
    with fewer than four); None without one."""
    values = sorted(v for v in samples_ms if math.isfinite(v) and v >= 0)
    if len(values) < 4:
        return values[0] if values else None
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def keep_at_least(nodes: int, min_nodes: int, majority: bool) -> int:
    """The nodes an exclusion must leave: ``min_nodes``, at least one, and with a majority
    quorum more than half of the group (or the rest could not re-form)."""
    floor = nodes // 2 + 1 if majority else 1
    return max(min_nodes, floor, 1)


def judge(
    figures: Mapping[str, float | None],
    states: Mapping[str, NodeState],
    *,
    factor: float,
    windows: int,
    keep: int,
    quick_factor: float = 0.0,
) -> Verdict:
    """One window. ``figures``: node -> its figure (ms, the largest of its ranks'), None
    when it has none this window; ``states``: node -> its state before the window, as
    the node's own ranks report it; ``factor`` >= 1, ``windows`` >= 1 as in
    ``torchhook.settings``; ``keep``: of the group's nodes (the keys of ``figures``), how
    many an exclusion must leave (``keep_at_least``); ``quick_factor``: 0, or >=
    ``factor``: a node at least that many times the reference is flagged in one window."""
    known = {n: f for n, f in figures.items() if f is not None and math.isfinite(f) and f >= 0}
    reference = statistics.median_low(sorted(known.values())) if len(known) >= 2 else None
    ratios: dict[str, float] = {}
    if reference is not None:
        for name, value in known.items():
            ratios[name] = value / reference if reference > 0 else math.inf
    after: dict[str, NodeState] = {}
    newly: list[str] = []
    cleared: list[str] = []
    quick: list[str] = []
    for name in sorted(set(states) | set(figures)):
        before = states.get(name, NodeState())
        if reference is None or name not in known:
            after[name] = before
            continue
        above = known[name] - reference >= NOISE_FLOOR_MS
        slow = above and known[name] >= factor * reference
        if (
            slow
            and not before.flagged
            and quick_factor > 0
            and known[name] >= quick_factor * reference
        ):
            after[name] = NodeState(flagged=True, run=0)  # far too slow: no second window
            newly.append(name)
            quick.append(name)
            continue
        if slow != before.flagged:
            run = min(before.run + 1, windows)
            if run >= windows:
                after[name] = NodeState(flagged=slow, run=0)
                (newly if slow else cleared).append(name)
                continue
            after[name] = NodeState(before.flagged, run)
        else:
            after[name] = NodeState(before.flagged, 0)
    flagged = sorted(
        (n for n, s in after.items() if s.flagged), key=lambda n: (-ratios.get(n, 0.0), n)
    )
    room = max(len(figures) - keep, 0) if reference is not None else 0
    exclude = tuple(n for n in flagged if n in known)[:room]
    return Verdict(
        after,
        ratios,
        reference,
        tuple(flagged),
        tuple(sorted(newly)),
        tuple(sorted(cleared)),
        exclude,
        tuple(sorted(quick)),
    )
