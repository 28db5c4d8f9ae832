"""``MembershipSnapshot`` + ``Node.bootstrap``: nodes that start fully joined from one
shared, copy-on-write member table, and the O(1)/O(k) table underneath (``swim.table``)."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from typing import Any

import pytest

from swim import (
    Address,
    EventKind,
    MembershipSnapshot,
    Node,
    NodeStateType,
    Output,
    SeedMember,
    formulas,
    push_pull,
    wire,
)
from swim import streams as streams_module
from swim.member_state import MemberState
from swim.messages import PushNodeState, PushPull, Suspect
from swim.table import MemberTable, below
from tests.swim.node_harness import packet

ALIVE, SUSPECT, DEAD = NodeStateType.ALIVE, NodeStateType.SUSPECT, NodeStateType.DEAD


def address(i: int) -> Address:
    return Address(f"10.1.{i // 250}.{i % 250 + 1}", 7946)


def seeds(n: int) -> list[SeedMember]:
    return [SeedMember(f"n{i:03d}", address(i)) for i in range(n)]


class Loop:
    """The smallest faithful driver: one heap, fixed 2 ms latency, streams answered."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.snapshot = MembershipSnapshot.build(seeds(n))
        self.heap: list[tuple[int, int, int, Any]] = []
        self.seq = 0
        self.now_ms = 0
        self.crashed: set[int] = set()
        self.index = {address(i): i for i in range(n)}
        self.log: list[tuple[int, int, Address, bytes]] = []
        self.events: list[tuple[int, EventKind, str]] = []
        self.nodes = [
            Node(f"n{i:03d}", address(i), rng=random.Random(rng.getrandbits(64)), now_ms=0)
            for i in range(n)
        ]
        for i, node in enumerate(self.nodes):
            self.apply(i, node.start(0))
            self.apply(i, node.bootstrap(self.snapshot, 0))

    def apply(self, i: int, out: Output) -> None:
        for event in out.events:
            self.events.append((i, event.kind, event.member.name))
        for timer in out.timers:
            self.push(timer.deadline_ms, i, ("timer", timer))
        for p in out.packets:
            self.log.append((self.now_ms, i, p.dest, p.data))
            self.push(
                self.now_ms + 2, self.index[p.dest], ("packet", self.nodes[i].address, p.data)
            )
        for s in out.streams:
            dst = self.index[s.dest]
            reply = None
            if dst not in self.crashed:
                parsed = self.nodes[dst].parse_stream(s.data)
                assert parsed is not None
                served = self.nodes[dst].handle_stream(
                    self.nodes[i].address, parsed[0], self.now_ms
                )
                self.apply(dst, served)
                if served.reply is not None:
                    got = self.nodes[i].parse_stream(served.reply)
                    reply = None if got is None else got[0]
            if s.expect_reply:
                self.push(self.now_ms + 4, i, ("result", s.stream_id, reply))

    def push(self, at_ms: int, i: int, what: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at_ms, self.seq, i, what))

    def run_until(self, end_ms: int) -> None:
        while self.heap and self.heap[0][0] <= end_ms:
            at_ms, _, i, what = heapq.heappop(self.heap)
            if i in self.crashed:
                continue
            self.now_ms = at_ms
            node = self.nodes[i]
            if what[0] == "timer":
                self.apply(i, node.handle_timer(what[1], at_ms))
            elif what[0] == "packet":
                self.apply(i, node.handle_datagram(what[1], what[2], at_ms))
            else:
                error = "" if what[2] is not None else "failed"
                self.apply(i, node.handle_stream_response(what[1], what[2], at_ms, error))
        self.now_ms = end_ms


