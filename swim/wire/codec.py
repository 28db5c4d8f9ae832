"""Messages to bytes and back: one packet message, the bodies of stream messages
(push-pull, user message, TCP ping/ack), and the LZW compression wrapper. Part of
``swim.wire`` (its docstring has the rules); the layers around a message (compound, CRC,
encryption, stream frames) are ``swim.wire.framing``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgpack

from swim import lzw
from swim.messages import (
    Ack,
    ErrResp,
    Message,
    MsgType,
    NodeStateType,
    Ping,
    PushNodeState,
    PushPull,
    UserMsg,
)
from swim.wire.compiled import compile_decoder, compile_encoder
from swim.wire.errors import DropReason, WireError
from swim.wire.fields import (
    CLASS_OF,
    FIELDS,
    HEAD_SCAN_BYTES,
    HEADER_FIELDS,
    TYPE_OF,
    USER_HEADER_FIELDS,
    check_declared_lengths,
    decode_fields,
    encode_fields,
    new_unpacker,
    pack,
    unpack_one,
)

__all__ = [
    "GOSSIP_CACHE_ENTRIES",
    "MAX_DECOMPRESSED_BYTES",
    "MESSAGE_TYPE_NAMES",
    "TYPE_NAMES",
    "UNPACK_ERRORS",
    "StreamLimits",
    "StreamMessage",
    "buffer_full",
    "compress_message",
    "decode_message",
    "decode_push_pull_header",
    "decode_push_state",
    "decode_small_stream",
    "decode_user_header",
    "decompress_body",
    "decompress_stream",
    "encode_message",
    "encode_push_pull",
    "encode_push_pull_parts",
    "encode_push_state",
    "encode_user_stream",
    "gossip_cache_len",
    "message_type_name",
    "parse_plain_stream",
    "stream_kind",
    "type_name",
]

MAX_DECOMPRESSED_BYTES = 2 * 20 * 1024 * 1024
"""net.go ``maxDecompressedBytes``."""
_LZW_ALGO = 0


def encode_message(msg: Message) -> bytes:
    """``[type byte][msgpack body]`` for one packet message."""
    if isinstance(msg, UserMsg):
        return bytes([MsgType.USER]) + msg.payload
    return _TYPE_BYTE[type(msg)] + _ENCODE[type(msg)](msg)


_TYPE_BYTE = {cls: bytes([kind]) for cls, kind in TYPE_OF.items()}
_ENCODE = {cls: compile_encoder(FIELDS[cls]) for cls in TYPE_OF}
"""``encode_fields`` of each message type's table (``swim.wire.compiled``)."""
_DECODE = {cls: compile_decoder(FIELDS[cls], cls) for cls in TYPE_OF}
"""``cls(**decode_fields(FIELDS[cls], obj))`` of each message type (``swim.wire.compiled``)."""


def decode_message(data: bytes) -> Message:
    """One message from ``[type byte][body]``; compound/compress/crc are not handled here."""
    if not data:
        raise WireError(DropReason.EMPTY, "missing message type byte")
    kind, body = data[0], data[1:]
    if kind == MsgType.USER:
        return UserMsg(bytes(body))
    cls = CLASS_OF.get(kind)  # type: ignore[call-overload]
    if cls is None:
        if kind in MsgType._value2member_map_:
            raise WireError(DropReason.UNEXPECTED_TYPE, f"message type {kind} not valid here")
        raise WireError(DropReason.UNKNOWN_TYPE, f"unknown message type {kind}")
    gossip = kind in _GOSSIP_TYPES
    if gossip:
        cached = _GOSSIP_CACHE.get(data)
        if cached is not None:
            return cached
    msg: Message = _DECODE[cls](unpack_one(body))
    if gossip:
        # A broadcast arrives up to retransmit-limit times per member, as the same bytes;
        # messages are frozen, so decoding them once is safe. Bounded: cleared when full.
        if len(_GOSSIP_CACHE) >= GOSSIP_CACHE_ENTRIES:
            _GOSSIP_CACHE.clear()
        _GOSSIP_CACHE[bytes(data)] = msg
    return msg


GOSSIP_CACHE_ENTRIES = 4096
"""Decoded alive/suspect/dead messages remembered by their bytes (a pure-function memo)."""
_GOSSIP_TYPES = frozenset((MsgType.ALIVE, MsgType.SUSPECT, MsgType.DEAD))
_GOSSIP_CACHE: dict[bytes, Message] = {}


def gossip_cache_len() -> int:
    """How many decoded broadcasts the memo holds (for tests and metrics)."""
    return len(_GOSSIP_CACHE)


def _type_label(kind: int) -> str:
    member = MsgType._value2member_map_.get(kind)
    return member.name.lower() if isinstance(member, MsgType) else f"type_{kind}"


TYPE_NAMES: tuple[str, ...] = tuple(_type_label(kind) for kind in range(256))
"""``type_name`` of each type byte, as a tuple to index (hot paths count per message)."""
_MESSAGE_TYPE_NAMES: dict[type, str] = {
    **{cls: TYPE_NAMES[kind] for cls, kind in TYPE_OF.items()},
    UserMsg: "user",
}


