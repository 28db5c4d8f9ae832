"""swim.Node's probe cycle through its public API: answering pings, the buddy system,
indirect probes with nacks, the helper side, Lifeguard local health, and the TCP fallback.

Reference: hashicorp/memberlist @ 1b4c746 state.go ``probeNode``, net.go ``handlePing``,
``handleIndirectPing``; Lifeguard arXiv 1707.00788 §IV-A. Time is explicit, no sockets.
"""

from __future__ import annotations

import pytest

from swim import Address, Config, EventKind, NodeStateType, Packet, ProbeResult, StreamKind
from swim.messages import Ack, Dead, IndirectPing, MsgType, Nack, Ping, Suspect
from swim.timers import ProbeDeadline, ProbeTcpGrace, ProbeTick, ProbeTimeout, RelayTimeout
from tests.swim.node_harness import (
    PORT,
    Peer,
    addr,
    alive,
    alive_of,
    decode,
    make_peer,
    to,
)

ALIVE = NodeStateType.ALIVE
SUSPECT = NodeStateType.SUSPECT

# --- answering pings ----------------------------------------------------------------------


def test_ping_is_acked_with_the_payload_at_the_advertised_source() -> None:
    a = make_peer("a", 1)
    a.node.set_ack_payload(b"coords")
    reply_to = Address("10.0.0.9", 9000)
    out = a.receive(addr(2), Ping(7, "a", reply_to.ip_bytes, reply_to.port, "x"), now_ms=10)
    assert [p.dest for p in out.packets] == [reply_to]
    assert decode(out.packets[0].data)[0] == Ack(7, b"coords")


def test_the_ack_is_framed_for_the_member_it_goes_to() -> None:
    """The CRC header (protocol ≥ 5 only) follows the member at the address the ack goes
    to, not the sender's; the sender is heard from either way."""
    a = make_peer("a", 1)
    a.learn(alive("b", 2, pmax=5), alive("c", 3, pmax=4))
    a.drain(now_ms=5)  # acks without piggybacked news: the first byte is the framing
    crc = bytes([MsgType.HAS_CRC])
    out = a.receive(addr(2), Ping(5, "a"), now_ms=10)
    assert [p.dest for p in out.packets] == [addr(2)]
    assert out.packets[0].data[:1] == crc
    assert out.heard_from == ["b"]
    out = a.receive(addr(2), Ping(6, "a", addr(3).ip_bytes, PORT, "b"), now_ms=11)
    assert [p.dest for p in out.packets] == [addr(3)]
    assert out.packets[0].data[:1] == bytes([MsgType.ACK])
    assert out.heard_from == ["b"]
    out = a.receive(addr(3), Ping(7, "a", addr(2).ip_bytes, PORT, "c"), now_ms=12)
    assert [p.dest for p in out.packets] == [addr(2)]
    assert out.packets[0].data[:1] == crc
    assert out.heard_from == ["c"]
    for data in (out.packets[0].data, a.receive(addr(9), Ping(8, "a"), now_ms=13).packets[0].data):
        assert decode(data)[0] in (Ack(7), Ack(8))


def test_ping_without_source_fields_is_acked_to_the_datagram_source() -> None:
    a = make_peer("a", 1)
    a.node.set_ack_payload(b"p")
    src = Address("10.0.0.2", 4000)
    out = a.receive(src, Ping(8, "a"), now_ms=10)
    assert [p.dest for p in out.packets] == [src]
    assert decode(out.packets[0].data)[0] == Ack(8, b"p")
    # An empty node name is memberlist's "whoever you are" (protocol < 4 senders).
    out = a.receive(src, Ping(9, ""), now_ms=11)
    assert decode(out.packets[0].data)[0] == Ack(9, b"p")


def test_ping_naming_another_node_is_dropped_unanswered() -> None:
    a = make_peer("a", 1)
    out = a.receive(addr(2), Ping(1, "b", addr(2).ip_bytes, PORT, "b"), now_ms=10)
    assert out.packets == []
    assert a.node.stats.dropped["wrong_node"] == 1
    assert sum(a.node.stats.dropped.values()) == 1


# --- probing a suspect: the buddy system ----------------------------------------------------


@pytest.mark.parametrize("buddy", [True, False])
def test_probe_of_a_suspect_carries_the_suspicion_only_with_buddy(buddy: bool) -> None:
    a = make_peer("a", 1, config=Config.lan(lifeguard_buddy=buddy))
    a.learn(alive("b", 2, 3))
    a.receive(addr(3), Suspect(3, "b", "c"), now_ms=10)
    assert a.member("b").state == SUSPECT
    a.drain(20)  # nothing left to piggyback: the packet holds exactly what the probe sends
    out, ping = a.probe("b", 100)
    assert len(out.packets) == 1
    assert out.packets[0].dest == addr(2)
    expected: list[object] = [Ping(ping.seq_no, "b", addr(1).ip_bytes, PORT, "a")]
    if buddy:
        expected.append(Suspect(3, "b", "a"))
    assert decode(out.packets[0].data) == expected


def test_probe_of_an_alive_member_is_a_plain_ping() -> None:
    a = make_peer("a", 1)
    a.learn(alive("b", 2))
    a.drain(20)
    out, ping = a.probe("b", 100)
    assert [decode(p.data) for p in out.packets] == [
        [Ping(ping.seq_no, "b", addr(1).ip_bytes, PORT, "a")]
    ]


# --- indirect probes ------------------------------------------------------------------------

HELPER_PMAX = {"h5": 5, "h4": 4, "h3": 3, "h2": 2}
INDEX = {"a": 1, "t": 2, "h5": 3, "h4": 4, "h3": 5, "h2": 6, "s": 7, "d": 8}
NAME_AT = {addr(i): n for n, i in INDEX.items()}


def _prober_with_helpers(config: Config, seed: int) -> Peer:
    """a probes t; four alive helpers with protocol max 5..2; s is suspect, d dead."""
    a = make_peer("a", 1, config=config, seed=seed)
    a.learn(
        alive("t", 2),
        *(alive(n, INDEX[n], pmax=p) for n, p in HELPER_PMAX.items()),
        alive("s", 7),
        alive("d", 8),
    )
    a.receive(addr(9), Suspect(1, "s", "x"), Dead(1, "d", "x"), now_ms=1)
    return a


def _indirect(out_packets: list[Packet], seq_no: int) -> dict[str, IndirectPing]:
    found: dict[str, IndirectPing] = {}
    for p in out_packets:
        msgs = decode(p.data)
        if isinstance(msgs[0], IndirectPing):
            assert msgs[0].seq_no == seq_no
            assert NAME_AT[p.dest] not in found, "one request per helper"
            found[NAME_AT[p.dest]] = msgs[0]
    return found


@pytest.mark.parametrize("seed", range(1, 7))
@pytest.mark.parametrize("nacks", [True, False])
def test_probe_timeout_asks_alive_helpers_with_nack_by_protocol(seed: int, nacks: bool) -> None:
    a = _prober_with_helpers(Config.lan(lifeguard_nacks=nacks), seed)
    _, ping = a.probe("t", 1000)
    timeout = a.timer(ProbeTimeout)
    assert timeout.deadline_ms == 1000 + a.node.config.probe_timeout_ms
    out = a.fire(ProbeTimeout)
    asked = _indirect(out.packets, ping.seq_no)
    assert len(asked) == 3  # indirect_checks
    assert set(asked) <= set(HELPER_PMAX)  # never a, t, the suspect or the dead
    for name, req in asked.items():
        assert req == IndirectPing(
            ping.seq_no,
            addr(2).ip_bytes,
            PORT,
            "t",
            nacks and HELPER_PMAX[name] >= 4,
            addr(1).ip_bytes,
            PORT,
            "a",
        )
    assert a.node.stats.indirect_probes_sent == 3


def test_indirect_helpers_are_every_alive_member_when_few() -> None:
    a = _prober_with_helpers(Config.lan(indirect_checks=6), seed=3)
    _, ping = a.probe("t", 1000)
    asked = _indirect(a.fire(ProbeTimeout).packets, ping.seq_no)
    assert sorted(asked) == sorted(HELPER_PMAX)


# --- the helper side ------------------------------------------------------------------------


