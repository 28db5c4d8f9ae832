"""Serf's delegate protocol on top of memberlist: tags, Lamport clocks, serf messages, the
push-pull user state and the ping-ack coordinate payload. Pure: stdlib + msgpack only.

Serf (hashicorp/serf v0.9.4, the version Debian packages as ``serf 0.9.4~ds1``, which says
``0.8.2-dev`` in ``serf version``) runs on memberlist and uses its extension points:

- node metadata = the node's tags (``serf/serf.go`` ``encodeTags``/``decodeTags``);
- user messages = serf messages, ``[serf type byte][msgpack struct]`` after memberlist's
  user-message byte 8 (``serf/messages.go``, ``serf/delegate.go`` ``NotifyMsg``);
- the push-pull user state = ``messagePushPull`` (``serf/delegate.go`` ``LocalState`` /
  ``MergeRemoteState``);
- the ack payload of a direct ping = ``[PingVersion=1][msgpack Coordinate]``
  (``serf/ping_delegate.go``, ``coordinate/coordinate.go``, ``coordinate/config.go``).

Encoding (checked byte for byte against tests/golden/serf): hashicorp/go-msgpack writes a Go
struct as a map whose keys are the field names in sorted order; ``string`` and ``[]byte``
both go out as msgpack raw str types without str8 (fixstr, str16, str32); integers use the
smallest encoding; ``float64`` is always float64 (0xcb); a nil slice (a ``[]byte`` nobody set,
``Filters``) is msgpack nil, an empty non-nil slice an empty array. Go map iteration order is
random, so serf writes ``StatusLTimes`` (and multi-key tags) in a random key order; our
encoders keep the caller's ``Mapping`` order (``encode_tags`` sorts, see below) and our
decoders keep the wire order, which makes every golden capture re-encode identically.
Strings are UTF-8 with ``surrogateescape`` both ways, as in ``swim.wire``.

Decoding follows Go's decoder: missing fields are zero values, unknown fields are ignored,
trailing bytes after the msgpack object are ignored, msgpack nil is the zero value. Every
decoder here raises only ``ValueError`` (``SerfCodecError``) on bad input.

Serf rules our agent must follow (serf/serf.go, serf/delegate.go, serf/config.go @ v0.9.4;
memberlist v0.2.2 net.go/state.go, the memberlist serf 0.9.4 is built against)
==========================================================================================

Versions. Serf nodes reject a push-pull/join (memberlist ``verifyProtocol``) when any *alive*
node's delegate versions are incompatible: our Alive and push-pull node states must carry
``Vsn`` = ``SERF_AGENT_VSN`` = [pmin 1, pmax 5, pcur 2, dmin 2, dmax 5, dcur 5] as serf
agents do (agent protocol 5 -> memberlist protocol 2 via ``ProtocolVersionMap``). A Vsn
with dmax 0 makes serf fail every push-pull: "delegate protocol version (5) is
incompatible: [2, 0]".

Status "left" vs "failed". Serf decides in ``handleNodeLeave`` (memberlist ``NotifyLeave``,
fired for a dead *and* for a left node alike): a member whose serf status is
``StatusLeaving`` becomes ``left`` (EventMemberLeave), a member that is ``StatusAlive``
becomes ``failed`` (EventMemberFailed). Only a serf leave intent makes a member
``StatusLeaving`` (``handleNodeLeaveIntent``); memberlist's dead-with-From==Node alone
shows as ``failed``. So a graceful leave is (``Serf.Leave``):

1. ``intent = LeaveIntent(ltime=clock.time(), node=us)`` then ``clock.increment()``;
   broadcast ``encode_leave_intent(intent)`` as a memberlist user message (gossip, i.e.
   piggybacked/retransmitted like serf's TransmitLimitedQueue). Only needed when some other
   member is alive (``hasAliveMembers``).
2. Wait until that broadcast has been sent out (its retransmit budget used up), at most
   ``BROADCAST_TIMEOUT_S`` (5 s; serf then returns "timeout while waiting for graceful
   leave" and does *not* do the memberlist leave).
3. Memberlist leave: broadcast ``dead(node=us, from=us)`` and wait for it to go out (again
   bounded by ``BROADCAST_TIMEOUT_S``).
4. Keep running and answering probes for ``LEAVE_PROPAGATE_DELAY_S`` (1 s) before closing
   sockets, so nobody marks us failed before it learns of the leave.

In the golden capture the intent goes out ~100 ms before the dead(left) message. The
intent is ignored as old unless ``ltime`` > the ``statusLTime`` a peer holds for us (the
LTime of our last join intent, or what a push-pull told it), so the agent must witness
every LTime it sees (intents, and ``ltime - 1`` of each push-pull state, as
``MergeRemoteState`` does) before it leaves. A leave intent that arrives after a peer
already marked us failed still moves us to ``left`` ("EventMemberLeave (forced)"), as does
our name in a push-pull ``LeftMembers`` (treated as an intent with LTime
``StatusLTimes[name] + 1``).

Refutation. If we are alive and receive a leave intent (or a push-pull ``LeftMembers``
entry) naming us with an LTime newer than ours, serf nodes mark us ``leaving``; a serf node
in our place refutes with ``JoinIntent(ltime=clock.time(), node=us)`` after witnessing.
Our agent must do the same (e.g. after a restart under the same name), or peers keep us
``leaving`` and later report ``left`` when we really die.

Join. After a successful memberlist join serf broadcasts ``JoinIntent(ltime=clock.time(),
node=us)`` and witnesses it locally (``broadcastJoin``). It is not needed to become a
member: ``handleNodeJoin`` (memberlist ``NotifyJoin``) adds any node as ``alive`` with
``statusLTime`` 0 (or the LTime of a buffered recent intent, kept
``RECENT_INTENT_TIMEOUT_S``) and tags decoded from its Meta, whether or not it ever sent a
serf message. We should still send it so peers' ``statusLTime`` for us orders later
intents.

Update. ``handleNodeUpdate`` (memberlist ``NotifyUpdate``, fired only when the Meta *bytes*
change) refreshes address, port and tags (EventMemberUpdate); unknown nodes are ignored.
Hence ``encode_tags`` is deterministic (keys sorted) so re-announcing the same tags never
looks like an update. Tags: empty Meta decodes as ``{"role": ""}`` and Meta without the
0xff magic byte as ``{"role": meta}`` (legacy); malformed tags are logged ("[ERR] serf:
Failed to decode tags") and partially kept. Encoded tags must fit ``META_MAX_SIZE`` (512).

Push-pull user state. Memberlist only calls ``MergeRemoteState`` when ``UserStateLen`` > 0,
so sending no user state is silent and harmless (peers just learn nothing from it). A
state that is sent but bad is logged: zero bytes "[ERR] serf: Remote state is zero bytes",
wrong first byte "[ERR] serf: Remote state has bad type prefix", undecodable "[ERR] serf:
Failed to decode remote state". If we send one, every ``LeftMembers`` name becomes a leave
intent at its receivers and every ``StatusLTimes`` entry a join intent: list only real
leaves and real LTimes. Serf always sends its state (~600 bytes with the 512-slot event
buffer), so our push-pull reader must accept it.

Ack payload. ``NotifyPingComplete`` returns silently on an empty payload, so acks without
a payload are fine (serf just keeps no coordinate for us). A payload whose first byte is
not 1 logs "[ERR] serf: Unsupported ping version"; an undecodable coordinate "[ERR] serf:
Failed to decode coordinate from ping"; a coordinate of another dimensionality or with
NaN/Inf is rejected at TRACE level. A fresh serf node sends ``DEFAULT_COORDINATE``; a static
coordinate never updated by Vivaldi slightly skews serf's own estimates, so send either
nothing or a real one. Serf peers do put coordinates in their acks to us.

Other serf messages. Serf ignores an empty user message and logs "[WARN] serf: Received
message of unknown type" for a first byte it does not know, so our own non-serf user
messages cause a warning per message on serf peers. Serf rebroadcasts intents, events and
queries it has not seen; a node that only consumes them does not break dissemination
among serf nodes. Queries (``_serf_ping``, ``_serf_conflict``, ``_serf_install-key``,
``_serf_use-key``, ``_serf_remove-key``, ``_serf_list-keys``) expect a response (and an
ack if ``QUERY_FLAG_ACK``) from every member sent to ``Addr:Port``; ``serf keys`` reports
"n/m nodes reported success" when a member (ours) does not answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

# --- constants ------------------------------------------------------------------------------

TAG_MAGIC_BYTE = 0xFF
"""serf.go ``tagMagicByte``: Meta starting with it is a msgpack map of tags."""
META_MAX_SIZE = 512
"""memberlist ``MetaMaxSize``; serf refuses tags whose encoding is longer."""
PROTOCOL_VERSION_MIN = 2
"""serf.go ``ProtocolVersionMin`` (serf delegate protocol)."""
PROTOCOL_VERSION_MAX = 5
"""serf.go ``ProtocolVersionMax``; the serf agent's default protocol."""
SERF_AGENT_VSN = bytes([1, 5, 2, PROTOCOL_VERSION_MIN, PROTOCOL_VERSION_MAX, PROTOCOL_VERSION_MAX])
"""Alive ``Vsn`` of a serf 0.9.4 agent (golden captures): pmin 1, pmax 5, pcur 2, dmin 2,
dmax 5, dcur 5."""
PING_VERSION = 1
"""ping_delegate.go ``PingVersion``: first byte of the ack payload."""
EVENT_BUFFER_SIZE = 512
"""config.go ``EventBuffer`` default: slots of the push-pull ``Events`` array."""
QUERY_BUFFER_SIZE = 512
"""config.go ``QueryBuffer`` default."""
BROADCAST_TIMEOUT_S = 5.0
"""config.go ``BroadcastTimeout``: how long ``Leave`` waits for each broadcast to go out."""
LEAVE_PROPAGATE_DELAY_S = 1.0
"""config.go ``LeavePropagateDelay``: how long ``Leave`` keeps running after the memberlist
leave."""
RECENT_INTENT_TIMEOUT_S = 5 * 60.0
"""config.go ``RecentIntentTimeout``: intents for not-yet-known nodes are kept this long."""
REAP_INTERVAL_S = 15.0
"""config.go ``ReapInterval``."""
RECONNECT_INTERVAL_S = 30.0
"""config.go ``ReconnectInterval``: serf retries a memberlist join to failed members."""
RECONNECT_TIMEOUT_S = 24 * 3600.0
"""config.go ``ReconnectTimeout``: failed members are reaped after this."""
TOMBSTONE_TIMEOUT_S = 24 * 3600.0
"""config.go ``TombstoneTimeout``: left members are reaped after this."""
USER_EVENT_SIZE_LIMIT = 512
"""The serf agent's default ``UserEventSizeLimit`` (name + payload, and encoded message)."""
USER_EVENT_SANE_LIMIT = 9 * 1024
"""serf.go ``UserEventSizeLimit``: the hard cap."""
QUERY_FLAG_ACK = 1
"""messages.go ``queryFlagAck``."""
QUERY_FLAG_NO_BROADCAST = 2
"""messages.go ``queryFlagNoBroadcast``."""
INTERNAL_QUERY_PREFIX = "_serf_"
"""internal_query.go ``InternalQueryPrefix``."""

