"""Timers are frozen values with typed payloads; the node's dispatch covers every kind and
refuses a timer that is not one of its own (swim.timers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from swim import Ack, Timer
from swim.messages import Suspect
from swim.timers import NODE_TIMERS, GossipTick, ProbeTick, SuspicionTimeout
from tests.swim.node_harness import addr, alive, make_peer


def test_every_kind_is_a_frozen_timer_with_deadline_and_id() -> None:
    assert len(set(NODE_TIMERS)) == len(NODE_TIMERS) == 11
    for kind in NODE_TIMERS:
        assert issubclass(kind, Timer)
        assert dataclasses.is_dataclass(kind)
        names = [f.name for f in dataclasses.fields(kind)]
        assert names[:2] == ["deadline_ms", "timer_id"], kind
        assert kind.__dataclass_params__.frozen, kind  # type: ignore[union-attr]


def test_a_timer_carries_its_payload() -> None:
    o = make_peer("o", 1)
    o.learn(alive("x", 2))
    o.receive(addr(3), Suspect(1, "x", "someone"), now_ms=500)
    timer = o.timer(SuspicionTimeout)
    member = o.member("x")
    assert (timer.name, timer.state_change_ms) == ("x", member.state_change_ms) == ("x", 500)
    with pytest.raises(dataclasses.FrozenInstanceError):
        timer.name = "y"  # type: ignore[misc]


def test_a_foreign_timer_raises_and_a_stale_one_is_ignored() -> None:
    @dataclass(frozen=True, slots=True)
    class Foreign(Timer):
        pass

    o = make_peer("o", 1)
    with pytest.raises(TypeError, match=r"not a timer of swim\.Node"):
        o.node.handle_timer(Foreign(0, 1), 0)
    with pytest.raises(TypeError):
        o.node.handle_timer(Timer(0, 1), 0)
    gossip = o.timer(GossipTick)
    o.fire(GossipTick)
    assert o.node.handle_timer(gossip, gossip.deadline_ms).timers == []  # already fired
    probe = o.timer(ProbeTick)
    forged = GossipTick(probe.deadline_ms, probe.timer_id)  # a live number, another kind
    assert o.node.handle_timer(forged, probe.deadline_ms).timers == []
    assert [type(t) for t in o.fire(ProbeTick).timers] == [ProbeTick]  # still live


def test_outputs_name_gossip_ticks_and_forgotten_timers_as_a_driver_relies_on() -> None:
    """agent/driver.py holds back idle gossip ticks and drops forgotten timers unhanded:
    an idle tick only asks for the next one an interval later, and a timer named in
    ``Output.cancelled_timers`` does nothing when handed back."""
    o = make_peer("o", 1)
    o.learn(alive("x", 2))
    o.drain(0)
    tick = o.timer(GossipTick)
    out = o.fire(GossipTick)
    assert o.node.broadcast_queue_depth == 0
    assert [type(t) for t in out.timers] == [GossipTick]
    assert out.gossip_timers == [out.timers[0].timer_id]
    assert out.timers[0].deadline_ms == tick.deadline_ms + o.node.config.gossip_interval_ms
    assert not out.packets and not out.events and not out.cancelled_timers

    probed, ping = o.probe("x", now_ms=5000)
    waiting = [t for t in probed.timers if not isinstance(t, (ProbeTick, GossipTick))]
    assert waiting and not probed.gossip_timers
    acked = o.receive(addr(2), Ack(ping.seq_no), now_ms=5001)
    assert sorted(acked.cancelled_timers) == sorted(t.timer_id for t in waiting)
    for timer in waiting:
        handed = o.node.handle_timer(timer, timer.deadline_ms)
        assert not (handed.timers or handed.packets or handed.events or handed.notices)
    again = o.node.handle_timer(waiting[0], waiting[0].deadline_ms)
    assert again.cancelled_timers == []  # forgotten once, named once
