"""One scripted scenario against real serf agents on loopback: the agents, tcpdump and the
iptables DSCP rules (``Resources``: every process and rule removed again, also on
failure), and the life cycle (``Scenario.execute``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.procs import stop, until
from serf_golden.config import (
    GID_BASE,
    KEYS,
    NODE_NAMES,
    USER_EVENT_NAME,
    USER_EVENT_PAYLOAD,
)


class CaptureError(RuntimeError):
    """The scripted scenario could not be driven to completion."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    index: int
    gossip_port: int
    rpc_port: int
    gid: int
    tags: dict[str, str]

    @property
    def dscp(self) -> int:
        return self.index + 1

    @property
    def tos(self) -> int:
        return self.dscp << 2

    @property
    def bind(self) -> str:
        return f"127.0.0.1:{self.gossip_port}"

    @property
    def rpc_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def dscp_rule(self) -> list[str]:
        """The mangle/OUTPUT rule that stamps this agent's packets with its DSCP value."""
        owner = ["-m", "owner", "--gid-owner", str(self.gid)]
        return ["-o", "lo", *owner, "-j", "DSCP", "--set-dscp", str(self.dscp)]


def make_nodes(gossip_base: int, rpc_base: int) -> list[NodeSpec]:
    return [
        NodeSpec(
            name=name,
            index=i,
            gossip_port=gossip_base + i,
            rpc_port=rpc_base + i,
            gid=GID_BASE + i,
            tags={"role": f"golden-{name}"},
        )
        for i, name in enumerate(NODE_NAMES)
    ]


