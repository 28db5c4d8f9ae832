"""Training clusters that a benchmark kills and restarts node by node (bench/step_efficiency.py).

Three nodes × ``ranks`` in slots (their first names). ``Cluster`` holds what every kind
shares: the live node of each slot and every node ever started (so every incarnation's step
records stay readable), a kill (the node's processes SIGKILLed and reaped, by pid), a work
directory per restart, and ``close`` (every node stopped). A kind says how its nodes start,
stop and log:

- ``InProcess``: agent/training_nodes.py's ``TrainingNode`` (an agent + elastic DDP trainers
  in one process group).
- ``Torchrun``: bench/torchrun_recovery.py's ``Node`` (torchrun with the ``c10d`` or
  ``swim`` rendezvous, plus an agent for swim).

``restart_as``: how a restarted node comes back: ``same-address`` (its name and its agent's
address, as a rebooted host would), ``new-address`` (its name on a new port), ``new-name``.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar
from unittest import mock

from agent import training_nodes
from agent.procs import free_port
from agent.training_nodes import TrainingNode, start_nodes
from bench import torchrun_recovery
from bench.torchrun_recovery import worker_of

__all__ = ["SCRIPT", "Cluster", "InProcess", "Record", "Torchrun", "agent_port"]

SCRIPT = "examples/elastic_ddp.py"
Record = dict[str, Any]


class _Node(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def port(self) -> int: ...


N = TypeVar("N", bound=_Node)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Cluster(Generic[N]):
    """Nodes in slots, each killable and restartable (see the module docstring)."""

    victims: list[str]  # slots, in the order they are killed

    def __init__(self, work: Path, ranks: int, restart_as: str) -> None:
        self.work = work
        self.ranks = ranks
        self.full_world = 3 * ranks
        self.restart_as = restart_as
        self.port_fallbacks = 0
        self.all: list[N] = []
        self.live: dict[str, N] = {}

    # --- what a kind provides -------------------------------------------------------------

    def _stop(self, node: N) -> None:
        """SIGKILL every process of ``node`` and reap it."""
        raise NotImplementedError

    def _node_records(self, nodes: list[N]) -> list[Record]:
        """The step records of ``nodes``."""
        raise NotImplementedError

    def restart(self, slot: str, incarnation: int) -> None:
        raise NotImplementedError

    def generation(self, record: Record) -> object:
        """What changes for a worker when it trains in a new group."""
        raise NotImplementedError

    # --- shared ---------------------------------------------------------------------------

    def _add(self, slot: str, node: N) -> N:
        self.all.append(node)
        self.live[slot] = node
        return node

    def _restart_dir(self, slot: str, incarnation: int) -> Path:
        work = self.work / f"{slot}.{incarnation}"
        work.mkdir()
        return work

    def _restart_port(self, slot: str) -> int | None:
        """The port a restarted node's agent binds: its old one (``same-address``) or new."""
        return self.live[slot].port if self.restart_as == "same-address" else None

    def name_for(self, slot: str, incarnation: int) -> str:
        return f"{slot}r{incarnation}" if self.restart_as == "new-name" else slot

    def kill(self, slot: str) -> str:
        """SIGKILL the node in ``slot`` (all its processes, reaped); returns its name."""
        node = self.live[slot]
        self._stop(node)
        return node.name

    def close(self) -> None:
        for node in self.all:
            self._stop(node)

    def live_records(self) -> list[list[Record]]:
        """Each live node's step records."""
        return [self._node_records([n]) for n in self.live.values()]

    def records(self) -> list[Record]:
        """Every step record of every node ever started."""
        return self._node_records(self.all)

    def at_full(self, after: float) -> bool:
        """Every worker of every live node has logged a step after ``after``, and its latest
        step was at the full world."""
        for recs in self.live_records():
            last: dict[tuple[str, int], Record] = {}
            for r in recs:
                last[worker_of(r)] = r
            fresh = [r for r in last.values() if r["t"] > after]
            if len(fresh) < self.ranks or any(r["world"] != self.full_world for r in fresh):
                return False
        return True


