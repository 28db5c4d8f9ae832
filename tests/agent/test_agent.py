"""Agents in one process on real loopback sockets (UDP + TCP + control socket), driven by
trio: what is about sockets. An end-to-end smoke test (join, the control socket, a
graceful leave), the control socket's mode and its streaming ``monitor``, hostile input on
a live port, and a stall's catch-up reading the kernel's socket buffer. The protocol on
top (crash detection, force-leave, probes, keys, every control op) runs on the memory
transport and a MockClock in tests/agent/test_agent_memory.py. Every wait is bounded;
nothing sleeps for a fixed time to pass a test (waits: ``agent.procs.until_async``).
``cluster``, ``all_alive``, ``seen_by`` and ``KEY`` are shared with
tests/agent/test_security.py and test_jobs.py."""

from __future__ import annotations

import base64
import functools
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from agent.config import load
from agent.control import ControlClient, ControlError
from agent.procs import free_port
from agent.procs import until_async as until
from agent.runtime import Agent
from swim import NodeStateType

pytestmark = pytest.mark.trio
KEY = base64.b64encode(bytes(range(16))).decode()


class Running:
    def __init__(self, agent: Agent, scope: trio.CancelScope) -> None:
        self.agent = agent
        self.scope = scope

    @property
    def node(self):
        assert self.agent.node is not None
        return self.agent.node

    def state_of(self, name: str) -> NodeStateType | None:
        m = self.node.member(name)
        return None if m is None else m.state


