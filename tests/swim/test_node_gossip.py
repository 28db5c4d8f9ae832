"""swim.Node's dissemination through its public API: the packet budget with piggybacked
broadcasts (plain, compressed, encrypted) and user messages.

Reference: hashicorp/memberlist @ 1b4c746 net.go ``sendMsg`` (piggyback up to
``UDPBufferSize − compoundHeaderOverhead − encryptOverhead``), state.go ``gossip``.
"""

from __future__ import annotations

import random

import pytest

from swim import Address, Config, EventKind, NodeStateType, Packet, UserMessage, wire
from swim.messages import Ack, Alive, Message, Ping, PushNodeState, PushPull, UserMsg
from swim.security import Keyring
from swim.timers import GossipTick
from tests.swim.node_harness import (
    PORT,
    Peer,
    addr,
    alive,
    decode,
    make_peer,
    mesh,
    of_type,
    packet,
    to,
    vsn,
)

N_NEW = 200


def _encode(keyring: Keyring | None, *messages: Message) -> bytes:
    crypto = None if keyring is None else wire.Crypto(keyring, random.Random(9).randbytes)
    parts = [wire.encode_message(m) for m in messages]
    return wire.encode_packet(parts, compress=False, crc=False, crypto=crypto)


def _flood(
    keyring: Keyring | None = None, *, compress: bool = False, meta_max: int = 300, pmax: int = 4
) -> tuple[Peer, list[Packet], list[Packet]]:
    """200 members join through one push-pull; returns the node, then the packets of 30
    gossip rounds and 30 acks it sends afterwards (all with piggybacked broadcasts)."""
    a = make_peer("a", 1, config=Config.lan(enable_compression=compress), keyring=keyring)
    rng = random.Random(5)
    states = tuple(
        PushNodeState(
            f"member-{i:03d}",
            Address(f"10.1.{i // 250}.{i % 250 + 1}", PORT).ip_bytes,
            PORT,
            rng.randbytes(rng.randrange(meta_max + 1)),
            rng.randrange(1, 100),
            NodeStateType.ALIVE,
            vsn(pmax),
        )
        for i in range(N_NEW)
    )
    out = a.take(a.node.handle_stream(addr(2), PushPull(False, states), 10))
    assert sum(e.kind == EventKind.JOINED for e in out.events) == N_NEW
    assert a.node.broadcast_queue_depth >= N_NEW
    gossip: list[Packet] = []
    acks: list[Packet] = []
    for i in range(30):
        now = 100 + 200 * i
        gossip += a.fire(GossipTick, now).packets
        src = Address(f"10.1.0.{i + 1}", PORT)  # a member: its ack carries piggyback
        acks += a.deliver(src, _encode(keyring, Ping(i, "a")), now).packets
    assert len(gossip) >= 60 and len(acks) == 30
    return a, gossip, acks


def _check_piggyback(sent: list[Packet], keyring: Keyring | None) -> None:
    counts = [len(decode(p.data, keyring)) for p in sent]
    assert max(counts) >= 3  # several broadcasts ride on one packet
    assert sum(c > 1 for c in counts) >= len(sent) // 2


# memberlist itself overshoots UDPBufferSize by these (net.go sendMsg, rawSendMsgPacket).
OWN_ENTRY_SLACK = wire.COMPOUND_OVERHEAD
CRC_SLACK = 5


@pytest.mark.parametrize("meta_max", [0, 300])
@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("encrypted", [False, True])
@pytest.mark.parametrize("pmax", [4, 5])
def test_packets_carry_piggyback_within_memberlists_budget(
    pmax: int, encrypted: bool, compress: bool, meta_max: int
) -> None:
    keyring = Keyring([bytes(16)]) if encrypted else None
    a, gossip, acks = _flood(keyring, compress=compress, meta_max=meta_max, pmax=pmax)
    budget = a.node.config.udp_buffer_size
    crc = CRC_SLACK if pmax >= 5 else 0
    assert max(len(p.data) for p in gossip) <= budget + crc
    assert max(len(p.data) for p in acks) <= budget + crc + OWN_ENTRY_SLACK
    _check_piggyback(gossip + acks, keyring)
    if not compress and meta_max:
        assert max(len(p.data) for p in gossip) > budget - 100  # really filled


