"""``swimctl demo``: a local cluster of real agent processes on loopback.

Starts N agents (each its own process, UDP+TCP port, control socket), waits until they all
see each other, prints the membership table, SIGKILLs one, and prints when each survivor
first saw it suspect and dead. Every process it started is stopped by pid at the end, also
on Ctrl-C or error.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError

POLL_S = 0.05


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1, outside the kernel's ephemeral range.

    A port drawn from the ephemeral range can be taken by any outgoing connection between
    this check and the agent's bind (serf's RPC listener lost such a race in a benchmark),
    so draw below it, and never hand the same port out twice in one process.
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, max(low, 10001))
        if port in _HANDED_OUT:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                tcp.bind(("127.0.0.1", port))
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port found")


def agent_command(
    name: str,
    port: int,
    control: Path,
    profile: str,
    join_port: int | None = None,
    *,
    retry_ms: int = 300,
) -> list[str]:
    """``swimctl agent`` on 127.0.0.1:``port`` with its own control socket, retrying to join
    ``join_port`` every ``retry_ms`` (the command line every local cluster here starts)."""
    args = [
        *(sys.executable, "-m", "agent.cli", "--control", str(control), "agent"),
        *("--node", name, "--bind", f"127.0.0.1:{port}", "--profile", profile),
    ]
    if join_port is not None:
        args += ["--retry-join", f"127.0.0.1:{join_port}", "--retry-interval-ms", str(retry_ms)]
    return args


class LocalAgent:
    """One agent process with its own port and control socket."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        profile: str,
        join: int | None,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.control = workdir / f"{name}.sock"
        self.log_path = workdir / f"{name}.log"
        args = agent_command(name, self.port, self.control, profile, join, retry_ms=500)
        args += ["--log-level", "info"]
        args += extra or []
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, **(env or {})},
        )
        self.client = ControlClient(self.control, timeout_s=5)

    def members(self) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.client.request("members")}

    def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
            try:
                self.client.request("info")
                return
            except ControlError:
                time.sleep(POLL_S)
        raise RuntimeError(f"{self.name} did not start within {timeout_s}s")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def start_cluster(
    n: int, workdir: Path, profile: str = "local", extra: list[str] | None = None
) -> list[LocalAgent]:
    agents: list[LocalAgent] = []
    try:
        first = LocalAgent("agent-0", workdir, profile, None, extra)
        agents.append(first)
        first.wait_ready(20)
        for i in range(1, n):
            agents.append(LocalAgent(f"agent-{i}", workdir, profile, first.port, extra))
        for a in agents:
            a.wait_ready(20)
    except BaseException:
        for a in agents:
            a.stop(signal.SIGKILL)
        raise
    return agents


def wait_converged(agents: list[LocalAgent], timeout_s: float) -> float:
    names = {a.name for a in agents}
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if all(
                {n for n, m in a.members().items() if m["status"] == "alive"} == names
                for a in agents
            ):
                return time.monotonic() - start
        except ControlError:
            pass
        time.sleep(POLL_S)
    raise RuntimeError(f"cluster did not converge within {timeout_s}s")


def _print_table(agent: LocalAgent) -> None:
    rows = [("Name", "Address", "Status", "Incarnation", "Phi")]
    for name, m in sorted(agent.members().items()):
        phi = "-" if m["phi"] is None else f"{m['phi']:.2f}"
        rows.append((name, f"{m['addr']}:{m['port']}", m["status"], str(m["incarnation"]), phi))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"membership as seen by {agent.name}:")
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def run_demo(n: int = 5, profile: str = "local") -> int:
    if n < 3:
        print("Error: the demo needs at least 3 agents", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="swim-demo-") as tmp:
        print(f"== starting {n} agents on 127.0.0.1 (profile {profile}, logs in {tmp})")
        agents = start_cluster(n, Path(tmp), profile)
        try:
            took = wait_converged(agents, 30)
            print(f"all {n} agents see each other alive after {took:.2f}s\n")
            _print_table(agents[0])
            victim, survivors = agents[-1], agents[:-1]
            print(f"\n== SIGKILL {victim.name} (pid {victim.proc.pid})")
            killed_at = time.monotonic()
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(5)
            seen: dict[str, dict[str, float]] = {a.name: {} for a in survivors}
            while time.monotonic() - killed_at < 120:
                for a in survivors:
                    status = a.members().get(victim.name, {}).get("status", "gone")
                    if status in ("suspect", "dead") and status not in seen[a.name]:
                        seen[a.name][status] = time.monotonic() - killed_at
                        print(
                            f"  t={seen[a.name][status]:6.2f}s  {a.name} sees "
                            f"{victim.name} {status}"
                        )
                if all("dead" in s for s in seen.values()):
                    break
                time.sleep(POLL_S)
            deads = [s["dead"] for s in seen.values() if "dead" in s]
            if len(deads) == len(survivors):
                print(
                    f"\nevery survivor declared {victim.name} dead: first after "
                    f"{min(deads):.2f}s, last after {max(deads):.2f}s\n"
                )
            else:
                print(f"\nonly {len(deads)} of {len(survivors)} survivors saw it dead\n")
            _print_table(survivors[0])
            print(f"\n== graceful leave of {survivors[-1].name} (SIGTERM)")
            left_at = time.monotonic()
            survivors[-1].stop(signal.SIGTERM)
            while time.monotonic() - left_at < 10:
                if survivors[0].members().get(survivors[-1].name, {}).get("status") == "left":
                    print(
                        f"  {survivors[0].name} sees it left after "
                        f"{time.monotonic() - left_at:.2f}s"
                    )
                    break
                time.sleep(POLL_S)
            return 0
        finally:
            for a in agents:
                a.stop(signal.SIGKILL)
            print(f"\nstopped {len(agents)} agent processes")
