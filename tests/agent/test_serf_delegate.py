"""The Serf delegate's rules (agent/serf/delegate.py), pure: bytes and a view in, actions out.

Every rule of the module docstring has a table here: the message table, the clocks, intent
news and its bound, leave intents by member state, push-pull LeftMembers, our own intents,
forgetting, queries and the key queries. No trio, no sockets.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest

from agent import serf
from agent.serf import delegate
from agent.serf.delegate import (
    FORCE_LEAVE_STATES,
    KEY_CHANGES,
    MESSAGE_RULES,
    Broadcast,
    ForceLeave,
    Log,
    MarkDepartedLeft,
    QueryReceived,
    SendUser,
    SerfAction,
    SerfDelegate,
    SerfView,
    UserEventReceived,
    Witness,
)
from agent.serf.queries import FILTER_NODE, FILTER_TAG, KEY_QUERIES
from swim import Address, EventKind, Keyring, KeyringError, Member, NodeStateType

ME = "me"
QUERIER = Address("127.0.0.1", 7946)
K1, K2, K3 = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))


def _member(name: str, state: NodeStateType = NodeStateType.ALIVE, port: int = 7000) -> Member:
    return Member(name, Address("10.0.0.1", port), b"", 1, state, 0, (1, 5, 2, 2, 5, 5))


@dataclass
class Table:
    """A member table as ``swim.Node`` offers it."""

    rows: dict[str, Member] = field(default_factory=dict)

    def member(self, name: str) -> Member | None:
        return self.rows.get(name)

    def members(self) -> Sequence[Member]:
        return sorted(self.rows.values(), key=lambda m: m.name)


@dataclass
class Keys:
    """A key store as ``swim.Node`` offers it."""

    keyring: Keyring | None

    def install_key(self, key: bytes) -> None:
        assert self.keyring is not None
        self.keyring.install(key)

    def use_key(self, key: bytes) -> None:
        assert self.keyring is not None
        self.keyring.use(key)

    def remove_key(self, key: bytes) -> None:
        assert self.keyring is not None
        self.keyring.remove(key)


def _view(*members: Member, leaving: bool = False, **kwargs: Any) -> SerfView:
    table = Table({m.name: m for m in (_member(ME), *members)})
    return SerfView(table, {"role": "web-1"}, leaving, **kwargs)


def _join(ltime: int, node: str) -> bytes:
    return serf.encode_join_intent(serf.JoinIntent(ltime, node))


def _leave(ltime: int, node: str) -> bytes:
    return serf.encode_leave_intent(serf.LeaveIntent(ltime, node))


def _query(
    ltime: int = 5,
    qid: int = 1,
    name: str = "deploy",
    *,
    flags: int = 0,
    filters: tuple[bytes, ...] = (),
    payload: bytes = b"",
    addr: bytes = bytes([127, 0, 0, 1]),
) -> bytes:
    query = serf.Query(
        ltime, qid, addr, QUERIER.port, "origin", filters, flags, 0, 0, name, payload
    )
    return serf.encode_query(query)


def _key_request(key: bytes) -> bytes:
    return bytes([serf.SerfMessageType.KEY_REQUEST]) + bytes(msgpack.packb({b"Key": key}))


def _pushpull(ltime: int, status: dict[str, int], left: list[str]) -> bytes:
    return serf.encode_push_pull_state(ltime, status, left, 0, query_ltime=0)


def _response(action: SerfAction) -> serf.QueryResponse:
    assert isinstance(action, SendUser) and action.dest == QUERIER
    _, message = serf.decode_serf_message(action.payload)
    assert isinstance(message, serf.QueryResponse)
    return message


def _key_response(action: SerfAction) -> dict[str, Any]:
    kind, body = serf.decode_serf_message(_response(action).payload)
    assert kind is serf.SerfMessageType.KEY_RESPONSE and isinstance(body, dict)
    return body


# --- the message table --------------------------------------------------------------------------


def test_every_serf_message_type_has_one_rule() -> None:
    assert set(MESSAGE_RULES) == set(serf.SerfMessageType)
    for kind, rule in MESSAGE_RULES.items():
        assert rule.reason, kind
        if rule.handler is None:
            assert rule.witness is Witness.NONE, f"{kind.name}: witnessed but not handled"


SAMPLES: dict[serf.SerfMessageType, bytes] = {
    serf.SerfMessageType.LEAVE: _leave(10, "other"),
    serf.SerfMessageType.JOIN: _join(10, "other"),
    serf.SerfMessageType.PUSH_PULL: _pushpull(10, {"x": 3}, ["x"]),
    serf.SerfMessageType.USER_EVENT: serf.encode_user_event(serf.UserEvent(10, "deploy", b"v2")),
    serf.SerfMessageType.QUERY: _query(ltime=10),
    serf.SerfMessageType.QUERY_RESPONSE: serf.encode_query_response(
        serf.QueryResponse(10, 1, "other", 0, b"x")
    ),
    serf.SerfMessageType.CONFLICT_RESPONSE: bytes([6]) + msgpack.packb({"Member": None}),
    serf.SerfMessageType.KEY_REQUEST: _key_request(K1),
    serf.SerfMessageType.KEY_RESPONSE: bytes([8]) + msgpack.packb({"Result": True}),
    serf.SerfMessageType.RELAY: bytes([9])
    + msgpack.packb({"DestAddr": {"IP": b"\x7f\x00\x00\x01", "Port": 1}, "DestName": "x"})
    + _join(10, "other"),
}


@pytest.mark.parametrize("kind", list(serf.SerfMessageType), ids=lambda k: k.name)
def test_the_table_says_which_clock_moves_and_whether_anything_happens(
    kind: serf.SerfMessageType,
) -> None:
    d = SerfDelegate(ME)
    actions = d.on_user_message(SAMPLES[kind], _view(_member("other")))
    rule = MESSAGE_RULES[kind]
    assert d.clock.time() == (11 if rule.witness is Witness.MEMBER else 0)
    assert d.query_clock.time() == (11 if rule.witness is Witness.QUERY else 0)
    if rule.handler is None:
        assert actions == []
    else:
        assert actions, f"{kind.name} is handled: the sample must do something"


@pytest.mark.parametrize("payload", [b"", b"\x63junk", b"\x01\xc1", bytes([1]) + b"\x92\x01"])
def test_bytes_that_are_not_a_serf_message_do_nothing(payload: bytes) -> None:
    d = SerfDelegate(ME)
    assert d.on_user_message(payload, _view()) == []
    assert (d.clock.time(), d.query_clock.time(), d.intent_names) == (0, 0, 0)


def test_witnessing_an_older_ltime_keeps_the_clock() -> None:
    d = SerfDelegate(ME)
    d.on_user_message(_join(10, "a"), _view())
    d.on_user_message(_join(3, "b"), _view())
    assert d.clock.time() == 11


# --- intents ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ltimes", "news"),
    [
        ([5], [True]),
        ([5, 5], [True, False]),  # the same intent again
        ([5, 4], [True, False]),  # an older one
        ([5, 6], [True, True]),  # a newer one
        ([0], [True]),  # nothing seen yet: any LTime is news
    ],
)
@pytest.mark.parametrize("encode", [_join, _leave], ids=["join", "leave"])
def test_an_intent_is_news_once_and_news_is_regossiped_byte_for_byte(
    ltimes: list[int], news: list[bool], encode: Any
) -> None:
    d = SerfDelegate(ME)
    view = _view(_member("other"))
    for ltime, expected in zip(ltimes, news, strict=True):
        payload = encode(ltime, "other")
        actions = d.on_user_message(payload, view)
        assert actions == ([Broadcast(payload)] if expected else [])
    assert d.status_ltime("other") == max(ltimes)


def test_intent_clocks_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delegate, "MAX_INTENT_NAMES", 2)
    d = SerfDelegate(ME)
    view = _view()
    assert d.on_user_message(_join(1, "a"), view)
    assert d.on_user_message(_join(1, "b"), view)
    assert d.on_user_message(_join(1, "c"), view) == [], "one more member is not news"
    assert d.on_user_message(_join(2, "a"), view), "a known member still is"
    assert d.intent_names == 2 and d.status_ltime("c") is None
    d.forget(["b"])
    assert d.on_user_message(_join(1, "c"), view)


LEAVE_CASES: list[tuple[str, NodeStateType | None, list[SerfAction]]] = [
    ("alive", NodeStateType.ALIVE, []),
    ("suspect", NodeStateType.SUSPECT, [ForceLeave("other")]),
    ("dead", NodeStateType.DEAD, [ForceLeave("other")]),
    ("left", NodeStateType.LEFT, []),
    ("reaped", None, [MarkDepartedLeft("other")]),
]


@pytest.mark.parametrize(
    ("state", "expected"), [c[1:] for c in LEAVE_CASES], ids=[c[0] for c in LEAVE_CASES]
)
def test_a_leave_intent_by_the_state_the_core_holds(
    state: NodeStateType | None, expected: list[SerfAction]
) -> None:
    view = _view() if state is None else _view(_member("other", state))
    payload = _leave(7, "other")
    assert SerfDelegate(ME).on_user_message(payload, view) == [Broadcast(payload), *expected]


def test_force_leave_states_are_the_failed_ones() -> None:
    assert {s.name for s in FORCE_LEAVE_STATES} == {"DEAD", "SUSPECT"}


def _leaving_other() -> SerfDelegate:
    """A delegate that had other's leave intent while other was alive."""
    d = SerfDelegate(ME)
    d.on_user_message(_leave(7, "other"), _view(_member("other")))
    assert d.is_leaving("other")
    return d


