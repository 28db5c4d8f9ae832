"""The faster-detection switches (on in `fast`), through swim.Node's public API on explicit
time (and ``swim.schedule.ProbeRing``, which is pure):

- ``coordinated_probes``: every member computes the same rotation of the name-sorted ring
  per round, so each round is a permutation (each member probed once) and n − 1 rounds
  cover everyone (SWIM §4.3's round-robin bound);
- ``early_probe_conclusion``: a round-robin probe ends once every path failed;
- ``suspicion_cross_checks``: a member that first hears an accusation probes the suspect;
  its failure is its own confirmation (Lifeguard §IV-B, arXiv:1707.00788);
- ``confirmed_suspicion_safety_mult``: k confirmations end the window at the derived window
  with that safety multiple (``swim.suspicion.confirmed_window_ms``);
- ``verify_confirmed_suspicion``: the last-chance ping goes to confirmed suspects too.

Rules: swim/schedule.py, swim/probe.py and swim/suspicion.py docstrings; measured in
simulations/RESULTS.md §9.
"""

from __future__ import annotations

import itertools
import random

import pytest

from swim import Config, ConfigError, EventKind, NodeStateType, Output, formulas
from swim.messages import Ack, Nack, Ping, Suspect
from swim.schedule import ProbeRing
from swim.suspicion import confirmed_window_ms, suspicion_window_ms
from swim.timers import (
    GossipTick,
    ProbeDeadline,
    ProbeTick,
    ProbeTimeout,
    SuspicionTimeout,
    SuspicionVerify,
)
from tests.swim.node_harness import (
    FAST_WITHOUT_DETECTION_SWITCHES,
    Peer,
    addr,
    alive,
    decode,
    make_peer,
)

ALIVE, SUSPECT = NodeStateType.ALIVE, NodeStateType.SUSPECT
NAMES = ("b", "c", "d", "e", "f", "g")

# --- the ring -------------------------------------------------------------------------------


def _rings(names: list[str]) -> dict[str, ProbeRing]:
    rings = {}
    for name in names:
        ring = ProbeRing(name)
        ring.reset(n for n in names if n != name)
        rings[name] = ring
    return rings


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13])
def test_every_round_is_a_permutation_and_n_minus_1_rounds_cover_everyone(n: int) -> None:
    names = [f"node-{i:03d}" for i in random.Random(n).sample(range(1000), n)]
    rings = _rings(names)
    for r in range(3 * n):
        targets = [rings[name].target(r) for name in names]
        assert sorted(t for t in targets if t is not None) == sorted(names), r
        assert all(t != name for t, name in zip(targets, names, strict=True))
    for name in names:
        covered = {rings[name].target(r) for r in range(7, 7 + n - 1)}
        assert covered == set(names) - {name}


def test_the_ring_adds_and_discards_idempotently_and_keeps_the_local_member() -> None:
    ring = ProbeRing("m")
    assert ring.target(0) is None, "alone: nothing to probe"
    ring.add("a")
    ring.add("a")
    ring.update("z", live=True)
    assert len(ring) == 3
    ring.discard("m")
    ring.discard("nobody")
    ring.update("a", live=False)
    assert len(ring) == 2
    assert {ring.target(r) for r in range(4)} == {"z"}


# --- the node: coordinated probes -------------------------------------------------------------


def _fast(**overrides: object) -> Config:
    """``fast`` with all four switches off but those a test is about."""
    return Config.fast(**{**FAST_WITHOUT_DETECTION_SWITCHES, **overrides})


def _group(**overrides: object) -> Peer:
    """a knows b..g (alive, protocol 5); nothing left to gossip."""
    a = make_peer("a", 1, config=_fast(**overrides))
    a.learn(*(alive(n, i) for i, n in enumerate(NAMES, start=2)))
    a.drain(5)
    return a


