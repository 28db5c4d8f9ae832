"""A stalled job and a suspect member (agent/stall_evidence.py): the pure rule, the stall
measured from real registrations, and whole agents on the in-memory transport and trio's
MockClock (tests/agent/test_agent_memory.py's cluster): a silent node whose loss stalls the
trainers leaves the job view before its death; one that refutes comes back and is not
dropped again within the backoff; trainers that keep stepping keep it until its death."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from agent.jobs import Registration
from agent.stall_evidence import (
    STALL_BACKOFF_MS,
    STALL_LEAD_MS,
    STALL_MIN_MS,
    STALL_STEPS,
    StallEvidence,
    stall_after_ms,
    stalled_since_ms,
)
from agent.step_clock import STEP_WINDOW, StepClock
from swim import Address, Member, NodeStateType
from tests.agent.test_agent_memory import WatchClient
from tests.agent.test_crash_evidence_live import trainers

ALIVE, SUSPECT, DEAD = NodeStateType.ALIVE, NodeStateType.SUSPECT, NodeStateType.DEAD
ALL = ["n0", "n1", "n2"]


def member(state: NodeStateType, since_ms: int, name: str = "n2") -> Member:
    return Member(name, Address("127.0.0.1", 7946), b"", 1, state, since_ms, ())


# (state, suspect since, stalled since or None, excluded?)
RULE = [
    (SUSPECT, 1000, 950, True),  # the ranks blocked at the fault, the suspicion came later
    (SUSPECT, 1000, 1000 - STALL_LEAD_MS, True),  # the longest lead
    (SUSPECT, 1000, 999 - STALL_LEAD_MS, False),  # an older stall does not borrow it
    (SUSPECT, 1000, 1200, True),  # the stall began after the suspicion
    (SUSPECT, 1000, None, False),  # the job steps: it waits for the verdict
    (ALIVE, 1000, 950, False),  # alive members are never left out
    (DEAD, 1000, 950, False),  # dead: out of the view anyway, not by this rule
]


@pytest.mark.parametrize(("state", "since", "stalled", "excluded"), RULE)
def test_the_rule(state: NodeStateType, since: int, stalled: int | None, excluded: bool) -> None:
    ev = StallEvidence(enabled=True)
    got = ev.excluded("j", [member(ALIVE, 0, "n1"), member(state, since)], stalled, 1500)
    assert got == (frozenset({"n2"}) if excluded else frozenset())


def test_off_leaves_everyone_in() -> None:
    assert StallEvidence().excluded("j", [member(SUSPECT, 1000)], 950, 1500) == frozenset()


def test_a_drop_lasts_the_suspicion_and_a_refutation_backs_off() -> None:
    ev = StallEvidence(enabled=True)
    assert ev.excluded("j", [member(SUSPECT, 1000)], 950, 1200) == {"n2"}
    # the job re-formed without it and steps again: still out, same suspicion
    assert ev.excluded("j", [member(SUSPECT, 1000)], None, 1400) == {"n2"}
    # it refuted: back, and counted as a wrong drop
    assert ev.excluded("j", [member(ALIVE, 1500)], None, 1600) == frozenset()
    assert ev.wrong_drops == 1
    # suspect again, the job stalled again: the backoff keeps it in
    assert ev.excluded("j", [member(SUSPECT, 2000)], 1950, 2100) == frozenset()
    later = 1600 + STALL_BACKOFF_MS
    assert ev.excluded("j", [member(SUSPECT, later)], later - 50, later + 100) == {"n2"}
    # dead: the record goes, the view leaves it out by the verdict
    assert ev.excluded("j", [member(DEAD, later + 300)], None, later + 400) == frozenset()
    assert ev.wrong_drops == 1


def test_backoffs_are_per_job_and_forgotten_with_the_job() -> None:
    ev = StallEvidence(enabled=True)
    ev.excluded("j", [member(SUSPECT, 1000)], 950, 1200)
    ev.excluded("j", [member(ALIVE, 1500)], None, 1600)
    assert ev.excluded("k", [member(SUSPECT, 2000)], 1950, 2100) == {"n2"}
    ev.forget("j")
    assert ev.excluded("j", [member(SUSPECT, 2000)], 1950, 2100) == {"n2"}


def test_the_stall_threshold_follows_the_step() -> None:
    assert stall_after_ms(10) == STALL_MIN_MS
    assert stall_after_ms(500) == STALL_STEPS * 500


def test_stalled_since_reads_the_registrations() -> None:
    ranks = [Registration.create("j", local_rank=r, local_world_size=2) for r in (0, 1)]
    assert stalled_since_ms(ranks, 10_000) is None, "no heartbeat yet: loading, not stalled"
    for reg in ranks:
        reg.heartbeat(0, 0)
    assert stalled_since_ms(ranks, 10_000) is None, "no step yet: forming, not stalled"
    for t in range(0, 2001, 100):
        for reg in ranks:
            reg.heartbeat(t // 100, t + 5 * reg.local_rank)
    after = stall_after_ms(100)
    assert stalled_since_ms(ranks, 2005 + after - 1) is None
    assert stalled_since_ms(ranks, 2005 + after) == 2005, "the last progress of any rank"
    for t in range(2050, 2400, 50):  # waiting on a collective: heartbeats, the same step
        for reg in ranks:
            reg.heartbeat(20, t)
    assert stalled_since_ms(ranks, 2005 + after) == 2005, "a beat without a new step"
    ranks[1].pause("checkpoint", 30, 2100)
    assert stalled_since_ms(ranks, 2005 + after) is None, "a declared pause is no stall"
    ranks[1].resume(2200)
    assert stalled_since_ms(ranks, 2005 + after) == 2005
    ranks[0].role = "spare"  # a spare's step never moves: it is never stalled
    assert stalled_since_ms(ranks, 2005 + after) is None


def test_the_step_clock_measures_steps_not_heartbeats() -> None:
    clock = StepClock()
    assert clock.median_step_ms() is None
    for i, t in enumerate([0, 100, 200, 1200, 1300]):  # one long step: a fault's stall
        clock.beat(i, t)
        clock.beat(i, t + 40)  # a wait-loop beat with the same step
    assert clock.median_step_ms() == 100 and clock.since_ms == 1300
    for i in range(5, 5 + STEP_WINDOW):  # the job's steps lengthen: the median follows
        clock.beat(i, 1300 + 500 * (i - 4))
    assert clock.median_step_ms() == 500


async def step(rank: WatchClient, steps: int, step_s: float = 0.1) -> None:
    for i in range(steps):
        await rank.send({"heartbeat": {"step": i}})
        await trio.sleep(step_s)


async def wait_in_collective(rank: WatchClient, step: int) -> None:
    """A rank blocked on a peer: it heartbeats (not hung) with the same step."""
    while True:
        await rank.send({"heartbeat": {"step": step}})
        await trio.sleep(0.1)


@pytest.mark.trio
@pytest.mark.parametrize("stall_drop", [True, False])
async def test_a_silent_node_leaves_the_view_of_a_stalled_job(
    autojump_clock: trio.testing.MockClock, stall_drop: bool
) -> None:
    async with trainers(job_stall_drop=stall_drop) as (c, ranks):
        n0, n1, n2 = c.members
        await step(ranks[0], 30)
        c.network.partition({n2.address}, {n0.address, n1.address})  # no refusal: silence
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_in_collective, ranks[0], 29)
            await ranks[0].until_view(["n0", "n1"], timeout_s=60, any_order=True)
            nursery.cancel_scope.cancel()
        if stall_drop:
            assert n0.state_of("n2") == SUSPECT, "left out before the membership's verdict"
            assert n0.node.stats.urgent_probes["started"] == 0, "a stall probes nobody"
        else:
            assert n0.state_of("n2") == DEAD, "without the switch the view waits for death"


@pytest.mark.trio
async def test_a_refuting_node_comes_back_and_the_rule_backs_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trainers(job_stall_drop=True) as (c, ranks):
        n0, n1, n2 = c.members
        await step(ranks[0], 30)
        c.network.partition({n2.address}, {n0.address, n1.address})
        await ranks[0].until_view(["n0", "n1"], timeout_s=60, any_order=True)
        assert n0.state_of("n2") == SUSPECT
        c.network.heal()  # alive after all: it refutes, and comes back
        await ranks[0].until_view(ALL, timeout_s=60, any_order=True)
        assert n0.agent.jobs.stall.wrong_drops == 1
        await step(ranks[0], 30)
        c.network.partition({n2.address}, {n0.address, n1.address})
        await ranks[0].until_view(["n0", "n1"], timeout_s=60, any_order=True)
        assert n0.state_of("n2") == DEAD, "within the backoff the view waits for death"


@pytest.mark.trio
async def test_a_job_that_steps_keeps_a_silent_node_until_its_death(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trainers(job_stall_drop=True) as (c, ranks):
        n0, n1, n2 = c.members
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step, ranks[0], 10_000)
            await trio.sleep(3)
            c.network.partition({n2.address}, {n0.address, n1.address})
            await ranks[0].until_view(["n0", "n1"], timeout_s=60, any_order=True)
            assert n0.state_of("n2") == DEAD
            nursery.cancel_scope.cancel()