def test_a_leaving_member_declared_dead_left() -> None:
    d = _leaving_other()
    for kind in (EventKind.SUSPECT, EventKind.ALIVE, EventKind.UPDATED):
        assert d.on_member_event(kind, "other") == [], kind
    assert d.on_member_event(EventKind.DEAD, "other") == [ForceLeave("other")]
    assert not d.is_leaving("other")
    assert d.on_member_event(EventKind.DEAD, "other") == [], "once"


def test_a_member_that_is_not_leaving_stays_dead() -> None:
    d = SerfDelegate(ME)
    assert d.on_member_event(EventKind.DEAD, "other") == []
    d.on_user_message(_join(3, "other"), _view(_member("other")))
    assert d.on_member_event(EventKind.DEAD, "other") == []


ENDS_LEAVING: list[tuple[str, Any]] = [
    ("join intent", lambda d: d.on_user_message(_join(8, "other"), _view(_member("other")))),
    ("joins again", lambda d: d.on_member_event(EventKind.JOINED, "other")),
    ("forgotten", lambda d: d.forget(["other"])),
]


@pytest.mark.parametrize("end", [c[1] for c in ENDS_LEAVING], ids=[c[0] for c in ENDS_LEAVING])
def test_what_ends_a_leaving(end: Any) -> None:
    d = _leaving_other()
    end(d)
    assert not d.is_leaving("other")
    assert d.on_member_event(EventKind.DEAD, "other") == []


def test_an_old_join_intent_does_not_end_a_leaving() -> None:
    d = _leaving_other()
    assert d.on_user_message(_join(6, "other"), _view(_member("other"))) == []
    assert d.is_leaving("other")


def test_a_stale_leave_about_us_is_refuted_by_a_join_intent() -> None:
    d = SerfDelegate(ME)
    payload = _leave(7, ME)
    actions = d.on_user_message(payload, _view())
    assert actions == [Broadcast(payload), Broadcast(_join(8, ME))], "LTime past the witnessed 7"
    assert d.clock.time() == 9


def test_a_leave_about_us_while_we_leave_is_not_refuted() -> None:
    payload = _leave(7, ME)
    assert SerfDelegate(ME).on_user_message(payload, _view(leaving=True)) == [Broadcast(payload)]


def test_a_leave_intent_that_is_not_news_does_nothing_more() -> None:
    d = SerfDelegate(ME)
    view = _view(_member("other", NodeStateType.DEAD))
    d.on_user_message(_leave(7, "other"), view)
    assert d.on_user_message(_leave(7, "other"), view) == []


def test_user_events_are_published_not_regossiped() -> None:
    event = serf.encode_user_event(serf.UserEvent(4, "deploy", b"v2"))
    d = SerfDelegate(ME)
    assert d.on_user_message(event, _view()) == [UserEventReceived("deploy", b"v2", 4)]
    assert d.on_user_message(event, _view()) == [UserEventReceived("deploy", b"v2", 4)]


# --- our own intents ----------------------------------------------------------------------------


def test_our_join_intent_carries_the_clock_then_moves_it() -> None:
    d = SerfDelegate(ME)
    d.clock.witness(4)
    assert d.join_intent() == [Broadcast(_join(5, ME))]
    assert d.join_intent() == [Broadcast(_join(6, ME))]
    assert d.clock.time() == 7
    assert d.status_ltime(ME) is None, "as today: our join is not recorded"


def test_our_leave_intent_is_remembered_so_its_echo_is_not_news() -> None:
    d = SerfDelegate(ME)
    view = _view(_member("other", NodeStateType.DEAD))
    actions = d.leave_intent("other", view)
    assert actions == [Broadcast(_leave(0, "other"))]
    assert d.clock.time() == 1 and d.status_ltime("other") == 0
    assert d.on_user_message(_leave(0, "other"), view) == []


def test_a_direct_leave_intent_goes_to_every_alive_peer_up_to_the_fanout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    view = _view(
        _member("a", port=1),
        _member("b", NodeStateType.SUSPECT, port=2),
        _member("c", port=3),
        _member("d", NodeStateType.DEAD, port=4),
        _member("e", port=5),
    )
    payload = _leave(0, ME)
    sends = [SendUser(Address("10.0.0.1", p), payload) for p in (1, 3, 5)]
    assert SerfDelegate(ME).leave_intent(ME, view, direct=True) == [Broadcast(payload), *sends]
    monkeypatch.setattr(delegate, "LEAVE_FANOUT", 2)
    assert SerfDelegate(ME).leave_intent(ME, view, direct=True) == [Broadcast(payload), *sends[:2]]


def test_forgotten_members_lose_their_intent_clock() -> None:
    d = SerfDelegate(ME)
    d.on_user_message(_join(5, "a"), _view())
    d.forget(["a", "never-seen"])
    assert d.status_ltime("a") is None
    assert d.on_user_message(_join(5, "a"), _view()) == [Broadcast(_join(5, "a"))]


# --- push-pull state ----------------------------------------------------------------------------


def test_a_push_pull_state_moves_the_clock_to_its_ltime() -> None:
    d = SerfDelegate(ME)
    assert d.on_push_pull_state(_pushpull(10, {}, []), _view()) == []
    assert d.clock.time() == 10, "witnessed as LTime - 1"
    other = SerfDelegate(ME)
    other.on_push_pull_state(_pushpull(0, {}, []), _view())
    assert other.clock.time() == 0


@pytest.mark.parametrize("state", [b"", b"\x03", b"\x02\xc1"])
def test_a_push_pull_state_that_does_not_decode_is_ignored(state: bytes) -> None:
    d = SerfDelegate(ME)
    assert d.on_push_pull_state(state, _view()) == []
    assert d.clock.time() == 0


def test_left_members_are_leave_intents_one_past_their_join_ltime() -> None:
    d = SerfDelegate(ME)
    view = _view(_member("dead", NodeStateType.DEAD), _member("alive"))
    state = _pushpull(3, {"dead": 4, "alive": 2}, ["dead", "alive", "reaped", ME])
    assert d.on_push_pull_state(state, view) == [
        ForceLeave("dead"),
        MarkDepartedLeft("reaped"),
        Broadcast(_join(3, ME)),  # a stale leave about us: refuted
    ]
    assert (d.status_ltime("dead"), d.status_ltime("alive"), d.status_ltime("reaped")) == (5, 3, 1)
    assert d.on_push_pull_state(state, view) == [], "the same state again is no news"


def test_left_members_are_not_news_under_a_newer_intent() -> None:
    d = SerfDelegate(ME)
    view = _view(_member("x", NodeStateType.DEAD))
    d.on_user_message(_join(9, "x"), view)
    assert d.on_push_pull_state(_pushpull(1, {"x": 4}, ["x"]), view) == []


def test_left_members_honoured_per_state_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delegate, "MAX_LEFT_MEMBERS", 2)
    d = SerfDelegate(ME)
    actions = d.on_push_pull_state(_pushpull(1, {}, ["a", "b", "c"]), _view())
    assert actions == [MarkDepartedLeft("a"), MarkDepartedLeft("b")]


# --- queries ------------------------------------------------------------------------------------


def _node_filter(names: list[str]) -> bytes:
    return bytes([FILTER_NODE]) + bytes(msgpack.packb(names))


def _tag_filter(tag: str, expr: str) -> bytes:
    return bytes([FILTER_TAG]) + bytes(msgpack.packb({"Tag": tag, "Expr": expr}))


QUERY_CASES: list[tuple[str, dict[str, Any], bool, bool, bool]] = [
    # (id, query fields, re-gossiped, acked, handed to the event handlers)
    ("plain", {}, True, False, True),
    ("ack", {"flags": serf.QUERY_FLAG_ACK}, True, True, True),
    ("no-broadcast", {"flags": serf.QUERY_FLAG_NO_BROADCAST}, False, False, True),
    (
        "no-broadcast-ack",
        {"flags": serf.QUERY_FLAG_NO_BROADCAST | serf.QUERY_FLAG_ACK},
        False,
        True,
        True,
    ),
    ("for-us-by-name", {"flags": 1, "filters": (_node_filter([ME]),)}, True, True, True),
    ("for-others", {"flags": 1, "filters": (_node_filter(["x"]),)}, True, False, False),
    ("for-us-by-tag", {"flags": 1, "filters": (_tag_filter("role", "^web"),)}, True, True, True),
    ("tag-mismatch", {"flags": 1, "filters": (_tag_filter("role", "db"),)}, True, False, False),
    ("no-address", {"flags": 1, "addr": b""}, True, False, False),
]


@pytest.mark.parametrize(
    ("fields", "regossiped", "acked", "handed"),
    [c[1:] for c in QUERY_CASES],
    ids=[c[0] for c in QUERY_CASES],
)
def test_a_query_is_passed_on_and_acked_by_its_flags_and_filters(
    fields: dict[str, Any], regossiped: bool, acked: bool, handed: bool
) -> None:
    d = SerfDelegate(ME)
    payload = _query(**fields)
    actions = d.on_user_message(payload, _view())
    expected: list[SerfAction] = [Broadcast(payload)] if regossiped else []
    assert actions[: len(expected)] == expected
    rest = actions[len(expected) :]
    acks = [a for a in rest if isinstance(a, SendUser)]
    assert len(acks) == (1 if acked else 0)
    queries = [a for a in rest if isinstance(a, QueryReceived)]
    assert [q.query.name for q in queries] == (["deploy"] if handed else [])
    assert len(rest) == len(acks) + len(queries)
    if acked:
        ack = _response(acks[0])
        assert (ack.ltime, ack.id, ack.from_node, ack.ack, ack.payload) == (5, 1, ME, True, b"")
    assert d.on_user_message(payload, _view()) == [], "a query is news once"


def test_queries_are_news_per_ltime_and_id() -> None:
    d = SerfDelegate(ME)
    assert d.on_user_message(_query(5, 1), _view())
    assert d.on_user_message(_query(5, 2), _view()), "same LTime, another ID"
    assert d.on_user_message(_query(6, 1), _view())
    assert d.on_user_message(_query(5, 1), _view()) == []


def _keys(*keys: bytes) -> Keys:
    return Keys(Keyring(list(keys)) if keys else None)


@dataclass
class Persist:
    calls: int = 0
    error: OSError | None = None

    def __call__(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error


# (id, query, key store before, persist error, result, message, keys after, primary after, log)
KEY_CASES: list[tuple[Any, ...]] = [
    ("list", "list-keys", b"", (K1, K2), None, True, "", None),
    (
        "list-none",
        "list-keys",
        b"",
        (),
        None,
        False,
        "Keyring is empty (encryption not enabled)",
        None,
    ),
    ("install", "install-key", K3, (K1,), None, True, "", ("info", "serf install-key query: done")),
    (
        "install-none",
        "install-key",
        K3,
        (),
        None,
        False,
        "No keyring to modify (encryption not enabled)",
        None,
    ),
    ("use", "use-key", K2, (K1, K2), None, True, "", ("info", "serf use-key query: done")),
    ("use-unknown", "use-key", K3, (K1,), None, False, "*", ("warning", None)),
    ("remove", "remove-key", K2, (K1, K2), None, True, "", ("info", "serf remove-key query: done")),
    ("remove-primary", "remove-key", K1, (K1, K2), None, False, "*", ("warning", None)),
    ("bad-request", "install-key", b"short", (K1,), None, False, "*", ("warning", None)),
    (
        "disk-full",
        "install-key",
        K3,
        (K1,),
        OSError(28, "No space left"),
        False,
        "*",
        ("warning", None),
    ),
]


@pytest.mark.parametrize(
    ("name", "key", "before", "persist_error", "ok", "message", "log"),
    [c[1:] for c in KEY_CASES],
    ids=[c[0] for c in KEY_CASES],
)
def test_key_queries_change_the_keyring_persist_it_and_answer(
    name: str,
    key: bytes,
    before: tuple[bytes, ...],
    persist_error: OSError | None,
    ok: bool,
    message: str,
    log: Any,
) -> None:
    keys = _keys(*before)
    persist = Persist(error=persist_error)
    view = _view(keys=keys, persist_keys=persist)
    request = _key_request(key) if key != b"short" else b"\x07\xc1"
    payload = _query(
        name=serf.INTERNAL_QUERY_PREFIX + name, flags=serf.QUERY_FLAG_ACK, payload=request
    )
    actions = SerfDelegate(ME).on_user_message(payload, view)
    assert actions[0] == Broadcast(payload)
    assert _response(actions[1]).ack
    answer = actions[-1]
    response = _response(answer)
    assert (response.ack, response.from_node) == (False, ME)
    body = _key_response(answer)
    assert body["Result"] is ok
    if message == "*":
        assert body["Message"]
    else:
        assert body["Message"] == message.encode()
    logs = [a for a in actions if isinstance(a, Log)]
    changed = name in KEY_CHANGES and keys.keyring is not None
    assert persist.calls == (1 if changed and (ok or persist_error) else 0)
    if log is None or name == "list-keys":
        assert logs == []
    else:
        assert len(logs) == 1 and logs[0].level == log[0]
        assert log[1] is None or logs[0].message == log[1]
    if name == "list-keys" and ok:
        assert body["Keys"] == [base64.b64encode(k) for k in before]
        assert body["PrimaryKey"] == base64.b64encode(K1)


def test_key_changes_reach_the_keyring() -> None:
    keys = _keys(K1)
    d = SerfDelegate(ME)
    for qid, (name, key) in enumerate([("install-key", K2), ("use-key", K2), ("remove-key", K1)]):
        query = _query(5, qid, serf.INTERNAL_QUERY_PREFIX + name, payload=_key_request(key))
        d.on_user_message(query, _view(keys=keys))
    assert keys.keyring is not None
    assert keys.keyring.keys == (K2,) and keys.keyring.primary_key == K2


def test_keyring_refusals_are_keyring_errors() -> None:
    with pytest.raises(KeyringError):
        _keys(K1).remove_key(K1)


@pytest.mark.parametrize("name", ["_serf_ping", "_serf_conflict", "deploy", "install-key"])
def test_other_queries_get_only_their_ack(name: str) -> None:
    """...and a user query (not ``_serf_``) goes to the event handlers, who may answer."""
    payload = _query(name=name, flags=serf.QUERY_FLAG_ACK, payload=_key_request(K3))
    keys = _keys(K1)
    actions = SerfDelegate(ME).on_user_message(payload, _view(keys=keys))
    handed = [] if name.startswith("_serf_") else [QueryReceived]
    assert [type(a) for a in actions] == [Broadcast, SendUser, *handed]
    assert keys.keyring is not None and keys.keyring.keys == (K1,)


def test_the_key_query_names_are_the_key_changes_and_list() -> None:
    assert set(KEY_QUERIES) == {*KEY_CHANGES, "list-keys"}


# --- purity -------------------------------------------------------------------------------------

ALLOWED_IMPORTS = {
    "__future__",
    "base64",
    "collections",
    "dataclasses",
    "enum",
    "ipaddress",
    "math",
    "msgpack",
    "re",
    "typing",
    "agent",
    "swim",
}


@pytest.mark.parametrize(
    "path", sorted(Path(serf.__file__).parent.glob("*.py")), ids=lambda p: p.name
)
def test_the_serf_package_is_pure(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            assert top in ALLOWED_IMPORTS, f"{path.name} imports {name}"
            if top == "agent":
                assert name.startswith("agent.serf"), f"{path.name} imports {name}"


def test_actions_are_frozen() -> None:
    action = Broadcast(b"x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        action.payload = b"y"  # type: ignore[misc]