def _tick(a: Peer, now_ms: int) -> tuple[Output, Ping]:
    out = a.fire(ProbeTick, now_ms)
    [ping] = [m for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
    return out, ping


def test_coordinated_probes_follow_the_rotation_of_the_wall_clock_round() -> None:
    a = _group(coordinated_probes=True)
    ring = ["a", *NAMES]  # name-sorted, a at position 0
    for r in range(1, 8):
        now = 250 * r + 17
        _, ping = _tick(a, now)
        assert ping.node == ring[(1 + r % 6) % 7], r
        a.receive(addr(ring.index(ping.node) + 1), Ack(ping.seq_no), now_ms=now + 2)
    # the driver's wall clock is one round ahead of the node's clock
    a.node.set_clock_offset_ms(250)
    _, ping = _tick(a, 250 * 9 + 17)
    assert ping.node == ring[(1 + 10 % 6) % 7]


def test_a_late_tick_never_repeats_a_round_and_the_dead_leave_the_ring() -> None:
    a = _group(coordinated_probes=True)
    a.receive(addr(30), Suspect(1, "d", "z"), now_ms=10)
    a.fire(SuspicionTimeout)  # unconfirmed: a last-chance ping first (at its deadline)
    a.fire(SuspicionVerify)
    assert a.member("d").state == NodeStateType.DEAD
    seen = []
    for _ in range(12):  # twelve ticks at the same instant: rounds still advance
        _, ping = _tick(a, 20_000)
        seen.append(ping.node)
        a.receive(a.member(ping.node).address, Ack(ping.seq_no), now_ms=20_001)
    assert "d" not in seen
    assert set(seen) == {"b", "c", "e", "f", "g"}
    assert all(x != y for x, y in itertools.pairwise(seen))


# --- early conclusion of round-robin probes ---------------------------------------------------


@pytest.mark.parametrize("early", [False, True])
def test_a_round_robin_probe_ends_once_every_path_failed_only_with_the_switch(
    early: bool,
) -> None:
    a = _group(early_probe_conclusion=early)
    _, ping = _tick(a, 100)
    indirect = a.fire(ProbeTimeout)  # at 200: no RTT samples yet, the static 100 ms
    for helper in (p.dest for p in indirect.packets):
        a.receive(helper, Nack(ping.seq_no), now_ms=240)
    [tcp] = indirect.streams
    refused = a.take(a.node.handle_stream_response(tcp.stream_id, None, 250, "refused"))
    if early:
        assert [(e.kind, e.member.name) for e in refused.events] == [(EventKind.SUSPECT, ping.node)]
        assert a.member(ping.node).state_change_ms == 250  # not the deadline at 350
    else:
        assert a.member(ping.node).state == ALIVE
        done = a.fire(ProbeDeadline)
        assert [(e.kind, e.member.name) for e in done.events] == [(EventKind.SUSPECT, ping.node)]


def test_an_open_tcp_ping_keeps_an_early_probe_waiting() -> None:
    """A live member behind a lossy path keeps its TCP ping open: no early verdict."""
    a = _group(early_probe_conclusion=True)
    _, ping = _tick(a, 100)
    indirect = a.fire(ProbeTimeout)
    for helper in (p.dest for p in indirect.packets):
        a.receive(helper, Nack(ping.seq_no), now_ms=240)
    assert a.member(ping.node).state == ALIVE
    [tcp] = indirect.streams
    a.take(a.node.handle_stream_response(tcp.stream_id, Ack(ping.seq_no), 300))
    a.fire(ProbeDeadline)
    assert a.member(ping.node).state == ALIVE


# --- cross-checks and the confirmed window ----------------------------------------------------


def test_hearing_an_accusation_starts_a_cross_check_whose_failure_confirms_it() -> None:
    a = _group(suspicion_cross_checks=16, confirmed_suspicion_safety_mult=1)
    heard = a.receive(addr(30), Suspect(1, "b", "z"), now_ms=1000)
    pings = [
        (p.dest, decode(p.data))
        for p in heard.packets
        if any(isinstance(m, Ping) for m in decode(p.data))
    ]
    [(dest, messages)] = pings
    assert dest == addr(2)
    assert any(isinstance(m, Suspect) and m.node == "b" for m in messages), "buddy accusation"
    [ping] = [m for m in messages if isinstance(m, Ping)]
    assert a.node.stats.cross_check_probes == 1
    indirect = a.take(
        a.node.handle_timer(next(t for t in heard.timers if isinstance(t, ProbeTimeout)), 1030)
    )
    for helper in (p.dest for p in indirect.packets):
        a.receive(helper, Nack(ping.seq_no), now_ms=1040)
    [tcp] = indirect.streams
    a.take(a.node.handle_stream_response(tcp.stream_id, None, 1050, "refused"))
    assert a.node.stats.cross_check_probes_failed == 1
    assert a.node.stats.suspicions_raised == 0, "a confirmation, not a new suspicion"
    # our own accusation is queued for gossip, sender = us: the others count it
    gossip = a.fire(GossipTick, 1060)
    ours = [
        m
        for p in gossip.packets
        for m in decode(p.data)
        if isinstance(m, Suspect) and m.sender == "a"
    ]
    assert ours and ours[0].node == "b"


def test_a_live_suspect_answers_the_cross_check_and_nothing_is_confirmed() -> None:
    a = _group(suspicion_cross_checks=16)
    heard = a.receive(addr(30), Suspect(1, "b", "z"), now_ms=1000)
    [ping] = [m for p in heard.packets for m in decode(p.data) if isinstance(m, Ping)]
    a.receive(addr(2), Ack(ping.seq_no), now_ms=1003)
    assert a.node.stats.cross_check_probes == 1
    assert a.node.stats.cross_check_probes_failed == 0


def test_no_cross_check_for_our_own_accusation_a_repeat_or_with_the_switch_off() -> None:
    off = _group()
    off.receive(addr(30), Suspect(1, "b", "z"), now_ms=1000)
    assert off.node.stats.cross_check_probes == 0
    on = _group(suspicion_cross_checks=16)
    on.receive(addr(30), Suspect(1, "b", "z"), now_ms=1000)
    on.receive(addr(31), Suspect(1, "b", "y"), now_ms=1001)  # a confirmation: no new probe
    assert on.node.stats.cross_check_probes == 1


def test_cross_checks_are_drawn_with_probability_checks_over_n_minus_1() -> None:
    started = 0
    trials = 400
    for seed in range(trials):
        a = make_peer("a", 1, config=_fast(suspicion_cross_checks=2), seed=seed)
        a.learn(*(alive(f"m{i:02d}", 2 + i) for i in range(20)))
        a.receive(addr(250), Suspect(1, "m07", "z"), now_ms=1000)
        started += a.node.stats.cross_check_probes
    assert 0.05 < started / trials < 0.16  # 2 / 20 = 0.1


# confirmed_window_ms: derived window (formulas.derived_suspicion_timeout_ms, SWIM §4.1
# dissemination rounds) at safety 1 under fast's gossip (50 ms to 4 members, RTT 5 ms);
# k = 2 confirmations (Lifeguard: suspicion_mult − 2).
@pytest.mark.parametrize(
    ("n", "unconfirmed_min_ms", "confirmed_ms"),
    [(8, 636, 318), (64, 848, 424), (1000, 1272, 636), (10_000, 1484, 742)],
)
def test_the_confirmed_window(n: int, unconfirmed_min_ms: int, confirmed_ms: int) -> None:
    on = _fast(confirmed_suspicion_safety_mult=1)
    assert suspicion_window_ms(on, n, 5)[0] == unconfirmed_min_ms
    assert confirmed_window_ms(on, n, 5) == confirmed_ms
    assert confirmed_window_ms(_fast(), n, 5) == unconfirmed_min_ms
    assert confirmed_ms == formulas.derived_suspicion_timeout_ms(n, 50, 4, 5, 1)


def test_k_confirmations_end_the_window_at_the_confirmed_window() -> None:
    """k = 2 confirmations after the first accusation: Lifeguard ends the window at min;
    with safety 1 it ends at the derived window with safety 1, exactly half of fast's
    (safety 2); fewer than k keep Lifeguard's decay either way."""
    windows = {}
    for mult in (0, 1):
        a = _group(confirmed_suspicion_safety_mult=mult)
        a.receive(addr(30), Suspect(1, "b", "x"), now_ms=1000)
        a.receive(addr(30), Suspect(1, "b", "y"), now_ms=1010)
        one = a.node.suspicion_deadline_ms("b")
        a.receive(addr(30), Suspect(1, "b", "z"), now_ms=1020)
        deadline = a.node.suspicion_deadline_ms("b")
        assert one is not None and deadline is not None
        windows[mult] = (one - 1000, deadline - 1000)
    assert windows[0][0] == windows[1][0], "one confirmation: the same decay"
    assert windows[1][1] * 2 == windows[0][1]
    assert windows[1][1] < windows[1][0]


def _members(n: int, **overrides: object) -> Peer:
    """a and n − 1 others (b, c, ...), alive; nothing left to gossip."""
    a = make_peer("a", 1, config=Config.fast(**overrides))
    a.learn(*(alive(name, i) for i, name in enumerate(NAMES[: n - 1], start=2)))
    a.drain(5)
    return a


@pytest.mark.parametrize("small", [True, False])
def test_a_small_group_confirmation_ends_the_window_at_the_confirmed_window(small: bool) -> None:
    """3 members, α = 4: memberlist's k is 0 (n − 2 < α − 2), so the window is min. With
    ``small_group_confirmations`` the one member that can confirm (k = n − 2 = 1) ends it at
    the confirmed window; without it the confirmation changes nothing."""
    a = _members(3, small_group_confirmations=small)
    a.receive(addr(30), Suspect(1, "b", "c"), now_ms=1000)
    config = Config.fast(small_group_confirmations=small)  # no RTT sample yet: RTT 0
    min_ms = suspicion_window_ms(config, 3, 0)[0]
    assert a.node.suspicion_deadline_ms("b") == 1000 + min_ms, "nobody confirmed yet: min"
    a.receive(addr(30), Suspect(1, "b", "a"), now_ms=1010)  # our own failed probe of b
    a.receive(addr(30), Suspect(1, "b", "c"), now_ms=1020)  # a repeat counts once
    confirmed_ms = confirmed_window_ms(config, 3, 0)
    assert confirmed_ms < min_ms
    expected = 1000 + (confirmed_ms if small else min_ms)
    assert a.node.suspicion_deadline_ms("b") == expected
    out = a.fire(SuspicionTimeout)
    if small:  # confirmed by every member that could: no last-chance ping, as with k
        assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.DEAD, "b")]
    else:  # unconfirmed (k = 0): the last-chance ping first
        assert out.events == []


