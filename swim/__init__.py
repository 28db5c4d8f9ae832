"""swim: a sans-IO SWIM + Lifeguard membership core speaking HashiCorp memberlist's protocol.

The public API is re-exported here; see ``swim.node`` for the state machine's contract.
"""

from swim.config import Config, ConfigError
from swim.effects import (
    EventKind,
    JoinResult,
    Member,
    MemberEvent,
    NodeStats,
    Notice,
    Output,
    Packet,
    ProbeResult,
    StreamKind,
    StreamRequest,
    Timer,
    UrgentProbeOutcome,
    UserMessage,
)
from swim.messages import Address, NodeStateType
from swim.node import Node
from swim.table import MembershipSnapshot, SeedMember

__all__ = [
    "Address",
    "Config",
    "ConfigError",
    "EventKind",
    "JoinResult",
    "Member",
    "MemberEvent",
    "MembershipSnapshot",
    "Node",
    "NodeStateType",
    "NodeStats",
    "Notice",
    "Output",
    "Packet",
    "ProbeResult",
    "SeedMember",
    "StreamKind",
    "StreamRequest",
    "Timer",
    "UrgentProbeOutcome",
    "UserMessage",
]
