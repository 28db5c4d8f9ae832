"""Codec tests: round trips, memberlist's byte layout, and hostile input."""

from __future__ import annotations

import contextlib
import struct
import zlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swim import wire
from swim.messages import (
    Ack,
    Alive,
    Dead,
    ErrResp,
    IndirectPing,
    Message,
    MsgType,
    Nack,
    NodeStateType,
    Ping,
    PushNodeState,
    PushPull,
    Suspect,
    UserMsg,
)
from swim.security import Keyring
from swim.wire import DropReason, WireError

IP = bytes([10, 0, 0, 1])
MESSAGES: list[Message] = [
    Ping(1, "b", IP, 7946, "a"),
    Ping(2, ""),
    IndirectPing(3, IP, 7946, "c", True, IP, 7947, "a"),
    IndirectPing(4, IP, 7946, "c", False),
    Ack(5, b"payload"),
    Ack(6),
    Nack(7),
    ErrResp("boom"),
    Suspect(8, "c", "a"),
    Alive(9, "c", IP, 7946, b"meta", bytes([1, 5, 2, 2, 5, 4])),
    Alive(10, "ünïcode", bytes(16), 1, b"", b""),
    Dead(11, "c", "c"),
    UserMsg(b"\x00\x01user"),
]
CRYPTO = wire.Crypto(Keyring([bytes(range(16))]), nonce=lambda n: bytes(n))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trip(msg: Message) -> None:
    assert wire.decode_message(wire.encode_message(msg)) == msg


def test_layout_matches_go_msgpack() -> None:
    """hashicorp/go-msgpack: map keyed by Go field names sorted by name, raw str types for
    strings and []byte, nil for empty slices, omitempty fields left out (net.go)."""
    data = wire.encode_message(Ping(1, "b"))
    assert data[0] == MsgType.PING
    assert data[1:] == bytes([0x82]) + b"\xa4Node\xa1b" + b"\xa5SeqNo\x01"
    ack = wire.encode_message(Ack(7))
    assert ack[1:] == bytes([0x82]) + b"\xa7Payload\xc0" + b"\xa5SeqNo\x07"
    alive = wire.encode_message(Alive(1, "n", IP, 7946, b"", bytes([1, 5, 2, 2, 5, 4])))
    body = msgpack.unpackb(alive[1:], raw=True)
    assert list(body) == [b"Addr", b"Incarnation", b"Meta", b"Node", b"Port", b"Vsn"]
    assert body[b"Meta"] is None
    # a 40-byte string is raw16 (0xda), never str8 (0xd9), as old go-msgpack writes
    long = wire.encode_message(Suspect(1, "x" * 40, "a"))
    assert b"\xda\x00\x28" + b"x" * 40 in long


def test_decoder_is_lenient_like_go() -> None:
    """Unknown keys ignored, missing keys are zero values, bin accepted for bytes."""
    body = msgpack.packb({"SeqNo": 3, "Extra": [1, 2], "Payload": b"x"}, use_bin_type=True)
    assert wire.decode_message(bytes([MsgType.ACK]) + body) == Ack(3, b"x")
    assert wire.decode_message(bytes([MsgType.NACK]) + msgpack.packb({})) == Nack(0)


def test_compound_round_trip_and_truncation() -> None:
    parts = [wire.encode_message(m) for m in MESSAGES[:4]]
    packet = wire.make_compound(parts)
    assert packet[0] == MsgType.COMPOUND and packet[1] == 4
    assert struct.unpack_from(">4H", packet, 2) == tuple(len(p) for p in parts)
    assert wire.split_compound(packet[1:]) == (parts, 0)
    got, truncated = wire.split_compound(packet[1:-3])
    assert got == parts[:3] and truncated == 1


def test_packet_layers_round_trip() -> None:
    parts = [wire.encode_message(m) for m in MESSAGES]
    for compress in (False, True):
        for crc in (False, True):
            for crypto in (None, CRYPTO):
                data = wire.encode_packet(parts, compress=compress, crc=crc, crypto=crypto)
                decoded = wire.decode_packet(data, crypto)
                assert list(decoded.messages) == MESSAGES
                assert decoded.drops == ()


