"""Hostile and adversarial input against a live Node: nothing raises, drops are counted by
reason, membership is unchanged by garbage, and the protocol invariants always hold
(incarnations never decrease, a node never declares itself dead, SWIM §4.2 precedence)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swim import Address, Config, Member, Node, NodeStateType, Timer, wire
from swim.messages import (
    Ack,
    Alive,
    Dead,
    IndirectPing,
    Message,
    MsgType,
    Nack,
    Ping,
    PushNodeState,
    PushPull,
    Suspect,
    UserMsg,
)
from swim.security import Keyring

VSN = bytes([1, 5, 2, 2, 5, 4])
NAMES = ["a", "b", "c", "d", "e"]
ADDRS = {name: Address(f"10.0.0.{i + 1}", 7946) for i, name in enumerate(NAMES)}


def _node(keyring: Keyring | None = None) -> Node:
    node = Node(
        "a",
        ADDRS["a"],
        rng=random.Random(7),
        now_ms=0,
        keyring=keyring,
        nonce_source=random.Random(1).randbytes,
    )
    node.start(0)
    states = tuple(
        PushNodeState(n, ADDRS[n].ip_bytes, 7946, b"", 1, NodeStateType.ALIVE, VSN)
        for n in NAMES[1:4]
    )
    node.handle_stream(ADDRS["b"], PushPull(True, states), 1)
    return node


def _view(node: Node) -> list[Member]:
    return node.members()


# --- arbitrary bytes ----------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=1500), min_size=1, max_size=20))
def test_random_bytes_change_nothing_and_are_counted(packets: list[bytes]) -> None:
    node = _node()
    for i, data in enumerate(packets):
        try:
            valid = bool(wire.decode_packet(data, None).messages)
        except wire.WireError:
            valid = False
        before = _view(node)
        dropped = sum(node.stats.dropped.values())
        node.handle_datagram(ADDRS["e"], data, 10 + i)
        if not valid:
            # nothing decodable: membership untouched and the drop counted
            assert _view(node) == before
            assert sum(node.stats.dropped.values()) > dropped


@dataclass
class Case:
    data: bytes
    reason: str


def _cases() -> list[Case]:
    alive = wire.encode_message(Alive(9, "b", ADDRS["b"].ip_bytes, 7946, b"", VSN))
    return [
        Case(b"", "empty"),
        Case(alive[:-3], "malformed"),  # truncated
        Case(
            bytes([MsgType.ALIVE]) + msgpack.packb({"Incarnation": "9", "Node": "b"}), "malformed"
        ),  # wrong type
        Case(
            bytes([MsgType.ALIVE])
            + msgpack.packb({"Incarnation": 9, "Node": "b", "Addr": b"\x01\x02\x03", "Port": 1}),
            "malformed",
        ),
        Case(
            bytes([MsgType.ALIVE])
            + msgpack.packb(
                {"Incarnation": 9, "Node": "b", "Addr": bytes(4), "Vsn": bytes([3, 2, 2])}
            ),
            "invalid_version",
        ),
        Case(
            bytes([MsgType.ALIVE])
            + msgpack.packb({"Incarnation": 9, "Node": "b", "Addr": bytes(4), "Meta": b"m" * 600}),
            "malformed",
        ),
        Case(bytes([250]) + b"\x80", "unknown_type"),
        Case(bytes([MsgType.PUSH_PULL]) + b"\x80", "unexpected_type"),
        Case(wire.add_crc(alive)[:-1] + b"\x00", "bad_crc"),
        Case(
            bytes([MsgType.COMPRESS]) + msgpack.packb({"Algo": 0, "Buf": b"\xff" * 10}),
            "decompress_failed",
        ),
        Case(wire.make_compound([alive])[:-2], "truncated_compound"),
        Case(wire.encode_message(Ping(1, "zz")), "wrong_node"),
        Case(b"\xff" * 65_000, "unknown_type"),  # oversized garbage
        # another name claiming our own address
        Case(wire.encode_message(Alive(1, "zz", ADDRS["a"].ip_bytes, 7946, b"", VSN)), "rejected"),
    ]


def test_each_hostile_packet_is_dropped_by_reason_and_changes_nothing() -> None:
    for case in _cases():
        node = _node()
        before = _view(node)
        out = node.handle_datagram(ADDRS["e"], case.data, 5)
        assert _view(node) == before, case.reason
        assert node.stats.dropped[case.reason] == 1, (case.reason, dict(node.stats.dropped))
        assert not out.events


def test_bad_key_and_replay_after_key_removal() -> None:
    k1, k2 = bytes(range(16)), bytes(range(16, 32))
    sender = Node(
        "e",
        ADDRS["e"],
        rng=random.Random(3),
        now_ms=0,
        keyring=Keyring([k2]),
        nonce_source=random.Random(2).randbytes,
    )
    out = sender.send_user(ADDRS["a"], b"hello", 1)
    packet = out.packets[0].data
    node = _node(Keyring([k1, k2]))
    assert node.handle_datagram(ADDRS["e"], packet, 2).user_messages[0].payload == b"hello"
    node.remove_key(k2)
    before = _view(node)
    out = node.handle_datagram(ADDRS["e"], packet, 3)  # replayed after removal
    assert not out.user_messages and _view(node) == before
    assert node.stats.dropped["decrypt_failed"] == 1
    stranger = Node("x", ADDRS["e"], rng=random.Random(4), now_ms=0, keyring=Keyring([bytes(16)]))
    node.handle_datagram(ADDRS["e"], stranger.send_user(ADDRS["a"], b"x", 1).packets[0].data, 4)
    assert node.stats.dropped["decrypt_failed"] == 2
    # a plaintext packet to an encrypted node is dropped too
    plain = wire.encode_message(Alive(50, "e", ADDRS["e"].ip_bytes, 7946, b"", VSN))
    node.handle_datagram(ADDRS["e"], plain, 5)
    assert node.member("e") is None


# --- adversarial but valid messages -------------------------------------------------------

names = st.sampled_from(NAMES)
incs = st.integers(min_value=0, max_value=12)
addrs = st.sampled_from([ADDRS[n] for n in NAMES] + [Address("10.9.9.9", 1)])


def _alive(draw: st.DrawFn) -> Message:
    addr = draw(addrs)
    return Alive(
        draw(incs),
        draw(names),
        addr.ip_bytes,
        addr.port,
        draw(st.binary(max_size=8)),
        draw(st.sampled_from([VSN, b"", bytes([2, 3, 2])])),
    )


@st.composite
def messages(draw: st.DrawFn) -> Message:
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return _alive(draw)
    if kind == 1:
        return Suspect(draw(incs), draw(names), draw(names))
    if kind == 2:
        return Dead(draw(incs), draw(names), draw(names))
    if kind == 3:
        return Ping(draw(st.integers(0, 50)), draw(st.sampled_from(["a", "", "b"])))
    if kind == 4:
        return Ack(draw(st.integers(0, 50)), draw(st.binary(max_size=4)))
    if kind == 5:
        return Nack(draw(st.integers(0, 50)))
    if kind == 6:
        t = draw(addrs)
        return IndirectPing(
            draw(st.integers(0, 50)), t.ip_bytes, t.port, draw(names), draw(st.booleans())
        )
    return UserMsg(draw(st.binary(max_size=16)))


steps = st.lists(
    st.one_of(
        st.tuples(st.just("msg"), st.lists(messages(), min_size=1, max_size=4)),
        st.tuples(st.just("bytes"), st.binary(max_size=64)),
        st.tuples(st.just("time"), st.integers(1, 40_000)),
        st.tuples(st.just("leave"), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_invariants_hold_under_adversarial_messages(script: list[tuple[str, object]]) -> None:
    node = _node()
    now = 10
    pending: list[Timer] = []
    incarnations = {m.name: m.incarnation for m in node.members()}
    own = node.incarnation
    for action, arg in script:
        before = {m.name: m for m in node.members()}
        if action == "msg":
            assert isinstance(arg, list)
            parts = [wire.encode_message(m) for m in arg]
            data = parts[0] if len(parts) == 1 else wire.make_compound(parts)
            out = node.handle_datagram(ADDRS["e"], data, now)
        elif action == "bytes":
            assert isinstance(arg, bytes)
            out = node.handle_datagram(ADDRS["e"], arg, now)
        elif action == "leave":
            out = node.leave(now)
        else:
            assert isinstance(arg, int)
            now += arg
            due = sorted((t for t in pending if t.deadline_ms <= now), key=lambda t: t.deadline_ms)
            pending = [t for t in pending if t.deadline_ms > now]
            out = node.handle_datagram(ADDRS["e"], b"", now)
            for timer in due:
                fired = node.handle_timer(timer, max(now, timer.deadline_ms))
                pending.extend(fired.timers)
        pending.extend(out.timers)
        _check_invariants(node, before, incarnations, own)
        incarnations = {m.name: m.incarnation for m in node.members()}
        own = node.incarnation
        assert node.live_timers <= 64


def _check_invariants(
    node: Node, before: dict[str, Member], incarnations: dict[str, int], own: int
) -> None:
    me = node.member("a")
    assert me is not None
    assert me.state != NodeStateType.DEAD, "a node never declares itself dead"
    assert me.state == (NodeStateType.LEFT if node.leaving else NodeStateType.ALIVE)
    assert node.incarnation >= own, "our incarnation never decreases"
    for m in node.members():
        old = before.get(m.name)
        # memberlist state.go aliveNode: only a member that left (or died past the reclaim
        # time) may come back from a new address, as a new process whose incarnation
        # restarts; that is the only way down (within one compound it may leave and return).
        reborn = old is not None and old.address != m.address
        if m.name in incarnations and not reborn:
            assert m.incarnation >= incarnations[m.name], f"{m.name} incarnation went down"
        if old is None or m.name == "a" or reborn:
            continue
        # SWIM §4.2: a suspect or dead member comes back alive only with a newer incarnation
        if (
            old.state in (NodeStateType.SUSPECT, NodeStateType.DEAD)
            and m.state == NodeStateType.ALIVE
        ):
            assert m.incarnation > old.incarnation
        # a suspicion never overrides a newer alive
        if old.state == NodeStateType.ALIVE and m.state == NodeStateType.SUSPECT:
            assert m.incarnation >= old.incarnation


def test_config_lan_is_the_default() -> None:
    assert Config() == Config.lan()
