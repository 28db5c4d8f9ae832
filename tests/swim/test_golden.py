"""Byte-compatibility with real Serf: every golden packet captured from serf 0.9.4 agents
(tests/golden/serf, scripts/capture_serf_golden.py) decodes cleanly, re-encodes to the
same bytes layer by layer (AES-GCM with the captured nonce, CRC, LZW, compound, msgpack),
and is accepted by a Node standing in for its destination."""

from __future__ import annotations

import base64
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from swim import Address, Node, NodeStateType, wire
from swim.messages import (
    Ack,
    Alive,
    Dead,
    IndirectPing,
    MsgType,
    Nack,
    Ping,
    PushPull,
    Suspect,
    UserMsg,
)
from swim.security import (
    Keyring,
    decrypt_payload,
    decrypt_stream_body,
    encrypt_payload,
    encrypt_stream,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "serf"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "manifest.json").read_text())
KEYS: dict[str, bytes] = {
    name: base64.b64decode(k["base64"]) for name, k in MANIFEST["keys"].items()
}
PORTS = {n["name"]: n["gossip_port"] for n in MANIFEST["nodes"]}
ENTRIES = MANIFEST["entries"]
UDP = [e for e in ENTRIES if e["transport"] == "udp"]
TCP = [e for e in ENTRIES if e["transport"] == "tcp"]
LIMITS = wire.StreamLimits()


def _data(entry: dict[str, Any]) -> bytes:
    path: Path = GOLDEN / str(entry["file"])
    return path.read_bytes()


def _crypto(entry: dict[str, Any]) -> wire.Crypto | None:
    if entry["scenario"] != "encrypted":
        return None
    return wire.Crypto(Keyring([KEYS["k2"], KEYS["k1"]]), nonce=lambda n: bytes(n))


def _key(entry: dict[str, Any]) -> bytes:
    return KEYS[entry["key"]] if "key" in entry else KEYS["k1"]


def _reencode_plain(buf: bytes) -> bytes:
    """Peel one layer, re-encode what is inside with our codec, and wrap it again."""
    kind = buf[0]
    if kind == MsgType.HAS_CRC:
        return wire.add_crc(_reencode_plain(buf[5:]))
    if kind == MsgType.COMPRESS:
        return wire.compress_message(_reencode_plain(wire.decompress_body(buf[1:])))
    if kind == MsgType.COMPOUND:
        parts, truncated = wire.split_compound(buf[1:])
        assert truncated == 0
        return wire.make_compound([_reencode_plain(p) for p in parts])
    return wire.encode_message(wire.decode_message(buf))


def _reencode_stream_plain(buf: bytes) -> bytes:
    if buf[0] == MsgType.COMPRESS:
        return wire.compress_message(_reencode_stream_plain(wire.decompress_body(buf[1:])))
    parsed = wire.parse_stream(buf, None, LIMITS)
    assert parsed is not None and parsed[1] == len(buf)
    message = parsed[0]
    if isinstance(message, PushPull):
        return wire.encode_push_pull(message)
    assert isinstance(message, Ping | Ack)
    return wire.encode_message(message)


def test_corpus_covers_every_message_kind() -> None:
    summaries = " ".join(e["summary"] for e in ENTRIES)
    for kind in [
        "ping",
        "ack",
        "indirectPing",
        "nack",
        "suspect",
        "alive",
        "dead(left)",
        "crc>dead",
        "compound",
        "compress",
        "crc>",
        "user(",
        "pushPull",
        "encrypted v1",
    ]:
        assert kind in summaries, kind
    assert any(e["transport"] == "tcp" and "ping" in e["summary"] for e in ENTRIES)


