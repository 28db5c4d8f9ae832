"""Training "nodes" on one host, for the torch demo, the tests and the benchmarks.

A node is one real agent process and ``ranks`` real trainer processes (one per local rank,
started with ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` as torchrun would), all in one process
group led by the agent, so a node can be killed or stopped as a whole (a dead or hung
host), or one trainer alone (a hung GPU worker on a live host). Every trainer is bounded
by ``timeout -s KILL``; ``stop`` kills the process group and reaps every process by pid
(agent/procs.py's ``stop``).

A node runs on loopback by default. A ``Placement`` puts it elsewhere: a command prefix for
every process (``ip netns exec NS``: a network namespace of its own, as
tests/netns/training.py sets up), the address its agent binds and advertises (the address
the other nodes' TCPStore and gloo traffic goes to), and extra environment for its trainers
(``GLOO_SOCKET_IFNAME``: gloo binds the address of the host name otherwise, loopback here).

Trainers write one JSON line per step to their own log (``steps_path(local_rank)``); the
helpers read them back. torch is never imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError
from agent.demo import agent_command
from agent.procs import Proc, free_port, stop, until

__all__ = [
    "LOOPBACK",
    "ROOT",
    "Launch",
    "Placement",
    "Proc",
    "TrainingNode",
    "reference_curves",
    "reference_losses",
    "start_nodes",
]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a node's processes run (module docstring): ``wrap`` prefixes every command,
    ``host`` is the address its agent binds (and the others join it at), ``env`` is added
    to its trainers' environment."""

    wrap: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=dict)


LOOPBACK = Placement()


Launch = Callable[[Sequence[str], Mapping[str, str], Path, int, Path], Proc]
"""Another way to start a node's command: (command, environment, log, process group or 0
for a new one it leads, working directory) to the started process (bench/forkserver.py)."""


