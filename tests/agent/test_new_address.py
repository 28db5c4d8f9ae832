"""A member restarted under its old name at a new address, side by side with real serf.

Each cluster has three members on their own loopback addresses (127.0.0.0/8); one is
SIGKILLed and started again under the same name on a fresh address at once, before the
others have noticed its death (the hardest case: its old record is still alive to them).

- Our agents: every member lists it at the new address and alive, without a force-leave,
  within ``CONVERGE_S`` (measured ≈ 1 s in ``fast``): the claim is refused while the old
  record is live, remembered, and takes the name at the death verdict (swim/claims.py).
- Serf (Debian's serf, memberlist without ``DeadNodeReclaimTime``): the new process loses
  serf's ``_serf_conflict`` vote and shuts itself down ("minority in name conflict
  resolution"); the others keep the name at the old address. Restarted again after the old
  one is marked failed, serf still refuses the new address (memberlist's "Conflicting
  address") until it reaps the failed record (``GossipToTheDeadTime``, 15 s in its
  ``local`` profile; measured: the new address listed ≈ 24 s after the restart).
- A real conflict (two live agents claiming one name): refused everywhere with the log
  line, counted in ``address_conflicts``; the first keeps the name.

The same three cases also run as whole agents on the in-memory transport and trio's
MockClock (``local`` profile), where the timing can be asserted exactly: the name moves at
the death verdict, not a push-pull later.

Every process is stopped by pid (agent/procs.py ``stop``).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from agent.control import ControlClient, ControlError
from agent.demo import agent_command
from agent.memory_transport import address_of
from agent.procs import free_port, stop, until, until_async
from bench.procs import SERF, LocalSerf, SerfError
from swim import EventKind, NodeStateType
from tests.agent.test_agent_memory import Member, cluster

ROOT = Path(__file__).resolve().parents[2]
CONVERGE_S = 10.0
"""Bound on a restarted member being listed at its new address everywhere (fast: failure
detection of the old process, about 1 s here, plus one gossip round; measured ≈ 1 s)."""
SERF_VOTE_S = 15.0
"""Bound on serf's new process losing its conflict vote (measured ≈ 2 s: its query
timeout)."""
SERF_REFUSES_S = 4.0
"""How long serf is watched refusing a failed member's new address (it gives in only after
15 s, when it reaps the record)."""


class Agent:
    """One of our agents on its own loopback address."""

    def __init__(self, name: str, ip: str, workdir: Path, join: Agent | None = None) -> None:
        self.name, self.ip, self.port = name, ip, free_port()
        tag = f"{name}@{ip}"
        self.control = workdir / f"{tag}.sock"
        self.log_path = workdir / f"{tag}.log"
        args = agent_command(
            name,
            self.port,
            self.control,
            "fast",
            None if join is None else join.port,
            retry_ms=200,
            host=ip,
            join_host="127.0.0.1" if join is None else join.ip,
        )
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*args, "--log-level", "info"], stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT
        )
        self.client = ControlClient(self.control, timeout_s=5)

    def members(self) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.client.request("members")}

    def where(self, name: str) -> tuple[str, str] | None:
        """(address, status) of ``name`` in this agent's list."""
        try:
            m = self.members().get(name)
        except (ControlError, OSError):
            return None
        return None if m is None else (m["addr"], m["status"])

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.client.request("info")["stats"]
        return stats

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        stop(self.proc, sig=sig)
        self._log.close()


def _serf(name: str, ip: str, workdir: Path, join: tuple[str, int] | None) -> LocalSerf:
    """A serf agent bound to ``ip`` (the later ``-bind`` wins over LocalSerf's 127.0.0.1)."""
    port = free_port()
    extra = [f"-bind={ip}:{port}"] + ([] if join is None else [f"-join={join[0]}:{join[1]}"])
    s = LocalSerf(name, workdir / ip, extra=extra)
    s.port = port
    return s


@pytest.fixture
def ours(tmp_path: Path) -> Iterator[list[Agent]]:
    started: list[Agent] = []
    try:
        started.append(Agent("w0", "127.0.0.21", tmp_path))
        started += [Agent(f"w{i}", f"127.0.0.{21 + i}", tmp_path, started[0]) for i in (1, 2)]
        until(lambda: _all_alive(started, 3), 30, "three agents see each other")
        yield started
    finally:
        for a in started:
            a.stop()


def _all_alive(agents: list[Agent], n: int) -> bool:
    try:
        return all(sum(m["status"] == "alive" for m in a.members().values()) == n for a in agents)
    except (ControlError, OSError):
        return False


