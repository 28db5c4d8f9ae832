"""wire.decode_message remembers decoded alive/suspect/dead broadcasts by their bytes (the
same broadcast arrives up to the retransmit limit times); the memo must be invisible:
equal results, bounded size, and never for probe messages or bad input."""

from __future__ import annotations

import pytest

from swim import wire
from swim.messages import MsgType, Ping, Suspect


def test_repeated_broadcast_decodes_equal_and_memo_is_bounded() -> None:
    data = wire.encode_message(Suspect(7, "node-a", "node-b"))
    first = wire.decode_message(data)
    assert first == Suspect(7, "node-a", "node-b")
    assert wire.decode_message(bytes(data)) == first
    for i in range(wire.GOSSIP_CACHE_ENTRIES + 10):
        wire.decode_message(wire.encode_message(Suspect(i, "n", "m")))
    assert wire.gossip_cache_len() <= wire.GOSSIP_CACHE_ENTRIES
    assert wire.decode_message(data) == first


def test_pings_and_bad_bytes_are_not_memoised() -> None:
    before = wire.gossip_cache_len()
    wire.decode_message(wire.encode_message(Ping(1, "x", b"", 0, "y")))
    assert wire.gossip_cache_len() == before
    bad = bytes([MsgType.SUSPECT]) + b"\xc1"
    with pytest.raises(wire.WireError):
        wire.decode_message(bad)
    assert wire.gossip_cache_len() == before
