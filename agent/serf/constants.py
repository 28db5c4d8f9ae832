"""Serf's numbers (serf/serf.go, serf/config.go, serf/messages.go, memberlist config.go @
serf v0.9.4): protocol versions, buffer sizes, timeouts, size limits, flags and the serf
message type byte. Every value carries the Go name it comes from.
"""

from __future__ import annotations

from enum import IntEnum

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
QUERY_RESPONSE_SIZE_LIMIT = 1024
"""serf.Config ``QueryResponseSizeLimit``: an encoded query response larger than this is
not sent (serf's ``Query.Respond`` refuses it)."""
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
