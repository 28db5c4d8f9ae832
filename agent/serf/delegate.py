"""The Serf delegate as pure logic: what a member does with each serf message, push-pull
state and intent of its own. No trio, no sockets, no clock, no logging: inputs in, actions
out (frozen dataclasses the agent executes in order, see ``SerfAction``).

The delegate owns Serf's member-side state: the Lamport clock of membership intents, the
query clock, the queries already handled (``queries.QuerySeen``) and each member's intent
LTime (serf.go ``statusLTime``). What it needs to know about membership comes in a
``SerfView``: the member table, our tags, whether we are leaving, the keyring.

Rules (hashicorp/serf v0.9.4: serf/serf.go ``handleNodeJoinIntent``,
``handleNodeLeaveIntent``, ``handleUserEvent``, ``handleQuery``, ``broadcastJoin``,
``Leave``; serf/delegate.go ``NotifyMsg``, ``MergeRemoteState``; serf/internal_query.go
``handleInstallKey``/``handleUseKey``/``handleRemoveKey``/``handleListKeys``)
--------------------------------------------------------------------------------------------
- One table, ``MESSAGE_RULES``, names for every serf message type the clock its LTime is
  witnessed into and its handler (or why it is ignored). A new Serf message has one obvious
  home: a row there; the tests iterate the table, so a type without a row fails them.
- Clocks. Join/leave intents and user events are witnessed into the member clock (serf
  witnesses user events into a separate event clock; we keep none, and a witnessed LTime
  only moves our clock forward), queries into the query clock, query responses into none.
  A push-pull state's ``LTime`` is witnessed as ``LTime - 1`` (``MergeRemoteState``).
- Our own intents carry the clock's current time, then the clock moves on (``broadcastJoin``,
  ``Leave``). A leave intent we send is remembered as that member's intent LTime, so it is
  not news when it comes back.
- An intent is news only if its LTime is newer than the last one seen for that member;
  at most ``MAX_INTENT_NAMES`` members are remembered (one beyond is not news). News is
  re-gossiped byte for byte: Serf relies on every member passing intents on.
- A leave intent that is news (``handleNodeLeaveIntent``): about us while we are not leaving,
  it is stale (e.g. from before a restart) and refuted by a join intent; about a member the
  core holds in a state of ``FORCE_LEAVE_STATES`` (dead, suspect), the member left (Serf's
  "EventMemberLeave (forced)"); about an alive member, it is *leaving* (serf's
  ``StatusLeaving``); about a left member, nothing (memberlist's own dead/left message
  ended it); about a member the core does not hold (already reaped as failed), its departed
  record turns "left".
- A leaving member the core then declares dead left (serf.go ``handleNodeLeave``: a leaving
  member's failure is its leave). The leave's own memberlist message can miss a member that
  had its intent: the leaver gossips it only a few times, some of them to dead members,
  and then stops answering probes. A join intent that is news, or the member joining
  again (dead or reaped before), ends the leaving (``handleNodeJoinIntent``, ``handleNodeJoin``).
- A push-pull state's ``LeftMembers`` (at most ``MAX_LEFT_MEMBERS``) are leave intents with
  LTime ``StatusLTimes[name] + 1``, so a leave missed in gossip still arrives.
- User events are published to subscribers (not re-gossiped).
- Queries (rules in agent/serf/queries.py): news once per (LTime, ID); news is re-gossiped
  unless ``no_broadcast``; a query for us (filters) is acked when it asks for an ack, and the
  key-management queries (``KEY_CHANGES`` and list-keys) are answered with a key response
  sent to the query's address. A key change that fails (bad request, keyring refusal, the
  keyring file write failing) is answered as failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from agent.serf import queries
from agent.serf.constants import INTERNAL_QUERY_PREFIX, SerfMessageType
from agent.serf.messages import (
    JoinIntent,
    LeaveIntent,
    Query,
    UserEvent,
    decode_serf_message,
    encode_join_intent,
    encode_leave_intent,
)
from agent.serf.state import LamportClock, decode_push_pull_state
from swim import LEAVE_FANOUT, Address, EventKind, Keyring, KeyringError, Member, NodeStateType

MAX_INTENT_NAMES = 65_536
"""Serf intent clocks remembered (one per member name); an intent about one more member is
not news. Entries go when the agent forgets a member (``SerfDelegate.forget``)."""
MAX_LEFT_MEMBERS = 65_536
"""LeftMembers names honoured from one push-pull state."""
FORCE_LEAVE_STATES = frozenset({NodeStateType.DEAD, NodeStateType.SUSPECT})
"""Core states in which a member named by a leave intent is forced to "left"
(serf.go ``handleNodeLeaveIntent``: a failed member becomes left)."""


# --- what the delegate needs to know ----------------------------------------------------------


class MemberTable(Protocol):
    """The core's member table (``swim.Node`` is one)."""

    def member(self, name: str) -> Member | None: ...

    def members(self) -> Sequence[Member]: ...


