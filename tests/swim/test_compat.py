"""Protocol-version checks on push-pull (memberlist state.go verifyProtocol)."""

from __future__ import annotations

import random

import pytest

from swim import Address, Config, Node
from swim import NodeStateType as S
from swim.compat import Versions, verify_protocol
from swim.messages import PushNodeState, PushPull

OURS = bytes([1, 5, 2, 2, 5, 5])


# (remote vsn, expected substring of the error or None); local side speaks OURS
@pytest.mark.parametrize(
    ("remote", "problem"),
    [
        (bytes([1, 5, 2, 2, 5, 5]), None),  # serf 0.9.4 exactly (golden captures)
        (bytes([1, 5, 5, 2, 5, 4]), None),
        (bytes([1, 3, 3, 2, 5, 5]), None),  # an older peer: range shrinks to [1, 3]
        (bytes([3, 5, 3, 2, 5, 5]), "node 'local' protocol version (2)"),  # it needs >= 3
        (bytes([1, 5, 2, 2, 5, 6]), "delegate protocol version (6)"),
        (b"", "protocol version (0)"),  # a remote without Vsn reads as version 0
    ],
)
def test_verify_protocol_table(remote: bytes, problem: str | None) -> None:
    got = verify_protocol([Versions("local", S.ALIVE, OURS)], [Versions("r", S.ALIVE, remote)])
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


def test_dead_nodes_do_not_narrow_the_range() -> None:
    dead_old = Versions("old", S.DEAD, bytes([1, 2, 2, 2, 5, 5]))
    assert verify_protocol([Versions("local", S.ALIVE, OURS)], [dead_old]) is None


def test_incompatible_push_pull_is_not_merged() -> None:
    node = Node(
        "a",
        Address("10.0.0.1", 7946),
        rng=random.Random(1),
        now_ms=0,
        config=Config(delegate_protocol_min=5, delegate_protocol_version=5),
    )
    stranger = PushNodeState(
        "x", bytes([10, 0, 0, 2]), 7946, b"", 1, S.ALIVE, bytes([1, 5, 2, 2, 4, 4])
    )
    out = node.handle_stream(Address("10.0.0.2", 7946), PushPull(True, (stranger,)), 5)
    assert out.reply is not None  # like memberlist, we still answer with our state
    assert node.member("x") is None
    assert node.stats.dropped["invalid_version"] == 1
    assert any(n.kind == "push_pull_rejected" for n in out.notices)
