"""A serf member's own state as serf encodes it: tags (node metadata), the Lamport clock, and
the push-pull user state (serf/serf.go ``encodeTags``/``decodeTags``, serf/lamport.go,
serf/delegate.go ``LocalState``/``MergeRemoteState``). Pure: stdlib + msgpack only.

Rules:
- Tags: empty Meta decodes as ``{"role": ""}`` and Meta without the 0xff magic byte as
  ``{"role": meta}`` (legacy); ``encode_tags`` sorts keys so the same tags give the same
  bytes (memberlist fires NotifyUpdate whenever the Meta bytes change); encoded tags must fit
  ``META_MAX_SIZE``.
- A Lamport clock only moves forward; witnessing ``v`` moves it to ``v + 1`` unless it is
  already past ``v``.
- The push-pull state's ``Events`` is an array of ``EVENT_BUFFER_SIZE`` slots, an event at
  ``ltime % size``; the rest are nil.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.serf.constants import EVENT_BUFFER_SIZE, META_MAX_SIZE, TAG_MAGIC_BYTE, SerfMessageType
from agent.serf.gomsgpack import (
    U64,
    SerfCodecError,
    check_bytes,
    check_uint,
    dec_str,
    enc_str,
    get_bytes,
    get_list,
    get_str,
    get_uint,
    go_struct,
    nil_if_empty,
    pack,
    unpack,
)

# --- tags (serf.go encodeTags / decodeTags) -------------------------------------------------


def encode_tags(tags: Mapping[str, str]) -> bytes:
    """Meta for ``tags`` as serf's ``encodeTags`` (protocol >= 3): 0xff + msgpack map.

    Keys are written sorted (serf writes Go's random map order) so the same tags always
    give the same Meta bytes: memberlist fires NotifyUpdate whenever the bytes change.
    """
    body: dict[bytes, bytes] = {}
    for key in sorted(tags):
        body[enc_str(key)] = enc_str(tags[key])
    return bytes([TAG_MAGIC_BYTE]) + pack(body)


def decode_tags(meta: bytes) -> dict[str, str]:
    """Tags from a node's Meta as serf's ``decodeTags``.

    Meta that is empty or does not start with 0xff is the legacy role: ``{"role": meta}``
    (so empty Meta is ``{"role": ""}``, exactly as serf shows it). Raises
    ``SerfCodecError`` (a ``ValueError``) when the map after 0xff is malformed; serf logs
    that and keeps what it decoded.
    """
    meta = check_bytes(meta, "meta")
    if not meta or meta[0] != TAG_MAGIC_BYTE:
        return {"role": dec_str(meta)}
    obj = unpack(meta[1:])
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
            raise SerfCodecError(f"tag {dec_str(key)!r} must be a string, got {value!r}")
        tags[dec_str(key)] = dec_str(value)
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
        self._counter = check_uint(start, U64, "start")

    def time(self) -> int:
        """The current value (``Time``)."""
        return self._counter

    def increment(self) -> int:
        """Add one and return the new value (``Increment``; wraps like Go's uint64)."""
        self._counter = (self._counter + 1) & U64
        return self._counter

    def witness(self, v: int) -> None:
        """``Witness``: a value older than ours changes nothing; otherwise our clock becomes
        ``v + 1`` (note: witnessing our own current value also moves us one ahead)."""
        check_uint(v, U64, "lamport time")
        if v < self._counter:
            return
        self._counter = (v + 1) & U64

    def __repr__(self) -> str:
        return f"LamportClock({self._counter})"


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
            b"Name": enc_str(e.name),
            b"Payload": nil_if_empty(check_bytes(e.payload, "payload")),
        }
        for e in entry.events
    ]
    return {b"Events": events or None, b"LTime": check_uint(entry.ltime, U64, "ltime")}


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
    check_uint(event_buffer_size, 1 << 24, "event_buffer_size")
    buffer: list[dict[bytes, Any] | None] = [None] * event_buffer_size
    for entry in events:
        if not isinstance(entry, BufferedEvents):
            raise SerfCodecError(f"events must be BufferedEvents, got {type(entry).__name__}")
        if event_buffer_size == 0:
            raise SerfCodecError("events given but event_buffer_size is 0")
        slot = check_uint(entry.ltime, U64, "event ltime") % event_buffer_size
        if buffer[slot] is not None:
            raise SerfCodecError(f"two event buffer entries for slot {slot}")
        buffer[slot] = _encode_buffered(entry)
    statuses = {
        enc_str(name): check_uint(value, U64, f"status ltime of {name!r}")
        for name, value in status_ltimes.items()
    }
    body = {
        b"EventLTime": check_uint(event_ltime, U64, "event_ltime"),
        b"Events": buffer,
        b"LTime": check_uint(ltime, U64, "ltime"),
        b"LeftMembers": [enc_str(name) for name in left_members],
        b"QueryLTime": check_uint(query_ltime, U64, "query_ltime"),
        b"StatusLTimes": statuses,
    }
    return bytes([SerfMessageType.PUSH_PULL]) + pack(body)


def _decode_buffered(obj: Any) -> BufferedEvents:
    entry = go_struct(obj, "userEvents")
    items: list[BufferedEvent] = []
    for item in get_list(entry, "Events"):
        ev = go_struct(item, "userEvent")
        items.append(BufferedEvent(name=get_str(ev, "Name"), payload=get_bytes(ev, "Payload")))
    return BufferedEvents(ltime=get_uint(entry, "LTime"), events=tuple(items))


def decode_push_pull_state(buf: bytes) -> dict[str, Any]:
    """Decode a serf push-pull user state (what ``MergeRemoteState`` accepts).

    Returns ``{"ltime", "status_ltimes": {name: ltime} (wire order), "left_members":
    [name], "event_ltime", "events": [BufferedEvents] (non-nil slots, buffer order),
    "event_buffer_size", "query_ltime"}``. Tolerant like Go's decoder (missing fields are
    zero); raises only ``ValueError`` (``SerfCodecError``).
    """
    try:
        data = check_bytes(buf, "state")
        if not data:
            raise SerfCodecError("remote state is zero bytes")
        if data[0] != SerfMessageType.PUSH_PULL:
            raise SerfCodecError(f"remote state has bad type prefix: {data[0]}")
        obj = go_struct(unpack(data[1:]), "messagePushPull")
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
                raise SerfCodecError(f"StatusLTimes[{dec_str(name)!r}] must be an integer")
            status[dec_str(name)] = check_uint(value or 0, U64, "StatusLTimes value")
        left: list[str] = []
        for name in get_list(obj, "LeftMembers"):
            if name is None:
                name = b""
            if not isinstance(name, bytes):
                raise SerfCodecError("LeftMembers must be strings")
            left.append(dec_str(name))
        raw_events = get_list(obj, "Events")
        events = [_decode_buffered(e) for e in raw_events if e is not None]
        return {
            "ltime": get_uint(obj, "LTime"),
            "status_ltimes": status,
            "left_members": left,
            "event_ltime": get_uint(obj, "EventLTime"),
            "events": events,
            "event_buffer_size": len(raw_events),
            "query_ltime": get_uint(obj, "QueryLTime"),
        }
    except SerfCodecError:
        raise
    except (ValueError, TypeError, RecursionError, UnicodeError) as exc:
        raise SerfCodecError(f"malformed push-pull state: {exc}") from exc