class KeyStore(Protocol):
    """The keyring and its changes (``swim.Node`` is one); a change raises ``ValueError``
    (``KeyringError`` is one) when the keyring refuses it."""

    @property
    def keyring(self) -> Keyring | None: ...

    def install_key(self, key: bytes) -> None: ...

    def use_key(self, key: bytes) -> None: ...

    def remove_key(self, key: bytes) -> None: ...


def _keep_nothing() -> None:
    """No keyring file: a key change lives in memory only."""


@dataclass(frozen=True, slots=True)
class SerfView:
    """What the delegate reads about its node when handling one input.

    ``members``: the core's member table; ``tags``: our current tags (query filters);
    ``leaving``: whether we are leaving (a stale leave about us is then not refuted);
    ``keys``: the keyring (None: as no keyring, encryption not enabled); ``persist_keys``:
    called after each key change from a query, writes the keyring file, may raise
    ``OSError`` (the query is then answered as failed)."""

    members: MemberTable
    tags: Mapping[str, str]
    leaving: bool = False
    keys: KeyStore | None = None
    persist_keys: Callable[[], None] = _keep_nothing


# --- what the delegate asks the agent to do -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Gossip ``payload`` as a memberlist user message (``Node.broadcast_user``)."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class SendUser:
    """Send ``payload`` to ``dest`` as one memberlist user message (``Node.send_user``)."""

    dest: Address
    payload: bytes


@dataclass(frozen=True, slots=True)
class ForceLeave:
    """A member the core holds as dead or suspect left (``Node.force_leave``)."""

    name: str


@dataclass(frozen=True, slots=True)
class MarkDepartedLeft:
    """A member the core no longer holds left: its departed record (agent/departed.py)
    turns "failed" into "left", and subscribers get a "left" event."""

    name: str


@dataclass(frozen=True, slots=True)
class UserEventReceived:
    """A serf user event (``serf event NAME PAYLOAD``) for subscribers."""

    name: str
    payload: bytes
    ltime: int


@dataclass(frozen=True, slots=True)
class Log:
    """A line for the agent's log; ``level`` is a ``swim.Notice`` level name ("info",
    "warning")."""

    level: str
    message: str


@dataclass(frozen=True, slots=True)
class QueryReceived:
    """A user query (``serf query NAME``) this node answers, for the event handlers; the
    answer goes to ``dest`` (agent/serf_runtime.py ``answer_query``)."""

    query: Query
    dest: Address


SerfAction = (
    Broadcast | SendUser | ForceLeave | MarkDepartedLeft | UserEventReceived | QueryReceived | Log
)


# --- the rules --------------------------------------------------------------------------------


class Witness(Enum):
    """Which clock a message's LTime moves."""

    MEMBER = "member"
    QUERY = "query"
    NONE = "none"


Handler = Callable[["SerfDelegate", Any, bytes, SerfView], list[SerfAction]]