class Resources:
    """Tracks every process and iptables rule we create so they can be undone."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()
        self.rules: list[tuple[str, str, list[str]]] = []
        self.log_files: list[Any] = []

    # processes -----------------------------------------------------------------
    def start(
        self, label: str, argv: Sequence[str], log_path: Path, gid: int | None = None
    ) -> subprocess.Popen[bytes]:
        log = log_path.open("wb")
        self.log_files.append(log)
        kwargs: dict[str, Any] = {}
        if gid is not None:
            kwargs["group"] = gid
            kwargs["extra_groups"] = []
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
        )
        self.procs[label] = proc
        return proc

    def send_signal(self, label: str, sig: signal.Signals) -> None:
        proc = self.procs[label]
        if proc.poll() is None:
            os.kill(proc.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(label)
        elif sig == signal.SIGCONT:
            self.stopped.discard(label)

    def stop(self, label: str, sig: signal.Signals = signal.SIGTERM, timeout: float = 10.0) -> None:
        proc = self.procs.get(label)
        if proc is None:
            return
        stop(proc, sig=sig, timeout_s=timeout)  # a SIGSTOPped one is sent SIGCONT too
        self.stopped.discard(label)
        del self.procs[label]

    # iptables ------------------------------------------------------------------
    def add_rule(self, table: str, chain: str, spec: list[str], insert: bool = False) -> None:
        op = "-I" if insert else "-A"
        subprocess.run(
            ["iptables", "-w", "5", "-t", table, op, chain, *spec],
            check=True,
            capture_output=True,
            timeout=15,
        )
        self.rules.append((table, chain, spec))

    def remove_rule(self, table: str, chain: str, spec: list[str]) -> None:
        if (table, chain, spec) in self.rules:
            self.rules.remove((table, chain, spec))
        subprocess.run(
            ["iptables", "-w", "5", "-t", table, "-D", chain, *spec],
            check=False,
            capture_output=True,
            timeout=15,
        )

    # everything ----------------------------------------------------------------
    def close(self) -> None:
        errors: list[str] = []
        for label in list(self.procs):
            try:
                self.stop(label, signal.SIGTERM, timeout=8.0)
            except Exception as exc:  # keep cleaning up
                errors.append(f"{label}: {exc}")
        for table, chain, spec in list(reversed(self.rules)):
            try:
                self.remove_rule(table, chain, spec)
            except Exception as exc:
                errors.append(f"iptables {table} {chain} {spec}: {exc}")
        for log in self.log_files:
            log.close()
        self.log_files.clear()
        if errors:
            print("cleanup problems:\n  " + "\n  ".join(errors), file=sys.stderr)


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def serf_package() -> str:
    """The distribution package that provides serf, if dpkg knows it."""
    if shutil.which("dpkg-query") is None:
        return "unknown"
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Version}", "serf"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return f"Debian package {proc.stdout.strip()}" if proc.returncode == 0 else "unknown"


def port_is_free(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            # like Go's listeners: TIME_WAIT leftovers of an earlier run do not count
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


@dataclass
class ScenarioRun:
    name: str
    encrypted: bool
    pcap: Path
    t0: float
    phases: list[tuple[float, str]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    tcpdump_stats: str = ""
    notes: list[str] = field(default_factory=list)
    key_switch_time: float | None = None


class Scenario:
    def __init__(
        self,
        name: str,
        encrypted: bool,
        nodes: list[NodeSpec],
        serf: str,
        workdir: Path,
        res: Resources,
    ) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.serf = serf
        self.workdir = workdir
        self.res = res
        self.run = ScenarioRun(name, encrypted, workdir / f"{name}.pcap", time.time())

    # -- small utilities ------------------------------------------------------------
    def phase(self, name: str) -> None:
        self.run.phases.append((time.time(), name))
        print(f"[{self.run.name}] +{time.time() - self.run.t0:6.1f}s phase {name}", flush=True)

    def record(self, argv: Sequence[str]) -> None:
        shown = ["serf" if a == self.serf else a for a in argv]
        self.run.commands.append({"t": round(time.time() - self.run.t0, 2), "argv": shown})

    def cli(self, argv: Sequence[str], timeout: float = 20.0, check: bool = True) -> str:
        argv = [self.serf, *argv]
        self.record(argv)
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
        if check and proc.returncode != 0:
            raise CaptureError(f"{' '.join(argv)} failed ({proc.returncode}): {out.strip()}")
        return out

    def log(self, name: str) -> Path:
        return self.workdir / f"{self.run.name}-{name}.log"

    def log_has(self, name: str, pattern: str, after: int = 0) -> bool:
        return re.search(pattern, read_text(self.log(name))[after:]) is not None

    def log_len(self, name: str) -> int:
        return len(read_text(self.log(name)))

    def alive_members(self, name: str) -> int:
        try:
            out = self.cli(
                ["members", f"-rpc-addr={self.nodes[name].rpc_addr}", "-status=alive"],
                timeout=5,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return 0
        return sum(1 for line in out.splitlines() if " alive" in line)

    def agent_argv(self, node: NodeSpec, join: NodeSpec | None) -> list[str]:
        argv = [
            self.serf,
            "agent",
            f"-node={node.name}",
            f"-bind={node.bind}",
            f"-rpc-addr={node.rpc_addr}",
            "-profile=local",
            "-log-level=debug",
        ]
        argv += [f"-tag={k}={v}" for k, v in node.tags.items()]
        if join is not None:
            argv.append(f"-join={join.bind}")
        if self.run.encrypted:
            argv.append(f"-encrypt={KEYS['k1']}")
        return argv

    def start_agent(self, name: str, join: str | None) -> None:
        node = self.nodes[name]
        argv = self.agent_argv(node, self.nodes[join] if join else None)
        self.record(argv)
        self.res.start(f"serf-{name}", argv, self.log(name), gid=node.gid)
        until(lambda: self.log_has(name, r"Serf agent running!"), 20, f"agent {name} to start")

    # -- the scripted life cycle ----------------------------------------------------
    def execute(self) -> ScenarioRun:
        ports = " or ".join(f"port {n.gossip_port}" for n in self.nodes.values())
        bpf = f"(udp or tcp) and ({ports})"
        td_log = self.workdir / f"{self.run.name}-tcpdump.log"
        td_argv = ["tcpdump", "-i", "lo", "-n", "-U", "-s", "0", "-w", str(self.run.pcap), bpf]
        self.run.commands.append({"t": 0.0, "argv": [*td_argv[:-2], f"{self.run.name}.pcap", bpf]})
        self.res.start("tcpdump", td_argv, td_log)
        until(lambda: "listening on" in read_text(td_log), 15, "tcpdump to listen")

        for node in self.nodes.values():
            spec = node.dscp_rule
            self.res.add_rule("mangle", "OUTPUT", spec)
            self.run.commands.append(
                {
                    "t": round(time.time() - self.run.t0, 2),
                    "argv": ["iptables", "-t", "mangle", "-A", "OUTPUT", *spec],
                }
            )
        a, b, c = (self.nodes[n] for n in NODE_NAMES)

        self.phase("join")
        self.start_agent("a", None)
        self.start_agent("b", "a")
        self.start_agent("c", "a")
        until(
            lambda: self.alive_members("a") == 3 and self.alive_members("c") == 3,
            30,
            "all three members alive",
        )

        self.phase("steady")
        time.sleep(3)

        self.phase("user-event")
        self.cli(["event", f"-rpc-addr={b.rpc_addr}", USER_EVENT_NAME, USER_EVENT_PAYLOAD])
        until(lambda: self.log_has("c", re.escape(USER_EVENT_NAME)), 15, "user event to reach c")
        time.sleep(2)

        if self.run.encrypted:
            self.phase("key-install")
            self.cli(["keys", f"-rpc-addr={a.rpc_addr}", f"-install={KEYS['k2']}"])
            time.sleep(2)
            self.phase("key-use")
            self.cli(["keys", f"-rpc-addr={a.rpc_addr}", f"-use={KEYS['k2']}"])
            self.run.key_switch_time = time.time()
            time.sleep(2)

        # At least one periodic (non-join) push/pull: memberlist waits a random
        # stagger below the interval (15 s in the local profile), then one interval,
        # so every agent starts its first one 15-30 s after it started.
        self.phase("await-periodic-pushpull")

        def pushpulls() -> int:
            return sum(
                read_text(self.log(n)).count("Initiating push/pull sync") for n in NODE_NAMES
            )

        until(lambda: pushpulls() >= 3, 40, "a periodic push/pull")

        self.phase("udp-blackhole-c")
        spec = ["-i", "lo", "-p", "udp", "--dport", str(c.gossip_port), "-j", "DROP"]
        self.res.add_rule("filter", "INPUT", spec, insert=True)
        self.record(["iptables", "-I", "INPUT", *spec])
        try:
            offs = {n: self.log_len(n) for n in ("a", "b")}
            try:
                until(
                    lambda: any(
                        self.log_has(n, r"Was able to connect to c", offs[n]) for n in ("a", "b")
                    ),
                    20,
                    "a TCP fallback ping to c",
                )
            except TimeoutError as exc:
                self.run.notes.append(f"udp-blackhole-c: {exc}")
            time.sleep(2)
        finally:
            self.res.remove_rule("filter", "INPUT", spec)
            self.record(["iptables", "-D", "INPUT", *spec])

        self.phase("recover")
        until(lambda: self.alive_members("a") == 3, 30, "c alive again after blackhole")
        time.sleep(3)

        self.phase("sigstop-c")
        off_a = self.log_len("a")
        self.res.send_signal("serf-c", signal.SIGSTOP)
        self.record(["kill", "-STOP", "<pid of c>"])
        until(
            lambda: self.log_has("a", r"EventMemberFailed: c ", off_a), 60, "a to declare c failed"
        )
        time.sleep(1.5)

        self.phase("sigcont-c")
        off_a = self.log_len("a")
        self.res.send_signal("serf-c", signal.SIGCONT)
        self.record(["kill", "-CONT", "<pid of c>"])
        until(
            lambda: self.log_has("a", r"EventMemberJoin: c ", off_a),
            45,
            "c to refute and be alive again",
        )
        time.sleep(3)

        self.phase("leave-c")
        off_a = self.log_len("a")
        self.cli(["leave", f"-rpc-addr={c.rpc_addr}"], timeout=30)
        until(lambda: self.log_has("a", r"EventMemberLeave: c ", off_a), 20, "a to see c leave")
        proc_c = self.res.procs["serf-c"]
        try:
            proc_c.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.run.notes.append("c did not exit by itself after leave; terminated")
        self.res.stop("serf-c")
        time.sleep(3)

        self.phase("shutdown")
        for name in ("b", "a"):
            self.res.stop(f"serf-{name}")
        self.res.stop("tcpdump", signal.SIGINT, timeout=10)
        for node in self.nodes.values():
            self.res.remove_rule("mangle", "OUTPUT", node.dscp_rule)
        self.run.tcpdump_stats = " / ".join(
            line.strip() for line in read_text(td_log).splitlines() if "packets" in line
        )
        return self.run