def _request(seq_no: int, nack: bool, requester: int = 1) -> IndirectPing:
    return IndirectPing(
        seq_no, addr(2).ip_bytes, PORT, "t", nack, addr(requester).ip_bytes, PORT, f"r{requester}"
    )


def test_helper_pings_with_its_own_seq_and_relays_the_ack() -> None:
    h, t = make_peer("h", 3), make_peer("t", 2)
    elsewhere = Address("10.0.0.77", 4000)  # the source fields win over the datagram source
    out1 = h.receive(elsewhere, _request(42, True, requester=1), now_ms=100)
    out2 = h.receive(elsewhere, _request(42, True, requester=5), now_ms=100)
    pings = []
    for out in (out1, out2):
        assert [p.dest for p in out.packets] == [addr(2)]
        ping = decode(out.packets[0].data)[0]
        assert isinstance(ping, Ping)
        assert (ping.node, ping.source_addr, ping.source_port, ping.source_node) == (
            "t",
            addr(3).ip_bytes,
            PORT,
            "h",
        )
        pings.append(ping)
    # Two requests with the same requester seq become two pings with distinct local seqs.
    assert pings[0].seq_no != pings[1].seq_no
    # The target answers the second one; the ack goes back to requester 5 only, as seq 42.
    t_out = t.deliver(h.address, out2.packets[0].data, now_ms=110)
    [ack_packet] = to(t_out, h.address)
    relay = h.deliver(t.address, ack_packet.data, now_ms=120)
    assert [p.dest for p in relay.packets] == [addr(5)]
    assert decode(relay.packets[0].data)[0] == Ack(42)
    # Its relay timer is now stale; the other request still gets its nack.
    relay_timers = [x for x in h.timers if isinstance(x, RelayTimeout)]
    assert [x.deadline_ms for x in relay_timers] == [100 + h.node.config.probe_timeout_ms] * 2
    outs = [h.take(h.node.handle_timer(x, x.deadline_ms)) for x in relay_timers]
    assert outs[1].packets == []
    assert [p.dest for p in outs[0].packets] == [addr(1)]
    assert decode(outs[0].packets[0].data)[0] == Nack(42)


def test_helper_without_nack_request_stays_silent_on_timeout() -> None:
    h = make_peer("h", 3)
    h.receive(addr(1), _request(9, False), now_ms=100)
    assert h.fire(RelayTimeout).packets == []


def test_helper_replies_to_the_datagram_source_without_source_fields() -> None:
    h = make_peer("h", 3)
    src = Address("10.0.0.1", 5000)
    out = h.receive(src, IndirectPing(9, addr(2).ip_bytes, PORT, "t", True), now_ms=100)
    ping = decode(out.packets[0].data)[0]
    assert isinstance(ping, Ping)
    relay = h.receive(addr(2), Ack(ping.seq_no), now_ms=105)
    assert [p.dest for p in relay.packets] == [src]
    assert decode(relay.packets[0].data)[0] == Ack(9)


# --- Lifeguard local health (LHA-Probe) -----------------------------------------------------


def _health_cluster(config: Config, helper_pmax: int = 5) -> Peer:
    a = make_peer("a", 1, config=config)
    a.learn(alive("t", 2), *(alive(f"h{i}", 2 + i, pmax=helper_pmax) for i in (1, 2, 3)))
    return a


def _failed_probe(a: Peer, now_ms: int, nacks: int) -> None:
    """Probe t, get no ack, ``nacks`` helpers nack, the deadline passes."""
    _, ping = a.probe("t", now_ms)
    out = a.fire(ProbeTimeout)
    requests = [(p.dest, decode(p.data)[0]) for p in out.packets]
    assert len(requests) == 3
    for dest, req in requests[:nacks]:
        assert isinstance(req, IndirectPing) and req.nack
        a.receive(dest, Nack(ping.seq_no), now_ms=now_ms + 600)
    a.fire(ProbeDeadline)


@pytest.mark.parametrize(("nacks", "delta"), [(0, 3), (1, 2), (2, 1), (3, 0)])
def test_failed_probe_raises_health_by_missing_nacks(nacks: int, delta: int) -> None:
    a = _health_cluster(Config.lan(disable_tcp_pings=True))
    _failed_probe(a, 1000, nacks)
    assert a.node.health_score == delta
    assert a.node.stats.nacks_received == nacks
    assert a.member("t").state == SUSPECT


