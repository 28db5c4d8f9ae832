"""The one place that encodes and decodes memberlist's wire format (protocol versions 2–5).

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

One package, six modules, each direction of each layer in one of them: ``fields`` (the
field table of every message body and the msgpack map codec), ``compiled`` (each table's
encoder and decoder as one generated function, the table walk done at import), ``codec``
(one message to bytes and back, stream message bodies, LZW compression), ``framing``
(compound packets, CRC, encryption, stream frames: ``encode_packet``/``decode_packet``,
``encode_stream``/``parse_stream``), ``decoder`` (``StreamDecoder``: ``parse_stream``'s
answers for bytes fed as they arrive, in work proportional to them), ``errors``
(``DropReason``, ``WireError``).
Everything else in swim, and every other package, uses the names re-exported here
(docs/design.md §3).

Sources: hashicorp/memberlist @ 1b4c746 net.go, util.go (``encode``, ``decode``,
``makeCompoundMessage``, ``decodeCompoundMessage``, ``compressPayload``), security.go.
"""

from swim.wire.codec import (
    GOSSIP_CACHE_ENTRIES,
    MAX_DECOMPRESSED_BYTES,
    MESSAGE_TYPE_NAMES,
    TYPE_NAMES,
    StreamLimits,
    StreamMessage,
    compress_message,
    decode_message,
    decompress_body,
    encode_message,
    encode_push_pull,
    encode_push_pull_parts,
    encode_push_state,
    encode_user_stream,
    gossip_cache_len,
    message_type_name,
    type_name,
)
from swim.wire.decoder import StreamDecoder
from swim.wire.errors import DropReason, WireError
from swim.wire.fields import MAX_ARRAY_LEN, MAX_MAP_LEN
from swim.wire.framing import (
    COMPOUND_HEADER_OVERHEAD,
    COMPOUND_OVERHEAD,
    CRC_OVERHEAD,
    MAX_COMPOUND_PARTS,
    MAX_NESTING,
    MIN_COMPRESS_BYTES,
    USER_MSG_OVERHEAD,
    Crypto,
    DecodedPacket,
    add_crc,
    decode_packet,
    encode_packet,
    encode_stream,
    make_compound,
    packet_overhead,
    parse_stream,
    split_compound,
)

__all__ = [
    "COMPOUND_HEADER_OVERHEAD",
    "COMPOUND_OVERHEAD",
    "CRC_OVERHEAD",
    "GOSSIP_CACHE_ENTRIES",
    "MAX_ARRAY_LEN",
    "MAX_COMPOUND_PARTS",
    "MAX_DECOMPRESSED_BYTES",
    "MAX_MAP_LEN",
    "MAX_NESTING",
    "MESSAGE_TYPE_NAMES",
    "MIN_COMPRESS_BYTES",
    "TYPE_NAMES",
    "USER_MSG_OVERHEAD",
    "Crypto",
    "DecodedPacket",
    "DropReason",
    "StreamDecoder",
    "StreamLimits",
    "StreamMessage",
    "WireError",
    "add_crc",
    "compress_message",
    "decode_message",
    "decode_packet",
    "decompress_body",
    "encode_message",
    "encode_packet",
    "encode_push_pull",
    "encode_push_pull_parts",
    "encode_push_state",
    "encode_stream",
    "encode_user_stream",
    "gossip_cache_len",
    "make_compound",
    "message_type_name",
    "packet_overhead",
    "parse_stream",
    "split_compound",
    "type_name",
]