# --- building snapshots -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "error"),
    [
        ([SeedMember("a", address(1)), SeedMember("a", address(2))], "duplicate member"),
        ([SeedMember("a", address(1)), SeedMember("b", address(1))], "share"),
        ([SeedMember("", address(1))], "non-empty"),
        ([SeedMember("a", address(1), meta=b"x" * 513)], "512"),
        ([SeedMember("a", address(1), vsn=(1, 5, 2))], "vsn"),
        ([SeedMember("a", address(1), vsn=(3, 2, 2, 2, 5, 5))], "vsn"),
        ([SeedMember("a", address(1), incarnation=-1)], "incarnation"),
        ([SeedMember("a", Address("not-an-ip", 1))], "IP"),
    ],
)
def test_build_rejects_bad_members(members: list[SeedMember], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        MembershipSnapshot.build(members)


def test_bootstrap_joins_everyone_without_events_or_traffic() -> None:
    snapshot = MembershipSnapshot.build(seeds(50))
    node = Node("n007", address(7), rng=random.Random(1), now_ms=0, meta=b"mine")
    node.start(0)
    out = node.bootstrap(snapshot, 5)
    assert out.events == [] and out.packets == [] and out.streams == []
    assert node.num_members() == 50
    assert {m.state for m in node.members()} == {ALIVE}
    me = node.member("n007")
    assert me is not None and me.meta == b"mine"  # our own entry is ours, not the seed's
    other = node.member("n008")
    assert other is not None and other.incarnation == 1 and other.address == address(8)


def test_bootstrap_adds_us_when_the_snapshot_lacks_us() -> None:
    node = Node("extra", address(99), rng=random.Random(1), now_ms=0)
    node.start(0)
    node.bootstrap(MembershipSnapshot.build(seeds(10)), 0)
    assert node.num_members() == 11


@pytest.mark.parametrize("case", ["twice", "after_join", "our_address_taken"])
def test_bootstrap_misuse_raises(case: str) -> None:
    snapshot = MembershipSnapshot.build(seeds(10))
    name, addr = ("intruder", address(3)) if case == "our_address_taken" else ("n001", address(1))
    node = Node(name, addr, rng=random.Random(1), now_ms=0)
    node.start(0)
    if case == "twice":
        node.bootstrap(snapshot, 0)
    elif case == "after_join":
        node.handle_datagram(address(50), packet(_alive(50)), 0)
    with pytest.raises(ValueError):
        node.bootstrap(snapshot, 0)


def _alive(i: int) -> Any:
    from tests.swim.node_harness import alive

    return alive(f"x{i}", i)


# --- copy-on-write isolation --------------------------------------------------------------


def test_a_change_at_one_node_never_shows_at_another() -> None:
    snapshot = MembershipSnapshot.build(seeds(20))
    nodes = []
    for i in range(3):
        node = Node(f"n{i:03d}", address(i), rng=random.Random(i), now_ms=0)
        node.start(0)
        node.bootstrap(snapshot, 0)
        nodes.append(node)
    out = nodes[0].handle_datagram(address(5), packet(Suspect(1, "n005", "n004")), 100)
    assert [e.kind for e in out.events] == [EventKind.SUSPECT]
    seen = nodes[0].member("n005")
    assert seen is not None and seen.state == SUSPECT
    for other in nodes[1:]:
        member = other.member("n005")
        assert member is not None and member.state == ALIVE
    base = snapshot.get("n005")
    assert base is not None and base.state == ALIVE
    assert nodes[1].handle_datagram(address(5), packet(Suspect(1, "n005", "n004")), 100).events


def test_table_matches_a_plain_dict_under_random_changes() -> None:
    """Counts, lookups and iteration agree with a brute-force model after many changes."""
    rng = random.Random(3)
    snapshot = MembershipSnapshot.build(seeds(40))
    local = MemberState("n000", address(0), b"", 1, ALIVE, 0)
    table = MemberTable(local)
    table.bootstrap(snapshot)
    model = {m.name: m.state for m in table}
    for step in range(400):
        name = f"n{rng.randrange(60):03d}"
        state = table.get(name)
        if name == "n000":
            continue
        if state is None:
            new = MemberState(name, address(int(name[1:])), b"", 1, ALIVE, step)
            table.insert(new, rng)
            model[name] = ALIVE
        elif rng.random() < 0.3 and state.dead_or_left():
            table.remove(name)
            del model[name]
        else:
            target = rng.choice([ALIVE, SUSPECT, DEAD, NodeStateType.LEFT])
            table.set_state(table.mutable(name), target, step)
            model[name] = target
        assert len(table) == len(model)
        for kind in NodeStateType:
            assert table.count(kind) == sum(1 for s in model.values() if s == kind)
    assert {m.name: m.state for m in table} == model
    for name in model:
        found = table.get(name)
        assert found is not None and table.by_address(found.address) is found
    assert snapshot.get("n001") is not None and snapshot.get("n001").state == ALIVE  # type: ignore[union-attr]


# --- random choices -----------------------------------------------------------------------


def _table(n: int) -> MemberTable:
    table = MemberTable(MemberState("n000", address(0), b"", 1, ALIVE, 0))
    table.bootstrap(MembershipSnapshot.build(seeds(n)))
    return table


def test_random_members_is_uniform_over_the_eligible() -> None:
    table = _table(60)
    for i in range(1, 60, 3):  # every third member is dead: never picked
        table.set_state(table.mutable(f"n{i:03d}"), DEAD, 0)
    rng = random.Random(9)
    counts: Counter[str] = Counter()
    trials = 12_000
    for _ in range(trials):
        picked = table.random_members(3, lambda m: m.name == "n000" or m.dead_or_left(), rng)
        assert len({m.name for m in picked}) == 3
        counts.update(m.name for m in picked)
    eligible = [m.name for m in table if m.name != "n000" and not m.dead_or_left()]
    assert set(counts) == set(eligible)
    expected = trials * 3 / len(eligible)
    assert all(abs(c - expected) < 0.15 * expected for c in counts.values())


def test_random_members_falls_back_when_few_are_eligible() -> None:
    table = _table(500)
    for i in range(2, 500):
        table.set_state(table.mutable(f"n{i:03d}"), DEAD, 0)
    picked = table.random_members(3, lambda m: m.dead_or_left(), random.Random(1))
    assert sorted(m.name for m in picked) == ["n000", "n001"]


def test_probe_rounds_visit_every_member_once_and_newcomers_in_the_same_round() -> None:
    table = _table(200)
    rng = random.Random(4)
    drawn = [table.draw(rng).name for _ in range(100)]
    table.insert(MemberState("late", address(900), b"", 1, ALIVE, 0), rng)
    while table.undrawn():
        drawn.append(table.draw(rng).name)
    assert sorted(drawn) == sorted(m.name for m in table)
    table.new_round()
    second = [table.draw(rng).name for _ in range(len(table))]
    assert sorted(second) == sorted(drawn) and second != drawn


# --- whole clusters -----------------------------------------------------------------------


def test_same_seed_same_run() -> None:
    runs = []
    for _ in range(2):
        loop = Loop(30, seed=5)
        loop.run_until(8_000)
        runs.append(loop.log)
    assert runs[0] == runs[1] and len(runs[0]) > 100


def test_bootstrap_then_a_crash_is_detected_everywhere() -> None:
    n = 40
    loop = Loop(n, seed=2)
    loop.run_until(3_000)
    assert not loop.events
    loop.crashed.add(17)
    loop.run_until(3_000 + _detection_bound_ms(n))
    for i, node in enumerate(loop.nodes):
        if i != 17:
            member = node.member("n017")
            assert member is not None and member.state == DEAD, node.name
    # nobody else was ever suspected or declared dead
    assert {name for _, _, name in loop.events} == {"n017"}
    assert {kind for _, kind, _ in loop.events} <= {EventKind.SUSPECT, EventKind.DEAD}


def _detection_bound_ms(n: int) -> int:
    interval = 1_000
    suspicion_max = 6 * formulas.suspicion_timeout_ms(4, n, interval)
    return 2 * n * interval // 10 + suspicion_max + 5_000


# --- the shared push-pull path equals the plain one ---------------------------------------

BIG = 300  # above swim.shared.SHARED_MIN_NODES


def _booted(name: str, seed: int, snapshot: MembershipSnapshot) -> Node:
    index = int(name[1:])
    node = Node(name, address(index), rng=random.Random(seed), now_ms=0)
    node.start(0)
    node.bootstrap(snapshot, 0)
    return node


def _remote_states(case: str) -> list[PushNodeState]:
    base = [
        PushNodeState(s.name, s.address.ip_bytes, s.address.port, b"", 1, ALIVE, bytes(s.vsn))
        for s in seeds(BIG)
    ]
    r = base[10]
    if case == "newer":
        base[10] = PushNodeState(r.name, r.addr, r.port, b"m", 2, ALIVE, r.vsn)
    elif case == "suspect":
        base[10] = PushNodeState(r.name, r.addr, r.port, b"", 1, SUSPECT, r.vsn)
    elif case == "dead":
        base[10] = PushNodeState(r.name, r.addr, r.port, b"", 1, DEAD, r.vsn)
    elif case == "left":
        base[10] = PushNodeState(r.name, r.addr, r.port, b"", 1, NodeStateType.LEFT, r.vsn)
    elif case == "unknown":
        extra = address(777)
        base.append(PushNodeState("new", extra.ip_bytes, extra.port, b"", 5, ALIVE, r.vsn))
    elif case == "twice":
        base.append(PushNodeState(r.name, r.addr, r.port, b"", 3, ALIVE, r.vsn))
    elif case == "accuses_us":
        me = base[0]
        base[0] = PushNodeState(me.name, me.addr, me.port, b"", 9, SUSPECT, me.vsn)
    elif case == "old_protocol":
        base[20] = PushNodeState(
            base[20].name, base[20].addr, 7946, b"", 1, ALIVE, b"\x01\x01\x01\x01\x01\x01"
        )
    return base


@pytest.mark.parametrize(
    "case",
    ["same", "newer", "suspect", "dead", "left", "unknown", "twice", "accuses_us", "old_protocol"],
)
def test_shared_merge_equals_plain_merge(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = MembershipSnapshot.build(seeds(BIG))
    remote = PushPull(False, tuple(_remote_states(case)))
    results = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(streams_module, "SHARED_MIN_NODES", 10**9)
        node = _booted("n000", 1, snapshot)
        # a member we changed ourselves before the push-pull arrives
        node.handle_datagram(address(30), packet(Suspect(1, "n030", "n031")), 10)
        out = node.handle_stream(address(5), remote, 20)
        results.append(
            (
                node.members(),
                [(e.kind, e.member) for e in out.events],
                dict(node.stats.dropped),
                [n.kind for n in out.notices],
                node.incarnation,
            )
        )
    assert results[0] == results[1]


def test_shared_encoding_is_the_plain_encoding() -> None:
    snapshot = MembershipSnapshot.build(seeds(BIG))
    node = _booted("n000", 1, snapshot)
    node.handle_datagram(address(30), packet(Suspect(1, "n030", "n031")), 10)
    node.handle_datagram(address(500), packet(_alive(200)), 10)
    members = node._members
    members._members.remove("n040")
    states = push_pull.push_states(members._members)
    plain = wire.encode_push_pull(PushPull(True, states, b"state"))
    assert members.push_pull.encode(True, b"state") == plain
    parsed = wire.parse_stream(plain, None, wire.StreamLimits())
    assert parsed is not None and isinstance(parsed[0], PushPull)
    assert len(parsed[0].nodes) == BIG


def test_shared_codec_memos_give_what_the_plain_calls_give() -> None:
    snapshot = MembershipSnapshot.build(seeds(BIG))
    codec = snapshot.codec
    message = _booted("n000", 1, snapshot)._members.push_pull.encode(False, b"")
    stream = codec.compress(message)
    ok, refused = wire.StreamLimits(), wire.StreamLimits(max_nodes=BIG - 1)
    for _ in range(2):  # a miss, then a hit
        assert codec.parse(stream, ok) == wire.parse_stream(stream, None, ok)
        with pytest.raises(wire.WireError) as plain:
            wire.parse_stream(stream, None, refused)
        with pytest.raises(wire.WireError) as memo:
            codec.parse(stream, refused)
        assert (memo.value.reason, memo.value.detail) == (plain.value.reason, plain.value.detail)
        compound = wire.make_compound([message[:100], message[100:300]])
        assert codec.compress_packet(compound) == wire.compress_message(compound)


def test_nodes_that_changed_the_same_members_alike_share_one_message() -> None:
    snapshot = MembershipSnapshot.build(seeds(BIG))
    nodes = [_booted(f"n{i:03d}", i + 1, snapshot) for i in range(3)]
    for node, accused in zip(nodes, ("n030", "n030", "n031"), strict=True):
        node.handle_datagram(address(30), packet(Suspect(1, accused, "n099")), 10)
    messages = [node._members.push_pull.encode(False, b"") for node in nodes]
    for node, message in zip(nodes, messages, strict=True):
        states = push_pull.push_states(node._members._members)
        assert message == wire.encode_push_pull(PushPull(False, states, b""))
    assert messages[0] is messages[1]  # one object: its hash is computed once
    assert messages[2] != messages[0]
    # the join flag and the user state are part of what is remembered
    assert nodes[0]._members.push_pull.encode(True, b"") != messages[0]
    assert nodes[1]._members.push_pull.encode(False, b"u") != messages[0]


def test_below_draws_what_randrange_draws() -> None:
    """The member table's draws skip ``randrange``'s Python layers; the numbers and the
    generator's state afterwards must be the same (the simulator's pinned traces rely on
    it)."""
    for seed in range(40):
        ours, theirs = random.Random(seed), random.Random(seed)
        for n in (1, 2, 3, 7, 8, 9, 255, 256, 257, 10_000, 10_001, 2**31 + 5, 2**40):
            assert below(ours, n) == theirs.randrange(n)
        assert ours.random() == theirs.random()
    with pytest.raises(ValueError):
        below(random.Random(1), 0)
