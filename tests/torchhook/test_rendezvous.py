"""The ``swim`` torchrun rendezvous backend against real agents, real torchrun and real gloo.

In-process handlers (one per agent, the way torchrun holds one) check the round rules:
ranks by join age, one increment per round, departures and joiners counted by
``num_nodes_waiting``, closing seen everywhere, a new leader after the old one's agent
dies. The process tests run three torchrun "nodes" of two workers each
(bench/torchrun_recovery.py's ``Node``: agent + torchrun + workers, signalled as a whole)
and assert on every worker's step log.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from agent.demo import LocalAgent, start_cluster, wait_converged
from agent.procs import until
from bench.torchrun_recovery import (
    Node,
    group_of,
    ranks_of,
    start_nodes,
    wait_group,
    worker_of,
)
from torchhook.client import JobMember, View
from torchhook.rendezvous import (
    Round,
    Settings,
    SwimRendezvousHandler,
    create_handler,
    nodes_waiting,
    ready_to_seal,
)

JOB = "rdzv-test"


def _view(*names: str) -> View:
    members = tuple(JobMember(n, "127.0.0.1", 1, 2, i, "", "alive") for i, n in enumerate(names))
    return View(JOB, 1, "fp", members)


# --- rules, without processes -----------------------------------------------------------


def test_nodes_waiting_counts_joiners_up_to_max_and_every_departure() -> None:
    current = Round(("a", 1), 3, ("a", "b", "c"))
    assert nodes_waiting(_view("a", "b", "c"), None, 3) == 0
    assert nodes_waiting(_view("a", "b", "c"), current, 3) == 0
    assert nodes_waiting(_view("a", "b"), current, 3) == 1  # c died, left or hung
    assert nodes_waiting(_view("a", "b", "c", "d"), current, 3) == 0  # no room for d
    assert nodes_waiting(_view("a", "b", "c", "d"), current, 4) == 1
    assert nodes_waiting(_view("a", "d"), current, 3) == 3  # b, c gone; d fits


def test_a_round_seals_only_when_every_view_member_arrived() -> None:
    assert ready_to_seal(("a", "b"), {"a"}, 2, 3) == (False, False)
    assert ready_to_seal(("a",), {"a"}, 2, 3) == (False, False)  # below min_nodes
    assert ready_to_seal(("a", "b"), {"a", "b"}, 2, 3) == (True, True)  # room: last call
    assert ready_to_seal(("a", "b", "c"), {"a", "b", "c"}, 2, 3) == (True, False)
    assert ready_to_seal(("a", "b"), {"a", "b"}, 2, 2) == (True, False)
    # survivors of a failure seal at once; a newcomer among them brings the last call back
    assert ready_to_seal(("a", "b"), {"a", "b"}, 2, 3, ("a", "b", "c")) == (True, False)
    assert ready_to_seal(("a", "d"), {"a", "d"}, 2, 3, ("a", "b", "c")) == (True, True)
    assert ready_to_seal(("a", "b"), {"a", "b", "d"}, 2, 3, ("a", "b", "c")) == (True, True)


# --- in-process handlers on real agents ---------------------------------------------------


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[LocalAgent]]:
    started = start_cluster(3, tmp_path, "local")
    try:
        wait_converged(started, 30)
        yield started
    finally:
        for a in started:
            a.stop(signal.SIGKILL)


def _handler(agent: LocalAgent, seed: LocalAgent, min_nodes: int = 2) -> SwimRendezvousHandler:
    settings = Settings(join_timeout_s=30, last_call_s=0.3, control=str(agent.control))
    return SwimRendezvousHandler(JOB, f"127.0.0.1:{seed.port}", min_nodes, 3, settings)


def _port(info: RendezvousInfo) -> int:
    assert info.bootstrap_store_info is not None
    return info.bootstrap_store_info.master_port


def _rendezvous(handlers: list[SwimRendezvousHandler]) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=40) for f in futures]


def test_entry_point_is_registered_with_torch(agents: list[LocalAgent]) -> None:
    assert create_handler().__name__ == "_creator"
    params = RendezvousParameters(
        "swim", f"127.0.0.1:{agents[0].port}", JOB, 1, 1, control=str(agents[0].control)
    )
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        assert handler.get_backend() == "swim" and handler.get_run_id() == JOB
        assert not handler.use_agent_store
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()


def test_rounds_follow_the_view(agents: list[LocalAgent]) -> None:
    handlers = [_handler(a, agents[0]) for a in agents]
    try:
        first = _rendezvous(handlers)
        # ranks are join age: the order the handlers registered in
        assert [i.rank for i in first] == [0, 1, 2]
        assert {i.world_size for i in first} == {3}
        assert len({_port(i) for i in first}) == 1  # one worker store, on rank 0
        assert [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]
        numbers = {h._round.number for h in handlers if h._round}

        handlers[2].shutdown()  # unregisters: a departure from the current round
        until(lambda: all(h.num_nodes_waiting() == 1 for h in handlers[:2]), 10, "a departure")
        second = _rendezvous(handlers[:2])
        assert [i.world_size for i in second] == [2, 2]
        assert {h._round.number for h in handlers[:2] if h._round} == {max(numbers) + 1}
        assert _port(first[0]) != _port(second[0])  # a fresh worker store per round

        handlers[2] = _handler(agents[2], agents[0])  # a joiner
        until(lambda: all(h.num_nodes_waiting() == 1 for h in handlers[:2]), 10, "a joiner")
        third = _rendezvous(handlers)
        assert [i.rank for i in third] == [0, 1, 2]
        assert {h._round.number for h in handlers if h._round} == {max(numbers) + 2}
    finally:
        for h in handlers:
            h.shutdown()


def test_closing_is_seen_by_every_node(agents: list[LocalAgent]) -> None:
    handlers = [_handler(a, agents[0]) for a in agents[:2]]
    try:
        _rendezvous(handlers)
        handlers[0].set_closed()
        until(handlers[1].is_closed, 10, "closed everywhere")
        with pytest.raises(RendezvousClosedError):
            handlers[1].next_rendezvous()
    finally:
        for h in handlers:
            h.shutdown()


def test_the_next_oldest_takes_over_when_the_leader_dies(agents: list[LocalAgent]) -> None:
    handlers = [_handler(a, agents[0]) for a in agents]
    try:
        first = _rendezvous(handlers)
        assert first[0].rank == 0
        agents[0].stop(signal.SIGKILL)  # the leader's host: its store stays, its view goes
        until(lambda: all(h.num_nodes_waiting() == 1 for h in handlers[1:]), 20, "leader gone")
        second = _rendezvous(handlers[1:])
        assert [i.rank for i in second] == [0, 1]
        rounds = {h._round for h in handlers[1:]}
        assert len(rounds) == 1
        (only,) = rounds
        assert only is not None and only.leader[0] == agents[1].name and only.number == 0
    finally:
        for h in handlers:
            h.shutdown()


# --- real torchrun nodes ------------------------------------------------------------------

# Real jobs run several workers per node: global ranks must stay contiguous per node, in node
# rank order, through every regrouping.
NPROC = 2


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    started = start_nodes(tmp_path, "swim", "local", 3, job=JOB, nproc_per_node=NPROC)
    try:
        yield started
    finally:
        for n in started:
            n.close()


def _by_name(nodes: list[Node], *names: str) -> list[Node]:
    return [n for n in nodes if n.name in names]


def _join_order(records: list[dict[str, Any]]) -> list[str]:
    """The group's node names by node rank, i.e. join age (rank 0: the rendezvous leader).
    Read off the group rather than assumed from start order: the torchruns start a second
    apart, and which registers first is up to the scheduler."""
    ranks = ranks_of(records)
    return sorted({name for name, _ in ranks}, key=lambda name: ranks[(name, 0)])


def _assert_group(records: list[dict[str, Any]], order: list[str]) -> None:
    """Every worker of ``order``'s nodes trained in this group, node i's local rank j as
    global rank i * NPROC + j, at world NPROC * len(order)."""
    expected = {((name, j), i * NPROC + j) for i, name in enumerate(order) for j in range(NPROC)}
    assert {(worker_of(r), int(r["rank"])) for r in records} == expected
    assert {int(r["world"]) for r in records} == {NPROC * len(order)}


@pytest.mark.slow
def test_torchrun_survives_the_leader_crash_and_regrows(nodes: list[Node], tmp_path: Path) -> None:
    before = wait_group(nodes, {n.name for n in nodes}, 120)
    order = _join_order(before)
    _assert_group(before, order)

    leader, *survivors = order
    fault = time.time()
    _by_name(nodes, leader)[0].signal(signal.SIGKILL)  # rendezvous leader and store host
    after = wait_group(nodes, set(survivors), 60, after=fault)
    assert {group_of(r) for r in before}.isdisjoint(group_of(r) for r in after)
    _assert_group(after, survivors)  # the oldest survivor's workers are ranks 0, 1

    grown = time.time()
    seed = _by_name(nodes, survivors[0])[0].port
    nodes.append(
        Node(
            "node3",
            tmp_path,
            backend="swim",
            job=JOB,
            endpoint=f"127.0.0.1:{seed}",
            nproc_per_node=NPROC,
        )
    )
    regrown = wait_group(nodes, {*survivors, "node3"}, 90, after=grown)
    _assert_group(regrown, [*survivors, "node3"])  # the newest node's workers come last


@pytest.mark.slow
def test_torchrun_drops_a_hung_node(nodes: list[Node]) -> None:
    before = wait_group(nodes, {n.name for n in nodes}, 120)
    order = _join_order(before)
    _assert_group(before, order)

    *rest, youngest = order
    fault = time.time()
    _by_name(nodes, youngest)[0].signal(signal.SIGSTOP)  # hung host: sockets open, all mute
    after = wait_group(nodes, set(rest), 60, after=fault)
    _assert_group(after, rest)
    # membership restarts are not failures: torchrun's restart budget is untouched
    assert {int(r["restart"]) for r in after} == {0}