def _converges(observers: list[Agent], name: str, ip: str) -> float:
    """Seconds until every observer lists ``name`` at ``ip`` and alive (at most
    ``CONVERGE_S``); then it stays there for a second."""
    want = (ip, "alive")
    last: dict[str, object] = {}

    def converged() -> bool:
        last.update({f"{o.name}@{o.ip}": o.where(name) for o in observers})
        return all(v == want for v in last.values())

    try:
        took = until(converged, CONVERGE_S, f"{name} listed at {ip} everywhere")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last seen: {last}") from None
    # and it stays there: no suspicion of the new process from probes of the old address
    time.sleep(1.0)
    assert {f"{o.name}@{o.ip}": o.where(name) for o in observers} == dict.fromkeys(last, want)
    return took


def test_ours_restarted_at_a_new_address_converges_without_force_leave(
    ours: list[Agent], tmp_path: Path
) -> None:
    """A crash, and the same name started at once on another address."""
    w0, w1, w2 = ours
    w2.stop(signal.SIGKILL)
    again = Agent("w2", "127.0.0.24", tmp_path, join=w0)
    ours.append(again)  # stopped by the fixture
    took = _converges([w0, w1, again], "w2", "127.0.0.24")
    print(f"restarted member listed at its new address everywhere after {took:.2f} s")


def test_ours_new_address_claimed_before_the_old_process_died_takes_the_name_at_its_death(
    ours: list[Agent], tmp_path: Path
) -> None:
    """The new process is up (and refused: its old self is alive) before the old one dies:
    the refused claim is remembered and takes the name at the death verdict."""
    w0, w1, w2 = ours
    again = Agent("w2", "127.0.0.24", tmp_path, join=w0)
    ours.append(again)  # stopped by the fixture
    line = "conflicting address for w2: ours 127.0.0.23"
    until(lambda: all(line in o.log() for o in (w0, w1)), CONVERGE_S, "the claim refused")
    assert w0.where("w2") == ("127.0.0.23", "alive")
    w2.stop(signal.SIGKILL)
    took = _converges([w0, w1, again], "w2", "127.0.0.24")
    print(f"claimed name taken {took:.2f} s after the old process was killed")


def test_ours_refuse_a_real_name_conflict_and_the_first_keeps_the_name(
    ours: list[Agent], tmp_path: Path
) -> None:
    w0, w1, w2 = ours
    impostor = Agent("w1", "127.0.0.25", tmp_path, join=w0)
    ours.append(impostor)  # stopped by the fixture
    line = "conflicting address for w1: ours 127.0.0.22"
    until(
        lambda: all(line in o.log() for o in (w0, w2)),
        CONVERGE_S,
        "the conflict logged by both observers",
    )
    for o in (w0, w2):
        assert o.stats()["address_conflicts"] >= 1, o.name
    assert impostor.proc.poll() is None  # refused, not killed: unlike serf, we do not vote
    # the first keeps the name, for as long as both run
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        for o in (w0, w1, w2):
            assert o.where("w1") == ("127.0.0.22", "alive"), o.name
        time.sleep(0.2)


@pytest.mark.skipif(
    SERF is None, reason="serf not installed (scripts/setup.sh installs it with apt-get)"
)
def test_serf_refuses_a_member_restarted_at_a_new_address(tmp_path: Path) -> None:
    started: list[LocalSerf] = []

    def start(name: str, ip: str, join: LocalSerf | None) -> LocalSerf:
        (tmp_path / ip).mkdir(exist_ok=True)
        s = _serf(name, ip, tmp_path, None if join is None else ("127.0.0.11", join.port))
        started.append(s)
        return s

    def where(observer: LocalSerf, name: str) -> tuple[str, str] | None:
        m = observer.members().get(name)
        return None if m is None else (m["addr"].rsplit(":", 1)[0], m["status"])

    try:
        s0 = start("s0", "127.0.0.11", None)
        s0.wait_ready()
        s1, s2 = start("s1", "127.0.0.12", s0), start("s2", "127.0.0.13", s0)
        for s in started:
            s.wait_ready()
        until(
            lambda: all(len(s.members()) == 3 for s in started),
            30,
            "three serf agents",
            ignore=(SerfError,),
        )
        s2.stop(signal.SIGKILL)
        # 1. restarted at once, while the old process is still alive to the others: the new
        # one loses serf's conflict vote and shuts down; the name stays at the old address
        again = start("s2", "127.0.0.14", s0)
        took = until(lambda: again.proc.poll() is not None, SERF_VOTE_S, "serf's vote")
        print(f"serf's restarted member lost the name conflict vote after {took:.2f} s")
        assert "minority in name conflict resolution" in again.log_path.read_text()
        for o in (s0, s1):
            assert where(o, "s2") in {("127.0.0.13", "alive"), ("127.0.0.13", "failed")}
        # 2. restarted after the old one is marked failed: refused (memberlist's conflicting
        # address) until serf reaps the failed record, longer than we watch here
        until(
            lambda: all(where(o, "s2") == ("127.0.0.13", "failed") for o in (s0, s1)),
            30,
            "serf marks the killed member failed",
            ignore=(SerfError,),
        )
        third = start("s2", "127.0.0.15", s0)
        third.wait_ready()
        deadline = time.monotonic() + SERF_REFUSES_S
        while time.monotonic() < deadline:
            for o in (s0, s1):
                assert where(o, "s2") == ("127.0.0.13", "failed"), o.name
            time.sleep(0.3)
        assert "Conflicting address for s2" in s0.log_path.read_text()
    finally:
        for s in started:
            s.stop(signal.SIGKILL)


