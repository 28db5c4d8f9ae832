"""The pure rules of answering Serf queries (agent/serf/queries.py): dedupe, filters, the
key request/response codec; the live interop is in test_security.py (serf keys)."""

from __future__ import annotations

import base64

import msgpack
import pytest

from agent import serf
from agent.serf.queries import (
    FILTER_NODE,
    FILTER_TAG,
    QuerySeen,
    for_us,
    key_request,
    key_response,
    response_address,
)


def test_a_query_is_news_once_and_old_ones_are_dropped() -> None:
    seen = QuerySeen(size=4)
    assert seen.is_news(10, 1)
    assert not seen.is_news(10, 1)
    assert seen.is_news(10, 2), "same LTime, another ID"
    assert seen.is_news(11, 1)
    assert not seen.is_news(5, 9), "older than the buffer remembers"


def _node_filter(names: list[str]) -> bytes:
    return bytes([FILTER_NODE]) + bytes(msgpack.packb(names))


def _tag_filter(tag: str, expr: str) -> bytes:
    return bytes([FILTER_TAG]) + bytes(msgpack.packb({"Tag": tag, "Expr": expr}))


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ((), True),
        ((_node_filter(["a", "me"]),), True),
        ((_node_filter(["a"]),), False),
        ((_tag_filter("role", "^web"),), True),
        ((_tag_filter("role", "db"),), False),
        ((_tag_filter("role", "("),), False),  # a regexp we cannot compile: not for us
        ((_tag_filter("zone", ".*"),), True),  # a missing tag matches as ""
        ((_node_filter(["me"]), _tag_filter("role", "db")), False),
        ((b"\x07junk",), False),  # an unknown filter type
        ((b"",), False),
    ],
)
def test_filters(filters: tuple[bytes, ...], expected: bool) -> None:
    assert for_us(filters, "me", {"role": "web-1"}) is expected


def test_key_request_and_response_codec() -> None:
    key = bytes(range(16))
    payload = bytes([serf.SerfMessageType.KEY_REQUEST]) + msgpack.packb({b"Key": key})
    assert key_request(payload) == key
    request = bytes([serf.SerfMessageType.KEY_REQUEST])
    for bad in (b"", b"\x08", request + b"\xc1", request + msgpack.packb({})):
        with pytest.raises(ValueError):
            key_request(bad)
    raw = key_response(True, "", [key], key)
    assert raw[0] == serf.SerfMessageType.KEY_RESPONSE
    body = msgpack.unpackb(raw[1:], raw=True)
    assert list(body) == [b"Keys", b"Message", b"PrimaryKey", b"Result"], "go-msgpack order"
    assert body[b"Keys"] == [base64.b64encode(key)] and body[b"Result"] is True
    assert msgpack.unpackb(key_response(False, "no", [], None)[1:], raw=True)[b"Keys"] is None


def test_response_address_from_a_go_ip() -> None:
    q = serf.Query(1, 1, bytes([127, 0, 0, 1]), 7946, "s0", (), 0, 0, 0, "_serf_list-keys")
    assert response_address(q) == ("127.0.0.1", 7946)
    mapped = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 2])
    assert response_address(serf.Query(1, 1, mapped, 1, "s", (), 0, 0, 0, "x")) == ("10.0.0.2", 1)


@pytest.mark.trio
async def test_key_changes_are_written_back_to_the_keyring_file(tmp_path) -> None:
    import functools
    import json

    import trio

    from agent.control import ControlClient
    from tests.agent.test_agent import cluster

    old, new = bytes(range(16)), bytes(range(16, 32))
    path = tmp_path / "keyring.json"
    path.write_text(json.dumps([base64.b64encode(old).decode()]))
    async with cluster(tmp_path, 1, keyring_file=str(path)):
        client = ControlClient(tmp_path / "n0.sock")
        b64 = base64.b64encode(new).decode()
        for action in ("install", "use"):
            change = functools.partial(client.request, "keys", action=action, key=b64)
            await trio.to_thread.run_sync(change)
    assert json.loads(path.read_text()) == [b64, base64.b64encode(old).decode()], "primary first"
    assert path.stat().st_mode & 0o777 == 0o600
