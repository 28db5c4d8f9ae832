"""``swimctl demo``: a local cluster of real agent processes on loopback.

Starts N agents (each its own process, UDP+TCP port, control socket), waits until they all
see each other, prints the membership table, SIGKILLs one, and prints when each survivor
first saw it suspect and dead. Every process it started is stopped by pid at the end, also
on Ctrl-C or error.

The agents run the ``fast`` profile unless told otherwise (the one the README leads with:
a SIGKILLed agent is dead everywhere in well under a second here); the last lines say how
to run the same demo with memberlist's LAN defaults, for comparison.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError
from agent.procs import free_port, stop, until

__all__ = [
    "LocalAgent",
    "agent_command",
    "free_port",
    "run_demo",
    "start_cluster",
    "wait_converged",
]


def agent_command(
    name: str,
    port: int,
    control: Path,
    profile: str,
    join_port: int | None = None,
    *,
    retry_ms: int = 300,
    host: str = "127.0.0.1",
    join_host: str = "127.0.0.1",
) -> list[str]:
    """``swimctl agent`` on ``host``:``port`` with its own control socket, retrying to join
    ``join_host``:``join_port`` every ``retry_ms`` (the command line every local cluster
    here starts, and the network-namespace testbed with each host's own address)."""
    args = [
        *(sys.executable, "-m", "agent.cli", "--control", str(control), "agent"),
        *("--node", name, "--bind", f"{host}:{port}", "--profile", profile),
    ]
    if join_port is not None:
        args += ["--retry-join", f"{join_host}:{join_port}", "--retry-interval-ms", str(retry_ms)]
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

    def ready(self) -> bool:
        """Whether its control socket answers; raises if the process exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
        try:
            self.client.request("info")
        except ControlError:
            return False
        return True

    def wait_ready(self, timeout_s: float) -> None:
        until(self.ready, timeout_s, f"{self.name} ready")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        stop(self.proc, sig=sig, timeout_s=timeout_s)
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
    """Until every agent sees exactly ``agents`` alive; the seconds that took."""
    names = {a.name for a in agents}

    def converged() -> bool:
        return all(
            {n for n, m in a.members().items() if m["status"] == "alive"} == names for a in agents
        )

    return until(converged, timeout_s, "the cluster converged", ignore=(ControlError,))


def _print_table(agent: LocalAgent) -> None:
    rows = [("Name", "Address", "Status", "Incarnation", "Phi")]
    for name, m in sorted(agent.members().items()):
        phi = "-" if m["phi"] is None else f"{m['phi']:.2f}"
        rows.append((name, f"{m['addr']}:{m['port']}", m["status"], str(m["incarnation"]), phi))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"membership as seen by {agent.name}:")
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _compare_hint(profile: str) -> str:
    """The demo's last line: how to see the other end of the trade-off."""
    if profile == "fast":
        other, what = "lan", "memberlist's LAN defaults: 1 s probes, dead after ~7-10 s"
    else:
        other, what = "fast", "ours for a GPU cluster: dead everywhere in about a second"
    return f"to compare, the {other} profile ({what}):\n  ./dev.sh demo --profile {other}"


def run_demo(n: int = 5, profile: str = "fast") -> int:
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
            stop(victim.proc, sig=signal.SIGKILL)
            seen: dict[str, dict[str, float]] = {a.name: {} for a in survivors}

            def all_dead() -> bool:
                for a in survivors:
                    status = a.members().get(victim.name, {}).get("status", "gone")
                    if status in ("suspect", "dead") and status not in seen[a.name]:
                        seen[a.name][status] = time.monotonic() - killed_at
                        print(
                            f"  t={seen[a.name][status]:6.2f}s  {a.name} sees "
                            f"{victim.name} {status}"
                        )
                return all("dead" in s for s in seen.values())

            with contextlib.suppress(TimeoutError):  # reported below
                until(all_dead, 120, f"{victim.name} dead everywhere")
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
            leaver, observer = survivors[-1].name, survivors[0]
            with contextlib.suppress(TimeoutError):
                until(
                    lambda: observer.members().get(leaver, {}).get("status") == "left",
                    10,
                    f"{leaver} left",
                )
                print(f"  {observer.name} sees it left after {time.monotonic() - left_at:.2f}s")
        finally:
            for a in agents:
                a.stop(signal.SIGKILL)
            print(f"\nstopped {len(agents)} agent processes")
    print(_compare_hint(profile))
    return 0
