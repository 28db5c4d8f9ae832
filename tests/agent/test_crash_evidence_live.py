"""Strong crash evidence with whole agents (agent/crash_evidence.py): on the in-memory
transport and trio's MockClock (tests/agent/test_agent_memory.py's cluster), three agents
with one registered trainer each. A crashed node that a trainer reported lost leaves that
agent's job view while the membership still holds it suspect; a live node behind a link
that rejects (connections refused) leaves too, and comes back once it refutes; one that is
only silent (a pause, a power loss) stays, suspect, until it is dead. With the switch off
the view waits for the death, as before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from agent.procs import until_async as until
from agent.watch import serve_watch
from swim import NodeStateType
from tests.agent.test_agent_memory import Cluster, WatchClient, alive, cluster

pytestmark = pytest.mark.trio
SUSPECT, DEAD = NodeStateType.SUSPECT, NodeStateType.DEAD
ALL = ["n0", "n1", "n2"]


@asynccontextmanager
async def trainers(**switches: bool) -> AsyncIterator[tuple[Cluster, list[WatchClient]]]:
    """Three ``local`` agents with these settings (``job_early_drop=True``, ...), each with
    one registered trainer watching job ``j`` (tests/agent/test_stall_evidence.py too)."""
    async with cluster(3, **switches) as c, trio.open_nursery() as nursery:
        await until(alive(c.members), 20)
        ranks = []
        for m in c.members:
            ours, theirs = trio.testing.memory_stream_pair()
            nursery.start_soon(serve_watch, m.agent, theirs, {"job": "j", "register": {}})
            ranks.append(WatchClient(ours))
        for rank in ranks:
            if not rank.views or sorted(m["name"] for m in rank.views[-1]["members"]) != ALL:
                await rank.until_view(ALL, any_order=True)
        yield c, ranks
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("early_drop", [True, False])
async def test_a_crashed_node_leaves_the_view_of_the_agent_with_evidence(
    autojump_clock: trio.testing.MockClock, early_drop: bool
) -> None:
    async with trainers(job_early_drop=early_drop) as (c, ranks):
        n0, n1, n2 = c.members
        c.crash(n2)
        await ranks[0].send({"lost": ["n1", "n2"]})  # one address for all: both named
        await ranks[0].until_view(["n0", "n1"], timeout_s=60, any_order=True)
        if early_drop:
            assert n0.state_of("n2") == SUSPECT, "left out before the membership's verdict"
            assert n0.state_of("n1") == NodeStateType.ALIVE, "the live node answered"
        else:
            assert n0.state_of("n2") == DEAD, "without the switch the view waits for death"
        if ranks[1].views[-1]["members"][-1]["name"] == "n2":
            await ranks[1].until_view(
                ["n0", "n1"], timeout_s=60, any_order=True
            )  # early too, or at death
        await until(lambda: n1.state_of("n2") == DEAD, 60)


async def test_a_node_that_refutes_comes_back_into_the_view(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trainers(job_early_drop=True) as (c, ranks):
        n0, n1, n2 = c.members
        c.network.partition({n2.address}, {n0.address, n1.address}, reject=True)
        await ranks[0].send({"lost": ["n2"]})
        await ranks[0].until_view(["n0", "n1"], timeout_s=60, any_order=True)
        assert n0.state_of("n2") == SUSPECT
        c.network.heal()  # alive after all: it refutes the suspicion
        await ranks[0].until_view(ALL, timeout_s=60, any_order=True)
        assert n0.state_of("n2") == NodeStateType.ALIVE
        assert n0.agent.jobs.evidence.excluded("j", n0.node.members()) == frozenset()


async def test_a_silent_node_stays_in_the_view_until_its_death(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cut off without a refusal (a pause, a power loss: its TCP ping goes unanswered): the
    report alone is no strong evidence, so the view waits for the membership's verdict."""
    async with trainers(job_early_drop=True) as (c, ranks):
        n0, n1, n2 = c.members
        c.network.partition({n2.address}, {n0.address, n1.address})
        await ranks[0].send({"lost": ["n2"]})
        await ranks[0].until_view(["n0", "n1"], timeout_s=60, any_order=True)
        assert n0.state_of("n2") == DEAD
