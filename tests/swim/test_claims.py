"""A known name claimed from another address: every row of ``swim.claims.CLAIM_RULES`` on a
real node, the remembered claim judged again at its holder's death, the bounds, and what
the claimant is told. Pure: packets and an explicit clock, no sockets.

Reference: hashicorp/memberlist @ 1b4c746 state.go ``aliveNode`` (the address-conflict
branch, ``DeadNodeReclaimTime``); the rules of swim/claims.py.
"""

from __future__ import annotations

import pytest

from swim import Config, EventKind, NodeStateType
from swim.claims import CLAIM_RULES, MAX_PENDING_CLAIMS, Claim
from swim.messages import Alive, Dead, Suspect
from swim.timers import ProbeDeadline, ProbeTimeout
from tests.swim.node_harness import Peer, addr, alive, alive_of, decode, make_peer

ALIVE, SUSPECT, DEAD, LEFT = (
    NodeStateType.ALIVE,
    NodeStateType.SUSPECT,
    NodeStateType.DEAD,
    NodeStateType.LEFT,
)
KNOWN = 5
"""The incarnation we know the member at."""
NEW = 9
"""The claim's address: 10.0.0.9 (the member was at 10.0.0.2)."""


def test_the_table_is_the_rules_worked_out_by_hand() -> None:
    """An oracle independent of the table (the row test below reads the table)."""
    conflict, hold, wait, reclaim = Claim.CONFLICT, Claim.HOLD, Claim.WAIT, Claim.RECLAIM
    assert dict(CLAIM_RULES) == {
        # a live holder keeps its name, whatever the claim's incarnation (memberlist); only
        # an alive one makes it a conflict, a suspect one waits for its verdict
        (ALIVE, False): conflict,
        (ALIVE, True): conflict,
        (SUSPECT, False): hold,
        (SUSPECT, True): hold,
        # a dead one: only a claim that outbids the verdict takes it at once (ours)
        (DEAD, False): wait,
        (DEAD, True): reclaim,
        # one that left gives it up (memberlist)
        (LEFT, False): reclaim,
        (LEFT, True): reclaim,
    }


def _knowing(known: NodeStateType, config: Config | None = None) -> Peer:
    """Node o knowing m (10.0.0.2) at ``KNOWN`` in state ``known``, three bystanders."""
    o = make_peer("o", 1, config=config or Config.lan())
    o.learn(alive("m", 2, KNOWN), *(alive(f"b{i}", 3 + i) for i in range(3)), now_ms=10)
    if known is SUSPECT:
        o.receive(addr(3), Suspect(KNOWN, "m", "z"), now_ms=20)
    elif known is DEAD:
        o.receive(addr(3), Dead(KNOWN, "m", "z"), now_ms=20)
    elif known is LEFT:
        o.receive(addr(2), Dead(KNOWN, "m", "m"), now_ms=20)
    o.drain(30)
    assert o.member("m").state == known
    return o


def _told(out_packets: list[tuple[object, bytes]]) -> list[object]:
    return [(dest, decode(data)[0]) for dest, data in out_packets]


@pytest.mark.parametrize(("key", "claim"), sorted(CLAIM_RULES.items(), key=str), ids=str)
def test_every_row_does_what_it_says(key: tuple[NodeStateType, bool], claim: Claim) -> None:
    known, newer = key
    o = _knowing(known)
    incarnation = KNOWN + 1 if newer else KNOWN
    out = o.receive(addr(3), alive("m", NEW, incarnation), now_ms=40)
    m = o.member("m")
    kinds = [n.kind for n in out.notices]
    told = _told([(p.dest, p.data) for p in out.packets if p.dest == addr(NEW)])
    if claim is Claim.RECLAIM:
        assert (m.address, m.state, m.incarnation) == (addr(NEW), ALIVE, incarnation)
        assert [e.kind for e in out.events] == [EventKind.JOINED]
        assert kinds == ["address_reclaimed"] and told == []
        assert o.node.stats.address_conflicts == 0
        return
    assert (m.address, m.state, m.incarnation) == (addr(2), known, KNOWN)
    assert out.events == [] and o.node.stats.dropped["rejected"] == 1
    if claim is Claim.CONFLICT:
        assert kinds == ["address_conflict"] and told == []
        assert o.node.stats.address_conflicts == 1
    elif claim is Claim.HOLD:
        assert kinds == ["address_claim_held"] and told == []
        assert o.node.stats.address_conflicts == 0
    else:
        assert claim is Claim.WAIT
        assert kinds == ["address_claim_waits"]
        assert told == [(addr(NEW), Dead(KNOWN, "m", "o"))]
        assert o.node.stats.address_conflicts == 0


