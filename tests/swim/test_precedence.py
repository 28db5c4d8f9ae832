"""SWIM §4.2 precedence: every row of ``swim.membership.PRECEDENCE``, checked on a real node.

For each (about, what we know, the message, its incarnation) the test builds a node that
knows exactly that, delivers the message from a third node, and checks what the row's
outcome promises: IGNORE changes nothing and says nothing; APPLY takes the message's state
and incarnation with the matching event; CONFIRM shortens an open suspicion; REFUTE outbids
the accusation; REFUTE_IF_CHANGED ignores our own echo and refutes any other version of us;
REANNOUNCE re-gossips our alive at our incarnation (every profile).

Reference: hashicorp/memberlist @ 1b4c746 state.go ``aliveNode``, ``suspectNode``,
``deadNode``, ``refute``; suspicion.go ``Confirm``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from swim import Config, EventKind, NodeStateType
from swim.membership import PRECEDENCE, About, News, Outcome
from swim.messages import Alive, Dead, Suspect
from tests.swim.node_harness import Peer, addr, alive, alive_of, make_peer

ALIVE, SUSPECT, DEAD, LEFT = (
    NodeStateType.ALIVE,
    NodeStateType.SUSPECT,
    NodeStateType.DEAD,
    NodeStateType.LEFT,
)
KNOWN = 5
"""The incarnation we know the member at (ours is whatever the node has)."""
RECLAIM_MS = 1_000
NEW_INDEX = 9
"""The reclaimed name's new address: 10.0.0.9."""
ROWS = sorted(PRECEDENCE.items(), key=lambda row: tuple(int(k) for k in row[0]))


def test_the_table_covers_every_reachable_case_once() -> None:
    """We are only ever alive or (after leave) left; a reclaimed name is only ever dead or
    left and announced alive; about any other member, every combination has a row."""
    messages = (ALIVE, SUSPECT, DEAD)
    want = {(About.US, k, m, n) for k in (ALIVE, LEFT) for m in messages for n in News}
    want |= {(About.MEMBER, k, m, n) for k in NodeStateType for m in messages for n in News}
    want |= {(About.RECLAIMED, k, ALIVE, n) for k in (DEAD, LEFT) for n in News}
    assert set(PRECEDENCE) == want


@dataclass
class Seen:
    """What the node shows of the subject and of itself."""

    state: NodeStateType
    incarnation: int
    address: object
    own_incarnation: int
    suspicion_deadline_ms: int | None
    queued: int


def _seen(o: Peer, name: str) -> Seen:
    m = o.member(name)
    return Seen(
        m.state,
        m.incarnation,
        m.address,
        o.node.incarnation,
        o.node.suspicion_deadline_ms(name),
        o.node.broadcast_queue_depth,
    )


def _setup(about: About, known: NodeStateType, verify: bool) -> tuple[Peer, str]:
    """Node o (10.0.0.1) knowing its subject in state ``known``, at ``KNOWN`` for another
    member, with three bystanders so that a suspicion expects confirmations (k >= 1)."""
    config = Config.lan(verify_unconfirmed_suspicion=verify, dead_node_reclaim_time_ms=RECLAIM_MS)
    o = make_peer("o", 1, config=config)
    o.learn(alive("m", 2, KNOWN), *(alive(f"b{i}", 3 + i) for i in range(3)), now_ms=10)
    if about is About.US:
        if known is LEFT:
            o.take(o.node.leave(20))
        subject = "o"
    else:
        subject = "m"
        if known is SUSPECT:
            o.receive(addr(3), Suspect(KNOWN, "m", "z"), now_ms=20)
        elif known is DEAD:
            o.receive(addr(3), Dead(KNOWN, "m", "z"), now_ms=20)
        elif known is LEFT:
            o.receive(addr(2), Dead(KNOWN, "m", "m"), now_ms=20)
    for _ in range(100):  # gossip out what is queued, so that new broadcasts show
        if o.node.broadcast_queue_depth == 0:
            break
        o.take(o.node.gossip(30))
    assert o.node.broadcast_queue_depth == 0
    assert o.member(subject).state == known
    return o, subject


