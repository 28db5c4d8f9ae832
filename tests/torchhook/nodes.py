"""Test nodes for the torch hook: one real agent process and one real trainer process per
"node", in their own process group, so a node can be killed or stopped as a whole (a dead
or hung host) or only its trainer (a hung GPU worker on a live host). Every process is
bounded in time and reaped by process group in ``stop``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError
from agent.demo import agent_command, free_port

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.05


class Node:
    def __init__(
        self, name: str, workdir: Path, join_port: int | None, profile: str = "local"
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.port = free_port()
        self.control = workdir / f"{name}.sock"
        self.agent_log = workdir / f"{name}.agent.log"
        self.trainer_log = workdir / f"{name}.trainer.log"
        self.steps_path = workdir / f"{name}.steps.jsonl"
        args = agent_command(name, self.port, self.control, profile, join_port)
        with self.agent_log.open("wb") as out:
            self.agent = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, process_group=0
            )
        self.pgid = self.agent.pid
        self.trainer: subprocess.Popen[bytes] | None = None

    def wait_ready(self, timeout_s: float = 20) -> None:
        until(lambda: _answers(self.control), timeout_s, f"agent {self.name} ready")

    def start_trainer(self, script: str, *args: str, timeout_s: float = 240) -> None:
        # --foreground: stay in the node's process group (timeout makes its own otherwise)
        cmd = ["timeout", "--foreground", "-s", "KILL", str(timeout_s), sys.executable, script]
        cmd += ["--control", str(self.control), "--log", str(self.steps_path), *args]
        with self.trainer_log.open("ab") as out:
            self.trainer = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, process_group=self.pgid
            )

    def records(self) -> list[dict[str, Any]]:
        if not self.steps_path.exists():
            return []
        return [json.loads(line) for line in self.steps_path.read_text().splitlines() if line]

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if "loss" in r]

    def final(self) -> dict[str, Any] | None:
        return next((r for r in self.records() if r.get("final")), None)

    def signal_all(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def stop(self) -> None:
        self.signal_all(signal.SIGCONT)
        self.signal_all(signal.SIGKILL)
        for proc in (self.trainer, self.agent):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)


def _answers(control: Path) -> bool:
    try:
        ControlClient(control, timeout_s=2).request("info")
        return True
    except ControlError:
        return False


def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(POLL_S)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def start_nodes(names: list[str], workdir: Path, profile: str = "local") -> list[Node]:
    nodes: list[Node] = []
    try:
        first = Node(names[0], workdir, None, profile)
        nodes.append(first)
        first.wait_ready()
        nodes += [Node(n, workdir, first.port, profile) for n in names[1:]]
        for node in nodes:
            node.wait_ready()
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes
