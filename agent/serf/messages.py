"""Serf messages (serf/messages.go): the user-message payloads serf sends over memberlist,
``[serf type byte][msgpack struct]`` after memberlist's user-message byte 8 (serf/delegate.go
``NotifyMsg``), as frozen dataclasses with their encoders and one decoder.

Rules: encoders write go-msgpack's struct order (fields sorted by name, see
agent/serf/gomsgpack.py); ``decode_serf_message`` takes any payload and raises only
``SerfCodecError`` (a ``ValueError``): empty payload, unknown type byte (serf logs
"Received message of unknown type"), or a body that does not decode. Which message a member
acts on, and how, is agent/serf/delegate.py's table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.serf.constants import QUERY_FLAG_ACK, QUERY_FLAG_NO_BROADCAST, SerfMessageType
from agent.serf.gomsgpack import (
    I64_MAX,
    I64_MIN,
    U8,
    U16,
    U32,
    U64,
    SerfCodecError,
    check_bytes,
    check_uint,
    enc_str,
    get_bool,
    get_bytes,
    get_int64,
    get_list,
    get_str,
    get_uint,
    go_struct,
    nil_if_empty,
    pack,
    plain,
    unpack,
    unpack_prefix,
)
from agent.serf.state import decode_push_pull_state

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
    return bytes([kind]) + pack(ordered)


def encode_join_intent(msg: JoinIntent) -> bytes:
    """Serf user-message payload for ``messageJoin``."""
    return _encode(
        SerfMessageType.JOIN,
        {b"LTime": check_uint(msg.ltime, U64, "ltime"), b"Node": enc_str(msg.node)},
    )


def encode_leave_intent(msg: LeaveIntent) -> bytes:
    """Serf user-message payload for ``messageLeave``."""
    return _encode(
        SerfMessageType.LEAVE,
        {
            b"LTime": check_uint(msg.ltime, U64, "ltime"),
            b"Node": enc_str(msg.node),
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
            b"LTime": check_uint(msg.ltime, U64, "ltime"),
            b"Name": enc_str(msg.name),
            b"Payload": nil_if_empty(check_bytes(msg.payload, "payload")),
        },
    )


def encode_query(msg: Query) -> bytes:
    """Serf user-message payload for ``messageQuery``."""
    filters = [check_bytes(f, "filter") for f in msg.filters]
    if isinstance(msg.timeout_ns, bool) or not isinstance(msg.timeout_ns, int):
        raise SerfCodecError("timeout_ns must be an int")
    if not I64_MIN <= msg.timeout_ns <= I64_MAX:
        raise SerfCodecError(f"timeout_ns={msg.timeout_ns} is out of range")
    return _encode(
        SerfMessageType.QUERY,
        {
            b"LTime": check_uint(msg.ltime, U64, "ltime"),
            b"ID": check_uint(msg.id, U32, "id"),
            b"Addr": nil_if_empty(check_bytes(msg.addr, "addr")),
            b"Port": check_uint(msg.port, U16, "port"),
            b"SourceNode": enc_str(msg.source_node),
            b"Filters": filters or None,
            b"Flags": check_uint(msg.flags, U32, "flags"),
            b"RelayFactor": check_uint(msg.relay_factor, U8, "relay_factor"),
            b"Timeout": int(msg.timeout_ns),
            b"Name": enc_str(msg.name),
            b"Payload": nil_if_empty(check_bytes(msg.payload, "payload")),
        },
    )


def encode_query_response(msg: QueryResponse) -> bytes:
    """Serf user-message payload for ``messageQueryResponse``."""
    return _encode(
        SerfMessageType.QUERY_RESPONSE,
        {
            b"LTime": check_uint(msg.ltime, U64, "ltime"),
            b"ID": check_uint(msg.id, U32, "id"),
            b"From": enc_str(msg.from_node),
            b"Flags": check_uint(msg.flags, U32, "flags"),
            b"Payload": nil_if_empty(check_bytes(msg.payload, "payload")),
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
    obj = go_struct(unpack(body), "messageJoin")
    return JoinIntent(ltime=get_uint(obj, "LTime"), node=get_str(obj, "Node"))


def _decode_leave(body: bytes) -> LeaveIntent:
    obj = go_struct(unpack(body), "messageLeave")
    return LeaveIntent(
        ltime=get_uint(obj, "LTime"), node=get_str(obj, "Node"), prune=get_bool(obj, "Prune")
    )


def _decode_user_event(body: bytes) -> UserEvent:
    obj = go_struct(unpack(body), "messageUserEvent")
    return UserEvent(
        ltime=get_uint(obj, "LTime"),
        name=get_str(obj, "Name"),
        payload=get_bytes(obj, "Payload"),
        cc=get_bool(obj, "CC"),
    )


def _decode_query(body: bytes) -> Query:
    obj = go_struct(unpack(body), "messageQuery")
    filters: list[bytes] = []
    for item in get_list(obj, "Filters"):
        if item is None:
            item = b""
        if not isinstance(item, bytes):
            raise SerfCodecError("Filters must be an array of byte strings")
        filters.append(item)
    return Query(
        ltime=get_uint(obj, "LTime"),
        id=get_uint(obj, "ID", U32),
        addr=get_bytes(obj, "Addr"),
        port=get_uint(obj, "Port", U16),
        source_node=get_str(obj, "SourceNode"),
        filters=tuple(filters),
        flags=get_uint(obj, "Flags", U32),
        relay_factor=get_uint(obj, "RelayFactor", U8),
        timeout_ns=get_int64(obj, "Timeout"),
        name=get_str(obj, "Name"),
        payload=get_bytes(obj, "Payload"),
    )


def _decode_query_response(body: bytes) -> QueryResponse:
    obj = go_struct(unpack(body), "messageQueryResponse")
    return QueryResponse(
        ltime=get_uint(obj, "LTime"),
        id=get_uint(obj, "ID", U32),
        from_node=get_str(obj, "From"),
        flags=get_uint(obj, "Flags", U32),
        payload=get_bytes(obj, "Payload"),
    )


def _decode_relay(body: bytes) -> dict[str, Any]:
    """``messageRelayType``: msgpack ``relayHeader{DestAddr net.UDPAddr, DestName}`` then
    the relayed serf message (type byte included)."""
    header_obj, used = unpack_prefix(body)
    header = go_struct(header_obj, "relayHeader")
    dest = go_struct(header.get(b"DestAddr"), "DestAddr")
    return {
        "dest_ip": get_bytes(dest, "IP"),
        "dest_port": get_int64(dest, "Port"),
        "dest_zone": get_str(dest, "Zone"),
        "dest_name": get_str(header, "DestName"),
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
        data = check_bytes(payload, "payload")
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
            result = plain(go_struct(unpack(body), kind.name.lower()))
        return kind, result
    except SerfCodecError:
        raise
    except (ValueError, TypeError, RecursionError, UnicodeError) as exc:
        raise SerfCodecError(f"malformed serf message: {exc}") from exc