@asynccontextmanager
async def cluster(tmp_path: Path, n: int, **extra: object) -> AsyncIterator[list[Running]]:
    async with trio.open_nursery() as nursery:
        running: list[Running] = []
        first_port = 0
        for i in range(n):
            overrides: dict[str, object] = {
                "node": f"n{i}",
                "bind": f"127.0.0.1:{free_port()}",
                "profile": "local",
                "control": str(tmp_path / f"n{i}.sock"),
                **extra,
            }
            if i:
                overrides["join"] = [f"127.0.0.1:{first_port}"]
            agent = Agent(load(None, overrides))
            scope = trio.CancelScope()

            async def run(
                agent: Agent = agent,
                scope: trio.CancelScope = scope,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with scope:
                    await agent.run(task_status=task_status)

            await nursery.start(run)
            if not i:
                first_port = agent.bound_port
            running.append(Running(agent, scope))
        try:
            yield running
        finally:
            nursery.cancel_scope.cancel()


# The local profile's retransmit limit is 2 * ceil(log10(n + 1)) = 2 at n <= 8: a joiner's
# alive message can miss a member (CI saw it once in ~30 runs), as in memberlist. Push-pull
# anti-entropy repairs it; its first run is within one interval (15 s local) of start.
CONVERGE_S = 15 + 5


async def all_alive(agents: list[Running], names: set[str], timeout_s: float = CONVERGE_S) -> None:
    """Wait until every agent sees exactly ``names`` alive."""
    await until(
        lambda: all(
            {m.name for m in a.node.members() if m.state == NodeStateType.ALIVE} == names
            for a in agents
        ),
        timeout_s,
        f"every agent sees {sorted(names)} alive",
        describe=seen_by(agents),
    )


def seen_by(agents: list[Running]) -> Callable[[], str]:
    """Every agent's view, for a timeout's message (to debug from CI)."""
    return lambda: (
        "views: "
        + str(
            {a.agent.config.node: {m.name: m.state.name for m in a.node.members()} for a in agents}
        )
    )


async def test_a_real_cluster_joins_answers_on_its_control_socket_and_leaves(
    tmp_path: Path,
) -> None:
    """End to end on sockets: UDP gossip, TCP push-pull joins, the control socket, a
    graceful leave. The protocol itself (crash -> dead, probes, force-leave, keys, every
    control op) is tested on the memory transport: tests/agent/test_agent_memory.py."""
    async with cluster(tmp_path, 3, tags={"rack": "r1"}) as agents:
        await all_alive(agents, {"n0", "n1", "n2"})
        client = ControlClient(tmp_path / "n0.sock")
        members = await trio.to_thread.run_sync(client.request, "members")
        assert {m["name"]: m["status"] for m in members} == dict.fromkeys(
            ("n0", "n1", "n2"), "alive"
        )
        assert all(m["tags"] == {"rack": "r1"} for m in members)
        with pytest.raises(ControlError, match="bad arguments"):
            await trio.to_thread.run_sync(functools.partial(client.request, "members", bogus=1))
        agents[2].agent.request_shutdown()
        took = await until(
            lambda: all(a.state_of("n2") == NodeStateType.LEFT for a in agents[:2]),
            5,
            describe=seen_by(agents),
        )
        assert took < 1.0, "peers see a graceful leave within one second"


async def test_socket_is_private(tmp_path: Path) -> None:
    async with cluster(tmp_path, 1):
        mode = (tmp_path / "n0.sock").stat().st_mode & 0o777
        assert mode == 0o660  # owner and the control group (tests/agent/test_access.py)


async def test_garbage_on_the_live_port_is_counted_and_harmless(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as agents:
        await until(lambda: agents[1].state_of("n0") == NodeStateType.ALIVE, 10)
        target = agents[0]
        before = [(m.name, m.state, m.incarnation) for m in target.node.members()]
        port = target.agent.bound_port
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            for i in range(2000):
                udp.sendto(bytes([i % 256]) * (1 + i % 1400), ("127.0.0.1", port))
                if i % 100 == 0:
                    await trio.sleep(0.01)  # let the agent drain: the kernel drops silently
        huge = b"\x06" + bytes([0x83, 0xA5]) + b"Nodes" + b"\xce\xff\xff\xff\xff"
        for payload in (huge, b"\x00" * 10, b"\x0a\xff\xff\xff\xff"):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(payload)
                with trio.move_on_after(2):
                    await stream.receive_some(100)
        for _ in range(20):  # connections reset by the peer before and after a request
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as raw:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                raw.connect(("127.0.0.1", port))
                raw.sendall(b"\x06")
        await until(lambda: sum(target.node.stats.dropped.values()) >= 1900, 10)
        assert [(m.name, m.state, m.incarnation) for m in target.node.members()] == before
        members = await trio.to_thread.run_sync(
            ControlClient(tmp_path / "n0.sock").request, "members"
        )
        assert len(members) == 2


async def test_monitor_streams_membership_events(tmp_path: Path) -> None:
    from agent.control import FrameDecoder, encode_frame, make_request

    async with cluster(tmp_path, 2) as agents:
        await until(lambda: agents[1].state_of("n0") == NodeStateType.ALIVE, 10)
        stream = await trio.open_unix_socket(str(tmp_path / "n0.sock"))
        async with stream:
            await stream.send_all(encode_frame(make_request("monitor")))
            decoder = FrameDecoder()
            frames: list[dict[str, object]] = []

            async def read_until(pred: Callable[[dict[str, object]], bool]) -> None:
                with trio.fail_after(10):
                    while not any(pred(f) for f in frames):
                        frames.extend(decoder.feed(await stream.receive_some(65536)))

            await read_until(lambda f: f.get("ok") is True)
            await agents[1].agent.set_tags({"new": "tag"})

            def is_update(frame: dict[str, object]) -> bool:
                event = frame.get("event")
                return (
                    isinstance(event, dict)
                    and event.get("type") == "updated"
                    and event.get("node") == "n1"
                )

            await read_until(is_update)


async def test_a_stalled_node_reads_its_socket_before_firing_overdue_timers(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path, 1) as [a]:
        port = a.agent.bound_port

        def stall(now_ms: int) -> None:
            # Runs inside the node task: datagrams arrive, then the whole process stalls
            # (as under SIGSTOP) past every timer's deadline.
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                for i in range(5):
                    udp.sendto(b"\xff stalled " + bytes([i]), ("127.0.0.1", port))
            time.sleep(0.4)

        await a.agent.command(stall)
        assert a.agent.driver is not None and a.agent.driver.stalls >= 1
        assert a.agent.driver.stall_datagrams >= 5  # read before the timers, not by the reader task
        await until(lambda: sum(a.node.stats.dropped.values()) >= 5, 5)
        info = await trio.to_thread.run_sync(ControlClient(tmp_path / "n0.sock").request, "info")
        assert info["stats"]["stalls"] == a.agent.driver.stalls