_U8 = 0xFF
_U16 = 0xFFFF
_U32 = 0xFFFF_FFFF
_U64 = 0xFFFF_FFFF_FFFF_FFFF
_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1
_MAX_GENERIC_DEPTH = 32


class SerfCodecError(ValueError):
    """Bytes that are not a valid serf structure, or a value serf cannot carry."""


class SerfMessageType(IntEnum):
    """messages.go ``messageType``: the first byte of a serf user message."""

    LEAVE = 0
    JOIN = 1
    PUSH_PULL = 2
    USER_EVENT = 3
    QUERY = 4
    QUERY_RESPONSE = 5
    CONFLICT_RESPONSE = 6
    KEY_REQUEST = 7
    KEY_RESPONSE = 8
    RELAY = 9


# --- msgpack helpers ------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    # use_bin_type=False: bytes go out as raw str types and str8 is never used, which is
    # what hashicorp/go-msgpack writes for both string and []byte.
    return msgpack.packb(obj, use_bin_type=False)  # type: ignore[no-any-return]


def _unpack_prefix(data: bytes) -> tuple[Any, int]:
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


def _unpack(data: bytes) -> Any:
    """The first msgpack object of ``data``; trailing bytes are ignored, as Go does."""
    return _unpack_prefix(data)[0]