def test_an_unconfirmed_small_group_suspicion_keeps_min_and_the_last_chance_ping() -> None:
    a = _members(3)
    a.receive(addr(30), Suspect(1, "b", "c"), now_ms=1000)
    min_ms = suspicion_window_ms(Config.fast(), 3, 0)[0]
    assert a.node.suspicion_deadline_ms("b") == 1000 + min_ms, "not Lifeguard's max"
    out = a.fire(SuspicionTimeout)
    assert out.events == [], "unconfirmed: verified before it is a death"
    assert a.timer(SuspicionVerify)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_groups_that_lifeguard_covers_or_nobody_can_confirm_are_unchanged(n: int) -> None:
    deadlines = []
    for small in (True, False):
        a = _members(n, small_group_confirmations=small)
        a.receive(addr(30), Suspect(1, "b", "c" if n > 2 else "a"), now_ms=1000)
        for t, accuser in enumerate(NAMES[2 : n - 1]):
            a.receive(addr(30), Suspect(1, "b", accuser), now_ms=1001 + t)
        deadlines.append(a.node.suspicion_deadline_ms("b"))
    assert deadlines[0] == deadlines[1]


@pytest.mark.parametrize("verify_confirmed", [False, True])
def test_a_confirmed_suspicion_gets_the_last_chance_ping_only_with_the_switch(
    verify_confirmed: bool,
) -> None:
    a = _group(verify_confirmed_suspicion=verify_confirmed)
    for t, accuser in enumerate("xyz"):  # the accusation and k = 2 confirmations
        a.receive(addr(30), Suspect(1, "b", accuser), now_ms=1000 + t)
    out = a.fire(SuspicionTimeout)
    if not verify_confirmed:
        assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.DEAD, "b")]
        return
    assert out.events == []
    pings = [m for p in out.packets if p.dest == addr(2) for m in decode(p.data)]
    assert [type(m) for m in pings] == [Suspect, Ping] * (len(pings) // 2)
    assert len(pings) >= 4, "the accusation and a ping, twice"
    done = a.fire(SuspicionVerify)
    assert [(e.kind, e.member.name) for e in done.events] == [(EventKind.DEAD, "b")]


def test_a_live_suspect_refutes_on_the_last_chance_ping_of_a_confirmed_suspicion() -> None:
    a = _group(verify_confirmed_suspicion=True)
    for t, accuser in enumerate("xyz"):
        a.receive(addr(30), Suspect(1, "b", accuser), now_ms=1000 + t)
    out = a.fire(SuspicionTimeout)
    [ping, *_] = [m for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
    t = a.timer(SuspicionVerify).deadline_ms - 1
    a.receive(addr(2), Ack(ping.seq_no), alive("b", 2, incarnation=2), now_ms=t)
    a.fire(SuspicionVerify)
    assert a.member("b").state == ALIVE


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"derived_suspicion": False, "confirmed_suspicion_safety_mult": 1}, "derived"),
        ({"confirmed_suspicion_safety_mult": 3}, "must not exceed"),
        ({"suspicion_cross_checks": 17}, "<= 16"),
        (
            {"confirmed_suspicion_safety_mult": 0, "small_group_confirmations": True},
            "small_group_confirmations needs",
        ),
        (
            {"verify_unconfirmed_suspicion": False, "verify_confirmed_suspicion": True},
            "needs verify_unconfirmed",
        ),
    ],
)
def test_bad_combinations_are_refused(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _fast(**overrides)
