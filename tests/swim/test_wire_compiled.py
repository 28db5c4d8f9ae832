"""The generated per-message encoders and decoders (``swim.wire.compiled``) compute what the
generic table walk (``encode_fields``/``decode_fields``) computes, on valid, odd and hostile
input; and a lone ping, which skips the datagram memo, decodes as any datagram does."""

from __future__ import annotations

import random
from typing import Any

import pytest

from swim import wire
from swim.messages import MsgType, Ping, PushNodeState
from swim.wire.compiled import compile_decoder, compile_encoder
from swim.wire.fields import FIELDS, TYPE_OF, Field, decode_fields, encode_fields, unpack_one

TABLES = [(cls, FIELDS[cls]) for cls in (*TYPE_OF, PushNodeState)]
IDS = [cls.__name__ for cls, _ in TABLES]

# What a hostile or buggy peer can put where a field belongs: every msgpack type, values
# at and past each Go width, empty and non-UTF-8 strings.
ODD_VALUES: list[Any] = [
    None, True, False, 0, 1, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1,
    1.5, b"", b"x", b"\xff\xfe", "text", [], [1], {}, {b"k": 1},
]  # fmt: skip


def _wire_value(f: Field, rng: random.Random) -> Any:
    """A well-formed value for field ``f`` as msgpack hands it back (raw bytes)."""
    if f.kind == "str":
        return rng.choice([b"", b"node-1", "ünï".encode(), b"\xff"])
    if f.kind == "bytes":
        return rng.choice([b"", b"\x0a\x00\x00\x01", None])
    if f.kind == "bool":
        return rng.choice([True, False])
    return rng.choice([0, 1, 200, 65535])


def _generic_decode(cls: type, table: tuple[Field, ...], obj: Any) -> Any:
    return cls(**decode_fields(table, obj))


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return ("ok", fn(*args))
    except wire.WireError as exc:
        return ("refused", exc.reason, exc.detail)


@pytest.mark.parametrize(("cls", "table"), TABLES, ids=IDS)
def test_decoder_matches_the_table_walk(cls: type, table: tuple[Field, ...]) -> None:
    decode = compile_decoder(table, cls)
    rng = random.Random(17)
    cases: list[Any] = [{}, [], None, b"", 3]
    for _ in range(200):
        obj = {f.key: _wire_value(f, rng) for f in table if rng.random() < 0.9}
        cases.append(obj)
        for f in table:  # one field odd, the rest well-formed
            cases.append({**obj, f.key: rng.choice(ODD_VALUES)})
        cases.append({**obj, b"Unknown": 1})
    refused = 0
    for obj in cases:
        ours, reference = _outcome(decode, obj), _outcome(_generic_decode, cls, table, obj)
        assert ours == reference, obj
        refused += ours[0] == "refused"
    assert 0 < refused < len(cases)  # both kinds of outcome were exercised


@pytest.mark.parametrize(("cls", "table"), TABLES, ids=IDS)
def test_encoder_matches_the_table_walk(cls: type, table: tuple[Field, ...]) -> None:
    encode = compile_encoder(table)
    decode = compile_decoder(table, cls)
    rng = random.Random(5)
    seen = set()
    for _ in range(300):
        obj = {f.key: _wire_value(f, rng) for f in table}
        msg = decode(obj)  # a message with empty, zero and full fields
        data = encode(msg)
        assert data == encode_fields(table, msg.__getattribute__)
        assert decode(unpack_one(data)) == msg
        seen.add(data)
    assert len(seen) >= 3  # not one encoding over and over


def test_positional_and_keyword_construction() -> None:
    """A class whose fields the table does not all name is built by keyword."""
    partial = (
        Field("SeqNo", "seq_no", "u32", key=b"SeqNo"),
        Field("Node", "node", "str", key=b"Node"),
    )
    made = compile_decoder(partial, Ping)({b"SeqNo": 3, b"Node": b"n"})
    assert made == Ping(3, "n")
    with pytest.raises(wire.WireError) as refused:
        compile_decoder(partial, Ping)({b"SeqNo": -1})
    assert refused.value.reason is wire.DropReason.MALFORMED


@pytest.mark.parametrize("crc", [True, False])
def test_a_lone_ping_decodes_as_any_datagram(crc: bool) -> None:
    ping = wire.encode_message(Ping(9, "node-2", b"\x0a\x00\x00\x01", 7946, "node-1"))
    bad = bytes([MsgType.PING]) + b"\x81\xa5SeqNo\xa1x"  # SeqNo is a string
    truncated = bytes([MsgType.PING]) + b"\x85"
    for body in (ping, bad, truncated):
        data = wire.encode_packet([body], compress=False, crc=crc, crypto=None)
        as_compound = wire.encode_packet([body, body], compress=False, crc=crc, crypto=None)
        single = wire.decode_packet(data, None)
        double = wire.decode_packet(as_compound, None)
        assert single.messages * 2 == double.messages
        assert single.drops * 2 == double.drops
    assert wire.decode_packet(
        wire.encode_packet([ping], compress=False, crc=True, crypto=None), None
    ).messages == (Ping(9, "node-2", b"\x0a\x00\x00\x01", 7946, "node-1"),)
    corrupted = bytearray(wire.encode_packet([ping], compress=False, crc=True, crypto=None))
    corrupted[-1] ^= 1
    with pytest.raises(wire.WireError) as refused:
        wire.decode_packet(bytes(corrupted), None)
    assert refused.value.reason is wire.DropReason.BAD_CRC