@pytest.mark.parametrize("encrypted", [False, True])
def test_gossip_packets_fit_the_udp_budget(encrypted: bool) -> None:
    keyring = Keyring([bytes(16)]) if encrypted else None
    a, gossip, _ = _flood(keyring, pmax=4)
    assert max(len(p.data) for p in gossip) <= a.node.config.udp_buffer_size


def test_gossip_packets_to_crc_receivers_fit_the_udp_budget() -> None:
    a, gossip, _ = _flood(pmax=5)
    assert max(len(p.data) for p in gossip) <= a.node.config.udp_buffer_size


def test_ack_packets_fit_the_udp_budget() -> None:
    a, _, acks = _flood(pmax=4)
    assert max(len(p.data) for p in acks) <= a.node.config.udp_buffer_size


# --- user messages --------------------------------------------------------------------------


def test_send_user_is_one_packet_to_dest() -> None:
    a = make_peer("a", 1)
    dest = Address("10.0.0.5", 8000)
    out = a.take(a.node.send_user(dest, b"hello", 10))
    assert [p.dest for p in out.packets] == [dest]
    assert decode(out.packets[0].data) == [UserMsg(b"hello")]


def test_received_user_message_is_handed_to_the_application() -> None:
    a = make_peer("a", 1)
    src = addr(2)
    out = a.deliver(src, packet(UserMsg(b"one")), 10)
    assert out.user_messages == [UserMessage(src, b"one")]
    # Also when it rides in a compound with protocol messages.
    out = a.deliver(src, packet(Ping(3, "a"), UserMsg(b"two")), 11)
    assert out.user_messages == [UserMessage(src, b"two")]
    assert decode(out.packets[0].data)[0] == Ack(3)


def test_broadcast_user_piggybacks_on_later_packets_to_others() -> None:
    a, b, c = make_peer("a", 1), make_peer("b", 2), make_peer("c", 3)
    mesh(a, b, c)
    a.take(a.node.broadcast_user(b"event:deploy", 10))
    # On an ack to b ...
    out = a.receive(b.address, Ping(5, "a"), now_ms=20)
    [ack] = to(out, b.address)
    msgs = decode(ack.data)
    assert msgs[0] == Ack(5)
    assert UserMsg(b"event:deploy") in msgs
    got = b.deliver(a.address, ack.data, 21)
    assert got.user_messages == [UserMessage(a.address, b"event:deploy")]
    # ... and on the gossip round to the others.
    out = a.fire(GossipTick, 200)
    assert {p.dest for p in out.packets} == {b.address, c.address}
    for p in out.packets:
        assert UserMsg(b"event:deploy") in decode(p.data)


def test_oversize_broadcast_user_raises() -> None:
    a = make_peer("a", 1)
    a.learn(alive("b", 2, pmax=4))  # no CRC header
    budget = a.node.config.udp_buffer_size
    # The payload plus its type byte and compound entry must fit the packet budget.
    largest = budget - wire.packet_overhead(None) - wire.USER_MSG_OVERHEAD - wire.COMPOUND_OVERHEAD
    with pytest.raises(ValueError):
        a.node.broadcast_user(bytes(largest + 1), 10)
    with pytest.raises(ValueError):
        a.node.broadcast_user(bytes(budget), 10)
    a.drain(20)
    payload = random.Random(3).randbytes(largest)  # incompressible
    a.take(a.node.broadcast_user(payload, 30))
    out = a.fire(GossipTick, 40)
    [p] = out.packets
    assert of_type(decode(p.data), UserMsg) == [UserMsg(payload)]
    assert len(p.data) <= budget


def test_alive_flood_by_datagram_keeps_the_budget() -> None:
    """Many alive messages delivered as datagrams are re-gossiped within the budget."""
    a = make_peer("a", 1, config=Config.lan(enable_compression=False))
    for i in range(N_NEW):
        ip = Address(f"10.2.0.{i + 1}", PORT).ip_bytes
        a.deliver(addr(2), packet(Alive(1, f"n{i:03d}", ip, PORT, bytes(40), vsn(4))), i)
    sizes = []
    counts = []
    for i in range(10):
        for p in a.fire(GossipTick, 1000 + 200 * i).packets:
            sizes.append(len(p.data))
            counts.append(len(decode(p.data)))
    assert sizes and max(sizes) <= a.node.config.udp_buffer_size
    assert min(counts) >= 10