def test_failed_probe_without_nack_capable_helpers_counts_one() -> None:
    a = _health_cluster(Config.lan(disable_tcp_pings=True), helper_pmax=3)
    _, _ = a.probe("t", 1000)
    out = a.fire(ProbeTimeout)
    requests = [decode(p.data)[0] for p in out.packets]
    assert len(requests) == 3
    assert all(isinstance(r, IndirectPing) and not r.nack for r in requests)
    a.fire(ProbeDeadline)
    assert a.node.health_score == 1


def test_health_scales_the_probe_deadline_and_recovers_on_success() -> None:
    a = _health_cluster(Config.lan(disable_tcp_pings=True))
    interval = a.node.config.probe_interval_ms
    _failed_probe(a, 1000, nacks=0)
    assert a.node.health_score == 3
    # The next probe's deadline is the interval scaled by (score + 1).
    out = a.fire(ProbeTick, 5000)
    assert a.timer(ProbeDeadline).deadline_ms == 5000 + interval * 4
    assert a.timer(ProbeTimeout).deadline_ms == 5000 + a.node.config.probe_timeout_ms  # unscaled
    [ping] = [m for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
    a.receive(out.packets[0].dest, Ack(ping.seq_no), now_ms=5010)
    assert a.node.health_score == 2
    out = a.fire(ProbeTick, 6000)
    assert a.timer(ProbeDeadline).deadline_ms == 6000 + interval * 3


def test_success_never_lowers_health_below_zero() -> None:
    a = _health_cluster(Config.lan())
    for now in (1000, 2000, 3000):
        out = a.fire(ProbeTick, now)
        [ping] = [m for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
        result = a.receive(out.packets[0].dest, Ack(ping.seq_no, b"x"), now_ms=now + 7)
        assert [(r.rtt_ms, r.payload, r.via) for r in result.probe_results] == [(7, b"x", "direct")]
        assert a.node.health_score == 0


def test_refuting_raises_health_by_one() -> None:
    a = _health_cluster(Config.lan())
    a.receive(addr(2), Suspect(a.node.incarnation, "a", "t"), now_ms=10)
    assert a.node.health_score == 1
    a.receive(addr(2), Dead(a.node.incarnation, "a", "t"), now_ms=20)
    assert a.node.health_score == 2


def test_without_lhm_health_stays_zero() -> None:
    a = _health_cluster(Config.lan(lifeguard_lhm=False, disable_tcp_pings=True))
    _failed_probe(a, 1000, nacks=0)
    a.receive(addr(2), Suspect(a.node.incarnation, "a", "t"), now_ms=3000)
    assert a.node.health_score == 0
    a.fire(ProbeTick, 5000)
    assert a.timer(ProbeDeadline).deadline_ms == 5000 + a.node.config.probe_interval_ms


# --- TCP fallback ---------------------------------------------------------------------------


def _tcp_setup(config: Config | None = None) -> tuple[Peer, Peer, Ping]:
    a, t = make_peer("a", 1, config=config), make_peer("t", 2)
    a.learn(alive_of(t))
    _, ping = a.probe("t", 1000)
    return a, t, ping


def _answer_tcp_ping(a: Peer, t: Peer, data: bytes, now_ms: int) -> Ack:
    parsed = t.node.parse_stream(data)
    assert parsed is not None
    request, used = parsed
    assert used == len(data)
    assert isinstance(request, Ping)
    reply = t.take(t.node.handle_stream(a.address, request, now_ms)).reply
    assert reply is not None
    back = a.node.parse_stream(reply)
    assert back is not None
    assert isinstance(back[0], Ack)
    return back[0]


@pytest.mark.parametrize("reply_after_deadline", [False, True])
def test_tcp_fallback_rescues_a_probe_and_warns(reply_after_deadline: bool) -> None:
    a, t, ping = _tcp_setup()
    a.receive(addr(3), Suspect(a.node.incarnation, "a", "x"), now_ms=1100)  # refute: +1
    assert a.node.health_score == 1
    out = a.fire(ProbeTimeout)
    [req] = out.streams
    assert (req.kind, req.dest, req.expect_reply) == (StreamKind.PING, t.address, True)
    assert req.deadline_ms == a.timer(ProbeDeadline).deadline_ms == 2000
    ack = _answer_tcp_ping(a, t, req.data, 1600)
    assert ack == Ack(ping.seq_no)
    if reply_after_deadline:
        waiting = a.fire(ProbeDeadline)
        assert waiting.probe_results == [] and waiting.events == []
        assert a.timer(ProbeTcpGrace).deadline_ms == 2000 + a.node.config.probe_timeout_ms
        done = a.take(a.node.handle_stream_response(req.stream_id, ack, 2100))
    else:
        early = a.take(a.node.handle_stream_response(req.stream_id, ack, 1700))
        assert early.probe_results == []  # indirect acks may still come: wait for the deadline
        done = a.fire(ProbeDeadline)
    warnings = [n for n in done.notices if n.level == "warning"]
    assert len(warnings) == 1
    assert "over TCP but UDP probes failed" in warnings[0].message
    assert done.probe_results == [ProbeResult("t", done.probe_results[0].rtt_ms, b"", "tcp")]
    assert done.events == []
    assert a.member("t").state == ALIVE
    assert a.node.stats.tcp_fallback_rescues == 1
    assert a.node.health_score == 0  # contact over TCP counts as an answer: −1
    assert a.node.stats.probes_failed == 0


def test_failed_tcp_fallback_leads_to_suspicion() -> None:
    a, _, _ = _tcp_setup()
    [req] = a.fire(ProbeTimeout).streams
    a.take(a.node.handle_stream_response(req.stream_id, None, 1700, "connection refused"))
    done = a.fire(ProbeDeadline)
    assert [(e.kind, e.member.name) for e in done.events] == [(EventKind.SUSPECT, "t")]
    assert [n.kind for n in done.notices if n.level == "warning"] == []


def test_tcp_fallback_ack_with_another_seq_does_not_rescue() -> None:
    a, _, ping = _tcp_setup()
    [req] = a.fire(ProbeTimeout).streams
    a.take(a.node.handle_stream_response(req.stream_id, Ack(ping.seq_no + 1), 1700))
    done = a.fire(ProbeDeadline)
    assert [e.kind for e in done.events] == [EventKind.SUSPECT]


def test_no_tcp_fallback_when_disabled_or_target_too_old() -> None:
    a, _, _ = _tcp_setup(Config.lan(disable_tcp_pings=True))
    assert a.fire(ProbeTimeout).streams == []
    old = make_peer("a", 1)
    old.learn(alive("t", 2, pmax=2))
    old.probe("t", 1000)
    assert old.fire(ProbeTimeout).streams == []
    assert old.node.stats.tcp_fallback_probes == 0


# --- ticks during a probe -------------------------------------------------------------------


def test_tick_during_a_probe_runs_when_it_ends_and_carries_the_new_suspicion() -> None:
    """A Go ticker buffers one tick while probeNode blocks; the buffered probe runs after
    the failed one has marked its target suspect, so a ping to the same target already
    uses the buddy system. The buffered probe picks b again only when b was last in the
    probe order and the reshuffle puts it first, so several seeds are tried."""
    again = 0
    for seed in range(1, 60):
        a = make_peer("a", 1, config=Config.lan(disable_tcp_pings=True), seed=seed)
        a.learn(alive("b", 2), alive("c", 3, pmax=2))  # c cannot be asked for a nack
        a.drain(10)
        _, first = a.probe("b", 1000)
        assert a.fire(ProbeTick, 1200).packets == []  # still probing: remembered
        a.fire(ProbeTimeout)
        done = a.fire(ProbeDeadline)
        assert [e.kind for e in done.events] == [EventKind.SUSPECT]
        pings = [p for p in done.packets if p.dest == addr(2)]
        if not pings:
            continue
        again += 1
        assert decode(pings[0].data) == [
            Ping(first.seq_no + 1, "b", addr(1).ip_bytes, PORT, "a"),
            Suspect(1, "b", "a"),
        ]
    assert again > 0