@pytest.mark.parametrize("entry", UDP, ids=[e["file"] for e in UDP])
def test_udp_packet_decodes_and_reencodes_byte_for_byte(entry: dict[str, Any]) -> None:
    data = _data(entry)
    decoded = wire.decode_packet(data, _crypto(entry))
    assert decoded.drops == ()
    assert decoded.messages
    names = {
        "ping": Ping,
        "ack": Ack,
        "indirectPing": IndirectPing,
        "nack": Nack,
        "suspect": Suspect,
        "alive": Alive,
        "dead": Dead,
        "user": UserMsg,
    }
    words = set(re.findall(r"[A-Za-z]+", re.sub(r"\([^)]*\)", "", entry["summary"])))
    for word, cls in names.items():
        if word in words:
            assert any(isinstance(m, cls) for m in decoded.messages), (word, entry["summary"])
    if entry["scenario"] == "encrypted":
        key = _key(entry)
        plain = decrypt_payload([key], data, b"")
        again = encrypt_payload(data[0], key, _reencode_plain(plain), b"", data[1:13])
    else:
        again = _reencode_plain(data)
    assert again == data


@pytest.mark.parametrize("entry", TCP, ids=[e["file"] for e in TCP])
def test_tcp_stream_decodes_and_reencodes_byte_for_byte(entry: dict[str, Any]) -> None:
    data = _data(entry)
    parsed = wire.parse_stream(data, _crypto(entry), LIMITS)
    assert parsed is not None
    message, used = parsed
    assert used == len(data)
    if entry["scenario"] == "encrypted":
        key = _key(entry)
        plain = decrypt_stream_body([key], data[:5], data[5:], b"")
        again = encrypt_stream(data[5], key, _reencode_stream_plain(plain), b"", data[6:18])
    else:
        again = _reencode_stream_plain(data)
    assert again == data
    if isinstance(message, PushPull):
        assert message.user_state, "serf always sends its own state after the nodes"
        for state in message.nodes:
            assert state.name in PORTS
            assert state.addr == bytes([127, 0, 0, 1])
            assert state.port == PORTS[state.name]
            assert len(state.vsn) == 6


def test_serf_alive_and_dead_fields_mean_what_we_think() -> None:
    alives = []
    lefts = []
    for entry in UDP:
        for m in wire.decode_packet(_data(entry), _crypto(entry)).messages:
            if isinstance(m, Alive):
                alives.append(m)
            if isinstance(m, Dead) and m.node == m.sender:
                lefts.append(m)
    assert alives and lefts
    for a in alives:
        assert a.port == PORTS[a.node]
        assert a.vsn[:3] == bytes([1, 5, 2])  # pmin 1, pmax 5, pcur 2
        assert a.meta.startswith(b"\xff")  # serf's tag encoding: 0xff + msgpack map
    assert {d.node for d in lefts} == {"c"}


@pytest.mark.parametrize("entry", UDP, ids=[e["file"] for e in UDP])
def test_a_node_in_the_destinations_place_accepts_it(entry: dict[str, Any]) -> None:
    dst = entry["dst"]
    keyring = None
    if entry["scenario"] == "encrypted":
        keyring = Keyring([KEYS["k2"], KEYS["k1"]])
    node = Node(
        dst, Address("127.0.0.1", PORTS[dst]), rng=random.Random(1), now_ms=0, keyring=keyring
    )
    out = node.handle_datagram(Address("127.0.0.1", PORTS[entry["src"]]), _data(entry), 10)
    assert dict(node.stats.dropped) == {}
    decoded = wire.decode_packet(_data(entry), _crypto(entry))
    pings = [m for m in decoded.messages if isinstance(m, Ping)]
    if pings:  # we answer serf's pings with an ack it can read
        acks = [p for p in out.packets if p.dest.port == PORTS[entry["src"]]]
        assert acks
        got = wire.decode_packet(acks[0].data, _crypto(entry)).messages
        assert Ack(pings[0].seq_no) in got
    for m in decoded.messages:
        if isinstance(m, Alive) and m.node != dst:
            member = node.member(m.node)
            assert member is not None and member.state == NodeStateType.ALIVE