def _struct(obj: Any, what: str) -> dict[Any, Any]:
    """A Go struct decoded from msgpack: a map (nil decodes to the zero struct)."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SerfCodecError(f"{what} must be a msgpack map, got {type(obj).__name__}")
    return obj


def _enc_str(value: str) -> bytes:
    if not isinstance(value, str):
        raise SerfCodecError(f"expected a str, got {type(value).__name__}")
    return value.encode("utf-8", "surrogateescape")


def _dec_str(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


def _check_uint(value: int, limit: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerfCodecError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise SerfCodecError(f"{name}={value} is outside 0..{limit}")
    return value


def _check_bytes(value: bytes, name: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise SerfCodecError(f"{name} must be bytes, got {type(value).__name__}")
    return bytes(value)


def _nil_if_empty(value: bytes) -> bytes | None:
    """A Go ``[]byte`` nobody set is nil, which go-msgpack writes as msgpack nil."""
    return value if value else None


def _get_uint(obj: Mapping[Any, Any], key: str, limit: int = _U64) -> int:
    value = obj.get(key.encode())
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerfCodecError(f"{key} must be an integer")
    if not 0 <= value <= limit:
        raise SerfCodecError(f"{key}={value} is out of range")
    return value


def _get_int64(obj: Mapping[Any, Any], key: str) -> int:
    value = obj.get(key.encode())
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerfCodecError(f"{key} must be an integer")
    if not _I64_MIN <= value <= _I64_MAX:
        raise SerfCodecError(f"{key}={value} is out of range")
    return value


def _get_bytes(obj: Mapping[Any, Any], key: str) -> bytes:
    value = obj.get(key.encode())
    if value is None:
        return b""
    if not isinstance(value, bytes):
        raise SerfCodecError(f"{key} must be a string or bytes")
    return value


def _get_str(obj: Mapping[Any, Any], key: str) -> str:
    return _dec_str(_get_bytes(obj, key))


def _get_bool(obj: Mapping[Any, Any], key: str) -> bool:
    value = obj.get(key.encode())
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SerfCodecError(f"{key} must be a bool")
    return value


def _as_float(value: Any, name: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SerfCodecError(f"{name} must be a number")
    return float(value)


def _get_list(obj: Mapping[Any, Any], key: str) -> list[Any]:
    value = obj.get(key.encode())
    if value is None:
        return []
    if not isinstance(value, list):
        raise SerfCodecError(f"{key} must be an array")
    return value


def _plain(value: Any, depth: int = 0) -> Any:
    """Generic msgpack value with str map keys (for messages we do not model)."""
    if depth > _MAX_GENERIC_DEPTH:
        raise SerfCodecError("msgpack data nested too deeply")
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            key = _dec_str(k) if isinstance(k, bytes) else k
            out[key] = _plain(v, depth + 1)
        return out
    if isinstance(value, list):
        return [_plain(v, depth + 1) for v in value]
    return value


# --- tags (serf.go encodeTags / decodeTags) -------------------------------------------------


def encode_tags(tags: Mapping[str, str]) -> bytes:
    """Meta for ``tags`` as serf's ``encodeTags`` (protocol >= 3): 0xff + msgpack map.

    Keys are written sorted (serf writes Go's random map order) so the same tags always
    give the same Meta bytes: memberlist fires NotifyUpdate whenever the bytes change.
    """
    body: dict[bytes, bytes] = {}
    for key in sorted(tags):
        body[_enc_str(key)] = _enc_str(tags[key])
    return bytes([TAG_MAGIC_BYTE]) + _pack(body)


def decode_tags(meta: bytes) -> dict[str, str]:
    """Tags from a node's Meta as serf's ``decodeTags``.

    Meta that is empty or does not start with 0xff is the legacy role: ``{"role": meta}``
    (so empty Meta is ``{"role": ""}``, exactly as serf shows it). Raises
    ``SerfCodecError`` (a ``ValueError``) when the map after 0xff is malformed; serf logs
    that and keeps what it decoded.
    """
    meta = _check_bytes(meta, "meta")
    if not meta or meta[0] != TAG_MAGIC_BYTE:
        return {"role": _dec_str(meta)}
    obj = _unpack(meta[1:])
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SerfCodecError(f"tags must be a msgpack map, got {type(obj).__name__}")
    tags: dict[str, str] = {}
    for key, value in obj.items():
        if not isinstance(key, bytes):
            raise SerfCodecError(f"tag name must be a string, got {key!r}")
        if value is None:
            value = b""
        if not isinstance(value, bytes):
            raise SerfCodecError(f"tag {_dec_str(key)!r} must be a string, got {value!r}")
        tags[_dec_str(key)] = _dec_str(value)
    return tags


def tags_fit(tags: Mapping[str, str], limit: int = META_MAX_SIZE) -> bool:
    """Whether the encoded tags fit memberlist's Meta limit (serf.go ``SetTags``/``Create``
    refuse "Encoded length of tags exceeds limit of 512 bytes")."""
    return len(encode_tags(tags)) <= limit


# --- Lamport clock (serf/lamport.go) --------------------------------------------------------


class LamportClock:
    """serf/lamport.go ``LamportClock`` (uint64). Serf starts each clock at 1 (``Create``
    increments it once) so that a join LTime of 0 is always old."""

    __slots__ = ("_counter",)

    def __init__(self, start: int = 0) -> None:
        self._counter = _check_uint(start, _U64, "start")

    def time(self) -> int:
        """The current value (``Time``)."""
        return self._counter

    def increment(self) -> int:
        """Add one and return the new value (``Increment``; wraps like Go's uint64)."""
        self._counter = (self._counter + 1) & _U64
        return self._counter

    def witness(self, v: int) -> None:
        """``Witness``: a value older than ours changes nothing; otherwise our clock becomes
        ``v + 1`` (note: witnessing our own current value also moves us one ahead)."""
        _check_uint(v, _U64, "lamport time")
        if v < self._counter:
            return
        self._counter = (v + 1) & _U64

    def __repr__(self) -> str:
        return f"LamportClock({self._counter})"


# --- serf messages (serf/messages.go) -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JoinIntent:
    """``messageJoin``: associates a node's join with a Lamport time."""

    ltime: int
    node: str


@dataclass(frozen=True, slots=True)
class LeaveIntent:
    """``messageLeave``: a node's intent to leave (``prune``: force-leave -prune)."""

    ltime: int
    node: str
    prune: bool = False


@dataclass(frozen=True, slots=True)
class UserEvent:
    """``messageUserEvent``. ``cc``: "can coalesce". An empty payload is written as nil, as
    serf does for ``serf event NAME`` without a payload."""

    ltime: int
    name: str
    payload: bytes = b""
    cc: bool = False


@dataclass(frozen=True, slots=True)
class Query:
    """``messageQuery``. ``addr``/``port``/``source_node``: where to send the response
    (a UDP memberlist user message); ``timeout_ns``: Go ``time.Duration``."""

    ltime: int
    id: int
    addr: bytes
    port: int
    source_node: str
    filters: tuple[bytes, ...]
    flags: int
    relay_factor: int
    timeout_ns: int
    name: str
    payload: bytes = b""

    @property
    def ack(self) -> bool:
        return bool(self.flags & QUERY_FLAG_ACK)

    @property
    def no_broadcast(self) -> bool:
        return bool(self.flags & QUERY_FLAG_NO_BROADCAST)


@dataclass(frozen=True, slots=True)
class QueryResponse:
    """``messageQueryResponse`` (``from_node`` is Go's ``From``)."""

    ltime: int
    id: int
    from_node: str
    flags: int
    payload: bytes = b""

    @property
    def ack(self) -> bool:
        return bool(self.flags & QUERY_FLAG_ACK)


SerfMessage = JoinIntent | LeaveIntent | UserEvent | Query | QueryResponse


def _encode(kind: SerfMessageType, body: dict[bytes, Any]) -> bytes:
    """``encodeMessage``: type byte + msgpack struct (fields sorted by name)."""
    ordered = {key: body[key] for key in sorted(body)}
    return bytes([kind]) + _pack(ordered)


def encode_join_intent(msg: JoinIntent) -> bytes:
    """Serf user-message payload for ``messageJoin``."""
    return _encode(
        SerfMessageType.JOIN,
        {b"LTime": _check_uint(msg.ltime, _U64, "ltime"), b"Node": _enc_str(msg.node)},
    )


def encode_leave_intent(msg: LeaveIntent) -> bytes:
    """Serf user-message payload for ``messageLeave``."""
    return _encode(
        SerfMessageType.LEAVE,
        {
            b"LTime": _check_uint(msg.ltime, _U64, "ltime"),
            b"Node": _enc_str(msg.node),
            b"Prune": bool(msg.prune),
        },
    )


def encode_user_event(msg: UserEvent) -> bytes:
    """Serf user-message payload for ``messageUserEvent`` (no size check: the agent applies
    ``USER_EVENT_SIZE_LIMIT`` like ``Serf.UserEvent``)."""
    return _encode(
        SerfMessageType.USER_EVENT,
        {
            b"CC": bool(msg.cc),
            b"LTime": _check_uint(msg.ltime, _U64, "ltime"),
            b"Name": _enc_str(msg.name),
            b"Payload": _nil_if_empty(_check_bytes(msg.payload, "payload")),
        },
    )


def encode_query(msg: Query) -> bytes:
    """Serf user-message payload for ``messageQuery``."""
    filters = [_check_bytes(f, "filter") for f in msg.filters]
    if isinstance(msg.timeout_ns, bool) or not isinstance(msg.timeout_ns, int):
        raise SerfCodecError("timeout_ns must be an int")
    if not _I64_MIN <= msg.timeout_ns <= _I64_MAX:
        raise SerfCodecError(f"timeout_ns={msg.timeout_ns} is out of range")
    return _encode(
        SerfMessageType.QUERY,
        {
            b"LTime": _check_uint(msg.ltime, _U64, "ltime"),
            b"ID": _check_uint(msg.id, _U32, "id"),
            b"Addr": _nil_if_empty(_check_bytes(msg.addr, "addr")),
            b"Port": _check_uint(msg.port, _U16, "port"),
            b"SourceNode": _enc_str(msg.source_node),
            b"Filters": filters or None,
            b"Flags": _check_uint(msg.flags, _U32, "flags"),
            b"RelayFactor": _check_uint(msg.relay_factor, _U8, "relay_factor"),
            b"Timeout": int(msg.timeout_ns),
            b"Name": _enc_str(msg.name),
            b"Payload": _nil_if_empty(_check_bytes(msg.payload, "payload")),
        },
    )


def encode_query_response(msg: QueryResponse) -> bytes:
    """Serf user-message payload for ``messageQueryResponse``."""
    return _encode(
        SerfMessageType.QUERY_RESPONSE,
        {
            b"LTime": _check_uint(msg.ltime, _U64, "ltime"),
            b"ID": _check_uint(msg.id, _U32, "id"),
            b"From": _enc_str(msg.from_node),
            b"Flags": _check_uint(msg.flags, _U32, "flags"),
            b"Payload": _nil_if_empty(_check_bytes(msg.payload, "payload")),
        },
    )


def encode_serf_message(msg: SerfMessage) -> bytes:
    """Any modelled serf message as its user-message payload."""
    if isinstance(msg, JoinIntent):
        return encode_join_intent(msg)
    if isinstance(msg, LeaveIntent):
        return encode_leave_intent(msg)
    if isinstance(msg, UserEvent):
        return encode_user_event(msg)
    if isinstance(msg, Query):
        return encode_query(msg)
    if isinstance(msg, QueryResponse):
        return encode_query_response(msg)
    raise SerfCodecError(f"not a serf message: {type(msg).__name__}")


def _decode_join(body: bytes) -> JoinIntent:
    obj = _struct(_unpack(body), "messageJoin")
    return JoinIntent(ltime=_get_uint(obj, "LTime"), node=_get_str(obj, "Node"))


def _decode_leave(body: bytes) -> LeaveIntent:
    obj = _struct(_unpack(body), "messageLeave")
    return LeaveIntent(
        ltime=_get_uint(obj, "LTime"), node=_get_str(obj, "Node"), prune=_get_bool(obj, "Prune")
    )


def _decode_user_event(body: bytes) -> UserEvent:
    obj = _struct(_unpack(body), "messageUserEvent")
    return UserEvent(
        ltime=_get_uint(obj, "LTime"),
        name=_get_str(obj, "Name"),
        payload=_get_bytes(obj, "Payload"),
        cc=_get_bool(obj, "CC"),
    )


def _decode_query(body: bytes) -> Query:
    obj = _struct(_unpack(body), "messageQuery")
    filters: list[bytes] = []
    for item in _get_list(obj, "Filters"):
        if item is None:
            item = b""
        if not isinstance(item, bytes):
            raise SerfCodecError("Filters must be an array of byte strings")
        filters.append(item)
    return Query(
        ltime=_get_uint(obj, "LTime"),
        id=_get_uint(obj, "ID", _U32),
        addr=_get_bytes(obj, "Addr"),
        port=_get_uint(obj, "Port", _U16),
        source_node=_get_str(obj, "SourceNode"),
        filters=tuple(filters),
        flags=_get_uint(obj, "Flags", _U32),
        relay_factor=_get_uint(obj, "RelayFactor", _U8),
        timeout_ns=_get_int64(obj, "Timeout"),
        name=_get_str(obj, "Name"),
        payload=_get_bytes(obj, "Payload"),
    )


def _decode_query_response(body: bytes) -> QueryResponse:
    obj = _struct(_unpack(body), "messageQueryResponse")
    return QueryResponse(
        ltime=_get_uint(obj, "LTime"),
        id=_get_uint(obj, "ID", _U32),
        from_node=_get_str(obj, "From"),
        flags=_get_uint(obj, "Flags", _U32),
        payload=_get_bytes(obj, "Payload"),
    )


def _decode_relay(body: bytes) -> dict[str, Any]:
    """``messageRelayType``: msgpack ``relayHeader{DestAddr net.UDPAddr, DestName}`` then
    the relayed serf message (type byte included)."""
    header_obj, used = _unpack_prefix(body)
    header = _struct(header_obj, "relayHeader")
    dest = _struct(header.get(b"DestAddr"), "DestAddr")
    return {
        "dest_ip": _get_bytes(dest, "IP"),
        "dest_port": _get_int64(dest, "Port"),
        "dest_zone": _get_str(dest, "Zone"),
        "dest_name": _get_str(header, "DestName"),
        "message": body[used:],
    }


def decode_serf_message(payload: bytes) -> tuple[SerfMessageType, SerfMessage | dict[str, Any]]:
    """Decode a serf user-message payload (the bytes after memberlist's type byte 8).

    Join/leave/user event/query/query response come back as dataclasses; push-pull as
    ``decode_push_pull_state``'s dict; relay as ``{"dest_ip", "dest_port", "dest_zone",
    "dest_name", "message"}``; the payload-only types (conflict response, key request,
    key response) as the plain msgpack map with str keys. Raises only ``ValueError``
    (``SerfCodecError``): empty payload, unknown type byte (serf logs "Received message of
    unknown type"), or a body that does not decode.
    """
    try:
        data = _check_bytes(payload, "payload")
        if not data:
            raise SerfCodecError("empty serf message")
        try:
            kind = SerfMessageType(data[0])
        except ValueError:
            raise SerfCodecError(f"unknown serf message type {data[0]}") from None
        body = data[1:]
        result: SerfMessage | dict[str, Any]
        if kind is SerfMessageType.JOIN:
            result = _decode_join(body)
        elif kind is SerfMessageType.LEAVE:
            result = _decode_leave(body)
        elif kind is SerfMessageType.USER_EVENT:
            result = _decode_user_event(body)
        elif kind is SerfMessageType.QUERY:
            result = _decode_query(body)
        elif kind is SerfMessageType.QUERY_RESPONSE:
            result = _decode_query_response(body)
        elif kind is SerfMessageType.PUSH_PULL:
            result = decode_push_pull_state(data)
        elif kind is SerfMessageType.RELAY:
            result = _decode_relay(body)
        else:
            result = _plain(_struct(_unpack(body), kind.name.lower()))
        return kind, result
    except SerfCodecError:
        raise
    except (ValueError, TypeError, RecursionError, UnicodeError) as exc:
        raise SerfCodecError(f"malformed serf message: {exc}") from exc


# --- push-pull user state (serf/delegate.go LocalState / MergeRemoteState) ------------------


@dataclass(frozen=True, slots=True)
class BufferedEvent:
    """serf.go ``userEvent``: one event in the event buffer."""

    name: str
    payload: bytes = b""


@dataclass(frozen=True, slots=True)
class BufferedEvents:
    """serf.go ``userEvents``: the events seen at one Lamport time (one buffer slot, at
    index ``ltime % len(buffer)``)."""

    ltime: int
    events: tuple[BufferedEvent, ...] = field(default_factory=tuple)


def _encode_buffered(entry: BufferedEvents) -> dict[bytes, Any]:
    events = [
        {
            b"Name": _enc_str(e.name),
            b"Payload": _nil_if_empty(_check_bytes(e.payload, "payload")),
        }
        for e in entry.events
    ]
    return {b"Events": events or None, b"LTime": _check_uint(entry.ltime, _U64, "ltime")}


def encode_push_pull_state(
    ltime: int,
    status_ltimes: Mapping[str, int],
    left_members: Sequence[str],
    event_ltime: int,
    events: Iterable[BufferedEvents] = (),
    *,
    query_ltime: int,
    event_buffer_size: int = EVENT_BUFFER_SIZE,
) -> bytes:
    """The push-pull user state serf's ``LocalState`` produces: type byte 2 + msgpack
    ``messagePushPull``.

    ``status_ltimes``: every member's ``statusLTime`` (written in the mapping's order);
    ``left_members``: names of members that left; ``events``: the non-empty slots of the
    event buffer, each placed at ``ltime % event_buffer_size`` of an array of
    ``event_buffer_size`` entries (the rest nil), as serf's ``eventBuffer``.
    """
    _check_uint(event_buffer_size, 1 << 24, "event_buffer_size")
    buffer: list[dict[bytes, Any] | None] = [None] * event_buffer_size
    for entry in events:
        if not isinstance(entry, BufferedEvents):
            raise SerfCodecError(f"events must be BufferedEvents, got {type(entry).__name__}")
        if event_buffer_size == 0:
            raise SerfCodecError("events given but event_buffer_size is 0")
        slot = _check_uint(entry.ltime, _U64, "event ltime") % event_buffer_size
        if buffer[slot] is not None:
            raise SerfCodecError(f"two event buffer entries for slot {slot}")
        buffer[slot] = _encode_buffered(entry)
    statuses = {
        _enc_str(name): _check_uint(value, _U64, f"status ltime of {name!r}")
        for name, value in status_ltimes.items()
    }
    body = {
        b"EventLTime": _check_uint(event_ltime, _U64, "event_ltime"),
        b"Events": buffer,
        b"LTime": _check_uint(ltime, _U64, "ltime"),
        b"LeftMembers": [_enc_str(name) for name in left_members],
        b"QueryLTime": _check_uint(query_ltime, _U64, "query_ltime"),
        b"StatusLTimes": statuses,
    }
    return bytes([SerfMessageType.PUSH_PULL]) + _pack(body)


def _decode_buffered(obj: Any) -> BufferedEvents:
    entry = _struct(obj, "userEvents")
    items: list[BufferedEvent] = []
    for item in _get_list(entry, "Events"):
        ev = _struct(item, "userEvent")
        items.append(BufferedEvent(name=_get_str(ev, "Name"), payload=_get_bytes(ev, "Payload")))
    return BufferedEvents(ltime=_get_uint(entry, "LTime"), events=tuple(items))


def decode_push_pull_state(buf: bytes) -> dict[str, Any]:
    """Decode a serf push-pull user state (what ``MergeRemoteState`` accepts).

    Returns ``{"ltime", "status_ltimes": {name: ltime} (wire order), "left_members":
    [name], "event_ltime", "events": [BufferedEvents] (non-nil slots, buffer order),
    "event_buffer_size", "query_ltime"}``. Tolerant like Go's decoder (missing fields are
    zero); raises only ``ValueError`` (``SerfCodecError``).
    """
    try:
        data = _check_bytes(buf, "state")
        if not data:
            raise SerfCodecError("remote state is zero bytes")
        if data[0] != SerfMessageType.PUSH_PULL:
            raise SerfCodecError(f"remote state has bad type prefix: {data[0]}")
        obj = _struct(_unpack(data[1:]), "messagePushPull")
        raw_status = obj.get(b"StatusLTimes")
        if raw_status is None:
            raw_status = {}
        if not isinstance(raw_status, dict):
            raise SerfCodecError("StatusLTimes must be a map")
        status: dict[str, int] = {}
        for name, value in raw_status.items():
            if not isinstance(name, bytes):
                raise SerfCodecError("StatusLTimes keys must be strings")
            if isinstance(value, bool) or not isinstance(value, int | None):
                raise SerfCodecError(f"StatusLTimes[{_dec_str(name)!r}] must be an integer")
            status[_dec_str(name)] = _check_uint(value or 0, _U64, "StatusLTimes value")
        left: list[str] = []
        for name in _get_list(obj, "LeftMembers"):
            if name is None:
                name = b""
            if not isinstance(name, bytes):
                raise SerfCodecError("LeftMembers must be strings")
            left.append(_dec_str(name))
        raw_events = _get_list(obj, "Events")
        events = [_decode_buffered(e) for e in raw_events if e is not None]
        return {
            "ltime": _get_uint(obj, "LTime"),
            "status_ltimes": status,
            "left_members": left,
            "event_ltime": _get_uint(obj, "EventLTime"),
            "events": events,
            "event_buffer_size": len(raw_events),
            "query_ltime": _get_uint(obj, "QueryLTime"),
        }
    except SerfCodecError:
        raise
    except (ValueError, TypeError, RecursionError, UnicodeError) as exc:
        raise SerfCodecError(f"malformed push-pull state: {exc}") from exc


# --- network coordinates (serf/ping_delegate.go, coordinate/) -------------------------------


@dataclass(frozen=True, slots=True)
class Coordinate:
    """coordinate.go ``Coordinate`` (seconds): Euclidean ``vec``, dimensionless ``error``,
    ``adjustment`` and non-Euclidean ``height``."""

    vec: tuple[float, ...]
    error: float
    adjustment: float
    height: float

    def is_valid(self) -> bool:
        """coordinate.go ``IsValid``: no NaN or infinity anywhere."""
        values = (*self.vec, self.error, self.adjustment, self.height)
        return all(math.isfinite(v) for v in values)

    def is_compatible_with(self, other: Coordinate) -> bool:
        """coordinate.go ``IsCompatibleWith``: same dimensionality."""
        return len(self.vec) == len(other.vec)


DEFAULT_DIMENSIONALITY = 8
"""coordinate/config.go ``DefaultConfig().Dimensionality``."""
VIVALDI_ERROR_MAX = 1.5
"""coordinate/config.go ``DefaultConfig().VivaldiErrorMax``."""
HEIGHT_MIN = 10.0e-6
"""coordinate/config.go ``DefaultConfig().HeightMin``."""
DEFAULT_COORDINATE = Coordinate(
    vec=(0.0,) * DEFAULT_DIMENSIONALITY, error=VIVALDI_ERROR_MAX, adjustment=0.0, height=HEIGHT_MIN
)
"""``coordinate.NewCoordinate(coordinate.DefaultConfig())``: what a fresh serf node acks."""


def encode_ping_payload(coordinate: Coordinate = DEFAULT_COORDINATE) -> bytes:
    """The ack payload serf's ``AckPayload`` produces: ``PING_VERSION`` then the msgpack
    ``Coordinate`` (fields Adjustment, Error, Height, Vec; float64 throughout)."""
    vec = [_as_float(v, "Vec") for v in coordinate.vec]
    body = {
        b"Adjustment": _as_float(coordinate.adjustment, "Adjustment"),
        b"Error": _as_float(coordinate.error, "Error"),
        b"Height": _as_float(coordinate.height, "Height"),
        b"Vec": vec,
    }
    return bytes([PING_VERSION]) + _pack(body)


def decode_ping_payload(payload: bytes) -> Coordinate:
    """The coordinate in an ack payload, as ``NotifyPingComplete`` reads it.

    Raises ``SerfCodecError`` (a ``ValueError``) for an empty payload (serf ignores it
    silently), another version byte (serf: "Unsupported ping version") or a body that does
    not decode (serf: "Failed to decode coordinate from ping"). The coordinate is returned
    even when ``is_valid()`` is false; serf's Vivaldi client rejects such ones.
    """
    try:
        data = _check_bytes(payload, "payload")
        if not data:
            raise SerfCodecError("empty ping payload")
        if data[0] != PING_VERSION:
            raise SerfCodecError(f"unsupported ping version: {data[0]}")
        obj = _struct(_unpack(data[1:]), "Coordinate")
        vec = tuple(_as_float(v, "Vec") for v in _get_list(obj, "Vec"))
        return Coordinate(
            vec=vec,
            error=_as_float(obj.get(b"Error"), "Error"),
            adjustment=_as_float(obj.get(b"Adjustment"), "Adjustment"),
            height=_as_float(obj.get(b"Height"), "Height"),
        )
    except SerfCodecError:
        raise
    except (ValueError, TypeError, RecursionError) as exc:
        raise SerfCodecError(f"malformed coordinate: {exc}") from exc


__all__ = [
    "BROADCAST_TIMEOUT_S",
    "DEFAULT_COORDINATE",
    "DEFAULT_DIMENSIONALITY",
    "EVENT_BUFFER_SIZE",
    "HEIGHT_MIN",
    "INTERNAL_QUERY_PREFIX",
    "LEAVE_PROPAGATE_DELAY_S",
    "META_MAX_SIZE",
    "PING_VERSION",
    "PROTOCOL_VERSION_MAX",
    "PROTOCOL_VERSION_MIN",
    "QUERY_BUFFER_SIZE",
    "QUERY_FLAG_ACK",
    "QUERY_FLAG_NO_BROADCAST",
    "REAP_INTERVAL_S",
    "RECENT_INTENT_TIMEOUT_S",
    "RECONNECT_INTERVAL_S",
    "RECONNECT_TIMEOUT_S",
    "SERF_AGENT_VSN",
    "TAG_MAGIC_BYTE",
    "TOMBSTONE_TIMEOUT_S",
    "USER_EVENT_SANE_LIMIT",
    "USER_EVENT_SIZE_LIMIT",
    "VIVALDI_ERROR_MAX",
    "BufferedEvent",
    "BufferedEvents",
    "Coordinate",
    "JoinIntent",
    "LamportClock",
    "LeaveIntent",
    "Query",
    "QueryResponse",
    "SerfCodecError",
    "SerfMessage",
    "SerfMessageType",
    "UserEvent",
    "decode_ping_payload",
    "decode_push_pull_state",
    "decode_serf_message",
    "decode_tags",
    "encode_join_intent",
    "encode_leave_intent",
    "encode_ping_payload",
    "encode_push_pull_state",
    "encode_query",
    "encode_query_response",
    "encode_serf_message",
    "encode_tags",
    "encode_user_event",
    "tags_fit",
]