def type_name(kind: int) -> str:
    """Lower-case name of a message type byte, for counters."""
    return TYPE_NAMES[kind] if 0 <= kind < 256 else _type_label(kind)


MESSAGE_TYPE_NAMES: Mapping[type, str] = MappingProxyType(_MESSAGE_TYPE_NAMES)
"""``message_type_name`` as a mapping from the message's class (counted per message)."""


def message_type_name(msg: Message) -> str:
    """The wire type name of a decoded message (``ping``, ``indirect_ping``, ``user``…)."""
    return _MESSAGE_TYPE_NAMES[type(msg)]


# --- compression --------------------------------------------------------------------------


def compress_message(data: bytes) -> bytes:
    """util.go ``compressPayload``: ``[9]`` + msgpack ``{Algo: 0, Buf: lzw(data)}``."""
    return bytes([MsgType.COMPRESS]) + pack({"Algo": _LZW_ALGO, "Buf": lzw.compress(data)})


def decompress_body(body: bytes, max_bytes: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """The payload inside a compress message (bytes after the type byte)."""
    return _decompress_obj(unpack_one(body), max_bytes)


def _decompress_obj(obj: Any, max_bytes: int) -> bytes:
    if not isinstance(obj, dict):
        raise WireError(DropReason.MALFORMED, "compress body is not a map")
    algo = obj.get(b"Algo", 0)
    buf = obj.get(b"Buf", b"")
    if algo != _LZW_ALGO:
        raise WireError(DropReason.DECOMPRESS_FAILED, f"unknown compression algorithm {algo!r}")
    if not isinstance(buf, bytes):
        raise WireError(DropReason.MALFORMED, "compress Buf must be bytes")
    try:
        return lzw.decompress(buf, max_bytes)
    except lzw.LZWError as exc:
        raise WireError(DropReason.DECOMPRESS_FAILED, str(exc)) from exc


# --- stream message bodies ------------------------------------------------------------------


def encode_push_pull(pp: PushPull) -> bytes:
    """net.go ``sendLocalState``: ``[6]`` header, each node state, then raw user state."""
    states = [encode_push_state(state) for state in pp.nodes]
    return encode_push_pull_parts(pp.join, len(states), states, pp.user_state)


def encode_push_state(state: PushNodeState) -> bytes:
    """One node state of a push-pull (a msgpack map)."""
    return _encode_push_state(state)


_encode_push_state = compile_encoder(FIELDS[PushNodeState])


def encode_push_pull_parts(
    join: bool, count: int, states: Sequence[bytes], user_state: bytes
) -> bytes:
    """``encode_push_pull`` from ``count`` node states already encoded with
    ``encode_push_state`` (empty parts are allowed and stand for nothing)."""
    header = encode_fields(
        HEADER_FIELDS,
        {"nodes": count, "user_state_len": len(user_state), "join": join}.get,
    )
    return b"".join([bytes([MsgType.PUSH_PULL]), header, *states, user_state])


def encode_user_stream(payload: bytes) -> bytes:
    """net.go ``sendUserMsg``: ``[8]`` + msgpack ``{UserMsgLen}`` + payload."""
    return bytes([MsgType.USER]) + pack({"UserMsgLen": len(payload)}) + payload


StreamMessage = Ping | Ack | ErrResp | PushPull | UserMsg


@dataclass(frozen=True, slots=True)
class StreamLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_nodes: int = 65_536
    max_user_bytes: int = 20 * 1024 * 1024


def parse_plain_stream(
    data: bytes, limits: StreamLimits, allow_compress: bool
) -> tuple[StreamMessage, int] | None:
    kind = stream_kind(data[0], allow_compress)
    if kind == MsgType.COMPRESS:
        return _parse_compressed_stream(data, limits)
    if kind == MsgType.PUSH_PULL:
        return _parse_push_pull(data, limits)
    if kind == MsgType.USER:
        return _parse_user_stream(data, limits)
    obj, used = _unpack_prefix(data, 1, limits)
    if obj is _MORE:
        return None
    return decode_small_stream(kind, obj), used


# The steps below are shared by the one-shot parsers here and the incremental
# ``swim.wire.decoder.StreamDecoder``, so both validate alike.

UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException)
"""What msgpack raises for bytes that are not (allowed) msgpack; read as MALFORMED."""


def stream_kind(kind: int, allow_compress: bool) -> MsgType:
    """The type byte that opens a plain stream, or UNEXPECTED_TYPE."""
    if kind in _STREAM_KINDS and (allow_compress or kind != MsgType.COMPRESS):
        return MsgType(kind)
    raise WireError(DropReason.UNEXPECTED_TYPE, f"message type {kind} not valid on a stream")


_STREAM_KINDS = frozenset(
    (MsgType.COMPRESS, MsgType.PUSH_PULL, MsgType.USER, MsgType.PING, MsgType.ACK, MsgType.ERR)
)