def _message(
    o: Peer, about: About, subject: str, kind: NodeStateType, incarnation: int, meta: bytes
) -> Alive | Suspect | Dead:
    if kind is SUSPECT:
        return Suspect(incarnation, subject, "z2")
    if kind is DEAD:
        return Dead(incarnation, subject, "z2")
    if about is About.US:
        return replace(alive_of(o), incarnation=incarnation, meta=meta)
    index = NEW_INDEX if about is About.RECLAIMED else 2
    return alive(subject, index, incarnation, meta=meta)


@pytest.mark.parametrize(("verify", "meta"), [(False, b""), (True, b""), (False, b"other")])
@pytest.mark.parametrize(("key", "outcome"), ROWS, ids=lambda v: getattr(v, "name", None))
def test_every_row_does_what_it_says(
    key: tuple[About, NodeStateType, NodeStateType, News],
    outcome: Outcome,
    verify: bool,
    meta: bytes,
) -> None:
    about, known, kind, news = key
    o, subject = _setup(about, known, verify)
    before = _seen(o, subject)
    base = before.own_incarnation if about is About.US else before.incarnation
    incarnation = base + {News.OLDER: -1, News.SAME: 0, News.NEWER: 1}[news]
    msg = _message(o, about, subject, kind, incarnation, meta)
    now_ms = 30 + RECLAIM_MS + 1  # a dead name is reclaimable by now
    out = o.receive(addr(3), msg, now_ms=now_ms)
    after = _seen(o, subject)
    events = [(e.kind, e.member.name) for e in out.events]
    refuted = [n for n in out.notices if n.kind == "refute"]
    if outcome is Outcome.REFUTE_IF_CHANGED:
        outcome = Outcome.IGNORE if meta == b"" else Outcome.REFUTE
    if outcome is Outcome.REANNOUNCE:
        assert (events, refuted, after.own_incarnation) == ([], [], before.own_incarnation)
        assert after.queued == before.queued + 1
        return
    if outcome is Outcome.IGNORE:
        assert (after, events, refuted) == (before, [], [])
    elif outcome is Outcome.REFUTE:
        assert after.own_incarnation == max(before.own_incarnation, incarnation) + 1
        assert (after.state, len(refuted), events) == (ALIVE, 1, [])
        assert after.queued == 1  # our new alive
    elif outcome is Outcome.CONFIRM:
        assert (after.state, after.incarnation, events) == (SUSPECT, KNOWN, [])
        assert before.suspicion_deadline_ms is not None
        assert after.suspicion_deadline_ms is not None
        assert after.suspicion_deadline_ms < before.suspicion_deadline_ms
        assert after.queued == 1  # the confirmation is gossiped on
        again = o.receive(addr(4), msg, now_ms=now_ms)  # the same accuser: not counted
        assert _seen(o, subject) == after and again.events == []
    else:
        assert outcome is Outcome.APPLY
        assert (after.state, after.incarnation) == (kind, incarnation)
        assert after.own_incarnation == before.own_incarnation and refuted == []
        assert after.queued == 1  # gossiped on
        if kind is SUSPECT:
            assert events == [(EventKind.SUSPECT, subject)]
            assert after.suspicion_deadline_ms is not None
        elif kind is DEAD:
            assert events == [(EventKind.DEAD, subject)]
            assert after.suspicion_deadline_ms is None
        elif known in (DEAD, LEFT):
            assert events == [(EventKind.JOINED, subject)]
            new_index = NEW_INDEX if about is About.RECLAIMED else 2
            assert after.address == addr(new_index)
        elif known is SUSPECT:
            assert events == [(EventKind.ALIVE, subject)]
            assert after.suspicion_deadline_ms is None
        else:
            assert events == ([(EventKind.UPDATED, subject)] if meta else [])