def test_crc_header_layout() -> None:
    inner = wire.encode_message(Nack(1))
    data = wire.add_crc(inner)
    assert data[0] == MsgType.HAS_CRC
    assert struct.unpack_from(">I", data, 1)[0] == zlib.crc32(inner)
    corrupt = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(WireError) as err:
        wire.decode_packet(corrupt, None)
    assert err.value.reason is DropReason.BAD_CRC


def test_compression_only_when_smaller() -> None:
    tiny = wire.encode_packet([wire.encode_message(Nack(1))], compress=True, crc=False, crypto=None)
    assert tiny[0] == MsgType.NACK
    big = wire.encode_message(Alive(1, "n" * 200, IP, 1, b"m" * 300, b""))
    packed = wire.encode_packet([big], compress=True, crc=False, crypto=None)
    assert packed[0] == MsgType.COMPRESS and len(packed) < len(big)


def test_one_bad_part_does_not_drop_its_neighbours() -> None:
    good = wire.encode_message(Nack(1))
    bad = bytes([MsgType.ALIVE]) + b"\xc1"  # 0xc1 is never valid msgpack
    unknown = bytes([99]) + b"\x80"
    decoded = wire.decode_packet(wire.make_compound([good, bad, unknown, good]), None)
    assert decoded.messages == (Nack(1), Nack(1))
    assert sorted(r.value for r in decoded.drops) == ["malformed", "unknown_type"]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", DropReason.EMPTY),
        (bytes([MsgType.PING]), DropReason.MALFORMED),
        (bytes([MsgType.PING]) + b"\x93\x01\x02\x03", DropReason.MALFORMED),  # array, not map
        (bytes([MsgType.PING]) + msgpack.packb({"SeqNo": "x"}), DropReason.MALFORMED),
        (bytes([MsgType.PING]) + msgpack.packb({"SeqNo": 2**32}), DropReason.MALFORMED),
        (bytes([MsgType.PING]) + msgpack.packb({"SeqNo": -1}), DropReason.MALFORMED),
        (bytes([MsgType.ALIVE]) + msgpack.packb({"Port": 70000}), DropReason.MALFORMED),
        (bytes([MsgType.INDIRECT_PING]) + msgpack.packb({"Nack": 1}), DropReason.MALFORMED),
        (bytes([MsgType.PUSH_PULL]) + b"\x80", DropReason.UNEXPECTED_TYPE),
        (bytes([200]) + b"\x80", DropReason.UNKNOWN_TYPE),
        (
            bytes([MsgType.COMPRESS]) + msgpack.packb({"Algo": 1, "Buf": b""}),
            DropReason.DECOMPRESS_FAILED,
        ),
        (
            bytes([MsgType.COMPRESS]) + msgpack.packb({"Algo": 0, "Buf": b"\xff\xff"}),
            DropReason.DECOMPRESS_FAILED,
        ),
        (bytes([MsgType.COMPOUND]), DropReason.MALFORMED),
        (bytes([MsgType.COMPOUND, 3, 0]), DropReason.MALFORMED),
    ],
)
def test_hostile_packets_are_dropped_with_a_reason(data: bytes, reason: DropReason) -> None:
    try:
        decoded = wire.decode_packet(data, None)
    except WireError as exc:
        assert exc.reason is reason
    else:
        assert decoded.messages == ()
        assert decoded.drops == (reason,)


def test_nesting_is_bounded() -> None:
    data = wire.encode_message(Nack(1))
    for _ in range(wire.MAX_NESTING + 1):
        data = wire.make_compound([data])
    decoded = wire.decode_packet(data, None)
    assert decoded.messages == () and decoded.drops == (DropReason.TOO_DEEP,)