def decode_small_stream(kind: MsgType, obj: Any) -> StreamMessage:
    """A ping, ack or error response from its msgpack body."""
    msg: StreamMessage = _DECODE[CLASS_OF[kind]](obj)
    return msg


def buffer_full(exc: msgpack.BufferFull) -> WireError:
    """An unpacker's buffer (``max_bytes``) overflowed: the stream is too long."""
    return WireError(DropReason.OVERSIZED, f"stream exceeds the limit: {exc!r}")


def decompress_stream(obj: Any, limits: StreamLimits) -> StreamMessage:
    """The message inside a compressed stream's ``{Algo, Buf}`` map (parsed one-shot)."""
    plain = _decompress_obj(obj, min(limits.max_bytes * 2, MAX_DECOMPRESSED_BYTES))
    if not plain:
        raise WireError(DropReason.MALFORMED, "decompressed stream is empty")
    parsed = parse_plain_stream(plain, limits, allow_compress=False)
    if parsed is None:
        raise WireError(DropReason.MALFORMED, "compressed stream holds a partial message")
    return parsed[0]


def decode_push_pull_header(obj: Any, limits: StreamLimits) -> tuple[int, int, bool]:
    """``(nodes, user_state_len, join)`` of a push-pull header, refused over the limits."""
    header = decode_fields(HEADER_FIELDS, obj)
    if header["nodes"] > limits.max_nodes:
        raise WireError(DropReason.OVERSIZED, f"push-pull claims {header['nodes']} nodes")
    if header["user_state_len"] > limits.max_user_bytes:
        raise WireError(DropReason.OVERSIZED, "push-pull user state exceeds limit")
    return header["nodes"], header["user_state_len"], header["join"]


def decode_push_state(raw: Any) -> PushNodeState:
    """One push-pull node state from its msgpack map."""
    values = decode_fields(FIELDS[PushNodeState], raw)
    if values["state"] not in NodeStateType._value2member_map_:
        raise WireError(DropReason.MALFORMED, f"unknown node state {values['state']}")
    values["state"] = NodeStateType(values["state"])
    return PushNodeState(**values)


def decode_user_header(obj: Any, limits: StreamLimits) -> int:
    """The payload length a user-message stream announces, refused over the limit."""
    length: int = decode_fields(USER_HEADER_FIELDS, obj)["length"]
    if length > limits.max_user_bytes:
        raise WireError(DropReason.OVERSIZED, f"user message claims {length} bytes")
    return length


_MORE = object()


def _unpack_prefix(data: bytes, offset: int, limits: StreamLimits) -> tuple[Any, int]:
    """The msgpack object at ``offset``, or ``_MORE`` if it is not complete yet."""
    unpacker = new_unpacker(limits.max_bytes)
    try:
        unpacker.feed(data[offset:])
        obj = unpacker.unpack()
    except msgpack.OutOfData:
        check_declared_lengths(data[offset : offset + HEAD_SCAN_BYTES], limits.max_bytes)
        return _MORE, 0
    except msgpack.BufferFull as exc:
        raise buffer_full(exc) from exc
    except UNPACK_ERRORS as exc:
        raise WireError(DropReason.MALFORMED, f"bad msgpack: {exc}") from exc
    return obj, offset + unpacker.tell()


def _parse_compressed_stream(data: bytes, limits: StreamLimits) -> tuple[StreamMessage, int] | None:
    obj, used = _unpack_prefix(data, 1, limits)
    if obj is _MORE:
        return None
    return decompress_stream(obj, limits), used


def _parse_push_pull(data: bytes, limits: StreamLimits) -> tuple[StreamMessage, int] | None:
    obj, offset = _unpack_prefix(data, 1, limits)
    if obj is _MORE:
        return None
    nodes, user_state_len, join = decode_push_pull_header(obj, limits)
    unpacker = new_unpacker(limits.max_bytes)
    try:
        unpacker.feed(data[offset:])
    except msgpack.BufferFull as exc:
        raise buffer_full(exc) from exc
    states: list[PushNodeState] = []
    for _ in range(nodes):
        try:
            raw = unpacker.unpack()
        except msgpack.OutOfData:
            return None
        except UNPACK_ERRORS as exc:
            raise WireError(DropReason.MALFORMED, f"bad node state: {exc}") from exc
        states.append(decode_push_state(raw))
    offset += unpacker.tell()
    end = offset + user_state_len
    if len(data) < end:
        return None
    pp = PushPull(join=join, nodes=tuple(states), user_state=bytes(data[offset:end]))
    return pp, end


def _parse_user_stream(data: bytes, limits: StreamLimits) -> tuple[StreamMessage, int] | None:
    obj, offset = _unpack_prefix(data, 1, limits)
    if obj is _MORE:
        return None
    length = decode_user_header(obj, limits)
    if len(data) < offset + length:
        return None
    return UserMsg(bytes(data[offset : offset + length])), offset + length
