"""A refutation lost in transit is said again when a stale accusation arrives, in every
profile (swim/membership.py ``Outcome.REANNOUNCE``; docs/design.md §5.6).

The failure it prevents (measured on 5 namespaced hosts at 20 % loss, docs/tuning.md §6):
b is accused, refutes with a new incarnation, and every copy of that refutation is lost
(4 transmissions at 5 members). memberlist ignores any later accusation of b's older
incarnation, so the accuser keeps b suspect although b acks its buddy pings, and declares
it dead when its window ends. With the re-announcement the buddy ping's accusation makes
b queue its alive again with a fresh retransmit budget, gossiped at its next gossip tick
(the ping comes first in the buddy packet, memberlist's order, so the ack leaves before).
"""

from __future__ import annotations

import pytest

from swim import Config, NodeStateType
from swim.messages import Ack, Alive, Dead, Suspect
from swim.timers import GossipTick
from tests.swim.node_harness import decode, make_peer, mesh, of_type, to


@pytest.mark.parametrize("profile", ["lan", "wan", "local"])
def test_a_lost_refutation_is_gossiped_again_after_the_accusers_buddy_ping(profile: str) -> None:
    config = Config.profile(profile)
    a, b, c = (make_peer(n, i, config=config) for i, n in enumerate("abc", start=1))
    mesh(a, b, c)
    for p in (a, b, c):
        p.drain(0)
    accused = b.member("b").incarnation
    a.receive(c.address, Suspect(accused, "b", "c"), now_ms=10)
    assert a.member("b").state == NodeStateType.SUSPECT
    b.receive(c.address, Suspect(accused, "b", "c"), now_ms=10)
    assert b.member("b").incarnation == accused + 1  # refuted ...
    b.drain(20)  # ... and every copy of the refutation lost: a never hears it

    out, ping = a.probe("b", now_ms=2_000)
    carried = [m for p in to(out, b.address) for m in decode(p.data)]
    assert Suspect(accused, "b", "a") in of_type(carried, Suspect)  # the buddy accusation
    reply = b.deliver(a.address, to(out, b.address)[0].data, now_ms=2_001)
    back = [m for p in to(reply, a.address) for m in decode(p.data)]
    assert [x.seq_no for x in of_type(back, Ack)] == [ping.seq_no]
    assert b.member("b").incarnation == accused + 1  # said again, not outbid again
    gossip = b.fire(GossipTick, now_ms=2_100)
    again = [m for p in to(gossip, a.address) for m in decode(p.data)]
    assert [(x.node, x.incarnation) for x in of_type(again, Alive)] == [("b", accused + 1)]
    for pkt in to(reply, a.address) + to(gossip, a.address):
        a.deliver(b.address, pkt.data, now_ms=2_101)
    assert (a.member("b").state, a.member("b").incarnation) == (NodeStateType.ALIVE, accused + 1)


def test_a_stale_death_of_us_is_answered_with_our_alive() -> None:
    a, b = make_peer("a", 1, config=Config.lan()), make_peer("b", 2, config=Config.lan())
    mesh(a, b)
    b.drain(0)
    old = b.member("b").incarnation
    b.receive(a.address, Suspect(old, "b", "a"), now_ms=10)
    b.drain(20)
    out = b.receive(a.address, Dead(old, "b", "a"), now_ms=30)
    assert out.notices == [] and b.member("b").incarnation == old + 1
    assert b.node.broadcast_queue_depth == 1  # our alive, at the same incarnation
