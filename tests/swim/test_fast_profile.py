"""The ``fast`` profile: Phi-adaptive probe timeouts (swim/rtt.py) and the derived suspicion
window (``formulas.derived_suspicion_timeout_ms``), through formulas tables, the RTT table
and swim.Node's public API.

Sources: Akka PhiAccrualFailureDetector.scala (logistic CDF; cross-checked here against
``phi.formulas.phi_akka``), Hayashibara et al. 2004, SWIM §4.1 (infection-style
dissemination in O(log n) rounds), simulations/RESULTS.md §1 (measured dissemination).
"""

from __future__ import annotations

import math

import pytest

from phi.formulas import phi_akka
from swim import Config, ConfigError, EventKind, NodeStateType, formulas
from swim.config import PROFILES
from swim.messages import Ack, IndirectPing, Ping, Suspect
from swim.rtt import RttTable
from swim.timers import ProbeTimeout, RelayTimeout, SuspicionTimeout, SuspicionVerify
from tests.swim.node_harness import (
    FAST_WITHOUT_DETECTION_SWITCHES,
    PORT,
    Peer,
    addr,
    alive,
    alive_of,
    decode,
    make_peer,
    to,
)

# --- formulas -------------------------------------------------------------------------------


# y with phi_akka(mean + y·std) == phi (Akka's logistic model; phi 8 = its default threshold)
@pytest.mark.parametrize(
    ("phi", "sigmas"),
    [(1, 1.2822), (2, 2.3227), (3, 3.0589), (8, 5.2260), (12, 6.2921), (16, 7.1197)],
)
def test_phi_sigmas_inverts_akkas_phi(phi: int, sigmas: float) -> None:
    y = formulas.phi_sigmas(phi)
    assert y == pytest.approx(sigmas, abs=1e-4)
    assert phi_akka(10.0 + y * 3.0, 10.0, 3.0) == pytest.approx(phi, rel=1e-9)


@pytest.mark.parametrize("phi", [0.0, -1.0, math.inf])
def test_phi_sigmas_rejects_non_positive_phi(phi: float) -> None:
    with pytest.raises(ValueError, match="phi"):
        formulas.phi_sigmas(phi)


@pytest.mark.parametrize(
    ("mean", "std", "phi", "lo", "hi", "expected"),
    [
        (1.0, 5.0, 8, 20, 125, 28),  # loopback: the std floor dominates: 1 + 5.226·5
        (0.1, 5.0, 8, 20, 125, 27),
        (0.1, 1.0, 8, 20, 125, 20),  # under the lower bound
        (40.0, 20.0, 8, 20, 125, 125),  # over the upper bound
        (10.0, 5.0, 3, 5, 500, 26),  # 10 + 3.0589·5 = 25.29
        (10.0, 5.0, 1, 5, 500, 17),  # 10 + 1.2822·5 = 16.41
    ],
)
def test_adaptive_probe_timeout(
    mean: float, std: float, phi: int, lo: int, hi: int, expected: int
) -> None:
    assert formulas.adaptive_probe_timeout_ms(mean, std, phi, lo, hi) == expected


def test_adaptive_probe_timeout_rejects_inverted_bounds() -> None:
    with pytest.raises(ValueError, match="min_ms"):
        formulas.adaptive_probe_timeout_ms(1.0, 1.0, 8, 100, 50)


# rounds = ceil(log_{f+1} n) + 1; exact powers of f+1 do not round up
@pytest.mark.parametrize(
    ("n", "fanout", "rounds"),
    [
        (1, 4, 1),
        (2, 4, 2),
        (8, 4, 3),
        (64, 4, 4),
        (125, 4, 4),
        (126, 4, 5),
        (1000, 4, 6),
        (10_000, 4, 7),
        (30, 3, 4),
        (1000, 3, 6),
        (10_000, 3, 8),
    ],
)
def test_gossip_rounds(n: int, fanout: int, rounds: int) -> None:
    assert formulas.gossip_rounds(n, fanout) == rounds


@pytest.mark.parametrize(
    ("n", "interval", "fanout", "rtt", "safety", "expected"),
    [
        (64, 50, 4, 0, 2, 800),  # the fast profile at 64 members: 2·2·4 rounds·50 ms
        (64, 50, 4, 2, 2, 816),  # + half an RTT per round
        (1000, 50, 4, 2, 2, 1224),
        (10_000, 50, 4, 2, 2, 1428),
        (64, 50, 4, 2, 1, 408),
        (64, 200, 3, 1, 2, 3216),  # lan's gossip: 3 + 1 rounds of 200 ms (+1 ms)
    ],
)
def test_derived_suspicion_timeout(
    n: int, interval: int, fanout: int, rtt: int, safety: int, expected: int
) -> None:
    assert formulas.derived_suspicion_timeout_ms(n, interval, fanout, rtt, safety) == expected


