"""torchhook.client.Membership when its reader thread fails: the agent killed (a real agent
process, stopped by pid), a listener that raises (a live agent in this process), a frame
that does not decode (a scripted peer on a real Unix socket). Each time the trainer gets
``MembershipLost`` promptly from ``wait``, ``view`` and its sends, and ``on_closed``
listeners are told once; never a frozen view."""

from __future__ import annotations

import importlib.util
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from agent.control import ControlError, FrameDecoder, encode_frame, ok
from agent.demo import LocalAgent
from agent.procs import stop, until, until_async
from tests.agent.test_agent import cluster
from torchhook.client import Membership, MembershipClosed, MembershipLost, View

HAS_TORCH = importlib.util.find_spec("torch") is not None


class Recorder:
    """An ``on_closed`` listener: every error it was told, in order."""

    def __init__(self) -> None:
        self.told: list[MembershipLost] = []

    def __call__(self, error: MembershipLost) -> None:
        self.told.append(error)


def waiting(m: Membership, timeout_s: float) -> Callable[[], BaseException | None]:
    """Start a thread blocked in ``m.wait`` for a view that never comes; the returned call
    joins it and gives what ``wait`` raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            m.wait(lambda v: False, timeout_s)
        except BaseException as exc:  # recorded for the test
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> BaseException | None:
        thread.join(timeout_s + 5)
        return raised[0] if raised else None

    return join


def assert_surfaced(m: Membership, error: BaseException | None, told: Recorder) -> MembershipLost:
    assert isinstance(error, MembershipLost), f"wait ended with {error!r}"
    assert told.told == [error], "on_closed is told once, with the recorded error"
    assert m.lost is error
    with pytest.raises(MembershipLost):
        _ = m.view
    with pytest.raises(MembershipLost):
        m.heartbeat(1)
    with pytest.raises(MembershipLost), m.paused("checkpoint", 5):
        pass
    late = Recorder()
    m.add_listener(lambda v: None, on_closed=late)
    assert late.told == [error], "a listener added after the failure is told at once"
    return error


def test_killing_the_agent_surfaces_in_the_trainer(tmp_path: Path) -> None:
    agent = LocalAgent("agent-0", tmp_path, "local", None)
    try:
        agent.wait_ready(20)
        m = Membership("k", control=agent.control)
        told = Recorder()
        m.add_listener(lambda v: None, on_closed=told)
        watch = None
        if HAS_TORCH:  # the verdict side: the group breaks, its collectives fail at once
            from torchhook.verdicts import GroupWatch

            watch = GroupWatch(m.node)
            watch.arm(m.view, frozenset((x.name, x.registered_ms) for x in m.view.members), "g")
            m.add_listener(watch.on_view, on_closed=watch.on_closed)
        join = waiting(m, 30)
        killed = time.monotonic()
        stop(agent.proc, sig=signal.SIGKILL)
        error = join()
        print(f"agent SIGKILL -> MembershipLost in the trainer: {time.monotonic() - killed:.3f} s")
        lost = assert_surfaced(m, error, told)
        assert isinstance(lost.cause, MembershipClosed) and "closed the watch" in str(lost)
        if watch is not None:
            assert watch.broken
            from torchhook.groups import MembershipChanged

            with pytest.raises(MembershipChanged, match="watch of the membership ended"):
                watch.comm_hook(None, 1).wait()
        m.close()
    finally:
        agent.stop(signal.SIGKILL)


@pytest.mark.trio
async def test_a_listener_that_raises_ends_the_watch_and_the_registration(tmp_path: Path) -> None:
    path = tmp_path / "n0.sock"
    async with cluster(tmp_path, 1) as agents:
        observer = await trio.to_thread.run_sync(
            lambda: Membership("l", control=path, register=False)
        )
        rank = await trio.to_thread.run_sync(lambda: Membership("l", control=path))
        told = Recorder()
        bug = RuntimeError("a bug in a listener")

        def buggy(view: View) -> None:
            raise bug

        rank.add_listener(buggy, on_closed=told)
        try:
            join = waiting(rank, 10)
            await trio.to_thread.run_sync(rank.set_group, "g1")  # a new view: the bug runs
            error = await trio.to_thread.run_sync(join)
            assert assert_surfaced(rank, error, told).cause is bug
            # the rank unregistered: a trainer that cannot see verdicts leaves the views
            await trio.to_thread.run_sync(lambda: observer.wait(lambda v: v.names == (), 10))
        finally:
            rank.close()
            observer.close()
        await until_async(lambda: "swim.job/l" not in agents[0].agent.tags, 5)


def test_a_frame_that_does_not_decode_ends_the_watch(tmp_path: Path) -> None:
    path = tmp_path / "peer.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(10)
    first = {"job": "b", "generation": 1, "fingerprint": "x", "members": []}
    started = threading.Event()  # the client runs its reader thread: the bad frame is its

    def peer() -> None:
        conn, _ = server.accept()
        with conn:
            decoder = FrameDecoder()
            while not decoder.feed(conn.recv(65536)):
                pass
            conn.sendall(encode_frame(ok({"node": "n0", "job": "b"})))
            conn.sendall(encode_frame({"view": first}))
            started.wait(10)
            conn.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # 0xc1: never msgpack
            conn.recv(1)  # until the client hangs up

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        m = Membership("b", control=path, register=False)
        told = Recorder()
        m.add_listener(lambda v: None, on_closed=told)
        started.set()
        until(lambda: m.lost is not None, 10, "the bad frame recorded")
        lost = assert_surfaced(m, waiting(m, 5)(), told)
        assert isinstance(lost.cause, ControlError) and "bad frame" in str(lost)
        m.close()
    finally:
        started.set()
        thread.join(10)
        server.close()
