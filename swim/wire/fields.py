"""memberlist's message bodies as msgpack maps: one field table per message type, and the
encoder and decoder of a table. Part of ``swim.wire`` (its docstring has the rules).

Rules: keys are memberlist's Go field names written in sorted order, as hashicorp/go-msgpack
writes struct fields; strings and ``[]byte`` go out as raw str types; ``omitempty`` fields
are left out and empty Go slices are nil; integers are checked against their Go width on
the way in. Decoding ignores unknown keys and reads missing ones as zero values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from swim.messages import (
    Ack,
    Alive,
    Dead,
    ErrResp,
    IndirectPing,
    MsgType,
    Nack,
    Ping,
    PushNodeState,
    Suspect,
)
from swim.wire.errors import DropReason, WireError

__all__ = [
    "CLASS_OF",
    "FIELDS",
    "HEADER_FIELDS",
    "MAX_ARRAY_LEN",
    "MAX_MAP_LEN",
    "TYPE_OF",
    "UNSIGNED_MAX",
    "USER_HEADER_FIELDS",
    "Field",
    "decode_fields",
    "decode_value",
    "encode_fields",
    "encoding_plan",
    "new_unpacker",
    "pack",
    "unpack_one",
]


# kind: u8/u16/u32 (unsigned of that width), int (Go int, ≥ 0 here), str, bytes, bool
# nil_if_empty: Go would hold a nil slice there, which go-msgpack writes as msgpack nil
@dataclass(frozen=True, slots=True)
class Field:
    go: str
    attr: str
    kind: str
    omitempty: bool = False
    nil_if_empty: bool = False
    key: bytes = b""
    """``go`` as the msgpack map key bytes."""


def _f(go: str, attr: str, kind: str, omit: bool = False, nil: bool = False) -> Field:
    return Field(go, attr, kind, omit, nil, go.encode())


_SOURCE = (
    _f("SourceAddr", "source_addr", "bytes", omit=True),
    _f("SourcePort", "source_port", "u16", omit=True),
    _f("SourceNode", "source_node", "str", omit=True),
)
FIELDS: dict[type, tuple[Field, ...]] = {
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
TYPE_OF: dict[type, MsgType] = {
    Ping: MsgType.PING,
    IndirectPing: MsgType.INDIRECT_PING,
    Ack: MsgType.ACK,
    Nack: MsgType.NACK,
    ErrResp: MsgType.ERR,
    Suspect: MsgType.SUSPECT,
    Alive: MsgType.ALIVE,
    Dead: MsgType.DEAD,
}
CLASS_OF: dict[MsgType, type] = {t: c for c, t in TYPE_OF.items()}
HEADER_FIELDS = (
    _f("Nodes", "nodes", "int"),
    _f("UserStateLen", "user_state_len", "int"),
    _f("Join", "join", "bool"),
)
USER_HEADER_FIELDS = (_f("UserMsgLen", "length", "int"),)
_ZERO: dict[str, Any] = {
    "u8": 0,
    "u16": 0,
    "u32": 0,
    "int": 0,
    "str": "",
    "bytes": b"",
    "bool": False,
}
UNSIGNED_MAX = {"u8": 0xFF, "u16": 0xFFFF, "u32": 0xFFFF_FFFF, "int": 2**63 - 1}


# --- msgpack helpers ----------------------------------------------------------------------


pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=False).pack
"""msgpack bytes of ``obj``. use_bin_type=False: ``[]byte`` and string both go out as raw
str types without str8, which is what hashicorp/go-msgpack writes (WriteExt off).