@dataclass(frozen=True, slots=True)
class MessageRule:
    """What a member does with one serf message type: witness its LTime into ``witness``,
    then run ``handler`` (None: nothing more, for ``reason``)."""

    witness: Witness
    handler: Handler | None
    reason: str


KEY_CHANGES: Mapping[str, Callable[[KeyStore, bytes], None]] = {
    "install-key": lambda keys, key: keys.install_key(key),
    "use-key": lambda keys, key: keys.use_key(key),
    "remove-key": lambda keys, key: keys.remove_key(key),
}
"""The key-changing internal queries (internal_query.go) and the keyring change each makes;
``list-keys`` only reads."""


class SerfDelegate:
    """Serf's member-side logic for the node ``node_name``. Every input returns the actions
    the agent must execute, in order."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.clock = LamportClock()
        """The member clock (serf.go ``clock``): intents."""
        self.query_clock = LamportClock()
        """serf.go ``queryClock``."""
        self._queries_seen = queries.QuerySeen()
        self._status_ltimes: dict[str, int] = {}
        self._leaving: set[str] = set()
        """Members whose leave intent came while they were alive (serf's StatusLeaving);
        always names in ``_status_ltimes``, so bounded by ``MAX_INTENT_NAMES``."""

    # --- inputs ---------------------------------------------------------------------------

    def on_user_message(self, payload: bytes, view: SerfView) -> list[SerfAction]:
        """A memberlist user message (serf delegate.go ``NotifyMsg``); bytes that are not a
        serf message are ignored."""
        try:
            kind, message = decode_serf_message(payload)
        except ValueError:
            return []
        rule = MESSAGE_RULES[kind]
        if rule.witness is Witness.MEMBER:
            self.clock.witness(message.ltime)  # type: ignore[union-attr]
        elif rule.witness is Witness.QUERY:
            self.query_clock.witness(message.ltime)  # type: ignore[union-attr]
        if rule.handler is None:
            return []
        return rule.handler(self, message, payload, view)

    def on_push_pull_state(self, state: bytes, view: SerfView) -> list[SerfAction]:
        """A push-pull user state (delegate.go ``MergeRemoteState``): witness its clock and
        take its LeftMembers as leave intents. A state that does not decode is ignored."""
        try:
            decoded = decode_push_pull_state(state)
        except ValueError:
            return []
        ltime: int = decoded["ltime"]
        if ltime > 0:
            self.clock.witness(ltime - 1)
        status_ltimes: Mapping[str, int] = decoded["status_ltimes"]
        left: list[str] = decoded["left_members"]
        actions: list[SerfAction] = []
        for name in left[:MAX_LEFT_MEMBERS]:
            if self._intent_is_news(name, status_ltimes.get(name, 0) + 1):
                actions += self._on_leave_news(name, view)
        return actions

    def on_member_event(self, kind: EventKind, name: str) -> list[SerfAction]:
        """The core's event about ``name`` (serf.go ``handleNodeLeave``,
        ``handleNodeJoin``): a leaving member declared dead left; one that joins again is
        no longer leaving. A refuted suspicion or an update changes nothing."""
        if name not in self._leaving or kind not in (EventKind.DEAD, EventKind.JOINED):
            return []
        self._leaving.discard(name)
        return [ForceLeave(name)] if kind == EventKind.DEAD else []

    def join_intent(self) -> list[SerfAction]:
        """Our join intent (serf.go ``broadcastJoin``): after joining, and to refute a stale
        leave about us."""
        intent = JoinIntent(self.clock.time(), self.node_name)
        self.clock.increment()
        return [Broadcast(encode_join_intent(intent))]

    def leave_intent(self, name: str, view: SerfView, *, direct: bool = False) -> list[SerfAction]:
        """A leave intent for ``name`` (us when leaving, another member on force-leave),
        gossiped; with ``direct`` also sent straight to up to ``LEAVE_FANOUT`` alive members
        (Serf peers call a departure "left" only if the intent came first: tell them
        directly rather than hope gossip gets there in time)."""
        intent = LeaveIntent(self.clock.time(), name)
        self.clock.increment()
        self._remember(name, intent.ltime)
        payload = encode_leave_intent(intent)
        actions: list[SerfAction] = [Broadcast(payload)]
        if direct:
            alive = [
                m
                for m in view.members.members()
                if m.state == NodeStateType.ALIVE and m.name != self.node_name
            ]
            actions += [SendUser(m.address, payload) for m in alive[:LEAVE_FANOUT]]
        return actions

    def forget(self, names: Iterable[str]) -> None:
        """Drop the intent LTimes of members the agent forgot (reaped, departed record
        expired or evicted)."""
        for name in names:
            self._status_ltimes.pop(name, None)
            self._leaving.discard(name)

    # --- what it holds --------------------------------------------------------------------

    def status_ltime(self, name: str) -> int | None:
        """The LTime of the last intent seen for ``name`` (serf.go ``statusLTime``)."""
        return self._status_ltimes.get(name)

    def is_leaving(self, name: str) -> bool:
        """Whether ``name`` sent a leave intent while alive and has not died or
        rejoined since (serf's ``StatusLeaving``)."""
        return name in self._leaving

    @property
    def intent_names(self) -> int:
        """How many members' intent LTimes are remembered (at most ``MAX_INTENT_NAMES``)."""
        return len(self._status_ltimes)

    # --- handlers (MESSAGE_RULES) ---------------------------------------------------------

    def _on_join(self, message: JoinIntent, payload: bytes, view: SerfView) -> list[SerfAction]:
        if not self._intent_is_news(message.node, message.ltime):
            return []
        self._leaving.discard(message.node)
        return [Broadcast(payload)]

    def _on_leave(self, message: LeaveIntent, payload: bytes, view: SerfView) -> list[SerfAction]:
        if not self._intent_is_news(message.node, message.ltime):
            return []
        return [Broadcast(payload), *self._on_leave_news(message.node, view)]

    def _on_user_event(
        self, message: UserEvent, payload: bytes, view: SerfView
    ) -> list[SerfAction]:
        return [UserEventReceived(message.name, message.payload, message.ltime)]

    def _on_query(self, query: Query, payload: bytes, view: SerfView) -> list[SerfAction]:
        if not self._queries_seen.is_news(query.ltime, query.id):
            return []
        actions: list[SerfAction] = []
        if not query.no_broadcast:
            actions.append(Broadcast(payload))
        if not queries.for_us(query.filters, self.node_name, view.tags):
            return actions
        try:
            dest = Address(*queries.response_address(query))
        except ValueError:
            return actions
        if query.ack:
            actions.append(SendUser(dest, queries.response(query, self.node_name, b"", ack=True)))
        name = query.name.removeprefix(INTERNAL_QUERY_PREFIX)
        if query.name.startswith(INTERNAL_QUERY_PREFIX) and name in queries.KEY_QUERIES:
            answer, notes = self._key_query(name, query.payload, view)
            actions += notes
            actions.append(SendUser(dest, queries.response(query, self.node_name, answer)))
        elif not query.name.startswith(INTERNAL_QUERY_PREFIX):
            actions.append(QueryReceived(query, dest))  # the event handlers may answer it
        return actions

    # --- rules used by the handlers -------------------------------------------------------

    def _intent_is_news(self, name: str, ltime: int) -> bool:
        """serf.go: an intent matters only if newer than the last one seen for that node."""
        if ltime <= self._status_ltimes.get(name, -1):
            return False
        return self._remember(name, ltime)

    def _remember(self, name: str, ltime: int) -> bool:
        """Record ``name``'s intent LTime; False when the table is full."""
        if name not in self._status_ltimes and len(self._status_ltimes) >= MAX_INTENT_NAMES:
            return False
        self._status_ltimes[name] = ltime
        return True

    def _on_leave_news(self, name: str, view: SerfView) -> list[SerfAction]:
        """A leave intent that is news (serf.go ``handleNodeLeaveIntent``)."""
        if name == self.node_name:
            # A stale leave about us (e.g. from before a restart): serf peers would keep us
            # "leaving"; a newer join intent refutes it.
            return [] if view.leaving else self.join_intent()
        member = view.members.member(name)
        if member is None:
            return [MarkDepartedLeft(name)]
        if member.state in FORCE_LEAVE_STATES:
            return [ForceLeave(name)]
        if member.state == NodeStateType.ALIVE:
            self._leaving.add(name)
        return []

    def _key_query(self, name: str, payload: bytes, view: SerfView) -> tuple[bytes, list[Log]]:
        """internal_query.go ``handleInstallKey`` and friends, on ``view.keys``: the
        ``messageKeyResponse`` payload and what to log."""
        keys = view.keys
        keyring = keys.keyring if keys is not None else None
        if keys is None or keyring is None:
            empty = "Keyring is empty" if name == "list-keys" else "No keyring to modify"
            return queries.key_response(False, f"{empty} (encryption not enabled)", [], None), []
        change = KEY_CHANGES.get(name)
        if change is None:  # list-keys
            return queries.key_response(True, "", list(keyring.keys), keyring.primary_key), []
        try:
            change(keys, queries.key_request(payload))
            view.persist_keys()
        except (ValueError, KeyringError, OSError) as exc:
            failed = Log("warning", f"serf {name} query failed: {exc}")
            return queries.key_response(False, str(exc), [], None), [failed]
        return queries.key_response(True, "", [], None), [Log("info", f"serf {name} query: done")]


MESSAGE_RULES: Mapping[SerfMessageType, MessageRule] = {
    SerfMessageType.LEAVE: MessageRule(
        Witness.MEMBER, SerfDelegate._on_leave, "serf.go handleNodeLeaveIntent"
    ),
    SerfMessageType.JOIN: MessageRule(
        Witness.MEMBER, SerfDelegate._on_join, "serf.go handleNodeJoinIntent"
    ),
    SerfMessageType.PUSH_PULL: MessageRule(
        Witness.NONE, None, "comes in a push-pull exchange (on_push_pull_state), not gossip"
    ),
    SerfMessageType.USER_EVENT: MessageRule(
        Witness.MEMBER, SerfDelegate._on_user_event, "serf.go handleUserEvent"
    ),
    SerfMessageType.QUERY: MessageRule(
        Witness.QUERY, SerfDelegate._on_query, "serf.go handleQuery"
    ),
    SerfMessageType.QUERY_RESPONSE: MessageRule(
        Witness.NONE, None, "we send no queries, so no response is ours"
    ),
    SerfMessageType.CONFLICT_RESPONSE: MessageRule(
        Witness.NONE, None, "answers a _serf_conflict query, which we never send"
    ),
    SerfMessageType.KEY_REQUEST: MessageRule(
        Witness.NONE, None, "travels inside a key query's payload, not on its own"
    ),
    SerfMessageType.KEY_RESPONSE: MessageRule(
        Witness.NONE, None, "travels inside a query response's payload, not on its own"
    ),
    SerfMessageType.RELAY: MessageRule(
        Witness.NONE, None, "we relay no responses (RelayFactor is ignored, queries.py)"
    ),
}
"""serf delegate.go ``NotifyMsg``: one row per serf message type."""


__all__ = [
    "FORCE_LEAVE_STATES",
    "KEY_CHANGES",
    "MAX_INTENT_NAMES",
    "MAX_LEFT_MEMBERS",
    "MESSAGE_RULES",
    "Broadcast",
    "ForceLeave",
    "KeyStore",
    "Log",
    "MarkDepartedLeft",
    "MemberTable",
    "MessageRule",
    "SendUser",
    "SerfAction",
    "SerfDelegate",
    "SerfView",
    "UserEventReceived",
    "Witness",
]