def test_encrypted_packets_need_the_key() -> None:
    data = wire.encode_packet(
        [wire.encode_message(Nack(1))], compress=False, crc=False, crypto=CRYPTO
    )
    other = wire.Crypto(Keyring([bytes(16)]), nonce=lambda n: bytes(n))
    with pytest.raises(WireError) as err:
        wire.decode_packet(data, other)
    assert err.value.reason is DropReason.DECRYPT_FAILED
    # Read as plaintext, the version byte 1 looks like an indirect ping whose body is noise.
    decoded = wire.decode_packet(data, None)
    assert decoded.messages == () and decoded.drops == (DropReason.MALFORMED,)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_never_raise_anything_but_wire_error(data: bytes) -> None:
    for crypto in (None, CRYPTO):
        with contextlib.suppress(WireError):
            wire.decode_packet(data, crypto)


# --- streams ------------------------------------------------------------------------------

LIMITS = wire.StreamLimits(max_bytes=1 << 20, max_nodes=100, max_user_bytes=1 << 16)
STATES = tuple(
    PushNodeState(f"n{i}", IP, 7946 + i, b"m", i, NodeStateType(i % 4), bytes([1, 5, 2, 2, 5, 4]))
    for i in range(5)
)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("crypto", [None, CRYPTO], ids=["plain", "encrypted"])
@pytest.mark.parametrize(
    "message",
    [PushPull(True, STATES, b"user-state"), PushPull(False, ()), UserMsg(b"hello")],
    ids=["push_pull", "empty_push_pull", "user"],
)
def test_stream_round_trip_incrementally(
    message: PushPull | UserMsg, compress: bool, crypto: wire.Crypto | None
) -> None:
    raw = (
        wire.encode_push_pull(message)
        if isinstance(message, PushPull)
        else wire.encode_user_stream(message.payload)
    )
    data = wire.encode_stream(raw, compress=compress, crypto=crypto)
    for cut in range(len(data)):
        assert wire.parse_stream(data[:cut], crypto, LIMITS) is None
    parsed = wire.parse_stream(data + b"trailing", crypto, LIMITS)
    assert parsed == (message, len(data))


def test_stream_ping_and_ack() -> None:
    for msg in (Ping(4, "x"), Ack(4, b"")):
        data = wire.encode_stream(wire.encode_message(msg), compress=True, crypto=None)
        assert wire.parse_stream(data, None, LIMITS) == (msg, len(data))


def test_stream_headers_claiming_huge_sizes_fail_fast() -> None:
    header = msgpack.packb({"Nodes": 10**9, "UserStateLen": 0, "Join": False})
    with pytest.raises(WireError) as err:
        wire.parse_stream(bytes([MsgType.PUSH_PULL]) + header, None, LIMITS)
    assert err.value.reason is DropReason.OVERSIZED
    header = msgpack.packb({"Nodes": 0, "UserStateLen": 1 << 30, "Join": False})
    with pytest.raises(WireError):
        wire.parse_stream(bytes([MsgType.PUSH_PULL]) + header, None, LIMITS)
    user = bytes([MsgType.USER]) + msgpack.packb({"UserMsgLen": 1 << 30})
    with pytest.raises(WireError):
        wire.parse_stream(user, None, LIMITS)
    encrypted = bytes([MsgType.ENCRYPT]) + struct.pack(">I", 1 << 31)
    with pytest.raises(WireError):
        wire.parse_stream(encrypted, CRYPTO, LIMITS)
    with pytest.raises(WireError):
        wire.parse_stream(b"x" * (LIMITS.max_bytes + 10), None, LIMITS)


def test_stream_encryption_is_enforced_both_ways() -> None:
    plain = wire.encode_stream(
        wire.encode_push_pull(PushPull(False, ())), compress=False, crypto=None
    )
    with pytest.raises(WireError) as err:
        wire.parse_stream(plain, CRYPTO, LIMITS)
    assert err.value.reason is DropReason.NOT_ENCRYPTED
    sealed = wire.encode_stream(
        wire.encode_push_pull(PushPull(False, ())), compress=False, crypto=CRYPTO
    )
    with pytest.raises(WireError):
        wire.parse_stream(sealed, None, LIMITS)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_arbitrary_stream_bytes_never_raise_anything_but_wire_error(data: bytes) -> None:
    for crypto in (None, CRYPTO):
        with contextlib.suppress(WireError):
            wire.parse_stream(data, crypto, LIMITS)
