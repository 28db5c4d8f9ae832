"""The discrete-event world: determinism, the join fallback, slow members, streams."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from simulations.model.network import Constant
from simulations.model.world import SlowSpec, World
from swim import EventKind, MemberEvent, NodeStateType

ROOT = Path(__file__).resolve().parents[2]


def _crash_run(seed: int, bootstrap: bool = True) -> World:
    world = World(10, seed=seed)
    world.start_all(bootstrap=bootstrap)
    world.run_until(3_000)
    world.crash(4)
    world.run_until(20_000)
    return world


def test_same_seed_same_trace_hash_and_different_seeds_differ() -> None:
    a, b, c = _crash_run(7), _crash_run(7), _crash_run(8)
    assert a.trace_hash() == b.trace_hash()
    assert a.events_processed == b.events_processed
    assert a.trace_hash() != c.trace_hash()


def test_trace_hash_does_not_depend_on_the_process_hash_seed(tmp_path: Path) -> None:
    hashes = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        command = [sys.executable, "-m", "simulations.run", "--scenario", "crash", "--ci"]
        command += ["--out", str(tmp_path / hash_seed), "--no-plots", "--set", "crashes=1"]
        out = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith("trace hash:"))
        hashes.add(line)
    assert len(hashes) == 1


def test_crash_is_seen_by_everyone_with_and_without_the_snapshot() -> None:
    for bootstrap in (False, True):
        world = _crash_run(3, bootstrap=bootstrap)
        victim = world.names[4]
        for i in world.live_indices():
            member = world.nodes[i].member(victim)
            assert member is not None and member.state == NodeStateType.DEAD


def test_join_fallback_uses_push_pull_streams() -> None:
    world = World(6, seed=1)
    assert world.start_all(bootstrap=False) is False
    world.run_until(5_000)
    assert sum(world.traffic.streams_out) >= 5
    assert sum(world.traffic.streams_in) >= 5
    assert all(node.num_members() == 6 for node in world.nodes)


def test_slow_member_handles_inputs_late_and_in_order() -> None:
    world = World(4, seed=2, latency=Constant(1))
    world.start_all()
    world.run_until(2_000)
    world.set_slow(1, SlowSpec(delay_ms=0, pauses=((2_000, 6_000),)))
    handled: list[int] = []
    before = world.traffic.pkts_in[1]
    world.run_until(5_999)
    assert world.traffic.pkts_in[1] == before, "a paused node handles nothing"
    world.run_until(6_000)
    handled.append(world.traffic.pkts_in[1] - before)
    assert handled[0] > 0, "the queued packets are handled when the pause ends"
    world.run_until(30_000)
    # the pause (4 s) is shorter than the suspicion timeout: suspected at most, never dead
    victim = world.names[1]
    for i in (0, 2, 3):
        member = world.nodes[i].member(victim)
        assert member is not None and member.state == NodeStateType.ALIVE


def test_restart_rejoins_with_a_higher_incarnation() -> None:
    world = _crash_run(5)
    victim = world.names[4]
    seen: list[tuple[int, EventKind, int]] = []

    class Spy:
        def on_event(self, idx: int, event: MemberEvent) -> None:
            if event.member.name == victim:
                seen.append((idx, event.kind, event.member.incarnation))

        def on_lifecycle(self, kind: str, idx: int) -> None:
            pass

    world.listeners.append(Spy())
    world.restart(4)
    world.run_until(world.now_ms + 20_000)
    for i in world.live_indices():
        member = world.nodes[i].member(victim)
        assert member is not None and member.state == NodeStateType.ALIVE
    assert any(kind == EventKind.JOINED for _, kind, _ in seen)


def test_an_overloaded_member_queues_drops_and_handles_late() -> None:
    world = World(6, seed=4, latency=Constant(1))
    world.start_all()
    world.run_until(2_000)
    world.set_slow(2, SlowSpec(delay_ms=400, queue_limit=4, timer_delay_ms=50))
    world.run_until(20_000)
    assert world.slow_dropped() > 0, "datagrams beyond the queue limit are dropped"
    assert world.packets_queue_dropped == world.slow_dropped()
    assert 2 in world.faulty
    world.set_slow(2, None)
    assert 2 not in world.faulty
    world.run_until(60_000)
    for i in world.live_indices():
        assert world.nodes[i].num_members() == 6


def test_leave_stops_the_process_after_it_told_the_others() -> None:
    world = World(6, seed=4)
    world.start_all()
    world.run_until(2_000)
    world.leave(3)
    assert list(world.up)[3] and not world.live(3)
    world.run_until(4_000)
    assert not list(world.up)[3]
    for i in world.live_indices():
        member = world.nodes[i].member(world.names[3])
        assert member is not None and member.state == NodeStateType.LEFT


def test_events_at_the_same_millisecond_run_in_the_order_they_were_scheduled() -> None:
    world = World(2, seed=1)
    order: list[str] = []

    def first() -> None:
        order.append("first")
        world.at(world.now_ms, order.append, "scheduled-during-first")  # zero delay

    world.at(100, first)
    world.at(100, order.append, "second")
    world.at(50, order.append, "earlier")
    world.at(10, order.append, "past")
    world.run_until(100)
    assert order == ["past", "earlier", "first", "second", "scheduled-during-first"]
    assert world.now_ms == 100 and world.pending_events() == 0


def _scripted_run(*, fast: bool) -> World:
    """Crash, restart, leave, join, a metadata update and a slow member, on a lossy net."""
    world = World(12, seed=11, loss=0.05)
    world.skip_idle_gossip = fast
    world.skip_stale_timers = fast
    world.start_all()
    world.run_until(2_000)
    world.set_slow(5, SlowSpec(delay_ms=150, queue_limit=8, timer_delay_ms=30))
    world.crash(3)
    world.run_until(8_000)
    world.set_meta(7, b"v2")
    world.leave(9)
    world.join_new(b"new")
    world.run_until(15_000)
    world.set_slow(5, None)
    world.restart(3)
    world.run_until(40_000)
    return world


def test_the_fast_paths_change_nothing_a_node_or_the_trace_could_see() -> None:
    """Idle gossip ticks handed back later and stale timers dropped (``World.
    skip_idle_gossip``, ``skip_stale_timers``): the same run as calling the node for each."""
    slow, fast = _scripted_run(fast=False), _scripted_run(fast=True)
    assert fast.trace_hash() == slow.trace_hash()
    assert fast.member_events == slow.member_events
    assert fast.traffic.snapshot() == slow.traffic.snapshot()
    assert fast.events_processed == slow.events_processed
    for a, b in zip(slow.nodes, fast.nodes, strict=True):
        assert b.members() == a.members()
        assert b.stats == a.stats
        assert b.incarnation == a.incarnation
        assert b.live_timers == a.live_timers
