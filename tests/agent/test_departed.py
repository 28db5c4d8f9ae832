"""agent.departed: failed/left members kept after the core reaps them (serf's reconnect and
tombstone timeouts, serf.go ``reap``; late leave = "EventMemberLeave (forced)")."""

from __future__ import annotations

import pytest

from agent.departed import Departed
from swim import Address, Member, NodeStateType


def member(name: str, state: NodeStateType = NodeStateType.DEAD) -> Member:
    return Member(name, Address("127.0.0.1", 7946), b"", 3, state, 0, ())


def test_keeps_only_dead_and_left() -> None:
    d = Departed()
    assert d.record(member("a", NodeStateType.ALIVE), 0) == []
    assert d.record(member("s", NodeStateType.SUSPECT), 0) == []
    d.record(member("dead"), 0)
    d.record(member("left", NodeStateType.LEFT), 0)
    assert [m.name for m in d.members()] == ["dead", "left"]
    assert "dead" in d and "a" not in d and len(d) == 2


@pytest.mark.parametrize(
    ("state", "age_ms", "kept"),
    [
        (NodeStateType.DEAD, 999, True),  # reconnect timeout 1000
        (NodeStateType.DEAD, 1000, False),
        (NodeStateType.LEFT, 1999, True),  # tombstone timeout 2000
        (NodeStateType.LEFT, 2000, False),
    ],
)
def test_expiry_per_state(state: NodeStateType, age_ms: int, kept: bool) -> None:
    d = Departed(reconnect_timeout_ms=1000, tombstone_timeout_ms=2000)
    d.record(member("x", state), 5_000)
    assert d.expire(5_000 + age_ms) == ([] if kept else ["x"])
    assert ("x" in d) is kept


def test_late_leave_turns_failed_into_left_once() -> None:
    d = Departed()
    d.record(member("x"), 10)
    left = d.mark_left("x", 20)
    assert left is not None and left.state == NodeStateType.LEFT and left.state_change_ms == 20
    assert d.get("x") == left
    assert d.mark_left("x", 30) is None  # already left
    assert d.mark_left("unknown", 30) is None


def test_bounded_oldest_evicted_and_rejoin_forgets() -> None:
    d = Departed(max_entries=2)
    d.record(member("a"), 1)
    d.record(member("b"), 2)
    assert d.record(member("c"), 3) == ["a"]
    assert [m.name for m in d.members()] == ["b", "c"]
    assert d.forget("b") and not d.forget("b")
    assert [m.name for m in d.members()] == ["c"]


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        Departed(max_entries=0)
    with pytest.raises(ValueError, match="timeouts"):
        Departed(reconnect_timeout_ms=-1)
