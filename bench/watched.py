"""Agents whose log lines are timestamped as they arrive, and their CPU, RSS and UDP counters
(bench/compare_serf.py's measurements, the same for serf and for our agent).

``start(impl, ...)`` runs ``serf agent`` (bench/procs.py's ``serf_command``) or ours
(agent/demo.py's ``agent_command``) with stdout piped to a reader thread, which writes the
log file and records ``PATTERNS`` matches (ready, join, suspect, dead) with
``time.monotonic()`` as each line arrives: serf's own log timestamps have one-second
resolution, so both sides are timed the same way. ``cpu_ticks`` and ``rss_mib`` read
/proc/PID; ``PortCounters`` counts UDP packets and bytes per source port with iptables
(root only; otherwise it reports nothing).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.demo import agent_command
from agent.procs import free_port
from bench.procs import serf_command

__all__ = ["CLK_TCK", "PATTERNS", "PortCounters", "Proc", "cpu_ticks", "rss_mib", "start"]

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")

# What each implementation logs (serf 0.9.4 memberlist/serf lines; our agent's lines).
PATTERNS = {
    "serf": {
        "ready": re.compile(r"()Serf agent running"),
        "join": re.compile(r"EventMemberJoin: (\S+)"),
        "suspect": re.compile(r"memberlist: Suspect (\S+) has failed"),
        "dead": re.compile(r"EventMemberFailed: (\S+)"),
        "raised": re.compile(r"memberlist: Suspect (\S+) has failed"),
        "declared": re.compile(r"memberlist: Marking (\S+) as failed"),
    },
    "swim": {
        "ready": re.compile(r"()control API on"),
        "join": re.compile(r"member (\S+) joined"),
        "suspect": re.compile(r"member (\S+) suspect"),
        "dead": re.compile(r"member (\S+) dead"),
        "alive": re.compile(r"member (\S+) alive"),
        "raised": re.compile(r"suspect (\S+) has failed, no acks"),
        "declared": re.compile(r"marking (\S+) as failed"),
    },
}


@dataclass
class Proc:
    name: str
    port: int
    popen: subprocess.Popen[bytes]
    events: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def seen(self, kind: str, target: str, since: float = -math.inf) -> float | None:
        """When this agent first logged ``kind`` about ``target`` at or after ``since``."""
        with self.lock:
            times = [t for t, k, n in self.events if k == kind and n == target and t >= since]
        return min(times) if times else None

    def first(self, kind: str) -> float | None:
        with self.lock:
            times = [t for t, k, _ in self.events if k == kind]
        return min(times) if times else None

    def joined(self) -> set[str]:
        with self.lock:
            return {n for _, k, n in self.events if k == "join"}


def _reader(proc: Proc, impl: str, log_path: Path) -> None:
    assert proc.popen.stdout is not None
    patterns = PATTERNS[impl]
    with log_path.open("ab") as log:
        for raw in proc.popen.stdout:
            now = time.monotonic()
            log.write(raw)
            line = raw.decode(errors="replace")
            for kind, pattern in patterns.items():
                match = pattern.search(line)
                if match:
                    with proc.lock:
                        proc.events.append((now, kind, match.group(1)))


def start(
    impl: str,
    name: str,
    profile: str,
    join_port: int | None,
    workdir: Path,
    port: int | None = None,
    config: Path | None = None,
) -> Proc:
    """Start one agent on ``port`` (a free one if None); its log is ``workdir/name.log``
    (appended to, so a restart under the same name keeps the earlier lines); ours reads
    ``config`` (a TOML file, agent/config.py) if given."""
    port = free_port() if port is None else port
    if impl == "serf":
        args = serf_command(name, port, f"127.0.0.1:{free_port()}", profile, join_port)
    else:
        control = workdir / f"{name}.sock"
        args = [*agent_command(name, port, control, profile, join_port, retry_ms=500)]
        args += ["--log-level", "info"]
        if config is not None:
            args += ["--config", str(config)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    popen = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env
    )
    proc = Proc(name, port, popen)
    threading.Thread(
        target=_reader, args=(proc, impl, workdir / f"{name}.log"), daemon=True
    ).start()
    return proc


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PortCounters:
    """iptables OUTPUT counters per UDP source port on loopback (root only)."""

    CHAIN = "SWIMBENCH"

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.ok = shutil.which("iptables") is not None and os.geteuid() == 0
        if not self.ok:
            return
        self.close()  # a chain left over from an interrupted run
        try:
            self._ipt("-N", self.CHAIN)
            self._ipt("-I", "OUTPUT", "-o", "lo", "-p", "udp", "-j", self.CHAIN)
            for port in ports:
                self._ipt("-A", self.CHAIN, "-p", "udp", "--sport", str(port))
        except subprocess.CalledProcessError:
            self.close()
            self.ok = False

    def _ipt(self, *args: str) -> str:
        return subprocess.run(
            ["iptables", "-w", *args], check=True, capture_output=True, text=True
        ).stdout

    def read(self) -> dict[int, tuple[int, int]]:
        if not self.ok:
            return {}
        out = self._ipt("-L", self.CHAIN, "-n", "-v", "-x")
        counts: dict[int, tuple[int, int]] = {}
        for line in out.splitlines():
            match = re.search(r"^\s*(\d+)\s+(\d+)\s+.*spt:(\d+)", line)
            if match:
                counts[int(match.group(3))] = (int(match.group(1)), int(match.group(2)))
        return counts

    def close(self) -> None:
        for args in (
            ("-D", "OUTPUT", "-o", "lo", "-p", "udp", "-j", self.CHAIN),
            ("-F", self.CHAIN),
            ("-X", self.CHAIN),
        ):
            subprocess.run(["iptables", "-w", *args], capture_output=True, check=False)
