"""Pinned trace hashes: the simulator's behaviour, byte for byte, for the main scenarios.

Rules: every row is (label, how to run it, the trace hash it gave when pinned). A change
that moves a hash changes what the simulated protocol does (or what the world records);
it is either a bug or a behaviour change to state in the commit that re-pins the row. The
hashes were computed at commit bd40ed1 (before ``simulations/`` was regrouped into
``model``, ``experiments`` and ``reports``), with ``PYTHONHASHSEED`` irrelevant (``test_world``
checks that).

Pinned: every registered scenario's CI variant at seed 3 (``slow-members`` in both the
``full`` and the ``swim`` Lifeguard modes, ``churn`` with all four event rates, ``scale``
at 150 nodes), ``crash`` at seed 9, the bare world's crash run at seed 7 (snapshot
bootstrap and join fallback), the frontier's CI sweep and one of its runs, and the
all-to-all heartbeat baseline in a clean and a lossy frontier cell.

Re-pinned on purpose once: ``fast`` turned on the coordinated probe ring, early
conclusion of round-robin probes, cross-checks and the confirmed window, which moved the
frontier CI sweep (``4b32e0a1…`` → ``6113bc69…``) and the fast run (``d6d6b7ec…`` →
``1da77eed…``); the old fast run is still pinned, unchanged, as ``fast/before-switches``.
And once more: every profile re-announces its alive on a stale accusation of itself (it
was ``fast`` only), which moved ``slow-members`` (``63e3ec66…`` → ``7d1f8ae9…``; Lifeguard
``swim``: ``55b981d0…`` → ``45ae4ef1…``) and ``partition`` (``c9dcbdb2…`` → ``31e7b6d1…``)
at seed 3; at seeds 1–5 their false deaths are unchanged and one partition merges sooner
(22.5 → 7.5 s after the heal, seed 2).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from simulations.experiments import frontier
from simulations.experiments.harness import Params
from simulations.experiments.scenarios import run
from simulations.model.world import World


def _scenario(name: str, seed: int = 3, **kw: object) -> Callable[[], str]:
    extra = kw.pop("extra", {})
    assert isinstance(extra, dict)

    def go() -> str:
        params = Params(seed=seed, ci=True, extra=dict(extra), **kw)  # type: ignore[arg-type]
        return run(name, params).trace_hash

    return go


def _world_crash(seed: int, bootstrap: bool) -> Callable[[], str]:
    def go() -> str:
        world = World(10, seed=seed)
        world.start_all(bootstrap=bootstrap)
        world.run_until(3_000)
        world.crash(4)
        world.run_until(20_000)
        return world.trace_hash()

    return go


def _frontier_ci() -> str:
    return frontier.explore(frontier.Options.ci()).trace_hash


def _frontier_run(variant: str, condition: str, n: int, seed: int) -> Callable[[], str]:
    def go() -> str:
        row = frontier.run_one(frontier.RunSpec(variant, condition, n, seed, 1)).row
        return str(row["trace_hash"])

    return go


CHURN = {"crash_per_min": 6, "restart_per_min": 4, "join_per_min": 2, "leave_per_min": 2}

PINS: list[tuple[str, Callable[[], str], str]] = [
    ("steady ci seed 3", _scenario("steady"), "30878f2f2ff9c4fa53646d966e5dd850"),
    ("crash ci seed 3", _scenario("crash"), "9e15d8fe66e36e887a3229582e5fc58a"),
    ("crash ci seed 9", _scenario("crash", seed=9), "0125d9f7d06afc38dcba69c3cbc743b0"),
    ("dissemination ci seed 3", _scenario("dissemination"), "8344a08f17b008ba4c5f07191acf743f"),
    ("loss ci seed 3", _scenario("loss"), "e4e1cd8767083451dc0e206bd903b10b"),
    ("slow-members ci seed 3", _scenario("slow-members"), "7d1f8ae9099961526dbdd25590cf0f35"),
    (
        "slow-members ci seed 3 lifeguard swim",
        _scenario("slow-members", lifeguard="swim"),
        "45ae4ef13d99a31766ff9413ebf7f023",
    ),
    ("partition ci seed 3", _scenario("partition"), "31e7b6d199dd33e0cb8d8ffb42e927a0"),
    ("churn ci seed 3", _scenario("churn", extra=CHURN), "3d5322137f535366e8774ad134c6243b"),
    ("scale ci seed 3 n 150", _scenario("scale", nodes=150), "112c1631137af721f82c834632020731"),
    ("world crash seed 7 snapshot", _world_crash(7, True), "c64f70d714e031bfbe3271d374b01f82"),
    ("world crash seed 7 join", _world_crash(7, False), "07abf7d31834b21e607a869b06e79f92"),
    ("frontier ci", _frontier_ci, "6113bc6966f3c21b6ce68819f53fb294"),
    (
        "frontier fast clean n 16 seed 2",
        _frontier_run("fast", "clean", 16, 2),
        "1da77eed6d84fd459f741b267843d598",
    ),
    (
        "frontier fast/before-switches clean n 16 seed 2",
        _frontier_run("fast/before-switches", "clean", 16, 2),
        "d6d6b7ecdb942ba0827d03f692068a45",
    ),
    (
        "heartbeat clean n 12 seed 1",
        _frontier_run("heartbeat", "clean", 12, 1),
        "40f846d933ab3c1696e12d5995231b34",
    ),
    (
        "heartbeat loss10 n 12 seed 1",
        _frontier_run("heartbeat", "loss10", 12, 1),
        "bfbeb088c422a8dbd4501a33053b8fbb",
    ),
]


@pytest.mark.parametrize(("label", "go", "want"), PINS, ids=[p[0] for p in PINS])
def test_trace_hash_is_pinned(label: str, go: Callable[[], str], want: str) -> None:
    assert go() == want, f"{label}: the simulated behaviour changed"
