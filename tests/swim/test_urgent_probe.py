"""Urgent probes (``Node.probe_now``): a report from outside the protocol moves a member's
probe earlier and never decides its fate. Through swim.Node's public API on explicit time,
and on the simulator's virtual clock for a crash in a 32-member ``fast`` cluster.

Rules under test: swim/probe.py's module docstring (the urgent probe is memberlist's
state.go ``probeNode`` cycle, started at once beside the round-robin probe).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from simulations.model.world import SlowSpec, World
from swim import (
    Config,
    EventKind,
    MemberEvent,
    NodeStateType,
    Output,
    ProbeResult,
    StreamKind,
    Timer,
    UrgentProbeOutcome,
    formulas,
)
from swim.messages import Ack, Dead, IndirectPing, Nack, Ping, Suspect
from swim.probe import MAX_URGENT_PROBES
from swim.timers import ProbeDeadline, ProbeTick, ProbeTimeout
from tests.swim.node_harness import (
    FAST_WITHOUT_DETECTION_SWITCHES,
    PORT,
    Peer,
    addr,
    alive,
    alive_of,
    decode,
    make_peer,
)

ALIVE = NodeStateType.ALIVE
SUSPECT = NodeStateType.SUSPECT
DEAD = NodeStateType.DEAD
STARTED = UrgentProbeOutcome.STARTED
NAMES = ("b", "c", "d", "e", "f", "g")


def _group(config: Config | None = None) -> Peer:
    """a knows b..g (alive, protocol 5), s (suspect) and x (dead); nothing left to gossip."""
    a = make_peer("a", 1, config=config)
    a.learn(*(alive(n, i) for i, n in enumerate(NAMES, start=2)), alive("s", 20), alive("x", 21))
    a.receive(addr(30), Suspect(1, "s", "z"), Dead(1, "x", "z"), now_ms=1)
    a.drain(5)
    assert a.member("s").state == SUSPECT and a.member("x").state == DEAD
    return a


def _urgent(a: Peer, name: str, now_ms: int) -> tuple[Output, Ping]:
    outcome, out = a.node.probe_now(name, now_ms)
    assert outcome is STARTED
    a.take(out)
    [packet] = out.packets
    assert packet.dest == a.member(name).address
    ping = decode(packet.data)[0]  # first, before any piggybacked gossip
    assert isinstance(ping, Ping)
    return out, ping


def _fire(a: Peer, out: Output, kind: type[Timer]) -> Output:
    """Hand back the timer of ``kind`` that ``out`` asked for, at its deadline."""
    [timer] = [t for t in out.timers if isinstance(t, kind)]
    return a.take(a.node.handle_timer(timer, timer.deadline_ms))


# --- the probe itself -------------------------------------------------------------------------


def test_an_urgent_probe_pings_at_once_with_the_probe_cycles_timers() -> None:
    a = _group()
    out, ping = _urgent(a, "b", 100)
    assert ping == Ping(ping.seq_no, "b", addr(1).ip_bytes, PORT, "a")
    config = a.node.config
    assert sorted((type(t).__name__, t.deadline_ms) for t in out.timers) == [
        ("ProbeDeadline", 100 + config.probe_interval_ms),
        ("ProbeTimeout", 100 + config.probe_timeout_ms),
    ]
    assert a.node.stats.urgent_probes == {"started": 1}
    assert a.node.stats.probes_sent == 1


def test_an_ack_ends_the_urgent_probe_with_an_rtt_sample_and_better_health() -> None:
    a = _group()
    a.receive(addr(2), Suspect(a.node.incarnation, "a", "b"), now_ms=50)  # refute: health 1
    assert a.node.health_score == 1
    out, ping = _urgent(a, "b", 100)
    done = a.receive(addr(2), Ack(ping.seq_no, b"p"), now_ms=103)
    assert done.probe_results == [ProbeResult("b", 3, b"p", "direct")]
    assert done.probes_refused == []
    assert a.node.health_score == 0
    assert a.member("b").state == ALIVE
    # its timers are dead: handing them back does nothing
    for kind in (ProbeTimeout, ProbeDeadline):
        late = _fire(a, out, kind)
        assert (late.packets, late.streams, late.events) == ([], [], [])
    assert a.node.stats.urgent_probes_failed == a.node.stats.probes_failed == 0


def test_a_failed_urgent_probe_asks_helpers_tries_tcp_and_suspects() -> None:
    a = _group()
    out, ping = _urgent(a, "b", 100)
    indirect = _fire(a, out, ProbeTimeout)
    requests = {p.dest: decode(p.data)[0] for p in indirect.packets}
    config = a.node.config
    assert len(requests) == config.indirect_checks
    assert all(isinstance(r, IndirectPing) and r.seq_no == ping.seq_no for r in requests.values())
    assert all(isinstance(r, IndirectPing) and r.node == "b" and r.nack for r in requests.values())
    [tcp] = indirect.streams
    assert (tcp.kind, tcp.dest) == (StreamKind.PING, addr(2))
    helper = next(iter(requests))
    a.receive(helper, Nack(ping.seq_no), now_ms=200)  # one of three helpers nacks
    a.take(a.node.handle_stream_response(tcp.stream_id, None, 210, "connection refused"))
    done = _fire(a, out, ProbeDeadline)
    assert [(e.kind, e.member.name) for e in done.events] == [(EventKind.SUSPECT, "b")]
    assert [n.kind for n in done.notices] == ["urgent_probe_failed"]
    assert done.probes_refused == ["b"]  # for the agent's crash evidence
    assert a.node.health_score == formulas.probe_failure_awareness_delta(3, 1) == 2
    stats = a.node.stats
    assert (stats.urgent_probes_failed, stats.probes_failed, stats.nacks_received) == (1, 1, 1)


def test_a_probe_whose_tcp_ping_went_unanswered_is_not_listed_as_refused() -> None:
    """A paused process's kernel accepts the TCP ping and nothing answers it: suspect at
    the deadline, but not the refusal a crashed process gives (``Output.probes_refused``)."""
    a = _group()
    out, ping = _urgent(a, "b", 100)
    indirect = _fire(a, out, ProbeTimeout)
    for helper in (p.dest for p in indirect.packets):
        a.receive(helper, Nack(ping.seq_no), now_ms=150)
    [tcp] = indirect.streams
    grace = _fire(a, out, ProbeDeadline)  # the TCP ping still open: a grace period
    assert a.member("b").state == ALIVE
    deadline = 100 + a.node.config.probe_interval_ms
    timed_out = a.take(a.node.handle_stream_response(tcp.stream_id, None, deadline, "timed out"))
    [(kind, name)] = [(e.kind, e.member.name) for e in grace.events + timed_out.events]
    assert (kind, name) == (EventKind.SUSPECT, "b")
    assert grace.probes_refused == timed_out.probes_refused == []


def test_the_tcp_fallback_rescues_an_urgent_probe() -> None:
    a, b = make_peer("a", 1), make_peer("b", 2)
    a.learn(alive_of(b))
    out, ping = _urgent(a, "b", 100)
    [tcp] = _fire(a, out, ProbeTimeout).streams
    parsed = b.node.parse_stream(tcp.data)
    assert parsed is not None and parsed[0] == ping
    reply = b.node.handle_stream(a.address, parsed[0], 150).reply
    assert reply is not None
    back = a.node.parse_stream(reply)
    assert back is not None
    a.take(a.node.handle_stream_response(tcp.stream_id, back[0], 160))
    done = _fire(a, out, ProbeDeadline)
    assert [(r.node, r.via) for r in done.probe_results] == [("b", "tcp")]
    assert done.events == [] and a.member("b").state == ALIVE
    assert a.node.stats.tcp_fallback_rescues == 1


def test_the_round_robin_keeps_probing_while_urgent_probes_run() -> None:
    a = _group(Config.lan(disable_tcp_pings=True))
    urgent_out, urgent_ping = _urgent(a, "b", 100)
    # The round robin is neither blocked nor deferred: every tick sends its own ping, to
    # b too when its turn comes, and each ack ends only the probe it answers.
    seen: list[str] = []
    now = 100
    for _ in range(2 * len(NAMES)):
        now += 10
        out = a.fire(ProbeTick, now)
        [ping] = [m for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
        assert ping.seq_no != urgent_ping.seq_no
        seen.append(ping.node)
        a.receive(a.member(ping.node).address, Ack(ping.seq_no), now_ms=now + 1)
    assert set(seen) == {*NAMES, "s"}  # b included; x is dead
    assert a.node.stats.probes_sent == 1 + len(seen)
    # the urgent probe is still in flight, and still ends on its own ack
    done = a.receive(addr(2), Ack(urgent_ping.seq_no), now_ms=now + 2)
    assert [(r.node, r.via) for r in done.probe_results] == [("b", "direct")]
    assert _fire(a, urgent_out, ProbeTimeout).packets == []


# --- refusals -------------------------------------------------------------------------------


def _refused(a: Peer, name: str, now_ms: int, why: UrgentProbeOutcome) -> None:
    """Refused: nothing sent, no timer, no state change; counted by reason."""
    timers, counted = a.node.live_timers, a.node.stats.urgent_probes[why.value]
    health, sent = a.node.health_score, a.node.stats.probes_sent
    outcome, out = a.node.probe_now(name, now_ms)
    assert outcome is why
    assert (out.packets, out.timers, out.streams, out.events) == ([], [], [], [])
    assert a.node.live_timers == timers
    assert (a.node.health_score, a.node.stats.probes_sent) == (health, sent)
    assert a.node.stats.urgent_probes[why.value] == counted + 1


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a", UrgentProbeOutcome.SELF),
        ("ghost", UrgentProbeOutcome.UNKNOWN),
        ("s", UrgentProbeOutcome.NOT_ALIVE),  # suspect: its suspicion is already running
        ("x", UrgentProbeOutcome.NOT_ALIVE),  # dead: nothing to probe
    ],
)
def test_refused_for_ourselves_unknown_and_not_alive_members(
    name: str, why: UrgentProbeOutcome
) -> None:
    a = _group()
    _refused(a, name, 100, why)
    assert a.node.stats.urgent_probes == {why.value: 1}


def test_refused_while_the_round_robin_probes_that_member() -> None:
    a = _group()
    a.probe("c", 100)
    _refused(a, "c", 110, UrgentProbeOutcome.PROBING)
    _urgent(a, "b", 120)  # another member is fine


def test_refused_while_an_urgent_probe_of_that_member_runs() -> None:
    a = _group()
    _urgent(a, "b", 100)
    _refused(a, "b", 101, UrgentProbeOutcome.PROBING)


def test_one_urgent_probe_per_member_per_probe_interval() -> None:
    a = _group()
    interval = a.node.config.probe_interval_ms
    _, ping = _urgent(a, "b", 100)
    a.receive(addr(2), Ack(ping.seq_no), now_ms=102)
    _refused(a, "b", 100 + interval - 1, UrgentProbeOutcome.RATE_LIMITED)
    _urgent(a, "c", 100 + interval - 1)  # the limit is per member
    _urgent(a, "b", 100 + interval)


def test_at_most_max_urgent_probes_in_flight() -> None:
    a = _group()
    pings = [_urgent(a, name, 100)[1] for name in NAMES[:MAX_URGENT_PROBES]]
    spare = NAMES[MAX_URGENT_PROBES]
    _refused(a, spare, 101, UrgentProbeOutcome.TOO_MANY)
    a.receive(addr(2), Ack(pings[0].seq_no), now_ms=102)  # b's probe ends: a slot frees
    _urgent(a, spare, 103)
    assert a.node.stats.urgent_probes == {"started": MAX_URGENT_PROBES + 1, "too_many": 1}


# --- on the virtual clock: a crash in a 32-member fast cluster ---------------------------------

N = 32
VICTIM = 7
REPORTERS = (0, 1, 2)
REPORT_AFTER_MS = 20
"""The model of a trainer noticing a crash through its collectives (the real delay is the
transport's; the assertions below do not depend on it)."""


@dataclass
class _Seen:
    """Per observer: when it first saw the victim suspect or dead, and how many urgent
    probes it had seen fail by then (read at that input's output, so a count that grew
    in the same input shows that input was the failing urgent probe's conclusion)."""

    world: World
    victim: str
    suspect: dict[int, tuple[int, int]] = field(default_factory=dict)
    dead: dict[int, int] = field(default_factory=dict)

    def on_event(self, idx: int, event: MemberEvent) -> None:
        if event.member.name != self.victim:
            return
        if event.kind == EventKind.SUSPECT and idx not in self.suspect:
            failed = self.world.nodes[idx].stats.urgent_probes_failed
            self.suspect[idx] = (event.at_ms, failed)
        elif event.kind == EventKind.DEAD:
            self.dead.setdefault(idx, event.at_ms)

    def on_lifecycle(self, kind: str, idx: int) -> None:
        pass


@dataclass
class _Crash:
    crash_ms: int
    seen: _Seen
    health_at_report: dict[int, int]
    urgent_failed_before: dict[int, int]


FAST = Config.fast(**FAST_WITHOUT_DETECTION_SWITCHES)
"""Urgent probes against the plain round robin (the faster-detection switches would blur
which probe raised a suspicion: a cross-check, a coordinated round, an early conclusion)."""


def _crash(seed: int, *, report: bool) -> _Crash:
    world = World(N, seed=seed, config=FAST)
    world.start_all()
    world.run_until(10_000)  # 40 probe rounds: RTT samples, adaptive timeouts in use
    seen = _Seen(world, world.names[VICTIM])
    world.listeners.append(seen)
    crash_ms = world.now_ms
    world.crash(VICTIM)
    health: dict[int, int] = {}
    failed_before = {i: world.nodes[i].stats.urgent_probes_failed for i in REPORTERS}
    if report:
        world.run_until(crash_ms + REPORT_AFTER_MS)
        for i in REPORTERS:
            health[i] = world.nodes[i].health_score
            assert world.probe_now(i, seen.victim) is STARTED
    survivors = len(world.live_indices())
    assert world.run_until_true(lambda: len(seen.dead) == survivors, 30_000, step_ms=10) >= 0
    assert not [i for i in world.live_indices() if i not in seen.dead]
    return _Crash(crash_ms, seen, health, failed_before)


def test_reported_crash_is_suspected_by_the_urgent_probe_and_dead_sooner() -> None:
    """Same seed with and without three survivors reporting the victim 20 ms after the
    crash. With reports, each reporter suspects it when its urgent probe ends (the direct
    ping's adaptive timeout, then the indirect and TCP round, all within the probe's
    deadline of one health-scaled probe interval), where the round robin would reach the
    victim from a given member only at its turn in a round of n−1 probe intervals. Three
    independent suspicions at once are Lifeguard's k confirmations, so the victim dies at
    the suspicion window's minimum: never later than without the reports, and earlier in
    total over the seeds (where some other member's round robin happened to probe the
    victim right after the crash, the two runs declare it dead at the same time)."""
    config = FAST
    round_robin_wait_ms = (N - 1) * config.probe_interval_ms
    first_dead: dict[bool, list[int]] = {False: [], True: []}
    last_dead: dict[bool, list[int]] = {False: [], True: []}
    for seed in (1, 2, 3):
        runs = {report: _crash(seed, report=report) for report in (False, True)}
        fast = runs[True]
        report_ms = fast.crash_ms + REPORT_AFTER_MS
        for i in REPORTERS:
            suspect_ms, urgent_failed = fast.seen.suspect[i]
            deadline_ms = report_ms + formulas.awareness_scale_ms(
                config.probe_interval_ms, fast.health_at_report[i]
            )
            # it was the urgent probe: its failure was counted in the very input that
            # raised the suspicion, at the probe's deadline
            assert urgent_failed == fast.urgent_failed_before[i] + 1, (seed, i)
            # (the deadline, or the TCP fallback's grace after it if the TCP ping is open)
            assert report_ms < suspect_ms <= deadline_ms + config.probe_timeout_ms, (seed, i)
            assert suspect_ms - report_ms < round_robin_wait_ms
            assert runs[False].seen.suspect[i][1] == runs[False].urgent_failed_before[i]
        for report, run in runs.items():
            first_dead[report].append(min(run.seen.dead.values()) - run.crash_ms)
            last_dead[report].append(max(run.seen.dead.values()) - run.crash_ms)
        assert first_dead[True][-1] <= first_dead[False][-1], seed
    assert sum(first_dead[True]) < sum(first_dead[False])
    assert sum(last_dead[True]) < sum(last_dead[False])


def _state(world: World, idx: int, name: str) -> NodeStateType | None:
    member = world.nodes[idx].member(name)
    return None if member is None else member.state


@dataclass
class _Recorder:
    events: list[tuple[int, MemberEvent]]

    def on_event(self, idx: int, event: MemberEvent) -> None:
        self.events.append((idx, event))

    def on_lifecycle(self, kind: str, idx: int) -> None:
        pass


def test_a_reported_live_member_is_acked_and_stays_alive() -> None:
    world = World(N, seed=4, config=Config.fast())
    world.start_all()
    world.run_until(10_000)
    target = world.names[VICTIM]
    events: list[tuple[int, MemberEvent]] = []
    world.listeners.append(_Recorder(events))
    reporters = [i for i in range(8) if i != VICTIM]
    for i in reporters:
        assert world.probe_now(i, target) is STARTED
    world.run_for(10_000)
    assert [(i, e.kind) for i, e in events if e.member.name == target] == []
    for i in reporters:
        stats = world.nodes[i].stats
        assert stats.urgent_probes == {"started": 1}
        assert stats.urgent_probes_failed == 0
    assert all(_state(world, i, target) == ALIVE for i in world.live_indices())


def test_a_reported_member_that_hangs_briefly_is_suspected_and_refutes() -> None:
    """A hung member (SIGSTOP) goes through the detector as usual: a report makes the
    probe earlier, the probe's failure makes it suspect, and once it runs again it refutes
    within the suspicion window and is never declared dead."""
    world = World(N, seed=5, config=Config.fast())
    world.start_all()
    world.run_until(10_000)
    target = world.names[VICTIM]
    events: list[tuple[int, MemberEvent]] = []
    world.listeners.append(_Recorder(events))
    hang_ms = 2 * world.config.probe_interval_ms
    world.set_slow(VICTIM, SlowSpec(pauses=((world.now_ms, world.now_ms + hang_ms),)))
    world.run_for(REPORT_AFTER_MS)
    assert world.probe_now(0, target) is STARTED
    world.run_for(20_000)
    about = [(i, e.kind) for i, e in events if e.member.name == target]
    assert (0, EventKind.SUSPECT) in about
    assert world.nodes[0].stats.urgent_probes_failed == 1
    assert EventKind.DEAD not in {kind for _, kind in about}
    assert world.nodes[VICTIM].stats.refutations >= 1
    assert all(_state(world, i, target) == ALIVE for i in world.live_indices())


@pytest.mark.parametrize("missing_nack", [False, True])
def test_an_urgent_probe_concludes_once_every_path_failed(missing_nack: bool) -> None:
    """Every helper nacked and the TCP ping was refused: suspect now, not at the deadline.
    One helper silent: the probe waits for its deadline, as a round-robin probe does."""
    a = _group()
    out, ping = _urgent(a, "b", 100)
    indirect = _fire(a, out, ProbeTimeout)
    helpers = [p.dest for p in indirect.packets]
    [tcp] = indirect.streams
    refused = a.take(a.node.handle_stream_response(tcp.stream_id, None, 130, "refused"))
    assert refused.events == []
    answering = helpers[:-1] if missing_nack else helpers
    last = Output()
    for i, helper in enumerate(answering):
        last = a.receive(helper, Nack(ping.seq_no), now_ms=140 + i)
    if missing_nack:
        assert a.member("b").state == ALIVE, "a silent helper may still relay a late ack"
        last = _fire(a, out, ProbeDeadline)
    assert [(e.kind, e.member.name) for e in last.events] == [(EventKind.SUSPECT, "b")]
    deadline = 100 + a.node.config.probe_interval_ms
    assert (a.member("b").state_change_ms < deadline) is not missing_nack
    assert a.node.stats.urgent_probes_failed == 1


def test_a_round_robin_probe_still_waits_for_its_deadline() -> None:
    a = make_peer("a", 1)
    a.learn(*(alive(n, i) for i, n in enumerate(NAMES, start=2)))
    a.drain(5)
    tick = a.take(a.node.handle_timer(next(t for t in a.timers if isinstance(t, ProbeTick)), 100))
    [packet] = tick.packets
    ping = decode(packet.data)[0]
    assert isinstance(ping, Ping)
    indirect = _fire(a, tick, ProbeTimeout)
    for helper in (p.dest for p in indirect.packets):
        a.receive(helper, Nack(ping.seq_no), now_ms=140)
    for tcp in indirect.streams:
        a.take(a.node.handle_stream_response(tcp.stream_id, None, 150, "refused"))
    assert a.member(ping.node).state == ALIVE
    done = _fire(a, tick, ProbeDeadline)
    assert [(e.kind, e.member.name) for e in done.events] == [(EventKind.SUSPECT, ping.node)]
    assert done.probes_refused == [ping.node]
