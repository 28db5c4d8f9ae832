"""agent.serf against hashicorp/serf v0.9.4 and the golden captures of real serf agents.

Formats: serf/messages.go (message types and structs), serf/serf.go (encodeTags /
decodeTags), serf/lamport.go (+ lamport_test.go), serf/delegate.go (LocalState /
MergeRemoteState), serf/ping_delegate.go and coordinate/{coordinate,config}.go. Every serf
user message, push-pull user state and ack payload captured in tests/golden/serf decodes,
matches its manifest summary, and re-encodes byte for byte.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import serf
from agent.serf import (
    DEFAULT_COORDINATE,
    BufferedEvent,
    BufferedEvents,
    Coordinate,
    JoinIntent,
    LamportClock,
    LeaveIntent,
    Query,
    QueryResponse,
    SerfCodecError,
    SerfMessageType,
    UserEvent,
)
from swim import (
    Ack,
    Alive,
    Crypto,
    Keyring,
    PushPull,
    StreamLimits,
    UserMsg,
    decode_packet,
    parse_stream,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "serf"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "manifest.json").read_text())
KEYS = {name: base64.b64decode(k["base64"]) for name, k in MANIFEST["keys"].items()}
NODE_TAGS: dict[str, dict[str, str]] = {n["name"]: n["tags"] for n in MANIFEST["nodes"]}
ENTRIES: list[dict[str, Any]] = MANIFEST["entries"]
USER_ENTRIES = [e for e in ENTRIES if "user(serf:" in e["summary"]]
STATE_ENTRIES = [e for e in ENTRIES if "+state(serf:pushPull)" in e["summary"]]
ACK_ENTRIES = [e for e in ENTRIES if "ack(payload)" in e["summary"]]
SUMMARY_USER = re.compile(r"user\(serf:(\w+)(?::([^)]+))?\)")
SUMMARY_NAMES = {
    "leave": SerfMessageType.LEAVE,
    "join": SerfMessageType.JOIN,
    "pushPull": SerfMessageType.PUSH_PULL,
    "userEvent": SerfMessageType.USER_EVENT,
    "query": SerfMessageType.QUERY,
    "queryResponse": SerfMessageType.QUERY_RESPONSE,
}


def _crypto(entry: dict[str, Any]) -> Crypto | None:
    if entry["scenario"] != "encrypted":
        return None
    return Crypto(Keyring([KEYS["k2"], KEYS["k1"]]), nonce=lambda n: bytes(n))


def _messages(entry: dict[str, Any]) -> list[Any]:
    data = (GOLDEN / str(entry["file"])).read_bytes()
    if entry["transport"] == "udp":
        decoded = decode_packet(data, _crypto(entry))
        assert decoded.drops == ()
        return list(decoded.messages)
    parsed = parse_stream(data, _crypto(entry), StreamLimits())
    assert parsed is not None
    return [parsed[0]]


def _user_payloads(entry: dict[str, Any]) -> list[bytes]:
    return [m.payload for m in _messages(entry) if isinstance(m, UserMsg)]


def _user_state(entry: dict[str, Any]) -> bytes:
    (message,) = _messages(entry)
    assert isinstance(message, PushPull)
    return message.user_state


def _ack_payloads(entry: dict[str, Any]) -> list[bytes]:
    return [m.payload for m in _messages(entry) if isinstance(m, Ack) and m.payload]


def _ids(entries: list[dict[str, Any]]) -> list[str]:
    return [str(e["file"]) for e in entries]


def test_corpus_has_what_these_tests_need() -> None:
    kinds = {k for e in USER_ENTRIES for k, _ in SUMMARY_USER.findall(e["summary"])}
    assert {"join", "leave", "userEvent", "query", "queryResponse"} <= kinds
    assert STATE_ENTRIES and ACK_ENTRIES


# --- tags: serf/serf.go encodeTags / decodeTags --------------------------------------------

GOLDEN_A_META = bytes.fromhex("ff81a4726f6c65a8676f6c64656e2d61")


@pytest.mark.parametrize(
    ("tags", "meta"),
    [
        ({}, b"\xff\x80"),
        ({"role": "golden-a"}, GOLDEN_A_META),
        ({"role": ""}, b"\xff\x81\xa4role\xa0"),
        # keys sorted: memberlist compares Meta bytes to detect updates
        ({"b": "1", "a": "2"}, b"\xff\x82\xa1a\xa12\xa1b\xa11"),
        ({"dc": "é"}, b"\xff\x81\xa2dc\xa2\xc3\xa9"),
        ({"k": "v" * 40}, b"\xff\x81\xa1k\xda\x00\x28" + b"v" * 40),
    ],
)
def test_encode_tags_layout(tags: dict[str, str], meta: bytes) -> None:
    assert serf.encode_tags(tags) == meta
    assert serf.decode_tags(meta) == tags


@pytest.mark.parametrize(
    "tags",
    [{}, {"role": "x"}, {"role": "web", "dc": "east", "rack": "r1"}, {"ünï": "cödé", "": ""}],
)
def test_tags_round_trip(tags: dict[str, str]) -> None:
    assert serf.decode_tags(serf.encode_tags(tags)) == tags


def test_golden_alive_meta_is_the_nodes_tags() -> None:
    seen: dict[str, bytes] = {}
    for entry in ENTRIES:
        if entry["transport"] != "udp":
            continue
        for message in _messages(entry):
            if isinstance(message, Alive):
                assert message.meta[0] == serf.TAG_MAGIC_BYTE
                assert serf.decode_tags(message.meta) == NODE_TAGS[message.node]
                assert serf.encode_tags(NODE_TAGS[message.node]) == message.meta
                assert message.vsn == serf.SERF_AGENT_VSN
                seen[message.node] = message.meta
    assert set(seen) == set(NODE_TAGS)


@pytest.mark.parametrize(
    ("meta", "tags"),
    [
        (b"", {"role": ""}),  # decodeTags: len(buf) == 0 -> legacy role
        (b"web", {"role": "web"}),
        (b"golden-a", {"role": "golden-a"}),
        (b"\xfe\x81", {"role": "\udcfe\udc81"}),  # not the magic byte: raw role
        (b"\xff\xc0", {}),  # nil map
        (b"\xff\x81\xa1a\xc0", {"a": ""}),  # nil string
        (b"\xff\x81\xa1a\xc4\x01b", {"a": "b"}),  # bin8 accepted like Go
        (GOLDEN_A_META + b"junk", {"role": "golden-a"}),  # trailing bytes ignored, as Go
    ],
)
def test_decode_tags_legacy_and_tolerant(meta: bytes, tags: dict[str, str]) -> None:
    assert serf.decode_tags(meta) == tags


@pytest.mark.parametrize(
    "meta",
    [
        b"\xff",  # magic byte only
        b"\xff\x81\xa4role",  # truncated
        b"\xff\x92\xa1a\xa1b",  # array
        b"\xff\x01",  # int
        b"\xff\x81\xa1a\x01",  # int value
        b"\xff\x81\x01\xa1a",  # int key
        b"\xff\x81\xa1a\x81\xa1b\xa1c",  # map value
        b"\xff\xc1",  # never-used byte
        b"\xff\xd6\xff\x00\x00\x00\x00",  # ext (timestamp)
    ],
)
def test_malformed_tags_raise_value_error(meta: bytes) -> None:
    with pytest.raises(ValueError):
        serf.decode_tags(meta)


def test_tags_fit_memberlist_meta_limit() -> None:
    assert serf.META_MAX_SIZE == 512
    assert serf.tags_fit({"role": "golden-a"})
    # 0xff + fixmap + fixstr "k" + str16 header (3) + value = 512 exactly
    exact = {"k": "v" * (512 - 1 - 1 - 2 - 3)}
    assert len(serf.encode_tags(exact)) == 512
    assert serf.tags_fit(exact)
    assert not serf.tags_fit({"k": "v" * 509})
    assert not serf.tags_fit({f"tag{i}": "x" * 20 for i in range(30)})


# --- Lamport clock: serf/lamport.go, lamport_test.go ---------------------------------------


def test_lamport_clock_as_serf_lamport_test() -> None:
    clock = LamportClock()
    assert clock.time() == 0
    assert clock.increment() == 1
    assert clock.time() == 1
    clock.witness(41)
    assert clock.time() == 42
    clock.witness(41)
    assert clock.time() == 42
    clock.witness(30)
    assert clock.time() == 42


@pytest.mark.parametrize(
    ("start", "op", "arg", "after", "returned"),
    [
        (0, "increment", None, 1, 1),
        (5, "increment", None, 6, 6),
        (5, "witness", 4, 5, None),  # older: nothing
        (5, "witness", 5, 6, None),  # equal: one ahead
        (5, "witness", 9, 10, None),
        (0, "witness", 0, 1, None),
        (2**64 - 1, "increment", None, 0, 0),  # Go uint64 wraps
    ],
)
def test_lamport_clock_operations(
    start: int, op: str, arg: int | None, after: int, returned: int | None
) -> None:
    clock = LamportClock(start)
    if op == "increment":
        assert clock.increment() == returned
    else:
        assert arg is not None and returned is None
        clock.witness(arg)
    assert clock.time() == after


@pytest.mark.parametrize("bad", [-1, 2**64, True, 1.5])
def test_lamport_clock_rejects_values_outside_uint64(bad: Any) -> None:
    with pytest.raises(ValueError):
        LamportClock().witness(bad)
    with pytest.raises(ValueError):
        LamportClock(bad)


# --- serf messages: serf/messages.go, serf/delegate.go NotifyMsg ---------------------------


def test_message_type_values_are_serfs() -> None:
    assert [(t.name, t.value) for t in SerfMessageType] == [
        ("LEAVE", 0),
        ("JOIN", 1),
        ("PUSH_PULL", 2),
        ("USER_EVENT", 3),
        ("QUERY", 4),
        ("QUERY_RESPONSE", 5),
        ("CONFLICT_RESPONSE", 6),
        ("KEY_REQUEST", 7),
        ("KEY_RESPONSE", 8),
        ("RELAY", 9),
    ]


@pytest.mark.parametrize("entry", USER_ENTRIES, ids=_ids(USER_ENTRIES))
def test_golden_user_messages_decode_as_their_summary_says(entry: dict[str, Any]) -> None:
    expected = SUMMARY_USER.findall(entry["summary"])
    payloads = _user_payloads(entry)
    assert len(payloads) == len(expected)
    for payload, (kind, query_name) in zip(payloads, expected, strict=True):
        msg_type, message = serf.decode_serf_message(payload)
        assert msg_type is SUMMARY_NAMES[kind]
        if msg_type is SerfMessageType.QUERY:
            assert isinstance(message, Query)
            assert message.name == query_name
            assert message.source_node in NODE_TAGS
            assert message.addr == bytes([127, 0, 0, 1])
            assert message.port == MANIFEST["nodes"][0]["gossip_port"]
        elif msg_type is SerfMessageType.QUERY_RESPONSE:
            assert isinstance(message, QueryResponse)
            assert message.from_node in NODE_TAGS
            assert message.payload[0] == SerfMessageType.KEY_RESPONSE
        elif msg_type is SerfMessageType.USER_EVENT:
            assert message == UserEvent(
                ltime=1,
                name=MANIFEST["user_event"]["name"],
                payload=MANIFEST["user_event"]["payload"].encode(),
                cc=True,
            )
        else:
            assert isinstance(message, JoinIntent | LeaveIntent)
            assert message.node in NODE_TAGS
            assert message.ltime >= 1


@pytest.mark.parametrize("entry", USER_ENTRIES, ids=_ids(USER_ENTRIES))
def test_golden_user_messages_reencode_byte_for_byte(entry: dict[str, Any]) -> None:
    for payload in _user_payloads(entry):
        _, message = serf.decode_serf_message(payload)
        assert not isinstance(message, dict)
        assert serf.encode_serf_message(message) == payload


# The exact golden bytes (plain/udp-0002, udp-0046, udp-0017), built from scratch.
@pytest.mark.parametrize(
    ("encoded", "golden"),
    [
        (serf.encode_join_intent(JoinIntent(1, "b")), b"\x01\x82\xa5LTime\x01\xa4Node\xa1b"),
        (
            serf.encode_leave_intent(LeaveIntent(3, "c")),
            b"\x00\x83\xa5LTime\x03\xa4Node\xa1c\xa5Prune\xc2",
        ),
        (
            serf.encode_user_event(UserEvent(1, "golden-deploy", b"payload-0123456789", cc=True)),
            b"\x03\x84\xa2CC\xc3\xa5LTime\x01\xa4Name\xadgolden-deploy"
            b"\xa7Payload\xb2payload-0123456789",
        ),
    ],
)
def test_intents_built_from_scratch_match_golden(encoded: bytes, golden: bytes) -> None:
    assert encoded == golden
    payloads = {p for e in USER_ENTRIES for p in _user_payloads(e)}
    assert golden in payloads


@pytest.mark.parametrize(
    ("message", "encoded"),
    [
        (LeaveIntent(7, "n", prune=True), b"\x00\x83\xa5LTime\x07\xa4Node\xa1n\xa5Prune\xc3"),
        # serf event NAME without a payload: nil []byte -> msgpack nil
        (UserEvent(2, "x"), b"\x03\x84\xa2CC\xc2\xa5LTime\x02\xa4Name\xa1x\xa7Payload\xc0"),
        (JoinIntent(300, "n"), b"\x01\x82\xa5LTime\xcd\x01\x2c\xa4Node\xa1n"),
        (JoinIntent(2**64 - 1, ""), b"\x01\x82\xa5LTime\xcf" + b"\xff" * 8 + b"\xa4Node\xa0"),
        (
            QueryResponse(1, 5, "a", serf.QUERY_FLAG_ACK),
            b"\x05\x85\xa5Flags\x01\xa4From\xa1a\xa2ID\x05\xa5LTime\x01\xa7Payload\xc0",
        ),
    ],
)
def test_encode_layouts(message: serf.SerfMessage, encoded: bytes) -> None:
    assert serf.encode_serf_message(message) == encoded
    assert serf.decode_serf_message(encoded)[1] == message


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"\x01\x80", JoinIntent(0, "")),  # missing fields are zero values
        (b"\x01\xc0", JoinIntent(0, "")),  # nil body
        (b"\x01\x82\xa4Node\xa1b\xa5LTime\x01", JoinIntent(1, "b")),  # any key order
        (b"\x01\x83\xa5LTime\x01\xa4Node\xa1b\xa3Foo\x93\x01\x02\x03", JoinIntent(1, "b")),
        (b"\x01\x82\xa5LTime\x01\xa4Node\xc4\x01b", JoinIntent(1, "b")),  # bin8 string
        (b"\x01\x82\xa5LTime\xcf\x00\x00\x00\x00\x00\x00\x00\x01\xa4Node\xa1b", JoinIntent(1, "b")),
        (b"\x01\x82\xa5LTime\x01\xa4Node\xa1bTRAILING", JoinIntent(1, "b")),
        (b"\x00\x82\xa5LTime\x03\xa4Node\xa1c", LeaveIntent(3, "c", prune=False)),  # pre-Prune
        (b"\x03\x82\xa5LTime\x04\xa4Name\xa1e", UserEvent(4, "e", b"", cc=False)),
    ],
)
def test_decoding_is_as_tolerant_as_go(payload: bytes, expected: serf.SerfMessage) -> None:
    assert serf.decode_serf_message(payload)[1] == expected


def test_query_flags_and_round_trip() -> None:
    query = Query(
        ltime=9,
        id=0xDEADBEEF,
        addr=bytes(16),
        port=7946,
        source_node="me",
        filters=(b"\x00\x91\xa1a",),
        flags=serf.QUERY_FLAG_ACK | serf.QUERY_FLAG_NO_BROADCAST,
        relay_factor=2,
        timeout_ns=15_000_000_000,
        name="_serf_ping",
    )
    assert query.ack and query.no_broadcast
    encoded = serf.encode_query(query)
    assert serf.decode_serf_message(encoded) == (SerfMessageType.QUERY, query)
    assert b"\xa7Payload\xc0" in encoded  # nil payload like Go


def test_relay_message_decodes_header_and_inner_message() -> None:
    inner = serf.encode_query_response(QueryResponse(3, 4, "b", 0, b"pong"))
    header = msgpack.packb(
        {
            b"DestAddr": {b"IP": bytes([127, 0, 0, 1]), b"Port": 27946, b"Zone": b""},
            b"DestName": b"a",
        },
        use_bin_type=False,
    )
    kind, relay = serf.decode_serf_message(bytes([SerfMessageType.RELAY]) + header + inner)
    assert kind is SerfMessageType.RELAY
    assert relay == {
        "dest_ip": bytes([127, 0, 0, 1]),
        "dest_port": 27946,
        "dest_zone": "",
        "dest_name": "a",
        "message": inner,
    }
    assert serf.decode_serf_message(inner)[1] == QueryResponse(3, 4, "b", 0, b"pong")


def test_relay_without_destination_decodes_to_zero_values() -> None:
    kind, relay = serf.decode_serf_message(b"\x09\x80\x01\x80")
    assert kind is SerfMessageType.RELAY
    assert relay == {
        "dest_ip": b"",
        "dest_port": 0,
        "dest_zone": "",
        "dest_name": "",
        "message": b"\x01\x80",
    }


def test_payload_only_types_decode_as_plain_maps() -> None:
    key_response = msgpack.packb(
        {b"Keys": None, b"Message": b"", b"PrimaryKey": b"", b"Result": True},
        use_bin_type=False,
    )
    kind, body = serf.decode_serf_message(bytes([SerfMessageType.KEY_RESPONSE]) + key_response)
    assert kind is SerfMessageType.KEY_RESPONSE
    assert body == {"Keys": None, "Message": b"", "PrimaryKey": b"", "Result": True}


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # serf ignores empty messages
        b"\x0a\x80",  # unknown type: serf logs "Received message of unknown type"
        b"\xff",
        b"\x01",  # no body
        b"\x01\x82\xa5LTime",  # truncated
        b"\x01\x92\x01\xa1b",  # array, not a struct map
        b"\x01\x05",
        b"\x01\x82\xa5LTime\xa1x\xa4Node\xa1b",  # LTime not an int
        b"\x01\x82\xa5LTime\xff\xa4Node\xa1b",  # negative LTime
        b"\x01\x82\xa5LTime\xc3\xa4Node\xa1b",  # bool LTime
        b"\x01\x82\xa5LTime\x01\xa4Node\x05",  # int Node
        b"\x00\x83\xa5LTime\x01\xa4Node\xa1c\xa5Prune\x01",  # int Prune
        b"\x03\x81\xa7Payload\x92\x01\x02",  # array Payload
        b"\x04\x81\xa2ID\xcf\x00\x00\x00\x01\x00\x00\x00\x00",  # ID over uint32
        b"\x04\x81\xa7Filters\x91\x01",  # filter not bytes
        b"\x04\x81\xa4Port\xce\x00\x01\x00\x00",  # port over uint16
        b"\x05\x81\xa4From\x80",
        b"\x09",  # relay without a header
        b"\x09\x81\xa8DestAddr\x01",
        b"\x07\x92\x01",  # key request: not a map
    ],
)
def test_bad_serf_messages_raise_value_error(payload: bytes) -> None:
    assert issubclass(SerfCodecError, ValueError)
    with pytest.raises(SerfCodecError):
        serf.decode_serf_message(payload)


@pytest.mark.parametrize(
    "message",
    [
        JoinIntent(-1, "a"),
        JoinIntent(2**64, "a"),
        LeaveIntent(1.5, "a"),  # type: ignore[arg-type]
        JoinIntent(1, b"a"),  # type: ignore[arg-type]
        UserEvent(1, "e", "not bytes"),  # type: ignore[arg-type]
        QueryResponse(1, 2**32, "a", 0),
        Query(1, 1, b"", 70000, "a", (), 0, 0, 0, "q"),
        Query(1, 1, b"", 1, "a", (), 0, 256, 0, "q"),
        Query(1, 1, b"", 1, "a", (), 0, 0, 2**63, "q"),
    ],
)
def test_encoders_refuse_values_serf_cannot_carry(message: serf.SerfMessage) -> None:
    with pytest.raises(ValueError):
        serf.encode_serf_message(message)


# --- push-pull user state: serf/delegate.go LocalState / MergeRemoteState ------------------


@pytest.mark.parametrize("entry", STATE_ENTRIES, ids=_ids(STATE_ENTRIES))
def test_golden_push_pull_state_decodes_and_reencodes(entry: dict[str, Any]) -> None:
    state = _user_state(entry)
    assert state[0] == SerfMessageType.PUSH_PULL
    decoded = serf.decode_push_pull_state(state)
    assert decoded["event_buffer_size"] == serf.EVENT_BUFFER_SIZE
    assert set(decoded["status_ltimes"]) <= set(NODE_TAGS)
    assert set(decoded["left_members"]) <= set(NODE_TAGS)
    assert decoded["ltime"] >= 1 and decoded["event_ltime"] >= 1 and decoded["query_ltime"] >= 1
    for slot in decoded["events"]:
        assert slot.events == (
            BufferedEvent(
                MANIFEST["user_event"]["name"], MANIFEST["user_event"]["payload"].encode()
            ),
        )
    again = serf.encode_push_pull_state(
        decoded["ltime"],
        decoded["status_ltimes"],
        decoded["left_members"],
        decoded["event_ltime"],
        decoded["events"],
        query_ltime=decoded["query_ltime"],
        event_buffer_size=decoded["event_buffer_size"],
    )
    assert again == state
    # a serf-style message with the push-pull type byte decodes the same way
    assert serf.decode_serf_message(state) == (SerfMessageType.PUSH_PULL, decoded)


def test_golden_states_cover_events_and_left_members() -> None:
    states = [serf.decode_push_pull_state(_user_state(e)) for e in STATE_ENTRIES]
    assert any(s["events"] for s in states)
    assert any(s["left_members"] == ["c"] for s in states)
    assert any(not s["events"] and not s["left_members"] for s in states)


def test_push_pull_state_built_from_scratch_matches_golden() -> None:
    first = next(e for e in STATE_ENTRIES if e["file"] == "plain/tcp-0001-initiator.bin")
    built = serf.encode_push_pull_state(1, {"b": 0}, [], 1, query_ltime=1)
    assert built == _user_state(first)
    # 1 type byte + fixmap(6) + ... + array16 of 512 nils
    assert b"\xa6Events\xdc\x02\x00" + b"\xc0" * 512 in built

    with_event = next(e for e in STATE_ENTRIES if e["file"] == "plain/tcp-0009-initiator.bin")
    event = BufferedEvents(1, (BufferedEvent("golden-deploy", b"payload-0123456789"),))
    decoded = serf.decode_push_pull_state(_user_state(with_event))
    built = serf.encode_push_pull_state(
        4, decoded["status_ltimes"], ["c"], 2, [event], query_ltime=1
    )
    assert built == _user_state(with_event)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (
            b"\x02\x80",
            {
                "ltime": 0,
                "status_ltimes": {},
                "left_members": [],
                "event_ltime": 0,
                "events": [],
                "event_buffer_size": 0,
                "query_ltime": 0,
            },
        ),
        (
            b"\x02\x83\xa5LTime\x05\xacStatusLTimes\x82\xa1z\x01\xa1a\x02\xa6Events\x92\xc0"
            b"\x82\xa5LTime\x07\xa6Events\x91\x81\xa4Name\xa1e",
            {
                "ltime": 5,
                "status_ltimes": {"z": 1, "a": 2},
                "left_members": [],
                "event_ltime": 0,
                "events": [BufferedEvents(7, (BufferedEvent("e", b""),))],
                "event_buffer_size": 2,
                "query_ltime": 0,
            },
        ),
    ],
)
def test_push_pull_decoder_is_tolerant(state: bytes, expected: dict[str, Any]) -> None:
    decoded = serf.decode_push_pull_state(state)
    assert decoded == expected
    assert list(decoded["status_ltimes"]) == list(expected["status_ltimes"])  # wire order


@pytest.mark.parametrize(
    "state",
    [
        b"",  # serf: "Remote state is zero bytes"
        b"\x01\x80",  # serf: "Remote state has bad type prefix"
        b"\x02",
        b"\x02\x93",
        b"\x02\x81\xacStatusLTimes\x91\x01",
        b"\x02\x81\xacStatusLTimes\x81\x01\x01",
        b"\x02\x81\xacStatusLTimes\x81\xa1a\xa1x",
        b"\x02\x81\xabLeftMembers\x91\x01",
        b"\x02\x81\xa6Events\x91\x01",
        b"\x02\x81\xa6Events\x91\x81\xa6Events\x91\x05",
        b"\x02\x81\xa5LTime\xd0\xff",
    ],
)
def test_bad_push_pull_states_raise_value_error(state: bytes) -> None:
    with pytest.raises(ValueError):
        serf.decode_push_pull_state(state)


def test_push_pull_encoder_checks_its_input() -> None:
    clash = [BufferedEvents(1), BufferedEvents(1 + serf.EVENT_BUFFER_SIZE)]
    with pytest.raises(ValueError, match="slot"):
        serf.encode_push_pull_state(1, {}, [], 1, clash, query_ltime=1)
    with pytest.raises(ValueError):
        serf.encode_push_pull_state(1, {"a": -1}, [], 1, query_ltime=1)
    with pytest.raises(ValueError):
        serf.encode_push_pull_state(
            1, {}, [], 1, [BufferedEvents(1)], query_ltime=1, event_buffer_size=0
        )
    small = serf.encode_push_pull_state(
        1,
        {},
        ["x"],
        1,
        [BufferedEvents(5, (BufferedEvent("e", b"p"),))],
        query_ltime=1,
        event_buffer_size=4,
    )
    decoded = serf.decode_push_pull_state(small)
    assert decoded["event_buffer_size"] == 4
    assert decoded["left_members"] == ["x"]
    assert msgpack.unpackb(small[1:], raw=True)[b"Events"][1] is not None  # 5 % 4


# --- ack payload: serf/ping_delegate.go, coordinate/ ---------------------------------------


def test_default_coordinate_is_new_coordinate_of_default_config() -> None:
    assert Coordinate((0.0,) * 8, 1.5, 0.0, 10.0e-6) == DEFAULT_COORDINATE
    assert DEFAULT_COORDINATE.is_valid()
    payload = serf.encode_ping_payload()
    assert payload[0] == serf.PING_VERSION == 1
    # what serf agents ack with before their first Vivaldi update (plain/udp-0014)
    fresh = _ack_payloads(next(e for e in ACK_ENTRIES if e["file"] == "plain/udp-0014.bin"))
    assert fresh == [payload]


@pytest.mark.parametrize("entry", ACK_ENTRIES, ids=_ids(ACK_ENTRIES))
def test_golden_ack_payloads_decode_and_reencode(entry: dict[str, Any]) -> None:
    payloads = _ack_payloads(entry)
    assert payloads
    for payload in payloads:
        coordinate = serf.decode_ping_payload(payload)
        assert len(coordinate.vec) == serf.DEFAULT_DIMENSIONALITY
        assert coordinate.is_valid()
        assert coordinate.is_compatible_with(DEFAULT_COORDINATE)
        assert 0 < coordinate.error <= serf.VIVALDI_ERROR_MAX
        assert coordinate.height >= serf.HEIGHT_MIN
        assert serf.encode_ping_payload(coordinate) == payload


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"\x01\x80", Coordinate((), 0.0, 0.0, 0.0)),
        (
            b"\x01\x82\xa3Vec\x92\x01\xcb?\xe0\x00\x00\x00\x00\x00\x00\xa5Error\x01",
            Coordinate((1.0, 0.5), 1.0, 0.0, 0.0),
        ),
        (
            b"\x01\x81\xa6Height\xca\x3f\x80\x00\x00",  # float32 accepted
            Coordinate((), 0.0, 0.0, 1.0),
        ),
    ],
)
def test_ping_payload_decoder_is_tolerant(payload: bytes, expected: Coordinate) -> None:
    assert serf.decode_ping_payload(payload) == expected


def test_invalid_coordinate_decodes_but_is_not_valid() -> None:
    nan = Coordinate((float("nan"),), 1.0, 0.0, 1e-5)
    coordinate = serf.decode_ping_payload(serf.encode_ping_payload(nan))
    assert not coordinate.is_valid()
    assert not coordinate.is_compatible_with(DEFAULT_COORDINATE)


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # serf returns silently
        b"\x02" + serf.encode_ping_payload()[1:],  # "Unsupported ping version: 2"
        b"\x00\x80",
        b"\x01",  # "Failed to decode coordinate from ping"
        b"\x01\x92\x01\x02",
        b"\x01\x81\xa3Vec\x91\xa1x",
        b"\x01\x81\xa3Vec\x01",
        b"\x01\x81\xa5Error\xc3",
        b"\x01\x81\xa5Error\xa1x",
    ],
)
def test_bad_ping_payloads_raise_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError):
        serf.decode_ping_payload(payload)


# --- robustness: arbitrary input raises only ValueError ------------------------------------

_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.binary(max_size=20)
    | st.sampled_from([b"LTime", b"Node", b"Name", b"Payload", b"Events", b"Vec", b"DestAddr"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    b"LTime",
                    b"Node",
                    b"Prune",
                    b"Name",
                    b"Payload",
                    b"CC",
                    b"ID",
                    b"Addr",
                    b"Port",
                    b"Filters",
                    b"Timeout",
                    b"From",
                    b"Flags",
                    b"StatusLTimes",
                    b"LeftMembers",
                    b"Events",
                    b"EventLTime",
                    b"QueryLTime",
                    b"Vec",
                    b"Error",
                    b"Height",
                    b"Adjustment",
                    b"DestAddr",
                    b"IP",
                    b"DestName",
                    b"x",
                ]
            )
            | st.binary(max_size=4),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


def _decode_all(data: bytes) -> None:
    for decode in (
        serf.decode_serf_message,
        serf.decode_push_pull_state,
        serf.decode_ping_payload,
        serf.decode_tags,
    ):
        with contextlib.suppress(ValueError):
            decode(data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_value_error(data: bytes) -> None:
    _decode_all(data)


@settings(max_examples=400, deadline=None)
@given(st.integers(min_value=0, max_value=255), _msgpack_values, st.binary(max_size=8))
def test_arbitrary_msgpack_bodies_raise_only_value_error(
    kind: int, body: Any, trailing: bytes
) -> None:
    packed = msgpack.packb(body, use_bin_type=False)
    for prefix in (bytes([kind]), bytes([kind % 10]), b"\xff", b"\x01", b"\x02"):
        _decode_all(prefix + packed + trailing)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.text(max_size=30),
    st.binary(max_size=100),
    st.booleans(),
)
def test_messages_round_trip(ltime: int, text: str, payload: bytes, flag: bool) -> None:
    for message in (
        JoinIntent(ltime, text),
        LeaveIntent(ltime, text, flag),
        UserEvent(ltime, text, payload, flag),
    ):
        assert serf.decode_serf_message(serf.encode_serf_message(message))[1] == message


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=6))
def test_tags_round_trip_property(tags: dict[str, str]) -> None:
    assert serf.decode_tags(serf.encode_tags(tags)) == tags
