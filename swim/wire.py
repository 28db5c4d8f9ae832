"""The one module that encodes and decodes memberlist's wire format (protocol versions 2–5).

Rules:
- A packet is ``[type byte][msgpack body]``; bodies are msgpack maps keyed by memberlist's Go
  field names, encoded as hashicorp/go-msgpack does (checked byte for byte against serf
  captures in tests/golden/serf): keys sorted by name, strings and ``[]byte`` as raw (str)
  types without str8, nil for empty byte slices, ``omitempty`` fields left out, integers in
  their shortest unsigned form. Decoding is lenient where Go is (unknown keys ignored, missing keys
  are zero values, bin or str accepted for bytes) and strict where safety needs it (types,
  integer ranges, sizes).
- Layers on send (net.go ``sendMsg``/``rawSendMsgPacket``): message → compound (piggyback)
  → LZW compress if smaller → CRC32 header when the receiver speaks ≥ 5 → AES-GCM. Receive
  undoes them in reverse; each compound part is handled on its own so one bad part does not
  drop its neighbours.
- Streams (push-pull, TCP fallback ping, user messages): the message is always compressed
  when compression is on, then encrypted with a 4-byte length frame. ``parse_stream`` is
  incremental: it says "need more bytes" until one whole message has arrived, and never
  accepts more than its byte bound.
- Every failure raises ``WireError`` carrying a ``DropReason``; nothing else escapes.

Sources: hashicorp/memberlist @ 1b4c746 net.go, util.go (``encode``, ``decode``,
``makeCompoundMessage``, ``decodeCompoundMessage``, ``compressPayload``), security.go.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from swim import lzw, security
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

COMPOUND_HEADER_OVERHEAD = 2
"""net.go ``compoundHeaderOverhead``: assumed bytes for a compound header."""
COMPOUND_OVERHEAD = 2
"""net.go ``compoundOverhead``: bytes per part in a compound header."""
CRC_OVERHEAD = 5
"""net.go: type byte plus a big-endian CRC32 for receivers that speak protocol ≥ 5."""
USER_MSG_OVERHEAD = 1
"""net.go ``userMsgOverhead``: the type byte of a piggybacked user message."""
MAX_COMPOUND_PARTS = 255
"""A compound header counts its parts in one byte."""
MAX_DECOMPRESSED_BYTES = 2 * 20 * 1024 * 1024
"""net.go ``maxDecompressedBytes``."""
MAX_NESTING = 4
"""Compound/compress layers we unwrap; memberlist recurses without a bound."""
MIN_COMPRESS_BYTES = 128
"""Packets shorter than this are sent uncompressed without trying. memberlist (net.go
``rawSendMsgPacket``) compresses every packet and keeps the result only if it is smaller;
receivers take either form (net.go ``handleCommand`` dispatches ``compressMsg`` and plain
messages alike), so skipping a compression that cannot pay is interoperable. LZW's fixed
cost (CLEAR and EOF codes, 9-bit codes, the msgpack ``{Algo, Buf}`` wrapper: ~17 bytes)
makes small packets grow: in a 100-node run with failures the smallest packet that
compression shrank was 134 bytes, by a few bytes. Pure-Python LZW was the top cost per
packet (pings and acks are 10–70 bytes)."""
_LZW_ALGO = 0


class DropReason(Enum):
    """Why an input was dropped; the node counts each one."""

    EMPTY = "empty"
    DECRYPT_FAILED = "decrypt_failed"
    NOT_ENCRYPTED = "not_encrypted"
    BAD_CRC = "bad_crc"
    MALFORMED = "malformed"
    UNKNOWN_TYPE = "unknown_type"
    TRUNCATED_COMPOUND = "truncated_compound"
    DECOMPRESS_FAILED = "decompress_failed"
    TOO_DEEP = "too_deep"
    OVERSIZED = "oversized"
    UNEXPECTED_TYPE = "unexpected_type"
    WRONG_NODE = "wrong_node"
    INVALID_VERSION = "invalid_version"
    REJECTED = "rejected"
    QUEUE_FULL = "queue_full"
    LIMIT = "limit"


class WireError(ValueError):
    """Input that cannot be decoded; ``reason`` says why."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