# --- whole agents in memory, on a virtual clock --------------------------------------------

SEED = f"{address_of(1).host}:{address_of(1).port}"


def _lists(members: list[Member], name: str, i: int) -> bool:
    """Every member lists ``name`` alive at ``address_of(i)``."""
    want = (address_of(i), NodeStateType.ALIVE)
    found = [x.node.member(name) for x in members]
    return all(m is not None and (m.address, m.state) == want for m in found)


async def _record(
    channel: trio.MemoryReceiveChannel[dict[str, Any]], name: str, into: list[tuple[float, str]]
) -> None:
    async for event in channel:
        if event.get("node") == name:
            into.append((trio.current_time(), f"{event['type']}@{event.get('addr')}"))


@pytest.mark.trio
async def test_in_memory_a_claim_made_before_the_death_takes_the_name_at_the_verdict(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(3) as c, trio.open_nursery() as watchers:
        n0, n1, n2 = c.members
        await until_async(lambda: _lists([n0, n1, n2], "n2", 3), 20)
        seen: list[tuple[float, str]] = []
        watchers.start_soon(_record, n0.agent.subscribe(), "n2", seen)
        c.crash(n2)
        again = await c.start("n2", 9, join=[SEED])
        # refused while its old record is live (the local profile takes seconds to notice)
        await until_async(lambda: n0.node.stats.address_conflicts > 0, 5)
        old = n0.node.member("n2")
        assert old is not None and old.address == address_of(3) and old.state != NodeStateType.DEAD
        await until_async(lambda: _lists([n0, n1, again], "n2", 9), 30)
        await trio.sleep(1)
        kinds = [k for _, k in seen]
        assert kinds[-2:] == [
            f"{EventKind.DEAD.value}@{address_of(3).host}",
            f"{EventKind.JOINED.value}@{address_of(9).host}",
        ], seen
        # the name moved with the verdict (the claimant outbids it within a round trip),
        # not a push-pull (15 s) or a reap (15 s) later
        assert seen[-1][0] - seen[-2][0] < 0.5, seen
        watchers.cancel_scope.cancel()


@pytest.mark.trio
async def test_in_memory_a_member_that_left_comes_back_at_a_new_address_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(3) as c:
        n0, n1, n2 = c.members
        await until_async(lambda: _lists([n0, n1, n2], "n2", 3), 20)
        n2.agent.request_shutdown()  # a graceful leave
        await n2.agent.stopped.wait()
        await until_async(lambda: n0.state_of("n2") == NodeStateType.LEFT, 5)
        start = trio.current_time()
        again = await c.start("n2", 9, join=[SEED])
        await until_async(lambda: _lists([n0, n1, again], "n2", 9), 5)
        assert trio.current_time() - start < 2
        assert n0.node.stats.address_conflicts == 0


@pytest.mark.trio
async def test_in_memory_a_real_conflict_is_refused_for_good(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(3) as c:
        n0, n1, n2 = c.members
        await until_async(lambda: _lists([n0, n1, n2], "n1", 2), 20)
        await c.start("n1", 9, join=[SEED])
        await until_async(lambda: n0.node.stats.address_conflicts > 0, 5)
        # a minute: past push-pulls, gossip to the dead and reconnects, the first keeps it
        for _ in range(60):
            assert _lists([n0, n1, n2], "n1", 2)
            await trio.sleep(1)
        assert n2.node.stats.address_conflicts > 0