class InProcess(Cluster[TrainingNode]):
    def __init__(
        self,
        work: Path,
        profile: str,
        ranks: int,
        step_sleep: float,
        run_s: float,
        restart_as: str,
    ) -> None:
        super().__init__(work, ranks, restart_as)
        self.profile = profile
        self.deadline = time.monotonic() + run_s
        self.args = (
            *("--job", "eff", "--steps", "100000000", "--step-sleep", str(step_sleep)),
            *("--pg-timeout", "60", "--min-nodes", "2"),
        )
        for node in start_nodes(["n0", "n1", "n2"], work, profile, ranks):
            self._add(node.name, node)
        self.victims = ["n2", "n1", "n0"]
        try:
            for node in self.all:
                self._start(node)
        except BaseException:
            self.close()
            raise

    def _start(self, node: TrainingNode) -> None:
        left = max(self.deadline - time.monotonic(), 60)
        node.start_trainers(SCRIPT, *self.args, timeout_s=left + 120)

    def _stop(self, node: TrainingNode) -> None:
        node.stop()  # SIGKILL of the node's process group (agent + trainers), reaped

    def _node_records(self, nodes: list[TrainingNode]) -> list[Record]:
        return [r for n in nodes for r in n.all_records() if "loss" in r]

    def restart(self, slot: str, incarnation: int) -> None:
        work = self._restart_dir(slot, incarnation)
        seed = next(n for other, n in self.live.items() if other != slot)
        name = self.name_for(slot, incarnation)
        port = self._restart_port(slot)
        with agent_port(port):
            node = self._add(slot, TrainingNode(name, work, seed.port, self.profile, self.ranks))
        try:
            node.wait_ready()
        except RuntimeError:  # the old port was not free after all: a new one
            if port is None:
                raise
            say(f"   {name}: its agent could not bind port {port} again; a new port")
            self.port_fallbacks += 1
            node.stop()
            (work / "again").mkdir()
            node = TrainingNode(name, work / "again", seed.port, self.profile, self.ranks)
            self._add(slot, node)
            node.wait_ready()
        self._start(node)

    def generation(self, record: Record) -> object:
        return record["formations"]


@contextlib.contextmanager
def agent_port(port: int | None) -> Iterator[None]:
    """TrainingNode binds its agent to ``free_port()``: make that ``port`` for a while."""
    if port is None:
        yield
        return
    with mock.patch.object(training_nodes, "free_port", lambda: port):
        yield


class Torchrun(Cluster[torchrun_recovery.Node]):
    def __init__(
        self,
        work: Path,
        backend: torchrun_recovery.Backend,
        profile: str,
        ranks: int,
        restart_as: str,
    ):
        super().__init__(work, ranks, restart_as)
        self.backend = backend
        self.profile = profile
        self.seed = free_port()
        self.victims = ["node2", "node1"]  # node0 hosts the c10d store / the swim endpoint
        try:
            for i in range(3):
                slot = f"node{i}"
                self._node(slot, slot, work, self.seed if i == 0 else None)
        except BaseException:
            self.close()
            raise

    def _node(self, slot: str, name: str, work: Path, agent_port: int | None) -> None:
        c10d = self.backend == "c10d"
        node = torchrun_recovery.Node(
            name,
            work,
            backend=self.backend,
            job="eff",
            endpoint=f"127.0.0.1:{self.seed}",
            profile=self.profile,
            nproc_per_node=self.ranks,
            max_restarts=1000,
            agent_port=None if c10d else agent_port,
            rdzv_conf=f"is_host={int(slot == 'node0')}" if c10d else "",
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if c10d else None,
        )
        self._add(slot, node)

    def _stop(self, node: torchrun_recovery.Node) -> None:
        node.signal(signal.SIGKILL)  # at once, then close reaps
        node.close()

    def _node_records(self, nodes: list[torchrun_recovery.Node]) -> list[Record]:
        return torchrun_recovery.read_steps(nodes)

    def restart(self, slot: str, incarnation: int) -> None:
        work = self._restart_dir(slot, incarnation)
        port = self._restart_port(slot)
        self._node(slot, self.name_for(slot, incarnation), work, port)

    def generation(self, record: Record) -> object:
        return record["group"]