# --- field tables -------------------------------------------------------------------------


# kind: u8/u16/u32 (unsigned of that width), int (Go int, ≥ 0 here), str, bytes, bool
# nil_if_empty: Go would hold a nil slice there, which go-msgpack writes as msgpack nil
@dataclass(frozen=True, slots=True)
class _Field:
    go: str
    attr: str
    kind: str
    omitempty: bool = False
    nil_if_empty: bool = False
    key: bytes = b""
    """``go`` as the msgpack map key bytes."""


def _f(go: str, attr: str, kind: str, omit: bool = False, nil: bool = False) -> _Field:
    return _Field(go, attr, kind, omit, nil, go.encode())


_SOURCE = (
    _f("SourceAddr", "source_addr", "bytes", omit=True),
    _f("SourcePort", "source_port", "u16", omit=True),
    _f("SourceNode", "source_node", "str", omit=True),
)
_FIELDS: dict[type, tuple[_Field, ...]] = {
    Ping: (_f("SeqNo", "seq_no", "u32"), _f("Node", "node", "str"), *_SOURCE),
    IndirectPing: (
        _f("SeqNo", "seq_no", "u32"),
        _f("Target", "target", "bytes", nil=True),
        _f("Port", "port", "u16"),
        _f("Node", "node", "str"),
        _f("Nack", "nack", "bool"),
        *_SOURCE,
    ),
    Ack: (_f("SeqNo", "seq_no", "u32"), _f("Payload", "payload", "bytes", nil=True)),
    Nack: (_f("SeqNo", "seq_no", "u32"),),
    ErrResp: (_f("Error", "error", "str"),),
    Suspect: (
        _f("Incarnation", "incarnation", "u32"),
        _f("Node", "node", "str"),
        _f("From", "sender", "str"),
    ),
    Alive: (
        _f("Incarnation", "incarnation", "u32"),
        _f("Node", "node", "str"),
        _f("Addr", "addr", "bytes", nil=True),
        _f("Port", "port", "u16"),
        _f("Meta", "meta", "bytes", nil=True),
        _f("Vsn", "vsn", "bytes", nil=True),
    ),
    Dead: (
        _f("Incarnation", "incarnation", "u32"),
        _f("Node", "node", "str"),
        _f("From", "sender", "str"),
    ),
    PushNodeState: (
        _f("Name", "name", "str"),
        _f("Addr", "addr", "bytes", nil=True),
        _f("Port", "port", "u16"),
        _f("Meta", "meta", "bytes", nil=True),
        _f("Incarnation", "incarnation", "u32"),
        _f("State", "state", "int"),
        _f("Vsn", "vsn", "bytes", nil=True),
    ),
}
_TYPE_OF: dict[type, MsgType] = {
    Ping: MsgType.PING,
    IndirectPing: MsgType.INDIRECT_PING,
    Ack: MsgType.ACK,
    Nack: MsgType.NACK,
    ErrResp: MsgType.ERR,
    Suspect: MsgType.SUSPECT,
    Alive: MsgType.ALIVE,
    Dead: MsgType.DEAD,
}
_CLASS_OF: dict[MsgType, type] = {t: c for c, t in _TYPE_OF.items()}
_HEADER_FIELDS = (
    _f("Nodes", "nodes", "int"),
    _f("UserStateLen", "user_state_len", "int"),
    _f("Join", "join", "bool"),
)
_USER_HEADER_FIELDS = (_f("UserMsgLen", "length", "int"),)
_ZERO: dict[str, Any] = {
    "u8": 0,
    "u16": 0,
    "u32": 0,
    "int": 0,
    "str": "",
    "bytes": b"",
    "bool": False,
}
_UNSIGNED_MAX = {"u8": 0xFF, "u16": 0xFFFF, "u32": 0xFFFF_FFFF, "int": 2**63 - 1}


# --- msgpack helpers ----------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    # use_bin_type=False: []byte and string both go out as raw str types without str8,
    # which is what hashicorp/go-msgpack writes (WriteExt off).
    return msgpack.packb(obj, use_bin_type=False)  # type: ignore[no-any-return]