def test_a_waiting_claim_is_reclaimed_past_the_reclaim_time_and_told_once_per_interval() -> None:
    o = _knowing(DEAD, Config.lan(dead_node_reclaim_time_ms=5_000))  # dead since 20 ms
    tells = []
    for now in (100, 600, 1_100, 5_020):  # probe interval 1 s; 5 020 − 20 is not past 5 000
        out = o.receive(addr(3), alive("m", NEW, KNOWN), now_ms=now)
        tells += [now for p in out.packets if p.dest == addr(NEW)]
    assert tells == [100, 1_100, 5_020]
    assert o.member("m").address == addr(2)
    out = o.receive(addr(3), alive("m", NEW, KNOWN), now_ms=5_021)
    assert [e.kind for e in out.events] == [EventKind.JOINED]
    assert o.member("m").address == addr(NEW)


@pytest.mark.parametrize("known", [ALIVE, SUSPECT])
@pytest.mark.parametrize("incarnation", [KNOWN, KNOWN + 1])
def test_a_claim_refused_while_live_is_judged_again_at_the_death_verdict(
    incarnation: int, known: NodeStateType
) -> None:
    o = _knowing(known)
    o.receive(addr(3), alive("m", NEW, incarnation), now_ms=100)
    assert o.member("m").address == addr(2)
    out = o.receive(addr(3), Dead(KNOWN, "m", "z"), now_ms=200)
    kinds = [e.kind for e in out.events]
    if incarnation > KNOWN:  # it outbid the verdict: the name moves in the same breath
        assert kinds == [EventKind.DEAD, EventKind.JOINED]
        assert (o.member("m").address, o.member("m").state) == (addr(NEW), ALIVE)
    else:  # it must outbid it first: told so, at its own address
        assert kinds == [EventKind.DEAD]
        told = _told([(p.dest, p.data) for p in out.packets if p.dest == addr(NEW)])
        assert told == [(addr(NEW), Dead(KNOWN, "m", "o"))]
        out = o.receive(addr(NEW), alive("m", NEW, KNOWN + 1), now_ms=210)  # its refutation
        assert [e.kind for e in out.events] == [EventKind.JOINED]


def test_a_remembered_claim_expires_after_the_gossip_to_the_dead_time() -> None:
    o = _knowing(ALIVE)
    o.receive(addr(3), alive("m", NEW, KNOWN + 1), now_ms=100)
    late = 100 + o.node.config.gossip_to_the_dead_time_ms + 1
    out = o.receive(addr(3), Dead(KNOWN, "m", "z"), now_ms=late)
    assert [e.kind for e in out.events] == [EventKind.DEAD]
    assert o.member("m").address == addr(2)


def test_remembered_claims_are_bounded_oldest_forgotten_first() -> None:
    o = make_peer("o", 1)
    names = [f"n{i}" for i in range(MAX_PENDING_CLAIMS + 1)]
    for i, name in enumerate(names):  # each at 10.1.x.y, claimed from 10.2.x.y
        a = alive(name, 2)
        here = bytes([10, 1, i // 250, 1 + i % 250])
        o.receive(addr(3), Alive(1, name, here, a.port, b"", a.vsn), now_ms=10)
    for i, name in enumerate(names):
        there = bytes([10, 2, i // 250, 1 + i % 250])
        o.receive(addr(3), Alive(2, name, there, 7946, b"", alive(name, 2).vsn), now_ms=20)
    assert o.node.stats.address_conflicts == len(names)
    first, last = names[0], names[-1]
    out = o.receive(addr(3), Dead(1, first, "z"), Dead(1, last, "z"), now_ms=30)
    assert [(e.kind, e.member.name) for e in out.events] == [
        (EventKind.DEAD, first),
        (EventKind.DEAD, last),
        (EventKind.JOINED, last),
    ]


def test_a_claim_on_our_own_name_is_refused_and_counted_never_refuted() -> None:
    o = _knowing(ALIVE)
    me = alive_of(o)
    claim = Alive(me.incarnation + 3, "o", addr(NEW).ip_bytes, me.port, b"", me.vsn)
    out = o.receive(addr(3), claim, now_ms=100)
    assert [n.kind for n in out.notices] == ["address_conflict"]
    assert o.node.stats.address_conflicts == 1
    assert (o.node.address, o.node.incarnation) == (addr(1), me.incarnation)
    assert o.node.broadcast_queue_depth == 0


def test_a_probe_of_the_old_address_does_not_suspect_the_new_process() -> None:
    o = _knowing(ALIVE, Config.lan(disable_tcp_pings=True))  # the probe ends at its deadline
    out, _ = o.probe("m", now_ms=1_000)
    assert [p.dest for p in out.packets] == [addr(2)]
    # while the probe runs, m dies and a new process takes its name from 10.0.0.9
    o.receive(addr(3), Dead(KNOWN, "m", "z"), alive("m", NEW, KNOWN + 1), now_ms=1_010)
    assert (o.member("m").address, o.member("m").state) == (addr(NEW), ALIVE)
    o.fire(ProbeTimeout, now_ms=1_600)
    out = o.fire(ProbeDeadline, now_ms=2_100)
    assert o.node.stats.probes_failed == 1  # the old address did not answer
    assert o.member("m").state == ALIVE  # but that says nothing of the new process
    assert out.events == [] and o.node.stats.suspicions_raised == 0
