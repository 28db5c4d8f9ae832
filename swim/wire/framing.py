"""The layers around messages: compound packets, the CRC header, AES-GCM encryption of
packets, and stream frames. Part of ``swim.wire`` (its docstring has the rules); messages
themselves are ``swim.wire.codec``.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swim import security
from swim.frozen import fast_init
from swim.messages import Message, MsgType
from swim.wire.codec import (
    StreamLimits,
    StreamMessage,
    compress_message,
    decode_message,
    decompress_body,
    parse_plain_stream,
)
from swim.wire.errors import DropReason, WireError

__all__ = [
    "COMPOUND_HEADER_OVERHEAD",
    "COMPOUND_OVERHEAD",
    "CRC_OVERHEAD",
    "MAX_COMPOUND_PARTS",
    "MAX_NESTING",
    "MIN_COMPRESS_BYTES",
    "USER_MSG_OVERHEAD",
    "Crypto",
    "DecodedPacket",
    "add_crc",
    "check_stream_start",
    "decode_packet",
    "decrypt_stream_message",
    "encode_packet",
    "encode_stream",
    "encrypted_stream_length",
    "make_compound",
    "packet_overhead",
    "parse_stream",
    "split_compound",
]

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

DECODE_MEMO_ENTRIES = 64
DECODE_MEMO_MAX_BYTES = 1500
"""Decoded plaintext datagrams up to this size are memoised (a thread-safe
``functools.lru_cache`` of ``DECODE_MEMO_ENTRIES``), as ``messages.ip_to_bytes`` is: decoding
is a pure function, its result (a ``DecodedPacket`` of frozen messages) is immutable and
safe to share, and the same datagram recurs: a gossip round sends one compound to several
members, acks of the same sequence number and payload are byte-identical (10,000 simulated
nodes × 12 s: 75% of 525,000 datagrams were one of the previous 64). The bound keeps the
memo under ~4 MiB even for hostile input (a compressed part inflates to at most 64 KiB);
exceptions are not memoised."""

# --- compound and crc -------------------------------------------------------------------


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


def add_crc(data: bytes) -> bytes:
    """net.go: ``[12][crc32 IEEE BE][data]`` for receivers that speak protocol ≥ 5."""
    return _crc_header(_HAS_CRC, zlib.crc32(data)) + data


_crc_header = struct.Struct(">BI").pack
_HAS_CRC = int(MsgType.HAS_CRC)


# --- packets ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodedPacket:
    """Messages recovered from one datagram and the reasons for any parts dropped."""

    messages: tuple[Message, ...]
    drops: tuple[DropReason, ...]


fast_init(DecodedPacket)  # one per datagram received


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
        plain = _strip_crc(data)
        if len(plain) <= DECODE_MEMO_MAX_BYTES and type(plain) is bytes:
            return _decode_plain_memo(plain)
        return _decode_plain(plain)
    crc_then_ping = data[0] == MsgType.HAS_CRC and data[CRC_OVERHEAD : CRC_OVERHEAD + 1] == _PING
    if (
        not crc_then_ping
        and len(data) <= DECODE_MEMO_MAX_BYTES + CRC_OVERHEAD
        and type(data) is bytes
    ):
        # A lone ping never repeats (its target, source and sequence number differ every
        # time), so the memo would only hash it and evict what does repeat. Other
        # unencrypted datagrams repeat whole, CRC header included: skip its check too.
        return _decode_datagram_memo(data)
    return _decode_datagram(data)


_PING = bytes([MsgType.PING])


def _strip_crc(data: bytes) -> bytes:
    """``data`` without its CRC header, if it has one; ``WireError`` if the CRC is wrong."""
    if len(data) >= CRC_OVERHEAD and data[0] == MsgType.HAS_CRC:
        (expected,) = struct.unpack_from(">I", data, 1)
        data = data[CRC_OVERHEAD:]
        if zlib.crc32(data) != expected:
            raise WireError(DropReason.BAD_CRC, "invalid checksum")
    return data


def _decode_plain(data: bytes) -> DecodedPacket:
    messages: list[Message] = []
    drops: list[DropReason] = []
    _unwrap(data, 0, messages, drops)
    return DecodedPacket(tuple(messages), tuple(drops))


def _decode_datagram(data: bytes) -> DecodedPacket:
    """An unencrypted datagram: its CRC header checked and removed, then decoded."""
    return _decode_plain(_strip_crc(data))


_decode_plain_memo = functools.lru_cache(maxsize=DECODE_MEMO_ENTRIES)(_decode_plain)
"""``_decode_plain`` of decrypted datagrams up to ``DECODE_MEMO_MAX_BYTES`` (see that
constant)."""
_decode_datagram_memo = functools.lru_cache(maxsize=DECODE_MEMO_ENTRIES)(_decode_datagram)
"""``_decode_datagram`` of unencrypted datagrams up to ``DECODE_MEMO_MAX_BYTES`` plus a CRC
header, memoised whole (one with a bad CRC raises, and an exception is never cached)."""


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
    compressor: Callable[[bytes], bytes] | None = None,
) -> bytes:
    """One datagram from encoded messages: the first is the message, the rest piggyback.

    ``compressor`` stands in for ``compress_message`` (the same function of its input, e.g.
    memoised: ``swim.shared.SharedCodec.compress_packet``)."""
    data = parts[0] if len(parts) == 1 else make_compound(parts)
    if compress and len(data) >= MIN_COMPRESS_BYTES:
        compressed = (compress_message if compressor is None else compressor)(data)
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


def parse_stream(
    data: bytes, crypto: Crypto | None, limits: StreamLimits
) -> tuple[StreamMessage, int] | None:
    """One message from the start of a stream, or None while more bytes are needed.

    Returns the message and the number of stream bytes it used. Raises ``WireError`` as
    soon as the bytes cannot become a valid message, including when a header announces
    more than the limits allow: a hostile peer cannot make us buffer past the bound.
    ``swim.wire.decoder.StreamDecoder`` gives the same answers for bytes fed in pieces.
    """
    if len(data) > limits.max_bytes + 5:
        raise WireError(DropReason.OVERSIZED, f"stream exceeds {limits.max_bytes} bytes")
    if not data:
        return None
    if check_stream_start(data[0], crypto) and crypto is not None:
        return _parse_encrypted_stream(data, crypto, limits)
    return parse_plain_stream(data, limits, allow_compress=True)


def check_stream_start(first: int, crypto: Crypto | None) -> bool:
    """Whether a stream opening with byte ``first`` is encrypted; raises if the stream's
    kind does not match the encryption settings."""
    if first == MsgType.ENCRYPT:
        if crypto is None:
            raise WireError(DropReason.DECRYPT_FAILED, "stream is encrypted, encryption is off")
        return True
    if crypto is not None and crypto.verify_incoming:
        raise WireError(DropReason.NOT_ENCRYPTED, "encryption is on but the stream is plain")
    return False


def encrypted_stream_length(header: bytes, limits: StreamLimits) -> int:
    """The body length an encrypted stream's 5-byte header announces, refused over the
    limit."""
    (length,) = struct.unpack_from(">I", header, 1)
    if length > limits.max_bytes:
        raise WireError(DropReason.OVERSIZED, f"encrypted stream claims {length} bytes")
    return int(length)


def decrypt_stream_message(
    header: bytes, body: bytes, crypto: Crypto, limits: StreamLimits
) -> StreamMessage:
    """The message inside a whole encrypted stream frame (header and body)."""
    try:
        plain = security.decrypt_stream_body(crypto.keyring.keys, header, body, crypto.label)
    except security.DecryptError as exc:
        raise WireError(DropReason.DECRYPT_FAILED, str(exc)) from exc
    if not plain:  # an authentic but empty payload (it raised IndexError, found by fuzzing)
        raise WireError(DropReason.EMPTY, "encrypted stream holds no message")
    parsed = parse_plain_stream(plain, limits, allow_compress=True)
    if parsed is None:
        raise WireError(DropReason.MALFORMED, "encrypted stream holds a partial message")
    return parsed[0]


def _parse_encrypted_stream(
    data: bytes, crypto: Crypto, limits: StreamLimits
) -> tuple[StreamMessage, int] | None:
    if len(data) < 5:
        return None
    length = encrypted_stream_length(data[:5], limits)
    if len(data) < 5 + length:
        return None
    return decrypt_stream_message(data[:5], data[5 : 5 + length], crypto, limits), 5 + length
