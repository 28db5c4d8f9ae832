"""The formation protocol (torchhook/formation.py) on an in-memory store, rule by rule.

Every rank runs its real steps (``Formation.steps``); a deterministic scheduler resumes
them round-robin on one in-memory ``Net`` with a fake clock (no threads, no sleeps): a wait
resumes when its keys are there, or, when no rank can move, the clock advances one
``WAIT_SLICE`` and every waiting rank rechecks its view and deadline. A trainer process
can be killed (SIGKILL: its stores die, it runs nothing more) or stopped (SIGSTOP: its
stores stop answering) right after its k-th store operation. Each test names the rules of
the module docstring it checks; the last one runs the same steps on real TCPStores.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from torchhook.client import JobMember, View
from torchhook.formation import (
    FORMATION_KEY,
    PLAN_KEY,
    POLL_S,
    TOKEN_KEY,
    WAIT_SLICE,
    Agreement,
    Formation,
    FormationOn,
    Retry,
    Wait,
    info_key,
)
from torchhook.formation_wire import VERSION, Offer, WireVersionError, decode_plan, encode_offer
from torchhook.strategy import Layout, Node, Plan, RankInfo, decide

TIMEOUT_S = 5.0
SLICE_S = WAIT_SLICE.total_seconds()


# --- an in-memory world ---------------------------------------------------------------


class Killed(BaseException):
    """The process was SIGKILLed: nothing of it runs any more (no except, no cleanup)."""


class Stopped(BaseException):
    """The process was SIGSTOPped: it runs nothing more, its stores stop answering."""


class StoreTimeout(RuntimeError):
    """A request that ran out of time (what a stopped store answers)."""


@dataclass
class Proc:
    """One trainer process. ``halt_after``: it is killed (or stopped) right after its
    k-th store operation (serving a store counts) took effect; ``on_op`` runs after each."""

    name: str
    ops: int = 0
    halt_after: int | None = None
    halt: str = "kill"
    on_op: Callable[[Proc], None] | None = None
    killed: bool = False
    stopped: bool = False

    def check(self) -> None:
        if self.killed:
            raise Killed(self.name)
        if self.stopped:
            raise Stopped(self.name)

    def did_op(self) -> None:
        self.ops += 1
        if self.ops == self.halt_after:
            self.killed, self.stopped = self.halt == "kill", self.halt == "stop"
            self.check()
        if self.on_op is not None:
            self.on_op(self)


@dataclass
class Server:
    port: int
    owner: Proc
    data: dict[str, bytes] = field(default_factory=dict)
    writes: list[tuple[str, str]] = field(default_factory=list)
    """(process, key) of every write, for "wrote nothing" checks."""

    @property
    def dead(self) -> bool:
        return self.owner.killed

    @property
    def stopped(self) -> bool:
        return self.owner.stopped


class MemStore:
    """A client (or a server's own handle) of one in-memory store, used by ``proc``."""

    def __init__(self, server: Server, proc: Proc) -> None:
        self.server = server
        self.proc = proc

    def _data(self) -> dict[str, bytes]:
        self.proc.check()
        if self.server.dead:
            raise RuntimeError("Connection reset by peer")
        if self.server.stopped:
            raise StoreTimeout("Socket Timeout")
        return self.server.data

    def _write(self, key: str, value: str) -> None:
        self._data()[key] = value.encode()
        self.server.writes.append((self.proc.name, key))

    def set(self, key: str, value: str) -> None:
        self._write(key, value)
        self.proc.did_op()

    def get(self, key: str) -> bytes:
        data = self._data()
        if key not in data:
            raise StoreTimeout(f"wait timeout for {key}")
        self.proc.did_op()
        return data[key]

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        # TCPStore's semantics: a missing key is set only if ``expected_value`` is empty
        current = self._data().get(key)
        if (current is None and expected_value == "") or current == expected_value.encode():
            self._write(key, desired_value)
            current = desired_value.encode()
        elif current is None:
            current = expected_value.encode()
        self.proc.did_op()
        return current

    def multi_get(self, keys: list[str]) -> list[bytes]:
        data = self._data()
        if any(k not in data for k in keys):
            raise StoreTimeout(f"wait timeout for {keys}")
        self.proc.did_op()
        return [data[k] for k in keys]

    def delete_key(self, key: str) -> bool:
        deleted = self._data().pop(key, None) is not None
        self.proc.did_op()
        return deleted

    def check(self, keys: list[str]) -> bool:
        raise AssertionError("the scheduler does the waiting")

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        raise AssertionError("the scheduler does the waiting")

    def set_timeout(self, timeout: timedelta) -> None:
        pass

    @property
    def port(self) -> int:
        return self.server.port


class World:
    """The clock, the stores by port, the processes and each node's view."""

    def __init__(self) -> None:
        self.now = 0.0
        self.servers: dict[int, Server] = {}
        self.views: dict[str, View] = {}
        self.events: list[tuple[float, Callable[[], None]]] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        raise AssertionError("the scheduler does the waiting")

    def at(self, t: float, event: Callable[[], None]) -> None:
        self.events.append((t, event))
        self.events.sort(key=lambda e: e[0])

    def advance_to(self, t: float) -> None:
        """Run the events due by ``t`` (each at its own time), then set the clock to ``t``."""
        while self.events and self.events[0][0] <= t:
            when, event = self.events.pop(0)
            self.now = max(self.now, when)
            event()
        self.now = max(self.now, t)


class MemNet:
    """``formation.Net`` for one process of the world."""

    def __init__(self, world: World, proc: Proc) -> None:
        self.world = world
        self.proc = proc

    def serve(self, host: str, timeout: timedelta) -> MemStore:
        self.proc.check()
        port = 1000 + len(self.world.servers)
        self.world.servers[port] = Server(port, self.proc)
        self.proc.did_op()
        return MemStore(self.world.servers[port], self.proc)

    def connect(self, addr: str, port: int, what: str, beat: Callable[[], None]) -> MemStore:
        self.proc.check()
        server = self.world.servers.get(port)
        if server is None or server.dead:
            raise Retry(f"{what} at {addr}:{port}: connection refused", unreachable=True)
        if server.stopped:
            raise Retry(f"{what} at {addr}:{port}: no answer", unreachable=True)
        return MemStore(server, self.proc)

    def timed_out(self, exc: BaseException) -> bool:
        return isinstance(exc, StoreTimeout)


Result = Any  # an Agreement, or the exception a rank's steps ended with


Steps = Generator[Wait[MemStore], bool | bytes, Any]


class Scheduler:
    """Resumes every rank's steps until they end (see the module docstring): a wait
    whose keys are there resumes at once; otherwise the clock moves to the next moment a
    wait runs out (``POLL_S`` for the leader's checks and for pauses, ``WAIT_SLICE`` for a
    follower's store wait) or an event is due."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pending: dict[str, tuple[Steps, Wait[MemStore], float]] = {}
        self.results: dict[str, Result] = {}

    def start(self, name: str, steps: Steps) -> None:
        self.results.pop(name, None)
        self._resume(name, steps, lambda: next(steps))

    def _resume(self, name: str, steps: Steps, how: Callable[[], Wait[MemStore]]) -> None:
        self.pending.pop(name, None)
        try:
            wait = how()
        except StopIteration as done:
            self.results[name] = done.value
        except (Exception, Killed, Stopped) as exc:
            self.results[name] = exc
        else:
            slice_s = POLL_S if wait.poll or not wait.keys else SLICE_S
            self.pending[name] = (steps, wait, self.world.now + slice_s)

    def run(self, until: Iterable[str] | None = None) -> dict[str, Result]:
        """Until the ranks named (default: every rank started) have ended."""
        names = set(self.pending) if until is None else set(until)
        for _ in range(100_000):
            if not names & set(self.pending):
                return self.results
            if self._step():
                continue
            due = min(d for _, _, d in self.pending.values())
            self.world.advance_to(due)
            for name, (steps, _, d) in list(self.pending.items()):
                if d <= self.world.now:
                    self._resume(name, steps, lambda s=steps: s.send(False))  # type: ignore[misc]
        raise AssertionError(f"still waiting: {sorted(self.pending)}")

    def _step(self) -> bool:
        moved = False
        for name, (steps, wait, _) in list(self.pending.items()):
            if not wait.keys:
                continue
            server = wait.store.server
            if server.dead:
                error = RuntimeError("Connection reset by peer")
                self._resume(name, steps, lambda s=steps, e=error: s.throw(e))  # type: ignore[misc]
                moved = True
            elif not server.stopped and all(k in server.data for k in wait.keys):
                # a follower's wait reads its key (one op: TCPStore's get); a poll does not
                ready = True if wait.poll else (lambda w=wait: w.store.get(w.keys[0]))
                self._resume(name, steps, lambda s=steps, r=ready: s.send(r if r is True else r()))  # type: ignore[misc]
                moved = True
        return moved


@dataclass
class Rank:
    node: str
    local_rank: int
    proc: Proc
    formation: FormationOn[MemStore]

    def info(self) -> RankInfo:
        return RankInfo("", None, 0, False)


def gloo_decide(layout: Layout, infos: list[RankInfo]) -> Plan:
    return decide(layout, infos, backend="gloo", supports_shrinking=False)


class Cluster:
    """Nodes (name, local ranks), one process per local rank, registered in that order
    (a at 100 ms, b at 200 ms, ...). A rank's view is its own if set, else its node's."""

    def __init__(self, nodes: list[tuple[str, int]], *, decide: Any = gloo_decide) -> None:
        self.world = World()
        self.sched = Scheduler(self.world)
        self.decide = decide
        self.ranks: dict[str, Rank] = {}
        self.registered: dict[str, int] = {}
        self.views: dict[str, View] = {}
        for name, count in nodes:
            self.add_node(name, count)

    def add_node(self, name: str, count: int, registered_ms: int | None = None) -> None:
        self.registered[name] = registered_ms or 100 * (len(self.registered) + 1)
        for lr in range(count):
            self.add_rank(name, lr)

    def add_rank(self, node: str, local_rank: int, key: str | None = None) -> Rank:
        proc = Proc(key or f"{node}/{local_rank}")
        formation = FormationOn(
            lambda: self.views.get(proc.name) or self.views[node],
            local_rank=local_rank,
            beat=lambda: None,
            timeout_s=TIMEOUT_S,
            store_host="mem",
            op_timeout=timedelta(seconds=1),
            net=MemNet(self.world, proc),
            clock=self.world,
        )
        rank = Rank(node, local_rank, proc, formation)
        self.ranks[proc.name] = rank
        return rank

    def member(self, name: str, registered_ms: int | None = None) -> JobMember:
        ranks = [r for r in self.ranks.values() if r.node == name]
        directory = next(r for r in ranks if r.local_rank == 0).formation.directory_port
        reg = self.registered[name] if registered_ms is None else registered_ms
        count = len({r.local_rank for r in ranks})
        return JobMember(name, "mem", 7946, directory, reg, "", "alive", count)

    def view(self, *names: str, **registered_ms: int) -> View:
        members = tuple(self.member(n, registered_ms.get(n)) for n in names)
        fingerprint = ",".join(f"{m.name}@{m.registered_ms}" for m in members)
        return View("job", 1, fingerprint, members)

    def see(self, view: View, *who: str) -> None:
        """``who`` (nodes or ranks; default: every node) see ``view`` from now on."""
        for n in who or tuple(self.registered):
            self.views[n] = view

    def start(self, *names: str) -> None:
        """A formation on each named rank (default: every rank), on its own view."""
        for name in names or tuple(self.ranks):
            r = self.ranks[name]
            r.proc.ops = 0
            view = self.views.get(name) or self.views[r.node]
            self.sched.start(
                name, r.formation.steps(view, r.node, r.local_rank, r.info(), self.decide)
            )

    def form(self, *names: str) -> dict[str, Result]:
        self.start(*names)
        return self.sched.run(names or None)

    def leader(self) -> Proc:
        return self.ranks["a/0"].proc

    def but(self, *excluded: str) -> list[str]:
        """Every rank's name except those of the nodes or ranks named."""
        return [n for n, r in self.ranks.items() if n not in excluded and r.node not in excluded]


def three_by_two() -> Cluster:
    c = Cluster([("a", 2), ("b", 2), ("c", 2)])
    c.see(c.view("a", "b", "c"))
    return c


def agreements(results: dict[str, Result]) -> dict[str, Agreement[MemStore]]:
    return {n: r for n, r in results.items() if isinstance(r, Agreement)}


def assert_one_plan(results: dict[str, Result]) -> Agreement[MemStore]:
    """Rule 9: every rank that returned holds the same plan, token, layout and store, and
    the ranks are distinct."""
    agreed = agreements(results)
    assert agreed, results
    first = next(iter(agreed.values()))
    for a in agreed.values():
        assert (a.plan, a.token, a.layout, a.store.port) == (
            first.plan,
            first.token,
            first.layout,
            first.store.port,
        )
    assert len({a.rank for a in agreed.values()}) == len(agreed)
    return first


def writers(c: Cluster, port: int) -> set[str]:
    return {proc for proc, _ in c.world.servers[port].writes}


def retried(results: dict[str, Result], names: Iterable[str], why: str) -> bool:
    return all(isinstance(results[n], Retry) and why in str(results[n]) for n in names)


# --- the tests --------------------------------------------------------------------------


def test_every_rank_forms_on_the_leaders_layout_with_a_fresh_store_and_token() -> None:
    """Rules 1, 2, 9: one plan for all; a follower whose view differs (it already sees a
    younger node) still joins the leader's layout; the next formation gets a new store
    and token."""
    c = three_by_two()
    c.add_node("d", 2)
    c.see(c.view("a", "b", "c", "d"), "c", "d")  # c sees d already; a and b do not
    results = c.form(*c.but("d"))
    first = assert_one_plan(results)
    assert len(agreements(results)) == 6
    assert first.layout == Layout.of(c.view("a", "b", "c").members)
    assert first.store.port not in {r.formation.directory_port for r in c.ranks.values()}
    assert first.plan.action == "reform" and first.plan.restore == "fresh"
    again = assert_one_plan(c.form(*c.but("d")))
    assert again.token != first.token and again.store.port != first.store.port
    assert c.world.now == 0.0  # nobody waited a slice: every wait ended on its key


LEADER_OPS = ["serve", "token", "offer", "read-claims", "withdraw", "publish-plan"]
"""The leader's store operations in one formation, in order."""


@pytest.mark.parametrize("after", range(len(LEADER_OPS) + 1), ids=["start", *LEADER_OPS])
def test_the_leader_killed_at_each_step(after: int) -> None:
    """Rules 6, 7, 9: the leader's process dies (its stores with it) right after each of
    its store operations, the last being the plan's publication: every follower, committed
    or not, ends at once in ``Retry`` (none follows an unpublished plan, none waits for
    the timeout)."""
    c = three_by_two()
    c.form()  # a first formation: the followers hold directory clients
    c.leader().halt_after = after
    c.leader().killed = after == 0
    c.start()
    results = c.sched.run(c.but("a/0"))
    assert c.leader().ops == after
    assert isinstance(results["a/0"], Killed)
    assert retried(results, c.but("a/0"), ""), results
    assert not agreements(results)
    assert c.world.now == 0.0


def test_the_leader_killed_while_its_plan_is_being_read() -> None:
    """Rule 9: the followers that read the plan before the leader died follow it, the
    others retry; nobody follows anything else."""
    c = three_by_two()

    def kill_the_leader_after_reading_the_plan(proc: Proc) -> None:
        if proc.ops == 4:  # the offer, the token, the claim, the plan
            c.leader().killed = True

    c.ranks["b/0"].proc.on_op = kill_the_leader_after_reading_the_plan
    results = c.form()
    assert set(agreements(results)) == {"a/0", "a/1", "b/0"}
    assert_one_plan(results)
    assert retried(results, ["b/1", "c/0", "c/1"], "formation store")


def test_the_offer_is_withdrawn_before_the_plan_is_published() -> None:
    """Rule 7: when the plan appears, the offer is gone already, so a rank that has read
    the plan (and starts over at once) cannot rejoin the decided formation."""
    c = three_by_two()
    directory = c.ranks["a/0"].formation.directory
    assert directory is not None
    seen: list[bool] = []

    def at_each_leader_op(proc: Proc) -> None:
        stores = [s for s in c.world.servers.values() if s.owner is proc]
        if any(PLAN_KEY in s.data for s in stores) and not seen:
            seen.append(FORMATION_KEY in directory.server.data)

    c.leader().on_op = at_each_leader_op
    assert_one_plan(c.form())
    assert seen == [False]


def test_a_stopped_leader_before_its_offer_is_left_when_the_view_drops_it() -> None:
    """Rule 8: before the commitment a follower gives up when the oldest node of its view
    changes (here the stopped leader is dropped after 1 s)."""
    c = three_by_two()
    c.form()
    c.leader().halt, c.leader().halt_after = "stop", 2  # served the store, wrote the token
    c.world.at(1.0, lambda: c.see(c.view("b", "c")))
    c.start()
    results = c.sched.run(c.but("a/0"))
    assert retried(results, c.but("a/0"), "another node is the oldest now"), results
    assert 1.0 <= c.world.now <= 1.0 + SLICE_S


def test_a_stopped_leader_holds_committed_followers_until_the_timeout() -> None:
    """Rules 6, 9: the leader stops after reading the claims; the committed followers
    ignore their views (which drop it at 1 s) and give up at the formation timeout."""
    c = three_by_two()
    c.form()
    c.leader().halt, c.leader().halt_after = "stop", 4
    c.world.at(1.0, lambda: c.see(c.view("b", "c")))
    c.start()
    results = c.sched.run(c.but("a/0"))
    assert retried(results, c.but("a/0"), "timed out waiting for the plan"), results
    assert all(results[n].unreachable for n in c.but("a/0"))
    assert TIMEOUT_S <= c.world.now <= TIMEOUT_S + SLICE_S


def test_an_offer_for_an_older_registration_of_this_node_is_not_joined() -> None:
    """Rules 3, 8: the leader's view still lists b's previous registration (150), so its
    offer is not for b's restarted ranks (200): they write nothing. When the leader's
    view catches up it abandons (``retry``), and the next offer is for them."""
    c = three_by_two()
    c.see(c.view("a", "b", "c", b=150), "a", "c")
    c.world.at(0.5, lambda: c.see(c.view("a", "b", "c"), "a", "c"))
    c.start()
    results = c.sched.run(c.but("b"))
    assert "['b'] left the view" in str(results["a/0"])
    assert retried(results, ["a/1", "c/0", "c/1"], "abandoned"), results
    abandoned_store = max(c.world.servers)
    assert writers(c, abandoned_store) == {"a/0", "a/1", "c/0", "c/1"}
    assert 0.5 <= c.world.now <= 0.5 + 2 * POLL_S  # the leader notices at once
    assert {"b/0", "b/1"} <= set(c.sched.pending)  # still waiting in the directory
    c.start(*c.but("b"))
    assert len(agreements(c.sched.run())) == 6


def _plant_offer(c: Cluster, port: int, token: str) -> None:
    directory = c.ranks["a/0"].formation.directory
    assert directory is not None
    offer = Offer("old", port, token, Layout((Node("b", 200, 2),)))
    directory.set(FORMATION_KEY, encode_offer(offer))


def test_an_offer_whose_port_serves_another_formation_is_stale() -> None:
    """Rule 4: the offered port now serves a store with another token (a reused port):
    ``Retry`` before writing anything there."""
    c = three_by_two()
    foreign = MemNet(c.world, Proc("other")).serve("mem", timedelta(seconds=1))
    foreign.set(TOKEN_KEY, "another formation")
    _plant_offer(c, foreign.port, "ours")
    results = c.form("b/1")
    assert retried(results, ["b/1"], "stale offer")
    assert writers(c, foreign.port) == {"other"}


def test_an_offer_whose_store_is_gone_is_stale() -> None:
    """Rule 4: the offered store is gone (its formation was abandoned): ``Retry``."""
    c = three_by_two()
    _plant_offer(c, 4242, "ours")
    results = c.form("b/1")
    assert retried(results, ["b/1"], "connection refused") and results["b/1"].unreachable


def test_an_offer_of_another_torchhook_version_stops_the_follower() -> None:
    """An offer of another wire version (the leader runs another torchhook): the follower
    raises ``WireVersionError`` (a ``ValueError``: the job stops) at once, having written
    nothing; an offer that does not decode at all is not joined (rule 3)."""
    c = three_by_two()
    directory = c.ranks["a/0"].formation.directory
    assert directory is not None
    offer = Offer("new", 4242, "t", Layout((Node("b", 200, 2),)))
    raw = bytearray(base64.b64decode(encode_offer(offer)))
    raw[1] = VERSION + 1
    directory.set(FORMATION_KEY, base64.b64encode(raw).decode())
    results = c.form("b/1")
    assert isinstance(results["b/1"], WireVersionError) and c.world.now == 0
    directory.set(FORMATION_KEY, "garbage")
    results = c.form("b/1")
    assert retried(results, ["b/1"], "timed out waiting for a formation")
    assert writers(c, directory.port) == {"a/0"}


def test_a_node_leaving_the_leaders_view_makes_it_publish_retry() -> None:
    """Rules 7, 8: c's ranks never claim; at 0.3 s the leader's view drops c: it publishes
    ``retry``, so the committed followers end then, not at the timeout."""
    c = three_by_two()
    c.world.at(0.3, lambda: c.see(c.view("a", "b"), "a"))
    results = c.form(*c.but("c"))
    assert "['c'] left the view" in str(results["a/0"])
    assert retried(results, ["a/1", "b/0", "b/1"], "abandoned"), results
    assert 0.3 <= c.world.now <= 0.3 + 2 * POLL_S  # the leader notices at once


def test_a_younger_node_does_not_make_the_leader_abandon_an_older_one_does() -> None:
    """Rule 8: a younger node appearing in the leader's view is no reason to abandon (it
    joins at the next step boundary); an older one is (it leads now)."""
    c = three_by_two()
    c.add_node("d", 1)
    c.add_node("z", 1, registered_ms=1)  # older than a
    c.world.at(0.2, lambda: c.see(c.view("a", "b", "c", "d"), "a"))
    c.world.at(0.4, lambda: c.start("c/0", "c/1"))
    c.start(*c.but("c", "d", "z"))
    results = c.sched.run(c.but("d", "z"))
    assert len(agreements(results)) == 6
    assert assert_one_plan(results).layout.world_size == 6
    c.see(c.view("a", "b", "c"))
    c.world.at(c.world.now + 0.2, lambda: c.see(c.view("z", "a", "b", "c"), "a"))
    results = c.form(*c.but("c", "d", "z"))
    assert "oldest" in str(results["a/0"])
    assert retried(results, ["a/1", "b/0", "b/1"], "abandoned"), results


def test_an_error_plan_reaches_every_rank() -> None:
    """Rule 7: a job no plan can serve (HSDP with uneven nodes) makes every rank raise
    the same ``ValueError``, at once."""

    def hsdp(layout: Layout, infos: list[RankInfo]) -> Plan:
        return decide(layout, infos, backend="gloo", supports_shrinking=False, shards=2)

    c = Cluster([("a", 2), ("b", 2), ("c", 1)], decide=hsdp)
    c.see(c.view("a", "b", "c"))
    results = c.form()
    assert all(isinstance(r, ValueError) for r in results.values()), results
    messages = {str(r) for r in results.values()}
    assert len(results) == 5 and len(messages) == 1
    assert "HSDP needs 2 local ranks" in messages.pop()
    assert c.world.now == 0.0


def test_a_late_joiner_waits_for_the_next_formation() -> None:
    """Rules 3, 8: d registered after the leader's offer (only d sees itself yet): its
    ranks write nothing into the running formation, which completes without them, and
    join the next one, offered once the leader's view lists d."""
    c = three_by_two()
    c.add_node("d", 2)
    c.see(c.view("a", "b", "c", "d"), "d")
    c.start()
    first = assert_one_plan(c.sched.run(c.but("d")))
    assert first.layout.world_size == 6
    assert writers(c, first.store.port) == set(c.but("d"))
    assert {"d/0", "d/1"} <= set(c.sched.pending)
    c.see(c.view("a", "b", "c", "d"))
    c.start(*c.but("d"))
    second = assert_one_plan(c.sched.run())
    assert len(agreements(c.sched.results)) == 8 and second.layout.world_size == 8
    assert {c.sched.results[n].rank for n in ("d/0", "d/1")} == {6, 7}


def test_a_second_process_claiming_a_rank_is_refused_and_the_first_keeps_it() -> None:
    """Rule 5: two processes for b's local rank 1: the second claimant gets ``ValueError``
    and the formation goes on with the first; one process claiming its rank twice (a
    retry on the same offer) is idempotent."""
    c = three_by_two()
    twin = c.add_rank("b", 1, key="b/1-twin")
    results = c.form()
    assert isinstance(results["b/1-twin"], ValueError)
    assert "claimed by another process" in str(results["b/1-twin"])
    assert len(agreements(results)) == 6
    del c.ranks["b/1-twin"]
    c.start()
    b1 = c.ranks["b/1"]
    c.sched.start("b/1-again", b1.formation.steps(c.views["b"], "b", 1, b1.info(), gloo_decide))
    results = c.sched.run()
    assert len(agreements(results)) == 7
    assert results["b/1"].rank == results["b/1-again"].rank == 3
    assert_one_plan({n: r for n, r in results.items() if n != "b/1-again"})
    assert twin.proc.ops > 0


def test_a_rank_that_never_claims_times_the_formation_out() -> None:
    """Rules 8, 9: c/1 never starts: the leader gives up at the formation timeout
    (``Retry``, unreachable) and publishes ``retry``; nobody waits longer."""
    c = three_by_two()
    results = c.form(*c.but("c/1"))
    assert retried(results, ["a/0"], "timed out waiting for every claim")
    assert results["a/0"].unreachable
    # the followers' deadlines are the leader's here: abandoned or timed out, no later
    assert retried(results, c.but("a/0", "c/1"), ""), results
    assert TIMEOUT_S <= c.world.now <= TIMEOUT_S + SLICE_S


def test_a_committed_follower_follows_the_plan_whatever_its_view_says() -> None:
    """Rule 6: a/1 has claimed; its own view then drops a and b (a lagging view): it still
    follows the plan the leader publishes once c has claimed."""
    c = three_by_two()
    c.world.at(0.1, lambda: c.see(c.view("c"), "a/1"))
    c.world.at(0.2, lambda: c.start("c/0", "c/1"))
    c.start(*c.but("c"))
    results = c.sched.run(c.ranks)
    assert len(agreements(results)) == 6, results
    assert_one_plan(results)
    assert c.world.now >= 0.2


def test_a_follower_before_its_claim_leaves_when_the_oldest_node_changes() -> None:
    """Rule 8: b/0 waits for an offer that does not come (the leader has not started);
    when its view's oldest node changes it retries, having written nothing."""
    c = three_by_two()
    c.world.at(0.3, lambda: c.see(c.view("b", "c"), "b"))
    results = c.form("b/0")
    assert retried(results, ["b/0"], "another node is the oldest now")
    assert 0.3 <= c.world.now <= 0.3 + SLICE_S  # at the end of its wait slice


# --- the same steps on real TCPStores -------------------------------------------------------


def test_ranks_agree_on_real_tcp_stores() -> None:
    """``agree`` on torch's TCPStore (rules 1, 9, 10): a leader and three followers as
    threads of this process; the followers wait a slice and more before the leader
    starts."""
    pytest.importorskip("torch", reason="TCPStore needs torch (pip install '.[torch]')")
    names = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    formations: dict[tuple[str, int], Formation] = {}
    for node, lr in names:
        formations[node, lr] = Formation(
            lambda: view,
            local_rank=lr,
            beat=lambda: None,
            timeout_s=10,
            store_host="127.0.0.1",
            op_timeout=timedelta(seconds=10),
        )
    members = tuple(
        JobMember(n, "127.0.0.1", 7946, formations[n, 0].directory_port, 100 * i, "", "alive", 2)
        for i, n in enumerate(("a", "b"), start=1)
    )
    view = View("job", 1, "a,b", members)
    results: dict[tuple[str, int], Any] = {}
    leader_may_start = threading.Event()

    def rank(node: str, lr: int) -> None:
        if (node, lr) == ("a", 0):
            leader_may_start.wait(10)
        try:
            info = RankInfo("", None, 0, False)
            results[node, lr] = formations[node, lr].agree(view, node, lr, info, gloo_decide)
        except Exception as exc:  # reported below
            results[node, lr] = exc

    threads = [threading.Thread(target=rank, args=key) for key in names]
    for t in threads:
        t.start()
    # the followers' first wait slice runs out (the store stays usable) before the offer
    timer = threading.Timer(1.2 * SLICE_S, leader_may_start.set)
    timer.start()
    for t in [*threads, timer]:
        t.join(20)
    assert all(isinstance(r, Agreement) for r in results.values()), results
    plans = {(r.plan, r.token) for r in results.values()}
    assert len(plans) == 1
    assert sorted(r.rank for r in results.values()) == [0, 1, 2, 3]
    assert formations["a", 0].directory is not None
    assert not formations["a", 0].directory.check([FORMATION_KEY])  # withdrawn
    store = results["a", 0].store
    assert decode_plan(store.get(PLAN_KEY)) == results["b", 1].plan
    assert store.check([info_key(3)])


def test_a_chosen_layout_puts_the_leader_at_its_slot_and_leaves_spares_out() -> None:
    """Rule 1 with ``choose`` (torchhook.roster): the leader's layout keeps b and c in the
    slots they held and puts the spare d into lost a's slot 0, so the leader b is rank 2;
    e, outside the layout, writes nothing (rule 3) and is still waiting."""
    from torchhook.roster import roster

    c = Cluster([("a", 2), ("b", 2), ("c", 2), ("d", 2), ("e", 2)])
    prev = Layout.of(c.view("a", "b", "c").members)
    for r in c.ranks.values():
        r.formation.choose = lambda v: roster(prev, v.members, 3).layout
    c.see(c.view("b", "c", "d", "e"))
    names = c.but("a", "e")
    c.start(*names, "e/0", "e/1")
    results = c.sched.run(names)
    agreed = assert_one_plan({n: results[n] for n in names})
    assert [n.name for n in agreed.layout.nodes] == ["d", "b", "c"]
    ranks = {n: a.rank for n, a in agreements(results).items()}
    assert ranks == {"d/0": 0, "d/1": 1, "b/0": 2, "b/1": 3, "c/0": 4, "c/1": 5}
    assert agreed.plan.source == 0 and agreed.plan.restore == "fresh"  # nobody held state
    assert not {"e/0", "e/1"} & writers(c, agreed.store.port)


def test_a_spare_follows_its_drafter_past_a_dead_leader_still_in_its_view() -> None:
    """Rule 12: a's node died; b and c dropped it, the spare d's view still lists it (its
    agent waits for the death verdict). d, drafted by b's offer (torchhook.spares: a's
    directory refused), follows b and forms with b and c in a's slot; when a node older
    than b that d did not pass over appears, d abandons as in rule 8."""
    from torchhook.roster import roster

    c = Cluster([("a", 2), ("b", 2), ("c", 2), ("d", 2)])
    prev = Layout.of(c.view("a", "b", "c").members)
    for r in c.ranks.values():
        r.formation.choose = lambda v: roster(prev, v.members, 3).layout
    c.see(c.view("b", "c", "d"))
    c.see(c.view("a", "b", "c", "d"), "d")
    names = c.but("a")
    c.start(*c.but("a", "d"))
    for name in ("d/0", "d/1"):
        r = c.ranks[name]
        view = c.views["d"]
        steps = r.formation.steps(view, "d", r.local_rank, r.info(), c.decide, "b")
        c.sched.start(name, steps)
    results = c.sched.run(names)
    agreed = assert_one_plan(results)
    assert [n.name for n in agreed.layout.nodes] == ["d", "b", "c"]
    assert {n: a.rank for n, a in agreements(results).items()}["d/0"] == 0

    # before its claim, a member older than b that d did not pass over: d leaves
    c2 = Cluster([("z", 2), ("a", 2), ("b", 2), ("d", 2)])
    c2.see(c2.view("a", "b", "d"))
    c2.world.at(0.3, lambda: c2.see(c2.view("z", "a", "b", "d"), "d"))
    r = c2.ranks["d/0"]
    c2.sched.start("d/0", r.formation.steps(c2.views["d"], "d", 0, r.info(), c2.decide, "b"))
    assert retried(c2.sched.run(["d/0"]), ["d/0"], "another node is the oldest now")
