"""swim.Node's member table through its public API: Lifeguard suspicion timeouts,
refutation and leave, SWIM §4.2 incarnation precedence, metadata updates, dead-node
reclaim, gossip to the dead and reaping, and push-pull state exchange.

Reference: hashicorp/memberlist @ 1b4c746 state.go ``aliveNode``, ``suspectNode``,
``deadNode``, ``refute``, ``mergeState``, ``gossip``, ``resetNodes``; suspicion.go.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from swim import Config, EventKind, NodeStateType, StreamKind, formulas
from swim.messages import Ack, Alive, Dead, Message, Ping, PushNodeState, PushPull, Suspect
from swim.timers import GossipTick, ProbeTick, PushPullTick, SuspicionTimeout
from tests.swim.node_harness import (
    PORT,
    Peer,
    addr,
    alive,
    alive_of,
    decode,
    make_peer,
    mesh,
    of_type,
    to,
    vsn,
)

ALIVE = NodeStateType.ALIVE
SUSPECT = NodeStateType.SUSPECT
DEAD = NodeStateType.DEAD
LEFT = NodeStateType.LEFT


def _state(p: Peer, name: str) -> tuple[NodeStateType, int] | None:
    m = p.node.member(name)
    return None if m is None else (m.state, m.incarnation)


# --- Lifeguard LHA-Suspicion ----------------------------------------------------------------


def _observer(config: Config | None = None, others: str = "bcde") -> Peer:
    o = make_peer("o", 1, config=config)
    o.learn(*(alive(n, i + 2) for i, n in enumerate(others)))
    return o


def test_suspicion_starts_at_max_and_shrinks_per_distinct_confirmation() -> None:
    o = _observer()  # n = 5: k = α − 2 = 2 confirmations possible
    c = o.node.config
    n = o.node.num_members()
    min_ms = formulas.suspicion_timeout_ms(c.suspicion_mult, n, c.probe_interval_ms)
    max_ms = c.suspicion_max_timeout_mult * min_ms
    k = formulas.suspicion_confirmations(c.suspicion_mult, n)
    assert (n, min_ms, max_ms, k) == (5, 4000, 24000, 2)
    start = 1000
    out = o.receive(addr(3), Suspect(1, "b", "c"), now_ms=start)
    assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.SUSPECT, "b")]
    assert o.node.suspicion_deadline_ms("b") == start + max_ms
    first = o.timer(SuspicionTimeout)
    assert first.deadline_ms == start + max_ms

    one = start + formulas.remaining_suspicion_time_ms(1, k, 0, min_ms, max_ms)
    out = o.receive(addr(4), Suspect(1, "b", "d"), now_ms=start + 2000)
    assert o.node.suspicion_deadline_ms("b") == one
    assert [t.deadline_ms for t in out.timers] == [one]
    for dup in ("d", "c"):  # a repeated confirmer, and the originator
        out = o.receive(addr(4), Suspect(1, "b", dup), now_ms=start + 3000)
        assert o.node.suspicion_deadline_ms("b") == one
        assert out.timers == []

    out = o.receive(addr(5), Suspect(1, "b", "e"), now_ms=start + 4000)
    assert o.node.suspicion_deadline_ms("b") == start + min_ms
    assert [t.deadline_ms for t in out.timers] == [start + min_ms]
    out = o.receive(addr(6), Suspect(1, "b", "f"), now_ms=start + 4500)  # beyond k
    assert out.timers == []

    # The superseded timer is stale; the live one declares the member dead.
    assert o.take(o.node.handle_timer(first, start + 4600)).events == []
    out = o.fire(SuspicionTimeout)
    assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.DEAD, "b")]
    assert _state(o, "b") == (DEAD, 1)
    assert o.node.stats.deaths_declared == 1
    assert o.node.suspicion_deadline_ms("b") is None


def test_without_dynamic_suspicion_the_deadline_is_the_minimum() -> None:
    o = _observer(Config.lan(lifeguard_dynamic_suspicion=False))
    min_ms = formulas.suspicion_timeout_ms(4, 5, 1000)
    o.receive(addr(3), Suspect(1, "b", "c"), now_ms=1000)
    assert o.node.suspicion_deadline_ms("b") == 1000 + min_ms
    assert o.timer(SuspicionTimeout).deadline_ms == 1000 + min_ms
    o.receive(addr(4), Suspect(1, "b", "d"), now_ms=1500)
    assert o.node.suspicion_deadline_ms("b") == 1000 + min_ms


def test_small_group_expects_no_confirmations() -> None:
    o = _observer(others="bc")  # n = 3: n − 2 < k, so the timer runs for min directly
    o.receive(addr(3), Suspect(1, "b", "c"), now_ms=1000)
    assert o.node.suspicion_deadline_ms("b") == 1000 + formulas.suspicion_timeout_ms(4, 3, 1000)


def test_alive_refutation_cancels_the_suspicion_timer() -> None:
    o = _observer()
    o.receive(addr(3), Suspect(1, "b", "c"), now_ms=1000)
    out = o.receive(addr(2), alive("b", 2, 2), now_ms=2000)
    assert [e.kind for e in out.events] == [EventKind.ALIVE]
    assert o.node.suspicion_deadline_ms("b") is None
    assert o.fire(SuspicionTimeout).events == []
    assert _state(o, "b") == (ALIVE, 2)
    assert o.node.stats.deaths_declared == 0


# --- refutation and leave -------------------------------------------------------------------


def _next_packet_messages(p: Peer, now_ms: int) -> list[Message]:
    """Ping the node and decode its ack packet (the ack plus whatever it piggybacks)."""
    out = p.receive(addr(2), Ping(99, p.name), now_ms=now_ms)
    [pkt] = out.packets
    return list(decode(pkt.data))


@pytest.mark.parametrize("accusation", [Suspect, Dead])
def test_accusation_is_refuted_with_a_higher_incarnation(accusation: type) -> None:
    a = make_peer("a", 1)
    a.learn(alive("b", 2))
    assert a.node.incarnation == 1
    out = a.receive(addr(2), accusation(1, "a", "b"), now_ms=10)
    assert a.node.incarnation == 2  # own + 1
    assert [n.kind for n in out.notices] == ["refute"]
    assert out.events == []
    a.receive(addr(2), accusation(7, "a", "b"), now_ms=20)
    assert a.node.incarnation == 8  # accused + 1
    a.receive(addr(2), accusation(3, "a", "b"), now_ms=30)
    assert a.node.incarnation == 8  # an old accusation changes nothing
    assert a.node.stats.refutations == 2
    assert _state(a, "a") == (ALIVE, 8)
    msgs = _next_packet_messages(a, 40)
    assert msgs[0] == Ack(99)
    about_us = [m for m in of_type(msgs, Alive) if m.node == "a"]
    assert [(m.incarnation, m.addr, m.port) for m in about_us] == [(8, addr(1).ip_bytes, PORT)]


def test_alive_about_us_that_differs_is_refuted_and_a_matching_one_ignored() -> None:
    a = make_peer("a", 1, meta=b"mine")
    inc = a.node.incarnation
    same = alive_of(a)
    assert a.receive(addr(2), same, now_ms=10).notices == []
    assert a.node.incarnation == inc
    # Same incarnation, other meta: a restarted process with another config (state.go).
    out = a.receive(addr(2), replace(same, meta=b"theirs"), now_ms=20)
    assert [n.kind for n in out.notices] == ["refute"]
    assert a.node.incarnation == inc + 1
    a.receive(addr(2), replace(same, incarnation=inc + 5), now_ms=30)
    assert a.node.incarnation == inc + 6
    assert a.member("a").meta == b"mine"
    assert a.node.stats.refutations == 2


def test_leave_marks_us_left_and_finishes_when_gossiped_out() -> None:
    a, b, c = make_peer("a", 1), make_peer("b", 2), make_peer("c", 3)
    mesh(a, b, c)
    inc = a.node.incarnation
    out = a.take(a.node.leave(100))
    assert a.node.leaving
    assert _state(a, "a") == (LEFT, inc)
    assert [e.kind for e in out.events] == [EventKind.LEFT]
    dests = {p.dest for p in out.packets}
    assert dests == {b.address, c.address}  # told directly and gossiped at once
    for pkt in out.packets:
        assert Dead(inc, "a", "a") in decode(pkt.data)
    # Retransmit limit for n = 3 is 4·ceil(log10 4) = 4 sends: one direct send to each
    # live peer (Node.leave's fan-out) and one gossip round use them all up at once.
    assert formulas.retransmit_limit(4, 3) == 4
    progress = [a.node.leave_done]
    carried = [sum(Dead(inc, "a", "a") in decode(p.data) for p in out.packets)]
    for now in (300, 500):
        tick = a.fire(GossipTick, now)
        carried.append(sum(Dead(inc, "a", "a") in decode(p.data) for p in tick.packets))
        progress.append(a.node.leave_done)
    assert carried == [4, 0, 0]
    assert progress == [True, True, True]
    # A leaving node neither refutes nor accepts news about itself.
    a.receive(addr(2), Suspect(inc, "a", "b"), alive("a", 1, inc + 5), now_ms=600)
    assert _state(a, "a") == (LEFT, inc)
    assert a.node.stats.refutations == 0
    # Peers learn it left, not died.
    got = b.deliver(a.address, out.packets[0].data, now_ms=110)
    assert [(e.kind, e.member.name) for e in got.events if e.member.name == "a"] == [
        (EventKind.LEFT, "a")
    ]


def test_leave_without_peers_is_done_at_once() -> None:
    a = make_peer("a", 1)
    out = a.take(a.node.leave(100))
    assert out.packets == []
    assert a.node.leave_done
    assert _state(a, "a") == (LEFT, 1)


# --- metadata -------------------------------------------------------------------------------


def test_set_meta_bumps_incarnation_and_peers_see_an_update() -> None:
    a, b = make_peer("a", 1, meta=b"v1"), make_peer("b", 2)
    mesh(a, b)
    inc = a.node.incarnation
    a.take(a.node.set_meta(b"v2", 100))
    assert a.node.incarnation == inc + 1
    assert a.member("a").meta == b"v2"
    out = a.fire(GossipTick, 200)
    [pkt] = to(out, b.address)
    got = b.deliver(a.address, pkt.data, 210)
    updates = [e for e in got.events if e.member.name == "a"]
    assert [(e.kind, e.member.meta, e.member.incarnation) for e in updates] == [
        (EventKind.UPDATED, b"v2", inc + 1)
    ]


def test_oversize_meta_raises_and_changes_nothing() -> None:
    a = make_peer("a", 1, meta=b"v1")
    depth, inc = a.node.broadcast_queue_depth, a.node.incarnation
    a.node.set_meta(bytes(512), 10)  # the limit itself is fine
    with pytest.raises(ValueError):
        a.node.set_meta(bytes(513), 20)
    assert a.node.incarnation == inc + 1
    assert a.member("a").meta == bytes(512)
    assert a.node.broadcast_queue_depth == depth


# --- dead-node reclaim ----------------------------------------------------------------------


def _dead_member(config: Config, sender: str = "z") -> Peer:
    o = make_peer("o", 1, config=config)
    o.receive(addr(2), alive("m", 2, 3), now_ms=10)
    o.receive(addr(3), Dead(3, "m", sender), now_ms=1000)
    return o


def test_dead_member_is_reclaimed_at_its_incarnation_only_after_the_reclaim_time() -> None:
    o = _dead_member(Config.lan(dead_node_reclaim_time_ms=10_000))
    assert _state(o, "m") == (DEAD, 3)
    for now in (5_000, 11_000):  # 11 000 − 1 000 is not more than the reclaim time
        out = o.receive(addr(9), alive("m", 9, 3), now_ms=now)
        assert [n.kind for n in out.notices] == ["address_claim_waits"]
        assert out.events == []
        # the claimant is told the verdict it has to outbid, at its new address (with what
        # gossip fits beside it)
        assert [(p.dest, decode(p.data)[0]) for p in out.packets] == [(addr(9), Dead(3, "m", "o"))]
    assert o.node.stats.dropped["rejected"] == 2
    assert o.node.stats.address_conflicts == 0  # a dead holder is no conflict
    assert o.member("m").address == addr(2)
    out = o.receive(addr(9), alive("m", 9, 3), now_ms=11_001)
    assert [e.kind for e in out.events] == [EventKind.JOINED]
    assert o.member("m").address == addr(9)
    assert _state(o, "m") == (ALIVE, 3)


def test_dead_member_is_reclaimed_at_once_by_a_claim_that_outbids_its_death() -> None:
    o = _dead_member(Config.lan())
    out = o.receive(addr(9), alive("m", 9, 4), now_ms=1001)
    assert [e.kind for e in out.events] == [EventKind.JOINED]
    assert (o.member("m").address, _state(o, "m")) == (addr(9), (ALIVE, 4))
    # stale gossip about the dead incarnation is older news to the new process's record
    o.receive(addr(3), Dead(3, "m", "z"), Suspect(3, "m", "z"), now_ms=1002)
    assert _state(o, "m") == (ALIVE, 4)


def test_dead_member_is_never_reclaimed_by_default_at_its_incarnation_nor_an_alive_one() -> None:
    o = _dead_member(Config.lan())
    o.receive(addr(9), alive("m", 9, 3), now_ms=10**9)
    assert o.member("m").address == addr(2)
    o.receive(addr(4), alive("x", 4), now_ms=10**9)
    o.receive(addr(9), alive("x", 9, 7), now_ms=10**9 + 1)
    assert o.member("x").address == addr(4)
    assert o.node.stats.dropped["rejected"] == 2
    assert o.node.stats.address_conflicts == 1  # x is alive: a real conflict


def test_left_member_may_come_back_from_a_new_address_at_once() -> None:
    o = _dead_member(Config.lan(), sender="m")
    assert _state(o, "m") == (LEFT, 3)
    # memberlist's updatesNode: even the same incarnation is taken from a new address.
    out = o.receive(addr(9), alive("m", 9, 3), now_ms=1001)
    assert [e.kind for e in out.events] == [EventKind.JOINED]
    assert o.member("m").address == addr(9)
    assert o.node.stats.dropped["rejected"] == 0


# --- gossip to the dead, reaping ------------------------------------------------------------


def _with_dead_and_left(config: Config | None = None) -> Peer:
    o = make_peer("o", 1) if config is None else make_peer("o", 1, config=config)
    o.learn(alive("b", 2), alive("d", 3), alive("l", 4))
    o.receive(addr(9), Dead(1, "d", "z"), Dead(1, "l", "l"), now_ms=1000)
    assert [_state(o, n) for n in "bdl"] == [(ALIVE, 1), (DEAD, 1), (LEFT, 1)]
    return o


@pytest.mark.parametrize("separately", [True, False], ids=["ours", "memberlist"])
def test_gossip_reaches_the_dead_only_within_the_window_and_never_the_left(
    separately: bool,
) -> None:
    o = _with_dead_and_left(Config.lan(gossip_to_dead_separately=separately))
    window = o.node.config.gossip_to_the_dead_time_ms
    seen: dict[int, set[str]] = {}
    for now in (1001, 1000 + window, 1001 + window):
        dests: set[str] = set()
        # Targets are random; with gossip_to_dead_separately the dead one is an extra
        # target with probability ~1/4 per round here, so run enough rounds.
        for _ in range(40):
            o.take(o.node.broadcast_user(b"news", now))
            out = o.fire(GossipTick, now)
            dests |= {str(p.dest) for p in out.packets}
        seen[now] = dests
    b, d = str(addr(2)), str(addr(3))
    assert seen[1001] == {b, d}
    assert seen[1000 + window] == {b, d}
    assert seen[1001 + window] == {b}


def _probe_ticks(o: Peer, now_ms: int, ticks: int) -> list[tuple[EventKind, str]]:
    """Run probe ticks, acking every ping at once; return the events they produced."""
    events = []
    for _ in range(ticks):
        out = o.fire(ProbeTick, now_ms)
        events += [(e.kind, e.member.name) for e in out.events]
        for p in out.packets:
            for m in decode(p.data):
                if isinstance(m, Ping):
                    o.receive(p.dest, Ack(m.seq_no), now_ms=now_ms)
    return events


def test_dead_and_left_are_reaped_when_the_probe_order_wraps_after_the_window() -> None:
    o = _with_dead_and_left()
    window = o.node.config.gossip_to_the_dead_time_ms
    assert _probe_ticks(o, 1000 + window, 10) == []  # wrapped, but not yet past the window
    assert o.node.num_members() == 4
    events = _probe_ticks(o, 1001 + window, 3)
    assert sorted(events) == [(EventKind.REAPED, "d"), (EventKind.REAPED, "l")]
    assert [m.name for m in o.node.members()] == ["b", "o"]


def test_coordinated_probes_reap_too_once_per_ring_round_after_the_window() -> None:
    """``fast``'s ring (``coordinated_probes``) has no round-robin wrap; it reaps when its
    own round turns, so dead and left members do not stay in the table for good."""
    o = _with_dead_and_left(Config.fast())
    interval = o.node.config.probe_interval_ms
    window = o.node.config.gossip_to_the_dead_time_ms
    events: list[tuple[EventKind, str]] = []
    now = 1000
    while now <= 1000 + window + 4 * interval:  # a ring round is 2 live members' rounds
        events += _probe_ticks(o, now, 1)
        if now <= 1000 + window:
            assert events == [], now
        now += interval
    assert sorted(events) == [(EventKind.REAPED, "d"), (EventKind.REAPED, "l")]


# --- push-pull ------------------------------------------------------------------------------


def _push_state(name: str, index: int, state: NodeStateType, inc: int = 1) -> PushNodeState:
    return PushNodeState(name, addr(index).ip_bytes, PORT, b"", inc, state, vsn())


def test_push_pull_timer_rescales_with_group_size_and_dials_an_alive_peer() -> None:
    o = make_peer("o", 1)
    o.learn(alive("b", 2), alive("c", 3))
    o.receive(addr(9), Dead(1, "c", "z"), now_ms=5)
    interval = o.node.config.push_pull_interval_ms
    out = o.fire(PushPullTick, 100)
    assert [t.deadline_ms for t in out.timers if isinstance(t, PushPullTick)] == [
        100 + formulas.push_pull_scale_ms(interval, 3)
    ]
    assert [(s.kind, s.dest) for s in out.streams] == [(StreamKind.PUSH_PULL, addr(2))]
    o.learn(*(alive(f"n{i}", 10 + i) for i in range(40)), now_ms=200)
    n = o.node.num_members()
    assert formulas.push_pull_scale_ms(interval, n) == 2 * interval
    out = o.fire(PushPullTick, 300)
    assert [t.deadline_ms for t in out.timers if isinstance(t, PushPullTick)] == [
        300 + 2 * interval
    ]


def test_incoming_push_pull_replies_with_our_state_and_merges_theirs() -> None:
    o = make_peer("o", 1)
    o.learn(alive("l", 4), alive("d", 5), alive("s", 6))
    remote = PushPull(
        False,
        (
            _push_state("b", 2, ALIVE, 3),
            _push_state("c", 3, ALIVE),
            _push_state("l", 4, LEFT),
            _push_state("d", 5, DEAD),
            _push_state("s", 6, SUSPECT),
        ),
    )
    out = o.take(o.node.handle_stream(addr(2), remote, 100))
    # The reply is our table as it was (memberlist sends before it merges).
    peer = make_peer("p", 7)
    assert out.reply is not None
    parsed = peer.node.parse_stream(out.reply)
    assert parsed is not None and isinstance(parsed[0], PushPull)
    assert sorted((s.name, s.state, s.incarnation) for s in parsed[0].nodes) == [
        ("d", ALIVE, 1),
        ("l", ALIVE, 1),
        ("o", ALIVE, 1),
        ("s", ALIVE, 1),
    ]
    # Theirs is merged: new alive members join, LEFT is left, DEAD/SUSPECT become suspicion.
    assert sorted((e.kind.value, e.member.name) for e in out.events) == [
        ("joined", "b"),
        ("joined", "c"),
        ("left", "l"),
        ("suspect", "d"),
        ("suspect", "s"),
    ]
    assert [_state(o, n) for n in "bcdls"] == [
        (ALIVE, 3),
        (ALIVE, 1),
        (SUSPECT, 1),
        (LEFT, 1),
        (SUSPECT, 1),
    ]
    assert o.node.suspicion_deadline_ms("d") is not None


def test_join_pushes_and_pulls_with_the_seed() -> None:
    a, seed = make_peer("a", 1), make_peer("s", 2)
    seed.learn(alive("x", 3))
    out = a.take(a.node.join([seed.address], 100))
    [req] = out.streams
    assert (req.kind, req.dest, req.expect_reply) == (StreamKind.PUSH_PULL, seed.address, True)
    parsed = seed.node.parse_stream(req.data)
    assert parsed is not None and isinstance(parsed[0], PushPull) and parsed[0].join
    served = seed.take(seed.node.handle_stream(a.address, parsed[0], 110))
    assert [(e.kind, e.member.name) for e in served.events] == [(EventKind.JOINED, "a")]
    assert served.reply is not None
    back = a.node.parse_stream(served.reply)
    assert back is not None
    done = a.take(a.node.handle_stream_response(req.stream_id, back[0], 120))
    assert [(r.address, r.ok) for r in done.join_results] == [(seed.address, True)]
    assert sorted(e.member.name for e in done.events if e.kind == EventKind.JOINED) == [
        "s",
        "x",
    ]