# --- the same, as memberlist's answers ------------------------------------------------------

# An oracle independent of the table: the table is data the code reads, so the row test above
# cannot tell a wrong row from a right one. These are state.go's answers, worked out by hand.

# Member m is known at incarnation 5 as ALIVE, SUSPECT or DEAD (declared by a third node);
# a message about it arrives from a third node. Expected (state, incarnation, event) from
# memberlist state.go @ 1b4c746:
# - aliveNode: ignored unless inc > known (same address, not us); Dead→Alive reports a join.
# - suspectNode: ignored if inc < known; an existing suspicion timer only counts a
#   confirmation (so Suspect(6) on SUSPECT(5) keeps 5: memberlist, not the paper); ignored
#   unless ALIVE.
# - deadNode: ignored if inc < known or already dead/left; else DEAD at the message's inc.
A, S, D = "alive", "suspect", "dead"
MEMBERLIST: list[tuple[str, str, int, NodeStateType, int, EventKind | None]] = [
    # known, message, its inc -> state, inc, event
    (A, A, 4, ALIVE, 5, None),
    (A, A, 5, ALIVE, 5, None),
    (A, A, 6, ALIVE, 6, None),  # same meta: no UPDATED
    (A, S, 4, ALIVE, 5, None),
    (A, S, 5, SUSPECT, 5, EventKind.SUSPECT),
    (A, S, 6, SUSPECT, 6, EventKind.SUSPECT),
    (A, D, 4, ALIVE, 5, None),
    (A, D, 5, DEAD, 5, EventKind.DEAD),
    (A, D, 6, DEAD, 6, EventKind.DEAD),
    (S, A, 4, SUSPECT, 5, None),
    (S, A, 5, SUSPECT, 5, None),
    (S, A, 6, ALIVE, 6, EventKind.ALIVE),
    (S, S, 4, SUSPECT, 5, None),
    (S, S, 5, SUSPECT, 5, None),  # a confirmation
    (S, S, 6, SUSPECT, 5, None),  # a confirmation; incarnation kept
    (S, D, 4, SUSPECT, 5, None),
    (S, D, 5, DEAD, 5, EventKind.DEAD),
    (S, D, 6, DEAD, 6, EventKind.DEAD),
    (D, A, 4, DEAD, 5, None),
    (D, A, 5, DEAD, 5, None),
    (D, A, 6, ALIVE, 6, EventKind.JOINED),
    (D, S, 4, DEAD, 5, None),
    (D, S, 5, DEAD, 5, None),
    (D, S, 6, DEAD, 5, None),
    (D, D, 4, DEAD, 5, None),
    (D, D, 5, DEAD, 5, None),
    (D, D, 6, DEAD, 5, None),
]


def _memberlist_message(kind: str, inc: int) -> Alive | Suspect | Dead:
    if kind == A:
        return alive("m", 2, inc)
    if kind == S:
        return Suspect(inc, "m", "z")
    return Dead(inc, "m", "z")


def _state(o: Peer) -> tuple[NodeStateType, int]:
    m = o.member("m")
    return m.state, m.incarnation


@pytest.mark.parametrize(("known", "kind", "inc", "state", "want_inc", "event"), MEMBERLIST)
def test_incarnation_precedence(
    known: str,
    kind: str,
    inc: int,
    state: NodeStateType,
    want_inc: int,
    event: EventKind | None,
) -> None:
    o = make_peer("o", 1)
    o.receive(addr(2), alive("m", 2, 5), now_ms=10)
    if known != A:
        o.receive(addr(3), _memberlist_message(known, 5), now_ms=20)
    assert _state(o) == ({A: ALIVE, S: SUSPECT, D: DEAD}[known], 5)
    out = o.receive(addr(3), _memberlist_message(kind, inc), now_ms=30)
    assert _state(o) == (state, want_inc)
    assert [e.kind for e in out.events] == ([] if event is None else [event])