class TrainingNode:
    def __init__(
        self,
        name: str,
        workdir: Path,
        join_port: int | None,
        profile: str = "local",
        ranks: int = 1,
        *,
        place: Placement = LOOPBACK,
        join_host: str = "127.0.0.1",
        agent_args: tuple[str, ...] = (),
        launch: Launch | None = None,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.ranks = ranks
        self.place = place
        self.host = place.host
        self.port = free_port()  # free on loopback; a namespace of its own has every port
        self.control = workdir / f"{name}.sock"
        self.agent_log = workdir / f"{name}.agent.log"
        args = agent_command(
            name, self.port, self.control, profile, join_port, host=place.host, join_host=join_host
        ) + list(agent_args)
        self.agent: Proc
        if launch is not None:  # process group 0: one of its own, as process_group=0
            self.agent = launch([*place.wrap, *args], dict(os.environ), self.agent_log, 0, ROOT)
        else:
            with self.agent_log.open("wb") as out:
                self.agent = subprocess.Popen(
                    [*place.wrap, *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    process_group=0,
                )
        self.pgid = self.agent.pid
        self.trainers: list[Proc] = []

    def ready(self) -> bool:
        if self.agent.poll() is not None:
            raise RuntimeError(f"agent {self.name} exited with {self.agent.returncode}")
        try:
            ControlClient(self.control, timeout_s=2).request("info")
            return True
        except ControlError:
            return False

    def wait_ready(self, timeout_s: float = 20) -> None:
        until(self.ready, timeout_s, f"agent {self.name} ready")

    def steps_path(self, local_rank: int = 0) -> Path:
        suffix = "" if self.ranks == 1 else f".r{local_rank}"
        return self.workdir / f"{self.name}{suffix}.steps.jsonl"

    def trainer_log(self, local_rank: int = 0) -> Path:
        suffix = "" if self.ranks == 1 else f".r{local_rank}"
        return self.workdir / f"{self.name}{suffix}.trainer.log"

    def start_trainers(
        self, script: str | Path, *args: str, timeout_s: float = 240, launch: Launch | None = None
    ) -> None:
        """One process per local rank, each with ``--control``, ``--log`` and ``args``;
        ``launch`` starts each command its own way instead of ``subprocess.Popen``."""
        for local_rank in range(self.ranks):
            # --foreground: stay in the node's process group (timeout makes its own otherwise)
            cmd = [
                *self.place.wrap,
                *("timeout", "--foreground", "-s", "KILL", str(timeout_s)),
                *(sys.executable, str(script), "--control", str(self.control)),
                *("--log", str(self.steps_path(local_rank)), *args),
            ]
            env = {
                **os.environ,
                **self.place.env,
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(self.ranks),
            }
            if launch is not None:
                self.trainers.append(
                    launch(cmd, env, self.trainer_log(local_rank), self.pgid, ROOT)
                )
                continue
            with self.trainer_log(local_rank).open("ab") as out:
                self.trainers.append(
                    subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                        process_group=self.pgid,
                        env=env,
                    )
                )

    def records(self, local_rank: int = 0) -> list[dict[str, Any]]:
        path = self.steps_path(local_rank)
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a torn last line
                out.append(json.loads(line))
        return out

    def all_records(self) -> list[dict[str, Any]]:
        return [r for lr in range(self.ranks) for r in self.records(lr)]

    def steps(self, local_rank: int = 0) -> list[dict[str, Any]]:
        return [r for r in self.records(local_rank) if "loss" in r]

    def training_at(self, world: int, steps: int = 3) -> bool:
        """Each local rank ran its last ``steps`` steps at world size ``world``."""
        for local_rank in range(self.ranks):
            recent = self.steps(local_rank)[-steps:]
            if len(recent) < steps or any(r["world"] != world for r in recent):
                return False
        return True

    def finals(self) -> list[dict[str, Any] | None]:
        """Each local rank's final record (None where it has none yet)."""
        return [
            next((r for r in self.records(lr) if r.get("final")), None) for lr in range(self.ranks)
        ]

    def trainer_pid(self, local_rank: int = 0) -> int:
        """The trainer itself (not its ``timeout`` wrapper), from its step log."""
        return int(self.steps(local_rank)[-1]["pid"])

    def trainers_done(self) -> bool:
        return all(t.poll() is not None for t in self.trainers)

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {self.trainer_log(lr).name}\n{self.trainer_log(lr).read_text()[-chars:]}"
            for lr in range(self.ranks)
            if self.trainer_log(lr).exists()
        )

    def signal_all(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def stop(self) -> None:
        """SIGKILL the whole node (a stopped process dies of SIGKILL too) and reap it."""
        stop(self.agent, sig=signal.SIGKILL, group=True)  # the agent leads the node's group
        stop(*self.trainers, sig=signal.SIGKILL)  # gone with the group: reaped here


def reference_losses(script: str | Path, steps: int, seed: int) -> list[float]:
    """The failure-free loss curve of an example trainer (its ``--reference``: the same
    training in one process on the whole batch), for comparing a run's losses against."""
    losses: list[float] = json.loads(_reference_run(script, steps, "--seed", str(seed)))
    return losses


def reference_curves(script: str | Path, steps: int, seeds: list[int]) -> list[list[float]]:
    """``reference_losses`` for several seeds in one process (one torch import)."""
    joined = ",".join(str(s) for s in seeds)
    curves: list[list[float]] = json.loads(
        _reference_run(script, steps, "--reference-seeds", joined)
    )
    return curves


def _reference_run(script: str | Path, steps: int, *extra: str) -> str:
    out = subprocess.run(
        [sys.executable, str(script), "--reference", "--steps", str(steps), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )
    return out.stdout


def start_nodes(
    names: list[str],
    workdir: Path,
    profile: str = "local",
    ranks: int = 1,
    places: list[Placement] | None = None,
    agent_args: tuple[str, ...] = (),
) -> list[TrainingNode]:
    """Agents of ``names`` (each at its ``places`` entry, loopback by default, with
    ``agent_args`` added to its command line), the later ones joining the first; all
    ready, or all stopped."""
    where = places or [LOOPBACK] * len(names)
    if len(where) != len(names):
        raise ValueError(f"{len(names)} names but {len(where)} places")
    nodes: list[TrainingNode] = []
    try:
        first = TrainingNode(
            names[0], workdir, None, profile, ranks, place=where[0], agent_args=agent_args
        )
        nodes.append(first)
        first.wait_ready()
        nodes += [
            TrainingNode(
                n,
                workdir,
                first.port,
                profile,
                ranks,
                place=p,
                join_host=first.host,
                agent_args=agent_args,
            )
            for n, p in zip(names[1:], where[1:], strict=True)
        ]
        for node in nodes:
            node.wait_ready()
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes
