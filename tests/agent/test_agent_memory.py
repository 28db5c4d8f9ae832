"""Whole agents (driver, Serf runtime, API, control operations) on the in-memory transport
(agent/memory_transport.py) and trio's MockClock: join, crash -> suspect -> dead, graceful
leave, reaped members kept listed, force-leave, urgent probes, tags, keys, the events
fan-out, a stall's catch-up, a partition, and the job watch of training processes.
Protocol time passes on the virtual clock (``autojump_clock``), so a test of tens of
protocol seconds runs in well under a second.

Control operations go through ``agent.control_server.answer`` (the op table) with the same
request frames ``swimctl`` sends; the socket side of the control API is tested on real
Unix sockets in tests/agent/test_agent.py.
"""

from __future__ import annotations

import base64
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from agent import serf
from agent.config import load
from agent.control import FrameDecoder, encode_frame, make_request
from agent.control_server import answer
from agent.driver import Driver
from agent.memory_transport import MemoryNetwork, MemoryTransport, address_of
from agent.procs import until_async as until
from agent.runtime import Agent
from agent.watch import job_view, serve_watch
from swim import Address, Node, NodeStateType, Output, Timer

pytestmark = pytest.mark.trio
KEY = base64.b64encode(bytes(range(16))).decode()


class Member:
    """One agent of a memory cluster, with its cancel scope (a crash)."""

    def __init__(self, agent: Agent, address: Address, scope: trio.CancelScope) -> None:
        self.agent = agent
        self.address = address
        self.scope = scope

    @property
    def node(self) -> Node:
        assert self.agent.node is not None
        return self.agent.node

    def state_of(self, name: str) -> NodeStateType | None:
        m = self.node.member(name)
        return None if m is None else m.state

    async def op(self, op: str, **args: Any) -> Any:
        """A control operation through the op table; its result, or AssertionError."""
        reply = await answer(self.agent, make_request(op, **args))
        assert reply["ok"], reply
        return reply["result"]

    async def op_error(self, op: str, **args: Any) -> str:
        reply = await answer(self.agent, {"v": 1, "op": op, "args": args})
        assert reply["ok"] is False, reply
        return str(reply["error"])


class Cluster:
    def __init__(self, network: MemoryNetwork, nursery: trio.Nursery) -> None:
        self.network = network
        self.members: list[Member] = []
        self._nursery = nursery

    async def start(self, name: str, i: int, **extra: object) -> Member:
        address = address_of(i)
        overrides: dict[str, object] = {
            "node": name,
            "bind": f"{address.host}:{address.port}",
            "profile": "local",
            **extra,
        }
        agent = Agent(
            load(None, overrides),
            rng=random.Random(i),
            transport=self.network.attach(address),
            control=False,
        )
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await agent.run(task_status=task_status)

        await self._nursery.start(run)
        member = Member(agent, address, scope)
        self.members.append(member)
        return member

    def crash(self, member: Member) -> None:
        """The process dies: its address goes away and its tasks stop, no leave."""
        self.network.crash(member.address)
        member.scope.cancel()


@asynccontextmanager
async def cluster(n: int, **extra: object) -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        c = Cluster(MemoryNetwork(random.Random(7)), nursery)
        seed = address_of(1)
        for i in range(n):
            join = {"join": [f"{seed.host}:{seed.port}"]} if i else {}
            await c.start(f"n{i}", i + 1, **join, **extra)
        try:
            yield c
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def one_agent_and_a_stranger() -> AsyncIterator[tuple[Member, MemoryTransport, Driver]]:
    """One agent, its driver, and a transport outside the cluster to send it datagrams."""
    async with cluster(1) as c:
        (a,) = c.members
        assert a.agent.driver is not None
        yield a, c.network.attach(address_of(50)), a.agent.driver


def dropped(member: Member) -> int:
    """Inputs the member's node dropped, for any reason."""
    return sum(member.node.stats.dropped.values())


def alive(members: list[Member]) -> Callable[[], bool]:
    names = {m.agent.name for m in members}
    return lambda: all(
        {x.name for x in m.node.members() if x.state == NodeStateType.ALIVE} == names
        for m in members
    )


async def test_join_detect_crash_and_leave(autojump_clock: trio.testing.MockClock) -> None:
    async with cluster(4) as c:
        agents = c.members
        await until(alive(agents), 20)
        c.crash(agents[3])
        took = await until(
            lambda: all(a.state_of("n3") == NodeStateType.DEAD for a in agents[:3]), 30
        )
        # local profile: 1 s probes; suspicion 3 s minimum (α=3, n=4, k=1 confirmation)
        assert 1 < took < 3 + 18 + 2
        agents[2].agent.request_shutdown()
        took = await until(
            lambda: all(a.state_of("n2") == NodeStateType.LEFT for a in agents[:2]), 5
        )
        assert took < 1.0, "peers see a graceful leave within one second"
        await agents[2].agent.stopped.wait()
        # serf peers call it "left", not "failed": the leave intent came first
        assert agents[0].agent.serf is not None
        assert agents[0].agent.serf.delegate.status_ltime("n2") is not None


async def test_a_member_whose_leave_intent_came_but_not_its_dead_message_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Serf's StatusLeaving: a leaver's memberlist dead-from-self can miss a member that had
    its leave intent (a few gossip transmissions, some to dead members). That member then
    declares it dead by probing, and the earlier intent makes that death a leave."""
    async with cluster(3) as c:
        agents = c.members
        await until(alive(agents), 20)
        leaver = agents[2]
        runtime, driver = leaver.agent.serf, leaver.agent.driver
        assert runtime is not None and driver is not None
        await driver.command(lambda t: runtime.send_leave_intent("n2", direct=True))
        await until(lambda: all(a.agent.serf.delegate.is_leaving("n2") for a in agents[:2]), 5)  # type: ignore[union-attr]
        c.crash(leaver)  # gone before its memberlist leave
        await until(lambda: all(a.state_of("n2") == NodeStateType.LEFT for a in agents[:2]), 30)
        rows = await agents[0].op("members")
        assert {r["name"]: r["status"] for r in rows}["n2"] == "left"


async def test_control_ops_members_info_tags_and_bad_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(2, tags={"rack": "r1"}) as c:
        n0, n1 = c.members
        await until(lambda: n1.state_of("n0") == NodeStateType.ALIVE, 10)
        members = await n0.op("members")
        assert {m["name"] for m in members} == {"n0", "n1"}
        assert all(m["tags"] == {"rack": "r1"} for m in members)
        assert {m["status"] for m in members} == {"alive"}
        assert await n0.op("members", status="dead") == []
        got = await n0.op("tags", set={"gpu": "h200"}, delete=["rack"])
        assert got == {"tags": {"gpu": "h200"}}
        await until(lambda: serf.decode_tags(n1.node.member("n0").meta) == {"gpu": "h200"}, 5)  # type: ignore[union-attr]
        cases: list[tuple[str, dict[str, object], str]] = [
            ("members", {"status": "zombie"}, "unknown status"),
            ("join", {"addrs": "x"}, "list of HOST:PORT"),
            ("force_leave", {"node": "n1"}, "is alive"),
            ("force_leave", {"node": "ghost"}, "no member named"),
            ("keys", {"action": "list"}, "encryption is not enabled"),
            ("members", {"bogus": 1}, "bad arguments"),
            ("probe", {}, "bad arguments"),
            ("tags", {"set": {"k": 1}}, "keys and values must be strings"),
            ("nonsense", {}, "unknown operation"),
            ("monitor", {}, "streams"),
        ]
        for op, args, message in cases:
            assert message in await n0.op_error(op, **args), (op, args)
        info = await n0.op("info")
        assert info["node"] == "n0" and info["members"]["alive"] == 2
        assert info["addr"] == "10.0.0.1" and info["port"] == 7946
        assert info["stats"]["packets_in"] > 0 and not info["encrypted"]
        joined = await n0.op("join", addrs=["10.0.0.2:7946", "10.0.0.9:7946", "10.0.0.1:7946"])
        assert joined["joined"] == 1
        assert [e.split(": ", 1)[0] for e in joined["errors"]] == [
            "10.0.0.9:7946",
            "10.0.0.1:7946",
        ]


async def test_a_reaped_member_stays_listed_and_force_leave_makes_it_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Serf lists a failed member for its reconnect timeout, and a leave intent that comes
    after the failure (here: an operator's force-leave on another node, gossiped) turns it
    into "left" even after memberlist reaped it."""
    fast_reap = {"protocol": {"gossip_to_the_dead_time_ms": 2_000}}
    async with cluster(3, **fast_reap, metrics_addr="127.0.0.1:0") as c:
        agents = c.members
        await until(alive(agents), 20)
        c.crash(agents[2])
        await until(lambda: all(a.state_of("n2") is None for a in agents[:2]), 40)

        def listed(a: Member) -> NodeStateType | None:
            found = [m.state for m in a.agent.all_members() if m.name == "n2"]
            return found[0] if found else None

        assert [listed(a) for a in agents[:2]] == [NodeStateType.DEAD] * 2
        rows = await agents[0].op("members")
        assert {r["name"]: r["status"] for r in rows}["n2"] == "dead"

        def page(a: Member) -> str:
            assert a.agent.metrics is not None
            return a.agent.metrics.render().decode()

        # the metrics name it too, reaped or not: its alert keeps firing (agent/member_metrics.py)
        assert 'swim_member_unhealthy{member="n2",status="dead"} 1.0' in page(agents[1])
        reply = await agents[0].op("force_leave", node="n2")
        assert reply["status"] == "left"
        await until(lambda: listed(agents[1]) == NodeStateType.LEFT, 10)
        assert 'swim_member_unhealthy{member="n2",status="left"} 1.0' in page(agents[1])
        assert 'swim_member_unhealthy{member="n2",status="dead"}' not in page(agents[1])
        assert "no member named" in await agents[0].op_error("force_leave", node="nobody")


async def test_probe_op_suspects_a_crashed_member_at_once_and_answers_refusals(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A survivor told right after a crash that it lost the victim probes it at once, and
    that probe (not a report) makes it suspect; bad names get reasons, bad input an error."""
    async with cluster(4, profile="fast") as c:
        agents = c.members
        await until(alive(agents), 20)
        survivor = agents[0]
        assert await survivor.op("probe", nodes=["ghost", "n0", "ghost"]) == {
            "started": [],
            "refused": {"ghost": "unknown", "n0": "self"},
        }
        cases: list[tuple[dict[str, object], str]] = [
            ({"nodes": "n1"}, "non-empty list of member names"),
            ({"nodes": []}, "non-empty list of member names"),
            ({"nodes": [1]}, "non-empty list of member names"),
            ({"nodes": [f"x{i}" for i in range(65)]}, "at most 64 names"),
            ({}, "bad arguments"),
        ]
        for args, message in cases:
            assert message in await survivor.op_error("probe", **args)
        assert await survivor.op("probe", nodes=["n1"]) == {"started": ["n1"], "refused": {}}
        again = await survivor.op("probe", nodes=["n1"])
        assert again["started"] == [] and again["refused"] in (
            {"n1": "probing"},
            {"n1": "rate_limited"},
        )
        c.crash(agents[3])
        got = await survivor.op("probe", nodes=["n3"])
        assert got in (
            {"started": ["n3"], "refused": {}},
            {"started": [], "refused": {"n3": "probing"}},
        )
        stats = survivor.node.stats
        took = await until(
            lambda: survivor.state_of("n3") in (NodeStateType.SUSPECT, NodeStateType.DEAD), 10
        )
        if got["started"]:
            await until(lambda: stats.urgent_probes_failed == 1, 5)
            # suspect within the urgent probe's own timeouts, not a round-robin turn later
            assert took < 1.0
        assert stats.urgent_probes_failed == len(got["started"])
        members = {m["name"]: m["status"] for m in await survivor.op("members")}
        assert members["n3"] in ("suspect", "dead") and members["n1"] == "alive"
        info = await survivor.op("info")
        assert info["stats"]["urgent_probes"]["unknown"] == 1
        assert info["stats"]["urgent_probes"]["self"] == 1


async def test_keys_and_a_stranger_with_another_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(2, encrypt=KEY) as c:
        n0, n1 = c.members
        await until(lambda: n1.state_of("n0") == NodeStateType.ALIVE, 10)
        other = base64.b64encode(bytes(16)).decode()
        stranger = await c.start("x", 9, encrypt=other)
        result = await stranger.agent.join(["10.0.0.1:7946"])
        assert result["joined"] == 0
        assert n0.node.member("x") is None
        assert n0.node.stats.dropped["decrypt_failed"] >= 1
        new = base64.b64encode(bytes(range(32))).decode()
        got = await n0.op("keys", action="install", key=new)
        assert got["keys"] == [KEY, new] and got["primary"] == KEY
        assert "primary" in await n0.op_error("keys", action="remove", key=KEY)
        assert "not valid base64" in await n0.op_error("keys", action="use", key="!!")
        assert "needs a key" in await n0.op_error("keys", action="use")
        assert "unknown keys action" in await n0.op_error("keys", action="rotate", key=new)
        assert (await n0.op("info"))["encrypted"] is True


async def test_events_fan_out_and_a_slow_subscriber_is_cut_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(2) as c:
        n0, n1 = c.members
        await until(lambda: n1.state_of("n0") == NodeStateType.ALIVE, 10)
        events = n0.agent.subscribe()
        slow = n0.agent.subscribe(depth=1)
        changed = n0.agent.changed
        await n1.agent.set_tags({"new": "tag"})
        with trio.fail_after(5):
            await changed.wait()
            async for event in events:
                if event["type"] == "updated" and event["node"] == "n1":
                    break
        await n1.agent.set_tags({"newer": "tag"})
        await until(lambda: n0.agent.events.subscribers == 1, 5)
        got = [e async for e in slow]  # what fit in its queue, then the end of the stream
        assert len(got) == 1


async def test_a_stall_handles_what_arrived_before_firing_overdue_timers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with one_agent_and_a_stranger() as (a, sender, driver):

        def stall(now_ms: int) -> None:
            # in the node task: datagrams arrive, then the process stalls past its timers
            for i in range(5):
                sender.send_datagram(a.address, b"\xff stalled " + bytes([i]))
            autojump_clock.jump(0.4)

        await a.agent.command(stall)
        await until(lambda: driver.stalls >= 1, 1)
        # read from the transport by the catch-up, before the timers (the reader task,
        # waiting on the queue, is handed the first one at once, as it may be by a socket)
        assert driver.stall_datagrams >= 4
        await until(lambda: dropped(a) == 5, 1)
        assert (await a.op("info"))["stats"]["stalls"] == driver.stalls


async def test_the_node_task_wakes_at_once_for_a_command_and_a_datagram(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The node task waits on its inbox until its next timer; an input must wake it at
    # once, not sit until the timer (the autojump clock would jump to it).
    async with one_agent_and_a_stranger() as (a, sender, driver):
        for _ in range(3):
            await trio.sleep(0.0123)  # somewhere between timers
            before = trio.current_time()
            assert await driver.command(lambda now_ms: now_ms) == int(before * 1000)
            assert trio.current_time() == before
            before_drops = dropped(a)
            sender.send_datagram(a.address, b"\xff not a packet")
            for _ in range(10):  # a few turns of the scheduler, no time
                await trio.lowlevel.checkpoint()
            assert dropped(a) == before_drops + 1
            assert trio.current_time() == before


async def test_a_partitioned_member_is_declared_dead_and_rejoins_after_healing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(3) as c:
        agents = c.members
        await until(alive(agents), 20)
        lonely = agents[2]
        c.network.partition({lonely.address}, {m.address for m in agents[:2]})
        await until(lambda: all(a.state_of("n2") == NodeStateType.DEAD for a in agents[:2]), 40)
        c.network.heal()
        # a dead member refutes once it hears of its death (push-pull or gossip), or joins
        await lonely.agent.join(["10.0.0.1:7946"])
        await until(alive(agents), 60)


class WatchClient:
    """One trainer's ``watch`` connection on a memory stream (what torchhook's Membership
    speaks over the control socket): frames in, frames out."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.views: list[dict[str, Any]] = []

    async def send(self, frame: dict[str, Any]) -> None:
        await self.stream.send_all(encode_frame(frame))

    async def until_view(
        self, names: list[str], timeout_s: float = 20, *, any_order: bool = False
    ) -> dict[str, Any]:
        """Until a view lists ``names`` (in that order, or in any with ``any_order``: the
        order follows registration times, wall-clock milliseconds, which trio's shuffled
        scheduling can swap between nodes registered together)."""
        want = sorted(names) if any_order else names
        with trio.fail_after(timeout_s):
            while True:
                for frame in self.decoder.feed(bytes(await self.stream.receive_some(65536))):
                    if "view" in frame:
                        view: dict[str, Any] = frame["view"]
                        self.views.append(view)
                        got = [m["name"] for m in view["members"]]
                        if (sorted(got) if any_order else got) == want:
                            return view


async def test_watch_registers_every_local_rank_and_peers_see_the_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(2) as c, trio.open_nursery() as nursery:
        n0, n1 = c.members
        await until(alive(c.members), 20)
        ranks: list[WatchClient] = []
        for local_rank in range(2):
            ours, theirs = trio.testing.memory_stream_pair()
            register = {"local_rank": local_rank, "local_world_size": 2, "store_port": 29500}
            nursery.start_soon(serve_watch, n0.agent, theirs, {"job": "j", "register": register})
            ranks.append(WatchClient(ours))
        observer_end, theirs = trio.testing.memory_stream_pair()
        nursery.start_soon(serve_watch, n1.agent, theirs, {"job": "j"})
        observer = WatchClient(observer_end)
        view = await observer.until_view(["n0"])
        assert view["members"][0]["ranks"] == 2 and view["members"][0]["store_port"] == 29500
        assert (await job_view(n1.agent, "j"))["fingerprint"] == view["fingerprint"]
        await ranks[0].until_view(["n0"])
        await ranks[0].send({"heartbeat": {"step": 1}})
        await ranks[0].send({"group": "g1"})
        seen = await observer.until_view(["n0"])
        while seen["members"][0]["group"] != "g1":
            seen = await observer.until_view(["n0"])
        assert seen["generation"] == view["generation"]
        await ranks[1].stream.aclose()  # one rank's process died: the node leaves the view
        gone = await observer.until_view([])
        assert gone["generation"] > view["generation"]
        assert not any(k.startswith("swim.job/") for k in n0.agent.tags)
        nursery.cancel_scope.cancel()


async def test_a_rank_that_stops_heartbeating_takes_its_node_out_until_it_steps_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(2) as c, trio.open_nursery() as nursery:
        n0, n1 = c.members
        await until(alive(c.members), 20)
        ours, theirs = trio.testing.memory_stream_pair()
        register = {"heartbeat_pause_ms": 300}
        nursery.start_soon(serve_watch, n0.agent, theirs, {"job": "j", "register": register})
        rank = WatchClient(ours)
        observer_end, theirs = trio.testing.memory_stream_pair()
        nursery.start_soon(serve_watch, n1.agent, theirs, {"job": "j"})
        observer = WatchClient(observer_end)
        view = await observer.until_view(["n0"])
        for step in range(5):
            await rank.send({"heartbeat": {"step": step}})
            await trio.sleep(0.05)
        start = trio.current_time()
        hung = await observer.until_view([])  # silence: the agent flags the node hung
        assert hung["generation"] > view["generation"]
        assert trio.current_time() - start < 5
        await rank.send({"heartbeat": {"step": 5}})
        await observer.until_view(["n0"])
        nursery.cancel_scope.cancel()


async def test_the_node_task_wakes_only_for_timers_that_can_do_something(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forgotten timers (``Output.cancelled_timers``) are never handed back, idle gossip
    ticks are held back, and a held tick is handed over at a multiple of the gossip
    interval from its deadline once something is queued (agent/driver.py docstring)."""
    cancelled: dict[str, set[int]] = {}
    handed: list[tuple[str, str, int, bool]] = []  # node, timer kind, ms late, queued
    apply, handle_timer = Driver.apply, Node.handle_timer

    def record_apply(driver: Driver, out: Output) -> Output:
        cancelled.setdefault(driver.node.name, set()).update(out.cancelled_timers)
        return apply(driver, out)

    def record_timer(node: Node, timer: Timer, now_ms: int) -> Output:
        assert timer.timer_id not in cancelled.get(node.name, set()), timer
        kind = type(timer).__name__
        handed.append((node.name, kind, now_ms - timer.deadline_ms, node.broadcast_queue_depth > 0))
        return handle_timer(node, timer, now_ms)

    monkeypatch.setattr(Driver, "apply", record_apply)
    monkeypatch.setattr(Node, "handle_timer", record_timer)
    async with cluster(3) as c:
        await until(alive(c.members), 20)
        await until(lambda: all(m.node.broadcast_queue_depth == 0 for m in c.members), 20)
        await trio.sleep(1)
        handed.clear()
        await trio.sleep(5)  # quiet: probes, no gossip
        kinds = {kind for _, kind, _, _ in handed}
        assert "ProbeTick" in kinds and "GossipTick" not in kinds, kinds
        assert sum(len(ids) for ids in cancelled.values()) > 0  # acked probes' timeouts

        handed.clear()
        n0 = c.members[0]
        await n0.agent.set_tags({"zone": "z1"})  # queues a broadcast of n0's alive
        await until(
            lambda: all(
                (m := x.node.member("n0")) is not None and b"z1" in m.meta for x in c.members
            ),
            5,
        )
        gossip = [(late, queued) for name, kind, late, queued in handed if kind == "GossipTick"]
        assert gossip and all(queued for _, queued in gossip)
        interval = n0.node.config.gossip_interval_ms
        assert all(late % interval == 0 for late, _ in gossip), gossip