# --- the RTT table --------------------------------------------------------------------------


def test_rtt_table_static_timeout_until_enough_samples_then_adaptive() -> None:
    c = Config.fast()
    rtt = RttTable(c)
    assert rtt.probe_timeout_ms("b", 0) == c.probe_timeout_ms
    for _ in range(c.rtt_min_samples - 1):
        rtt.sample("b", 1)
    assert rtt.probe_timeout_ms("b", 0) == c.probe_timeout_ms
    rtt.sample("b", 1)
    assert rtt.probe_timeout_ms("b", 0) == 28  # 1 + 5.226 · max(0, 5 ms floor)
    assert rtt.probe_timeout_ms("b", 2) == 84  # Lifeguard: × (health + 1)
    # A peer not sampled enough yet gets the pooled estimate over all peers.
    assert rtt.probe_timeout_ms("other", 0) == 28
    for _ in range(c.rtt_window):
        rtt.sample("c", 41)
    assert rtt.probe_timeout_ms("other", 0) > 28
    assert RttTable(c).probe_timeout_ms("other", 0) == c.probe_timeout_ms


def test_rtt_table_follows_a_slower_peer_within_the_window() -> None:
    c = Config.fast()
    rtt = RttTable(c)
    for _ in range(50):
        rtt.sample("b", 2)
    for _ in range(5 * c.rtt_window):  # weight of the old mean: (15/16)^80 < 0.6%
        rtt.sample("b", 30)
    est = rtt.estimate("b")
    assert est is not None
    mean, std, n = est
    assert n == c.rtt_window
    assert 29.0 < mean <= 30.0
    assert rtt.probe_timeout_ms("b", 0) == math.ceil(mean + formulas.phi_sigmas(8) * max(std, 5))


def test_rtt_table_variance_tracks_jitter() -> None:
    rtt = RttTable(Config.fast())
    for i in range(200):
        rtt.sample("b", 10 + (20 if i % 2 else 0))
    est = rtt.estimate("b")
    assert est is not None
    assert 8.0 < est[1] < 12.0  # ±10 ms around 20 ms
    assert rtt.probe_timeout_ms("b", 0) > 60


def test_rtt_table_is_bounded_and_forgets_the_least_recently_sampled() -> None:
    rtt = RttTable(Config.fast(max_members=3))
    for name in ("a", "b", "c"):
        rtt.sample(name, 1)
    rtt.sample("a", 1)  # a is now the most recent
    rtt.sample("d", 1)
    assert len(rtt) == 3
    assert rtt.estimate("b") is None
    assert rtt.estimate("a") is not None
    rtt.forget("a")
    assert rtt.estimate("a") is None


def test_rtt_table_ignores_negative_samples_and_empty_names() -> None:
    rtt = RttTable(Config.fast())
    rtt.sample("b", -5)
    rtt.sample("", 3)
    assert len(rtt) == 0
    assert rtt.typical_ms == 0
    rtt.sample("b", 4)
    rtt.sample("c", 8)
    assert rtt.typical_ms == 6


def test_rtt_table_is_static_when_adaptive_is_off() -> None:
    rtt = RttTable(Config.lan())
    for _ in range(10):
        rtt.sample("b", 1)
    assert rtt.probe_timeout_ms("b", 3) == 500  # memberlist: never scaled


# --- configuration --------------------------------------------------------------------------


def test_fast_profile_values_and_lookup_by_name() -> None:
    c = Config.fast()
    assert (c.probe_interval_ms, c.gossip_interval_ms, c.gossip_nodes) == (250, 50, 4)
    assert c.adaptive_probe_timeout and c.derived_suspicion
    assert Config.profile("fast") == c
    assert Config.profile("fast", gossip_nodes=5).gossip_nodes == 5
    assert PROFILES == ("lan", "wan", "local", "fast")
    for name in ("lan", "wan", "local"):
        other = Config.profile(name)
        assert not other.adaptive_probe_timeout and not other.derived_suspicion
    with pytest.raises(ConfigError, match="unknown profile 'turbo'"):
        Config.profile("turbo")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"probe_timeout_min_ms": 200}, "probe_timeout_min_ms"),
        ({"probe_timeout_max_ms": 250}, "probe_timeout_max_ms"),
        ({"probe_timeout_min_ms": 0}, "probe_timeout_min_ms"),
        ({"gossip_interval_ms": 0}, "derived_suspicion needs gossip_interval_ms"),
        ({"rtt_window": 0}, "rtt_window"),
        ({"rtt_min_samples": 0}, "rtt_min_samples"),
        ({"suspicion_safety_mult": 0}, "suspicion_safety_mult"),
        ({"probe_timeout_phi": 0}, "probe_timeout_phi"),
        ({"suspicion_verify_copies": 0}, "suspicion_verify_copies must be 1..8"),
        ({"suspicion_verify_copies": 9}, "suspicion_verify_copies must be 1..8"),
    ],
)
def test_fast_profile_rejects_inconsistent_settings(
    overrides: dict[str, int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.fast(**overrides)


# --- through the Node -----------------------------------------------------------------------


def test_probe_timeout_adapts_to_the_targets_measured_rtt() -> None:
    # the harness hands ticks back at arbitrary times: no starvation rule (starved_lag_ms)
    c = Config.fast(disable_tcp_pings=True, starved_lag_ms=0)
    a = make_peer("a", 1, config=c)
    a.learn(alive("b", 2))
    now = 1000
    for _ in range(c.rtt_min_samples):
        _, ping = a.probe("b", now)
        assert a.timer(ProbeTimeout).deadline_ms == now + c.probe_timeout_ms
        a.receive(addr(2), Ack(ping.seq_no), now_ms=now + 3)  # 3 ms RTT
        now += c.probe_interval_ms
    _, ping = a.probe("b", now)
    assert a.timer(ProbeTimeout).deadline_ms == now + math.ceil(3 + formulas.phi_sigmas(8) * 5)


def test_a_late_direct_ack_is_a_sample_but_an_indirect_one_is_not() -> None:
    # the plain round robin: the harness acks h's probes before b's, so h's RTTs are pooled
    c = Config.fast(disable_tcp_pings=True, rtt_min_samples=1, **FAST_WITHOUT_DETECTION_SWITCHES)
    for via in ("direct", "indirect"):
        a = make_peer("a", 1, config=c)
        a.learn(alive("b", 2), alive("h", 3))
        _, ping = a.probe("b", 1000)
        a.fire(ProbeTimeout)  # asks h
        source = addr(2) if via == "direct" else addr(3)
        # 150 ms: after the direct timeout; direct, it is an RTT sample (150 + 26 > max)
        a.receive(source, Ack(ping.seq_no), now_ms=1150)
        _, ping = a.probe("b", 2000)
        timeout_ms = a.timer(ProbeTimeout).deadline_ms - 2000
        if via == "direct":
            assert timeout_ms == 125  # 150 + 26 ms, clamped
        else:  # only the harness's 0 ms acks from h (pooled) were sampled
            assert timeout_ms < 100, timeout_ms


def test_relay_uses_its_own_rtt_estimate_of_the_target() -> None:
    c = Config.fast()
    h = make_peer("h", 3, config=c)
    h.learn(alive("t", 2))
    now = 100
    for seq in range(c.rtt_min_samples):
        req = IndirectPing(seq, addr(2).ip_bytes, PORT, "t", True, addr(1).ip_bytes, PORT, "r")
        out = h.receive(addr(1), req, now_ms=now)
        [ping] = [m for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
        assert h.timer(RelayTimeout).deadline_ms == now + c.probe_timeout_ms
        relayed = h.receive(addr(2), Ack(ping.seq_no), now_ms=now + 2)
        assert [decode(p.data)[0] for p in relayed.packets] == [Ack(seq)]
        now += 100
    req = IndirectPing(99, addr(2).ip_bytes, PORT, "t", True, addr(1).ip_bytes, PORT, "r")
    h.receive(addr(1), req, now_ms=now)
    assert h.timer(RelayTimeout).deadline_ms == now + math.ceil(2 + formulas.phi_sigmas(8) * 5)


def test_derived_suspicion_window_replaces_memberlists() -> None:
    # Lifeguard's window, without the confirmed one
    c = Config.fast(**FAST_WITHOUT_DETECTION_SWITCHES)
    o = make_peer("o", 1, config=c)
    o.learn(*(alive(name, i + 2) for i, name in enumerate("bcdefg")))
    n = o.node.num_members()
    min_ms = formulas.derived_suspicion_timeout_ms(n, 50, 4, 0, 2)  # no RTT samples yet
    assert min_ms == 2 * 2 * 3 * 50
    o.receive(addr(3), Suspect(1, "b", "c"), now_ms=1000)
    assert o.timer(SuspicionTimeout).deadline_ms == 1000 + c.suspicion_max_timeout_mult * min_ms
    for i, sender in enumerate("de"):  # k = α − 2 = 2 confirmations bring it to min
        o.receive(addr(4 + i), Suspect(1, "b", sender), now_ms=1100)
    assert o.node.suspicion_deadline_ms("b") == 1000 + min_ms


# --- last chance for an unconfirmed suspect (verify_unconfirmed_suspicion) ------------------


def _suspecting_observer(**overrides: int) -> tuple[Peer, int]:
    o = make_peer("o", 1, config=Config.fast(disable_tcp_pings=True, **overrides))
    o.learn(*(alive(name, i + 2) for i, name in enumerate("bcdefg")))
    o.receive(addr(3), Suspect(1, "b", "c"), now_ms=1000)  # one accuser, no confirmations
    return o, o.timer(SuspicionTimeout).deadline_ms


def test_unconfirmed_suspect_gets_the_accusation_and_a_ping_before_it_is_declared_dead() -> None:
    o, deadline = _suspecting_observer()
    out = o.fire(SuspicionTimeout)
    assert out.events == []  # not dead yet
    sent = to(out, addr(2))
    assert len(sent) == Config.fast().suspicion_verify_copies == 4
    for packet in sent:
        accusation, ping = decode(packet.data)
        assert accusation == Suspect(1, "b", "o")
        assert isinstance(ping, Ping) and ping.node == "b"
    assert o.node.stats.suspicion_verifications == 1
    verify = o.timer(SuspicionVerify)
    assert verify.deadline_ms == deadline + o.node.config.probe_timeout_ms  # no RTT samples
    out = o.fire(SuspicionVerify)  # silence: dead
    assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.DEAD, "b")]


@pytest.mark.parametrize("copies", [1, 2, 8])
def test_the_last_chance_goes_out_in_as_many_copies_as_configured(copies: int) -> None:
    o, _ = _suspecting_observer(suspicion_verify_copies=copies)
    sent = to(o.fire(SuspicionTimeout), addr(2))
    assert [decode(p.data)[0] for p in sent] == [Suspect(1, "b", "o")] * copies
    assert o.node.stats.suspicion_verifications == 1  # one verification, however many copies


def test_a_live_suspect_that_already_refuted_answers_the_verification_with_its_alive() -> None:
    o, _ = _suspecting_observer()
    b = make_peer("b", 2, config=Config.fast())
    b.learn(alive_of(o))
    b.receive(addr(3), Suspect(1, "b", "c"), now_ms=1000)  # b refutes: incarnation 2 ...
    b.drain(1100)  # ... and its gossip is spent, but never reached o
    assert b.node.incarnation == 2
    out = o.fire(SuspicionTimeout)
    replies = b.deliver(o.address, to(out, addr(2))[0].data, now_ms=4400)
    [ack_packet] = to(replies, o.address)
    messages = decode(ack_packet.data)
    assert isinstance(messages[0], Ack)
    assert alive_of(b) in messages  # the refutation rides on the ack
    o.deliver(b.address, ack_packet.data, now_ms=4410)
    assert o.member("b").state == NodeStateType.ALIVE and o.member("b").incarnation == 2
    assert o.fire(SuspicionVerify).events == []  # the stale verification timer is ignored
    assert b.node.incarnation == 2  # re-announced, not outbid


def test_a_confirmed_suspicion_is_declared_without_verification() -> None:
    o, _ = _suspecting_observer()
    for i, sender in enumerate("de"):
        o.receive(addr(4 + i), Suspect(1, "b", sender), now_ms=1100)
    out = o.fire(SuspicionTimeout)
    assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.DEAD, "b")]
    assert o.node.stats.suspicion_verifications == 0


def test_the_rtt_term_of_the_derived_window_is_bounded_like_a_timeout() -> None:
    c = Config.fast()
    h = make_peer("h", 3, config=c)
    h.learn(alive("t", 2), alive("x", 4), alive("y", 5))
    now = 100
    for seq in range(8):  # t answers relayed pings 200 ms late: a stalled member's view
        req = IndirectPing(seq, addr(2).ip_bytes, PORT, "t", False, addr(1).ip_bytes, PORT, "r")
        out = h.receive(addr(1), req, now_ms=now)
        [ping] = [m for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
        h.receive(addr(2), Ack(ping.seq_no), now_ms=now + 200)
        now += 300
    n = h.node.num_members()
    capped = formulas.derived_suspicion_timeout_ms(n, 50, 4, c.probe_timeout_max_ms, 2)
    h.receive(addr(5), Suspect(1, "x", "y"), now_ms=now)
    assert h.timer(SuspicionTimeout).deadline_ms == now + c.suspicion_max_timeout_mult * capped
