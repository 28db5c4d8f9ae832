"""The invariant checker passes real runs and catches deliberately corrupted state."""

from __future__ import annotations

import dataclasses

import pytest

from simulations.model.invariants import InvariantChecker, InvariantViolation
from simulations.model.world import World
from swim import EventKind, MemberEvent, NodeStateType


def _world(n: int = 8, *, full: bool = True) -> tuple[World, InvariantChecker]:
    world = World(n, seed=5)
    checker = InvariantChecker(world, full=full)
    world.start_all()
    world.run_until(3_000)
    return world, checker


def test_a_healthy_run_with_a_crash_and_a_restart_passes_full_checks() -> None:
    world, checker = _world()
    world.crash(3)
    world.run_until(20_000)
    world.restart(3)
    world.run_until(40_000)
    checker.scan_all()
    assert checker.checked_inputs > 1000
    assert checker.full_scans > 1000


def test_catches_a_node_whose_own_incarnation_went_backwards() -> None:
    world, _ = _world(full=False)
    node = world.nodes[2]
    node._members.local.incarnation = 0  # deliberate corruption
    with pytest.raises(InvariantViolation) as caught:
        world.run_until(6_000)
    err = caught.value
    assert err.rule == "own incarnation never decreases"
    assert err.seed == 5 and err.time_ms > 3_000
    assert "seed=5" in str(err)


def test_catches_an_observer_table_whose_incarnation_went_backwards() -> None:
    world, checker = _world()
    world.set_meta(6, b"v2")  # every observer now saw node-006 at a higher incarnation
    world.run_until(8_000)
    victim = world.nodes[1]._members.get(world.names[6])
    assert victim is not None
    victim.incarnation = 0  # deliberate corruption of node-001's view of node-006
    with pytest.raises(InvariantViolation, match="per-member incarnation"):
        checker.scan(1)


def test_catches_an_alive_that_clears_a_suspicion_without_a_higher_incarnation() -> None:
    world, checker = _world(full=False)
    member = world.nodes[0].member(world.names[5])
    assert member is not None
    suspect = dataclasses.replace(member, state=NodeStateType.SUSPECT, incarnation=4)
    checker.on_event(0, MemberEvent(EventKind.SUSPECT, suspect, world.now_ms))
    same = dataclasses.replace(member, state=NodeStateType.ALIVE, incarnation=4)
    with pytest.raises(InvariantViolation, match="alive"):
        checker.on_event(0, MemberEvent(EventKind.ALIVE, same, world.now_ms))


def test_catches_a_live_node_declaring_itself_dead() -> None:
    world, checker = _world(full=False)
    me = world.nodes[0].member(world.names[0])
    assert me is not None
    with pytest.raises(InvariantViolation, match="declares itself"):
        checker.on_event(0, MemberEvent(EventKind.DEAD, me, world.now_ms))


def test_catches_a_suspicion_overriding_a_death() -> None:
    world, checker = _world(full=False)
    member = world.nodes[0].member(world.names[5])
    assert member is not None
    dead = dataclasses.replace(member, state=NodeStateType.DEAD, incarnation=3)
    checker.on_event(0, MemberEvent(EventKind.DEAD, dead, world.now_ms))
    with pytest.raises(InvariantViolation, match="suspect never overrides dead"):
        checker.on_event(0, MemberEvent(EventKind.SUSPECT, dead, world.now_ms))