One packer for every call: ``msgpack.packb`` builds a new ``Packer`` per call, a third
of the cost of packing a ping. Sharing it is safe: ``Packer.pack`` (autoreset) hands
back the bytes and empties its buffer, empties it on an error too, and runs no Python
code for the plain types we pack, so under the GIL one call cannot interleave with
another."""


MAX_ARRAY_LEN = 1024
"""Longest msgpack array accepted from the wire (both decoders share the bound)."""
MAX_MAP_LEN = 64
"""Most keys in one msgpack map accepted from the wire."""


def new_unpacker(max_bytes: int) -> msgpack.Unpacker:
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


HEAD_SCAN_BYTES = 64
"""How much of a stream's first msgpack object ``check_declared_lengths`` reads: enough for
a header map and a compressed stream's ``{Algo, Buf}`` up to ``Buf``'s length (~20 bytes)."""

_FIXED_SIZES = {
    0xC0: 0, 0xC2: 0, 0xC3: 0,  # nil, false, true
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,  # uint 8..64
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,  # int 8..64
    0xCA: 4, 0xCB: 8,  # float 32, 64
    0xDC: 2, 0xDE: 2, 0xDD: 4, 0xDF: 4,  # array/map 16, 32 headers: the count only
}  # fmt: skip
_LENGTH_SIZES = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}  # str, bin 8..32


def check_declared_lengths(head: bytes | bytearray, max_len: int) -> None:
    """Refuse (OVERSIZED) a string or binary whose header, within ``head``, announces more
    than ``max_len`` bytes. msgpack checks ``max_str_len``/``max_bin_len`` only once the
    whole string has arrived, so a peer announcing 4 GiB and then trickling would hold its
    stream until the deadline; this reads the headers as they come. Walks msgpack tokens
    from the start of ``head`` and stops, saying nothing, at the end of ``head``, at an
    extension or a byte msgpack would refuse itself (the unpacker's error wins)."""
    i, n = 0, len(head)
    while i < n:
        b = head[i]
        if b <= 0x7F or b >= 0xE0 or 0x80 <= b <= 0x9F:  # fixint; fixmap, fixarray header
            i += 1
        elif 0xA0 <= b <= 0xBF:  # fixstr
            i += 1 + (b & 0x1F)
        elif b in _LENGTH_SIZES:
            size = _LENGTH_SIZES[b]
            if i + 1 + size > n:
                return
            length = int.from_bytes(head[i + 1 : i + 1 + size], "big")
            if length > max_len:
                raise WireError(
                    DropReason.OVERSIZED, f"a string of {length} bytes exceeds {max_len}"
                )
            i += 1 + size + length
        elif b in _FIXED_SIZES:
            i += 1 + _FIXED_SIZES[b]
        else:
            return


def unpack_one(body: bytes) -> Any:
    """Decode the first msgpack object of ``body``; trailing bytes are ignored, as Go does."""
    size = max(len(body), 1)
    try:
        # The same limits as new_unpacker, spelled out: msgpack's keyword fast path makes this
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
_PLANS: dict[int, tuple[Sequence[Field], _Plan]] = {}
_MAX_PLANS = 1024
"""Plans remembered; the field tables are module constants, a handful in all."""


def encoding_plan(fields: Sequence[Field]) -> _Plan:
    """(go name, attr, is str, omitempty, nil_if_empty) per field, sorted by go name, as
    go-msgpack writes struct fields (seen in every serf capture), not in declaration order;
    the tables are in declaration order for readability. Computed once per table, found
    again by the table's identity (hashing its fields took five Python-level hash calls per
    encoded message; the entry keeps the table alive, so its id cannot be reused)."""
    entry = _PLANS.get(id(fields))
    if entry is not None and entry[0] is fields:
        return entry[1]
    plan = tuple(
        (f.go, f.attr, f.kind == "str", f.omitempty, f.nil_if_empty)
        for f in sorted(fields, key=lambda f: f.go)
    )
    if len(_PLANS) < _MAX_PLANS:
        _PLANS[id(fields)] = (fields, plan)
    return plan


def encode_fields(fields: Sequence[Field], values: Callable[[str], Any]) -> bytes:
    out: dict[str, Any] = {}
    for go, attr, is_str, omitempty, nil_if_empty in encoding_plan(fields):
        value = values(attr)
        if is_str:
            value = value.encode("utf-8", "surrogateescape")
        if not value:
            if omitempty:
                continue
            if nil_if_empty:
                value = None
        out[go] = value
    return pack(out)


def decode_value(field: Field, value: Any) -> Any:
    kind = field.kind
    if value is None:
        return _ZERO[kind]
    if kind in UNSIGNED_MAX:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(DropReason.MALFORMED, f"{field.go} must be an integer")
        if not 0 <= value <= UNSIGNED_MAX[kind]:
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


def decode_fields(fields: Sequence[Field], obj: Any) -> dict[str, Any]:
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
            type(value) is int and 0 <= value <= UNSIGNED_MAX.get(kind, -1)
        ):
            result[field.attr] = value
        else:
            result[field.attr] = decode_value(field, value)
    return result