MAX_ARRAY_LEN = 1024
"""Longest msgpack array accepted from the wire (both decoders share the bound)."""
MAX_MAP_LEN = 64
"""Most keys in one msgpack map accepted from the wire."""


def _unpacker(max_bytes: int) -> msgpack.Unpacker:
    return msgpack.Unpacker(
        raw=True,
        strict_map_key=False,
        max_buffer_size=max_bytes,
        max_str_len=max_bytes,
        max_bin_len=max_bytes,
        max_array_len=MAX_ARRAY_LEN,
        max_map_len=MAX_MAP_LEN,
        max_ext_len=0,
    )


def _unpack_one(body: bytes) -> Any:
    """Decode the first msgpack object of ``body``; trailing bytes are ignored, as Go does."""
    size = max(len(body), 1)
    try:
        # The same limits as _unpacker, spelled out: msgpack's keyword fast path makes this
        # 0.50 µs per call against 0.82 µs with **shared_kwargs (measured), once per message.
        return msgpack.unpackb(
            body,
            raw=True,
            strict_map_key=False,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except msgpack.ExtraData as extra:  # a whole object, then trailing bytes
        return extra.unpacked
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(DropReason.MALFORMED, f"bad msgpack: {exc}") from exc


_Plan = tuple[tuple[str, str, bool, bool, bool], ...]
_PLANS: dict[tuple[_Field, ...], _Plan] = {}


def _plan(fields: Sequence[_Field]) -> _Plan:
    """(go name, attr, is str, omitempty, nil_if_empty) per field, sorted by go name, as
    go-msgpack writes struct fields (seen in every serf capture), not in declaration order;
    the tables are in declaration order for readability. Computed once per table."""
    key = tuple(fields)
    plan = _PLANS.get(key)
    if plan is None:
        plan = tuple(
            (f.go, f.attr, f.kind == "str", f.omitempty, f.nil_if_empty)
            for f in sorted(fields, key=lambda f: f.go)
        )
        _PLANS[key] = plan
    return plan


def _encode_fields(fields: Sequence[_Field], values: Callable[[str], Any]) -> bytes:
    out: dict[str, Any] = {}
    for go, attr, is_str, omitempty, nil_if_empty in _plan(fields):
        value = values(attr)
        if is_str:
            value = value.encode("utf-8", "surrogateescape")
        if not value:
            if omitempty:
                continue
            if nil_if_empty:
                value = None
        out[go] = value
    return _pack(out)


def _decode_value(field: _Field, value: Any) -> Any:
    kind = field.kind
    if value is None:
        return _ZERO[kind]
    if kind in _UNSIGNED_MAX:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(DropReason.MALFORMED, f"{field.go} must be an integer")
        if not 0 <= value <= _UNSIGNED_MAX[kind]:
            raise WireError(DropReason.MALFORMED, f"{field.go}={value} is out of range")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise WireError(DropReason.MALFORMED, f"{field.go} must be a bool")
        return value
    if not isinstance(value, bytes):
        raise WireError(DropReason.MALFORMED, f"{field.go} must be a string or bytes")
    if kind == "str":
        return value.decode("utf-8", "surrogateescape")
    return value


def _decode_fields(fields: Sequence[_Field], obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WireError(DropReason.MALFORMED, "message body is not a map")
    result: dict[str, Any] = {}
    get = obj.get
    for field in fields:
        value = get(field.key)
        kind = field.kind
        # fast paths for well-formed values; everything else goes the careful way
        if kind == "str" and type(value) is bytes:
            result[field.attr] = value.decode("utf-8", "surrogateescape")
        elif (kind == "bytes" and type(value) is bytes) or (
            type(value) is int and 0 <= value <= _UNSIGNED_MAX.get(kind, -1)
        ):
            result[field.attr] = value
        else:
            result[field.attr] = _decode_value(field, value)
    return result


# --- single messages ----------------------------------------------------------------------


def encode_message(msg: Message) -> bytes:
    """``[type byte][msgpack body]`` for one packet message."""
    if isinstance(msg, UserMsg):
        return bytes([MsgType.USER]) + msg.payload
    fields = _FIELDS[type(msg)]
    return bytes([_TYPE_OF[type(msg)]]) + _encode_fields(fields, lambda a: getattr(msg, a))


def decode_message(data: bytes) -> Message:
    """One message from ``[type byte][body]``; compound/compress/crc are not handled here."""
    if not data:
        raise WireError(DropReason.EMPTY, "missing message type byte")
    kind, body = data[0], data[1:]
    if kind == MsgType.USER:
        return UserMsg(bytes(body))
    cls = _CLASS_OF.get(kind)  # type: ignore[call-overload]
    if cls is None:
        if kind in MsgType._value2member_map_:
            raise WireError(DropReason.UNEXPECTED_TYPE, f"message type {kind} not valid here")
        raise WireError(DropReason.UNKNOWN_TYPE, f"unknown message type {kind}")
    gossip = kind in _GOSSIP_TYPES
    if gossip:
        cached = _GOSSIP_CACHE.get(data)
        if cached is not None:
            return cached
    values = _decode_fields(_FIELDS[cls], _unpack_one(body))
    msg: Message = cls(**values)
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


_TYPE_NAMES = tuple(_type_label(kind) for kind in range(256))
_MESSAGE_TYPE_NAMES: dict[type, str] = {
    **{cls: _TYPE_NAMES[kind] for cls, kind in _TYPE_OF.items()},
    UserMsg: "user",
}


def type_name(kind: int) -> str:
    """Lower-case name of a message type byte, for counters."""
    return _TYPE_NAMES[kind] if 0 <= kind < 256 else _type_label(kind)


def message_type_name(msg: Message) -> str:
    """The wire type name of a decoded message (``ping``, ``indirect_ping``, ``user``…)."""
    return _MESSAGE_TYPE_NAMES[type(msg)]


# --- compound, compression, crc -----------------------------------------------------------


def make_compound(parts: Sequence[bytes]) -> bytes:
    """util.go ``makeCompoundMessage``: ``[7][count][uint16 BE lengths…][parts…]``."""
    if not 1 <= len(parts) <= MAX_COMPOUND_PARTS:
        raise ValueError(f"a compound holds 1..{MAX_COMPOUND_PARTS} parts, got {len(parts)}")
    for part in parts:
        if len(part) > 0xFFFF:
            raise ValueError(f"a compound part is at most 65535 bytes, got {len(part)}")
    header = struct.pack(f">BB{len(parts)}H", MsgType.COMPOUND, len(parts), *map(len, parts))
    return header + b"".join(parts)


def split_compound(body: bytes) -> tuple[list[bytes], int]:
    """util.go ``decodeCompoundMessage`` on the bytes after the type byte.

    Returns the parts that are whole and the number of truncated ones.
    """
    if len(body) < 1:
        raise WireError(DropReason.MALFORMED, "missing compound length byte")
    count = body[0]
    if len(body) < 1 + 2 * count:
        raise WireError(DropReason.MALFORMED, "truncated compound length table")
    lengths = struct.unpack_from(f">{count}H", body, 1)
    offset = 1 + 2 * count
    parts: list[bytes] = []
    for index, length in enumerate(lengths):
        if len(body) - offset < length:
            return parts, count - index
        parts.append(body[offset : offset + length])
        offset += length
    return parts, 0


def compress_message(data: bytes) -> bytes:
    """util.go ``compressPayload``: ``[9]`` + msgpack ``{Algo: 0, Buf: lzw(data)}``."""
    return bytes([MsgType.COMPRESS]) + _pack({"Algo": _LZW_ALGO, "Buf": lzw.compress(data)})


def decompress_body(body: bytes, max_bytes: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """The payload inside a compress message (bytes after the type byte)."""
    return _decompress_obj(_unpack_one(body), max_bytes)


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


def add_crc(data: bytes) -> bytes:
    """net.go: ``[12][crc32 IEEE BE][data]`` for receivers that speak protocol ≥ 5."""
    return struct.pack(">BI", MsgType.HAS_CRC, zlib.crc32(data)) + data


# --- packets ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodedPacket:
    """Messages recovered from one datagram and the reasons for any parts dropped."""

    messages: tuple[Message, ...]
    drops: tuple[DropReason, ...]


@dataclass(frozen=True, slots=True)
class Crypto:
    """Encryption settings for a codec call: keys (primary first), label, nonce source.

    ``verify_incoming``/``verify_outgoing`` are memberlist's ``GossipVerifyIncoming`` and
    ``GossipVerifyOutgoing``: with ``verify_incoming`` off, plain streams are accepted and a
    packet no key authenticates is read as plaintext; with ``verify_outgoing`` off,
    nothing is encrypted."""

    keyring: security.Keyring
    nonce: Callable[[int], bytes]
    version: int = 1
    label: bytes = b""
    verify_incoming: bool = True
    verify_outgoing: bool = True


def decode_packet(data: bytes, crypto: Crypto | None) -> DecodedPacket:
    """Undo encryption and the CRC header, then unpack compound and compressed layers."""
    if not data:
        raise WireError(DropReason.EMPTY, "empty packet")
    if crypto is not None:
        try:
            data = security.decrypt_payload(crypto.keyring.keys, data, crypto.label)
        except security.DecryptError as exc:
            if crypto.verify_incoming:
                raise WireError(DropReason.DECRYPT_FAILED, str(exc)) from exc
            # net.go ingestPacket: without GossipVerifyIncoming, treat it as plaintext
    if len(data) >= 5 and data[0] == MsgType.HAS_CRC:
        (expected,) = struct.unpack_from(">I", data, 1)
        data = data[5:]
        if zlib.crc32(data) != expected:
            raise WireError(DropReason.BAD_CRC, "invalid checksum")
    messages: list[Message] = []
    drops: list[DropReason] = []
    _unwrap(data, 0, messages, drops)
    return DecodedPacket(tuple(messages), tuple(drops))


def _unwrap(data: bytes, depth: int, messages: list[Message], drops: list[DropReason]) -> None:
    try:
        if not data:
            raise WireError(DropReason.EMPTY, "missing message type byte")
        if data[0] in (MsgType.COMPOUND, MsgType.COMPRESS):
            if depth >= MAX_NESTING:
                raise WireError(DropReason.TOO_DEEP, "too many nested layers")
            if data[0] == MsgType.COMPOUND:
                parts, truncated = split_compound(data[1:])
                drops.extend([DropReason.TRUNCATED_COMPOUND] * truncated)
            else:
                parts = [decompress_body(data[1:], 64 * 1024)]
            for part in parts:
                _unwrap(part, depth + 1, messages, drops)
            return
        messages.append(decode_message(data))
    except WireError as exc:
        drops.append(exc.reason)


def encode_packet(
    parts: Sequence[bytes],
    *,
    compress: bool,
    crc: bool,
    crypto: Crypto | None,
) -> bytes:
    """One datagram from encoded messages: the first is the message, the rest piggyback."""
    data = parts[0] if len(parts) == 1 else make_compound(parts)
    if compress and len(data) >= MIN_COMPRESS_BYTES:
        compressed = compress_message(data)
        if len(compressed) < len(data):
            data = compressed
    if crc:
        data = add_crc(data)
    if crypto is not None and crypto.verify_outgoing:
        data = security.encrypt_payload(
            crypto.version,
            crypto.keyring.primary_key,
            data,
            crypto.label,
            crypto.nonce(security.NONCE_SIZE),
        )
    return data


def packet_overhead(crypto: Crypto | None) -> int:
    """Bytes a packet loses to framing before piggybacking (net.go ``sendMsg``)."""
    overhead = COMPOUND_HEADER_OVERHEAD
    if crypto is not None and crypto.verify_outgoing:
        overhead += security.encrypt_overhead(crypto.version)
    return overhead


# --- streams ------------------------------------------------------------------------------


def encode_push_pull(pp: PushPull) -> bytes:
    """net.go ``sendLocalState``: ``[6]`` header, each node state, then raw user state."""
    states = [encode_push_state(state) for state in pp.nodes]
    return encode_push_pull_parts(pp.join, len(states), states, pp.user_state)


def encode_push_state(state: PushNodeState) -> bytes:
    """One node state of a push-pull (a msgpack map)."""
    return _encode_fields(_FIELDS[PushNodeState], state.__getattribute__)


def encode_push_pull_parts(
    join: bool, count: int, states: Sequence[bytes], user_state: bytes
) -> bytes:
    """``encode_push_pull`` from ``count`` node states already encoded with
    ``encode_push_state`` (empty parts are allowed and stand for nothing)."""
    header = _encode_fields(
        _HEADER_FIELDS,
        {"nodes": count, "user_state_len": len(user_state), "join": join}.get,
    )
    return b"".join([bytes([MsgType.PUSH_PULL]), header, *states, user_state])


def encode_user_stream(payload: bytes) -> bytes:
    """net.go ``sendUserMsg``: ``[8]`` + msgpack ``{UserMsgLen}`` + payload."""
    return bytes([MsgType.USER]) + _pack({"UserMsgLen": len(payload)}) + payload


def encode_stream(message: bytes, *, compress: bool, crypto: Crypto | None) -> bytes:
    """net.go ``rawSendMsgStream``: compress whenever enabled, then encrypt with a frame."""
    if compress:
        message = compress_message(message)
    if crypto is not None and crypto.verify_outgoing:
        message = security.encrypt_stream(
            crypto.version,
            crypto.keyring.primary_key,
            message,
            crypto.label,
            crypto.nonce(security.NONCE_SIZE),
        )
    return message


StreamMessage = Ping | Ack | ErrResp | PushPull | UserMsg


@dataclass(frozen=True, slots=True)
class StreamLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_nodes: int = 65_536
    max_user_bytes: int = 20 * 1024 * 1024


def parse_stream(
    data: bytes, crypto: Crypto | None, limits: StreamLimits
) -> tuple[StreamMessage, int] | None:
    """One message from the start of a stream, or None while more bytes are needed.

    Returns the message and the number of stream bytes it used. Raises ``WireError`` as
    soon as the bytes cannot become a valid message, including when a header announces
    more than the limits allow: a hostile peer cannot make us buffer past the bound.
    """
    if len(data) > limits.max_bytes + 5:
        raise WireError(DropReason.OVERSIZED, f"stream exceeds {limits.max_bytes} bytes")
    if not data:
        return None
    if data[0] == MsgType.ENCRYPT:
        return _parse_encrypted_stream(data, crypto, limits)
    if crypto is not None and crypto.verify_incoming:
        raise WireError(DropReason.NOT_ENCRYPTED, "encryption is on but the stream is plain")
    return _parse_plain_stream(data, limits, allow_compress=True)


def _parse_encrypted_stream(
    data: bytes, crypto: Crypto | None, limits: StreamLimits
) -> tuple[StreamMessage, int] | None:
    if crypto is None:
        raise WireError(DropReason.DECRYPT_FAILED, "stream is encrypted, encryption is off")
    if len(data) < 5:
        return None
    (length,) = struct.unpack_from(">I", data, 1)
    if length > limits.max_bytes:
        raise WireError(DropReason.OVERSIZED, f"encrypted stream claims {length} bytes")
    if len(data) < 5 + length:
        return None
    try:
        plain = security.decrypt_stream_body(
            crypto.keyring.keys, data[:5], data[5 : 5 + length], crypto.label
        )
    except security.DecryptError as exc:
        raise WireError(DropReason.DECRYPT_FAILED, str(exc)) from exc
    if not plain:  # an authentic but empty payload (it raised IndexError, found by fuzzing)
        raise WireError(DropReason.EMPTY, "encrypted stream holds no message")
    parsed = _parse_plain_stream(plain, limits, allow_compress=True)
    if parsed is None:
        raise WireError(DropReason.MALFORMED, "encrypted stream holds a partial message")
    return parsed[0], 5 + length


def _parse_plain_stream(
    data: bytes, limits: StreamLimits, allow_compress: bool
) -> tuple[StreamMessage, int] | None:
    kind = data[0]
    if kind == MsgType.COMPRESS and allow_compress:
        return _parse_compressed_stream(data, limits)
    if kind == MsgType.PUSH_PULL:
        return _parse_push_pull(data, limits)
    if kind == MsgType.USER:
        return _parse_user_stream(data, limits)
    if kind in (MsgType.PING, MsgType.ACK, MsgType.ERR):
        obj, used = _unpack_prefix(data, 1, limits)
        if obj is _MORE:
            return None
        cls = _CLASS_OF[MsgType(kind)]
        msg: StreamMessage = cls(**_decode_fields(_FIELDS[cls], obj))
        return msg, used
    raise WireError(DropReason.UNEXPECTED_TYPE, f"message type {kind} not valid on a stream")


_MORE = object()


def _unpack_prefix(data: bytes, offset: int, limits: StreamLimits) -> tuple[Any, int]:
    """The msgpack object at ``offset``, or ``_MORE`` if it is not complete yet."""
    unpacker = _unpacker(limits.max_bytes)
    unpacker.feed(data[offset:])
    try:
        obj = unpacker.unpack()
    except msgpack.OutOfData:
        return _MORE, 0
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(DropReason.MALFORMED, f"bad msgpack: {exc}") from exc
    return obj, offset + unpacker.tell()


def _parse_compressed_stream(data: bytes, limits: StreamLimits) -> tuple[StreamMessage, int] | None:
    obj, used = _unpack_prefix(data, 1, limits)
    if obj is _MORE:
        return None
    plain = _decompress_obj(obj, min(limits.max_bytes * 2, MAX_DECOMPRESSED_BYTES))
    if not plain:
        raise WireError(DropReason.MALFORMED, "decompressed stream is empty")
    parsed = _parse_plain_stream(plain, limits, allow_compress=False)
    if parsed is None:
        raise WireError(DropReason.MALFORMED, "compressed stream holds a partial message")
    return parsed[0], used


def _parse_push_pull(data: bytes, limits: StreamLimits) -> tuple[StreamMessage, int] | None:
    obj, offset = _unpack_prefix(data, 1, limits)
    if obj is _MORE:
        return None
    header = _decode_fields(_HEADER_FIELDS, obj)
    if header["nodes"] > limits.max_nodes:
        raise WireError(DropReason.OVERSIZED, f"push-pull claims {header['nodes']} nodes")
    if header["user_state_len"] > limits.max_user_bytes:
        raise WireError(DropReason.OVERSIZED, "push-pull user state exceeds limit")
    unpacker = _unpacker(limits.max_bytes)
    unpacker.feed(data[offset:])
    states: list[PushNodeState] = []
    fields = _FIELDS[PushNodeState]
    for _ in range(header["nodes"]):
        try:
            raw = unpacker.unpack()
        except msgpack.OutOfData:
            return None
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise WireError(DropReason.MALFORMED, f"bad node state: {exc}") from exc
        values = _decode_fields(fields, raw)
        if values["state"] not in NodeStateType._value2member_map_:
            raise WireError(DropReason.MALFORMED, f"unknown node state {values['state']}")
        values["state"] = NodeStateType(values["state"])
        states.append(PushNodeState(**values))
    offset += unpacker.tell()
    end = offset + header["user_state_len"]
    if len(data) < end:
        return None
    pp = PushPull(join=header["join"], nodes=tuple(states), user_state=bytes(data[offset:end]))
    return pp, end


def _parse_user_stream(data: bytes, limits: StreamLimits) -> tuple[StreamMessage, int] | None:
    obj, offset = _unpack_prefix(data, 1, limits)
    if obj is _MORE:
        return None
    length = _decode_fields(_USER_HEADER_FIELDS, obj)["length"]
    if length > limits.max_user_bytes:
        raise WireError(DropReason.OVERSIZED, f"user message claims {length} bytes")
    if len(data) < offset + length:
        return None
    return UserMsg(bytes(data[offset : offset + length])), offset + length
