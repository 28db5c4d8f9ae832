"""hashicorp/go-msgpack as serf uses it: the encoding rules every serf codec here shares.

Encoding (checked byte for byte against tests/golden/serf): hashicorp/go-msgpack writes a Go
struct as a map whose keys are the field names in sorted order; ``string`` and ``[]byte``
both go out as msgpack raw str types without str8 (fixstr, str16, str32); integers use the
smallest encoding; ``float64`` is always float64 (0xcb); a nil slice (a ``[]byte`` nobody set,
``Filters``) is msgpack nil, an empty non-nil slice an empty array. Go map iteration order is
random, so serf writes ``StatusLTimes`` (and multi-key tags) in a random key order; our
encoders keep the caller's ``Mapping`` order (``agent.serf.state.encode_tags`` sorts) and our
decoders keep the wire order, which makes every golden capture re-encode identically.
Strings are UTF-8 with ``surrogateescape`` both ways, as in ``swim.wire``.

Decoding follows Go's decoder: missing fields are zero values, unknown fields are ignored,
trailing bytes after the msgpack object are ignored, msgpack nil is the zero value. Every
decoder in agent/serf raises only ``ValueError`` (``SerfCodecError``) on bad input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

U8 = 0xFF
U16 = 0xFFFF
U32 = 0xFFFF_FFFF
U64 = 0xFFFF_FFFF_FFFF_FFFF
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1
MAX_GENERIC_DEPTH = 32


class SerfCodecError(ValueError):
    """Bytes that are not a valid serf structure, or a value serf cannot carry."""


def pack(obj: Any) -> bytes:
    # use_bin_type=False: bytes go out as raw str types and str8 is never used, which is
    # what hashicorp/go-msgpack writes for both string and []byte.
    return msgpack.packb(obj, use_bin_type=False)  # type: ignore[no-any-return]


def unpack_prefix(data: bytes) -> tuple[Any, int]:
    """The first msgpack object of ``data`` and how many bytes it used."""
    unpacker = msgpack.Unpacker(
        raw=True,
        strict_map_key=False,
        max_buffer_size=max(len(data), 1),
        max_ext_len=0,
    )
    try:
        unpacker.feed(data)
        obj = unpacker.unpack()
        used = unpacker.tell()
    except msgpack.OutOfData as exc:
        raise SerfCodecError("truncated msgpack data") from exc
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise SerfCodecError(f"bad msgpack data: {exc}") from exc
    return obj, int(used)


def unpack(data: bytes) -> Any:
    """The first msgpack object of ``data``; trailing bytes are ignored, as Go does."""
    return unpack_prefix(data)[0]


def go_struct(obj: Any, what: str) -> dict[Any, Any]:
    """A Go struct decoded from msgpack: a map (nil decodes to the zero struct)."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SerfCodecError(f"{what} must be a msgpack map, got {type(obj).__name__}")
    return obj


def enc_str(value: str) -> bytes:
    if not isinstance(value, str):
        raise SerfCodecError(f"expected a str, got {type(value).__name__}")
    return value.encode("utf-8", "surrogateescape")


def dec_str(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


def check_uint(value: int, limit: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerfCodecError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise SerfCodecError(f"{name}={value} is outside 0..{limit}")
    return value


def check_bytes(value: bytes, name: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise SerfCodecError(f"{name} must be bytes, got {type(value).__name__}")
    return bytes(value)


def nil_if_empty(value: bytes) -> bytes | None:
    """A Go ``[]byte`` nobody set is nil, which go-msgpack writes as msgpack nil."""
    return value if value else None


def get_uint(obj: Mapping[Any, Any], key: str, limit: int = U64) -> int:
    value = obj.get(key.encode())
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerfCodecError(f"{key} must be an integer")
    if not 0 <= value <= limit:
        raise SerfCodecError(f"{key}={value} is out of range")
    return value


def get_int64(obj: Mapping[Any, Any], key: str) -> int:
    value = obj.get(key.encode())
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerfCodecError(f"{key} must be an integer")
    if not I64_MIN <= value <= I64_MAX:
        raise SerfCodecError(f"{key}={value} is out of range")
    return value


def get_bytes(obj: Mapping[Any, Any], key: str) -> bytes:
    value = obj.get(key.encode())
    if value is None:
        return b""
    if not isinstance(value, bytes):
        raise SerfCodecError(f"{key} must be a string or bytes")
    return value


def get_str(obj: Mapping[Any, Any], key: str) -> str:
    return dec_str(get_bytes(obj, key))


def get_bool(obj: Mapping[Any, Any], key: str) -> bool:
    value = obj.get(key.encode())
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SerfCodecError(f"{key} must be a bool")
    return value


def as_float(value: Any, name: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SerfCodecError(f"{name} must be a number")
    return float(value)


def get_list(obj: Mapping[Any, Any], key: str) -> list[Any]:
    value = obj.get(key.encode())
    if value is None:
        return []
    if not isinstance(value, list):
        raise SerfCodecError(f"{key} must be an array")
    return value


def plain(value: Any, depth: int = 0) -> Any:
    """Generic msgpack value with str map keys (for messages we do not model)."""
    if depth > MAX_GENERIC_DEPTH:
        raise SerfCodecError("msgpack data nested too deeply")
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            key = dec_str(k) if isinstance(k, bytes) else k
            out[key] = plain(v, depth + 1)
        return out
    if isinstance(value, list):
        return [plain(v, depth + 1) for v in value]
    return value
