"""Serf's delegate protocol on top of memberlist, as a package: what a serf agent puts in
memberlist's extension points, and how our agent behaves as a serf member.

Serf (hashicorp/serf v0.9.4, the version Debian packages as ``serf 0.9.4~ds1``, which says
``0.8.2-dev`` in ``serf version``) runs on memberlist and uses its extension points:

- node metadata = the node's tags (``serf/serf.go`` ``encodeTags``/``decodeTags``):
  agent/serf/state.py;
- user messages = serf messages, ``[serf type byte][msgpack struct]`` after memberlist's
  user-message byte 8 (``serf/messages.go``, ``serf/delegate.go`` ``NotifyMsg``):
  agent/serf/messages.py;
- the push-pull user state = ``messagePushPull`` (``serf/delegate.go`` ``LocalState`` /
  ``MergeRemoteState``): agent/serf/state.py;
- the ack payload of a direct ping = ``[PingVersion=1][msgpack Coordinate]``
  (``serf/ping_delegate.go``, ``coordinate/coordinate.go``, ``coordinate/config.go``):
  agent/serf/coordinate.py.

Modules: ``constants`` (serf's numbers and the message type byte), ``gomsgpack`` (the
go-msgpack encoding every codec shares), ``state``, ``messages``, ``coordinate`` (the
codecs; pure, stdlib + msgpack only), ``queries`` (the pure rules of answering a query) and
``delegate`` (``SerfDelegate``: what a member does with each serf message, pure; the agent
executes the actions it returns). The codec names are re-exported here, so
``from agent import serf; serf.encode_tags(...)`` works.


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

from agent.serf import delegate, queries
from agent.serf.constants import (
    BROADCAST_TIMEOUT_S,
    EVENT_BUFFER_SIZE,
    INTERNAL_QUERY_PREFIX,
    LEAVE_PROPAGATE_DELAY_S,
    META_MAX_SIZE,
    PING_VERSION,
    PROTOCOL_VERSION_MAX,
    PROTOCOL_VERSION_MIN,
    QUERY_BUFFER_SIZE,
    QUERY_FLAG_ACK,
    QUERY_FLAG_NO_BROADCAST,
    REAP_INTERVAL_S,
    RECENT_INTENT_TIMEOUT_S,
    RECONNECT_INTERVAL_S,
    RECONNECT_TIMEOUT_S,
    SERF_AGENT_VSN,
    TAG_MAGIC_BYTE,
    TOMBSTONE_TIMEOUT_S,
    USER_EVENT_SANE_LIMIT,
    USER_EVENT_SIZE_LIMIT,
    SerfMessageType,
)
from agent.serf.coordinate import (
    DEFAULT_COORDINATE,
    DEFAULT_DIMENSIONALITY,
    HEIGHT_MIN,
    VIVALDI_ERROR_MAX,
    Coordinate,
    decode_ping_payload,
    encode_ping_payload,
)
from agent.serf.gomsgpack import SerfCodecError
from agent.serf.messages import (
    JoinIntent,
    LeaveIntent,
    Query,
    QueryResponse,
    SerfMessage,
    UserEvent,
    decode_serf_message,
    encode_join_intent,
    encode_leave_intent,
    encode_query,
    encode_query_response,
    encode_serf_message,
    encode_user_event,
)
from agent.serf.state import (
    BufferedEvent,
    BufferedEvents,
    LamportClock,
    decode_push_pull_state,
    decode_tags,
    encode_push_pull_state,
    encode_tags,
    tags_fit,
)

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
    "delegate",
    "encode_join_intent",
    "encode_leave_intent",
    "encode_ping_payload",
    "encode_push_pull_state",
    "encode_query",
    "encode_query_response",
    "encode_serf_message",
    "encode_tags",
    "encode_user_event",
    "queries",
    "tags_fit",
]
