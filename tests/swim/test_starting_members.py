"""A fleet that starts at once must not declare its own live members dead (the fast
profile's ``recovered_hold_ms`` and ``starved_lag_ms``; rules in swim/suspicion.py and
swim/awareness.py), through swim.Node's public API on explicit time.

- A suspicion of a member that came back alive from our suspect, dead or left state (it
  refuted an accusation, or restarted) less than ``recovered_hold_ms`` ago runs
  Lifeguard's maximum window; confirmations do not shorten it; it ends with the
  last-chance ping, which the member's refutation answers, and a silent member is dead
  after it. A first join is no such evidence: the confirmed window, as for any member;
  after the hold time, too.
- A node whose own timer came back ``starved_lag_ms`` late was starved: its health score
  rises (at most once per probe interval), and a suspicion that runs out meanwhile is held
  to the maximum window, then verified. An idle gossip tick that the driver held back is
  no such sign.
"""

from __future__ import annotations

from swim import Config, EventKind, NodeStateType
from swim.messages import Alive, Suspect
from swim.suspicion import confirmed_window_ms, suspicion_window_ms
from swim.timers import GossipTick, ProbeTick, SuspicionTimeout, SuspicionVerify
from tests.swim.node_harness import Peer, addr, alive, decode, make_peer, of_type, to

NAMES = "bcdefg"


def _observer(**overrides: int) -> Peer:
    o = make_peer("o", 1, config=Config.fast(disable_tcp_pings=True, **overrides))
    o.learn(*(alive(name, i + 2) for i, name in enumerate(NAMES)), now_ms=0)
    return o


def _accused(o: Peer, now_ms: int, inc: int = 1) -> int:
    """b accused by c, confirmed by d and e (k = 2): the suspicion's deadline."""
    o.receive(addr(3), Suspect(inc, "b", "c"), now_ms=now_ms)
    for i, sender in enumerate("de"):
        o.receive(addr(4 + i), Suspect(inc, "b", sender), now_ms=now_ms + 10)
    deadline = o.node.suspicion_deadline_ms("b")
    assert deadline is not None
    return deadline


def _refutes(o: Peer, inc: int, now_ms: int) -> None:
    """b's alive at ``inc`` (its refutation) reaches o."""
    o.receive(addr(2), Alive(inc, "b", addr(2).ip_bytes, addr(2).port, b"", b""), now_ms=now_ms)
    assert o.member("b").state == NodeStateType.ALIVE


def test_a_first_join_keeps_the_confirmed_window() -> None:
    o = _observer()
    confirmed = confirmed_window_ms(o.node.config, o.node.num_members(), 0)
    assert _accused(o, 1000) == 1000 + confirmed
    out = o.fire(SuspicionTimeout)
    assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.DEAD, "b")]


def test_a_member_that_refuted_gets_the_maximum_window_and_a_last_chance() -> None:
    o = _observer()
    _accused(o, 1000)
    _refutes(o, 2, 1200)  # slow, not gone
    _, max_ms, k = suspicion_window_ms(o.node.config, o.node.num_members(), 0)
    assert k == 2
    assert _accused(o, 2000, inc=2) == 2000 + max_ms, "confirmations do not shorten it"
    out = o.fire(SuspicionTimeout)
    assert out.events == [], "not dead: a last-chance ping first"
    assert of_type([m for p in to(out, addr(2)) for m in decode(p.data)], Suspect)
    _refutes(o, 3, 2000 + max_ms + 50)  # the refutation rides on the ack
    assert o.fire(SuspicionVerify).events == []


def test_a_silent_recovered_member_is_still_declared_dead_after_the_last_chance() -> None:
    o = _observer()
    _accused(o, 1000)
    _refutes(o, 2, 1200)
    _accused(o, 2000, inc=2)
    o.fire(SuspicionTimeout)
    out = o.fire(SuspicionVerify)
    assert [(e.kind, e.member.name) for e in out.events] == [(EventKind.DEAD, "b")]


def test_after_the_hold_time_the_confirmed_window_is_back() -> None:
    o = _observer()
    _accused(o, 1000)
    _refutes(o, 2, 1200)
    at = 1200 + o.node.config.recovered_hold_ms
    confirmed = confirmed_window_ms(o.node.config, o.node.num_members(), 0)
    assert _accused(o, at, inc=2) == at + confirmed


def test_a_refutation_heard_second_hand_holds_but_a_tag_update_does_not() -> None:
    o = _observer()
    _, max_ms, _ = suspicion_window_ms(o.node.config, o.node.num_members(), 0)
    _refutes(o, 2, 1000)  # b refuted an accusation that never reached o: same metadata
    assert _accused(o, 2000, inc=2) == 2000 + max_ms
    t = _observer()
    t.receive(addr(2), Alive(2, "b", addr(2).ip_bytes, addr(2).port, b"rack=a", b""), now_ms=1000)
    confirmed = confirmed_window_ms(t.node.config, t.node.num_members(), 0)
    assert _accused(t, 2000, inc=2) == 2000 + confirmed, "new tags are no recovery"


def test_a_member_back_from_dead_is_held() -> None:
    o = _observer()
    _accused(o, 1000)
    o.fire(SuspicionTimeout)  # dead (first join: the confirmed window)
    assert o.member("b").state == NodeStateType.DEAD
    _refutes(o, 2, 3000)  # restarted, or refuted its death
    _, max_ms, _ = suspicion_window_ms(o.node.config, o.node.num_members(), 0)
    assert _accused(o, 4000, inc=2) == 4000 + max_ms


def test_a_starved_observer_holds_a_suspicion_that_ran_out_meanwhile() -> None:
    o = _observer(recovered_hold_ms=0)
    c = o.node.config
    _accused(o, 1000)
    deadline = o.node.suspicion_deadline_ms("b")
    assert deadline is not None
    score = o.node.health_score
    # our own probe tick comes back late by more than starved_lag_ms: we were not running
    tick = o.timer(ProbeTick)
    o.timers.remove(tick)
    assert 1100 - tick.deadline_ms >= c.starved_lag_ms
    o.take(o.node.handle_timer(tick, 1100))
    assert o.node.health_score == score + 1
    out = o.fire(SuspicionTimeout)
    assert out.events == [], "held, not dead"
    assert o.node.stats.suspicions_held_starved == 1
    _, max_ms, _ = suspicion_window_ms(c, o.node.num_members(), 0)
    assert o.timer(SuspicionTimeout).deadline_ms == max(
        1000 + max_ms, deadline + c.probe_interval_ms
    )
    out = o.fire(SuspicionTimeout)
    assert out.events == [], "then the last-chance ping"
    assert o.node.stats.suspicion_verifications == 1


def test_a_late_idle_gossip_tick_is_no_sign_of_starvation() -> None:
    o = _observer(recovered_hold_ms=0)
    score = o.node.health_score
    tick = o.timer(GossipTick)
    o.timers.remove(tick)
    o.take(o.node.handle_timer(tick, tick.deadline_ms + 10_000))
    assert o.node.health_score == score
    deadline = _accused(o, 20_000)
    assert o.fire(SuspicionTimeout, deadline).events != []


def test_off_in_memberlists_profiles() -> None:
    for name in ("lan", "wan", "local"):
        c = Config.profile(name)
        assert c.recovered_hold_ms == 0 and c.starved_lag_ms == 0
