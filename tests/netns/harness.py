"""Agents on separate network hosts: one Linux network namespace per agent, faults by iptables.

Topology of one ``Testbed`` (``uid``: 6 random hex digits, ``x``: a random third octet)::

    namespace swimtest-<uid>-br      bridge br0, one port v<i> per host
    namespace swimtest-<uid>-<i>     lo up, eth0 = 10.77.<x>.<i>/24 (the peer of v<i>),
                                     one agent bound to 10.77.<x>.<i>:7946, named n<i>

The bridge lives in its own namespace, so nothing touches the root namespace's links or
firewall (a bridge there would meet the host's FORWARD policy through br_netfilter). Agents
run as ``ip netns exec NS <python> -m agent.cli agent ...`` (``ip netns exec`` execs, so the
pid we hold is the agent's); their control sockets are files in a short temp dir, reachable
from the root namespace (Unix sockets are filesystem objects, not network ones).

A host may run a real ``serf agent`` instead (``start_serf``: bound to the host's address,
its RPC on the namespace's own loopback, its log lines stamped with ``time.time()`` as they
arrive; ``serf_events`` parses them into the same ``MemberEvent`` kinds), for side-by-side
measurements such as bench/loss_windows.py.

Faults are iptables rules in the receiving host's namespace (filter table, INPUT; OUTPUT too
for UDP blocking), so a fault never outlives its namespace:

- ``host_loss(p)``: every packet arriving at a host is dropped with probability p
  (``-m statistic --mode random``), so each one-way datagram is lost with p and a
  ping+ack round trip with 1-(1-p)².
- ``link_loss(a, b, p)``: the same on one link (both directions unless ``both=False``).
- ``block(src, dst)``: everything from src to dst dropped (one direction: asymmetric).
- ``partition(side_a, side_b, asymmetric=False)``: block between every pair across.
- ``block_udp(i)``: UDP in and out of host i dropped, TCP untouched.
- ``heal()``: flush the rules.

Latency is NFQUEUE in the sending host's namespace (mangle table, OUTPUT), so it too dies
with its namespace: ``delay(group_a, group_b, mean_ms, jitter_ms)`` holds every packet (UDP,
TCP, anything IP) from a host of one group to a host of the other for mean ± jitter ms,
drawn per packet by a userspace delayer process in the sender's namespace
(``tests/netns/delayer.py``: why NFQUEUE and not netem, its bounds, and why it fails open).
``undelay()`` removes the rules, then stops the delayers (which accept what they hold) and
keeps their stats in ``delayer_stats``. ``heal()`` leaves delays in place.

``close()`` (also the context manager's exit, an atexit hook, and the fixture's finalizer)
SIGKILLs every agent by pid, then any other pid still in one of its namespaces
(``ip netns pids``), deletes the namespaces (which removes the veths, the bridge and every
rule) and the socket dir, and raises if a namespace is still listed.

Command line, to bring up agents by hand for debugging (root)::

    python -m tests.netns.harness up -k 4 [--profile local] [--config FILE.toml]
        starts 4 namespaced agents, waits until they see each other, prints the
        membership and copy-paste commands (swimctl, iptables) for each host, and keeps
        them running until Ctrl-C / SIGTERM, then removes everything.
    python -m tests.netns.harness check
        says whether this machine can run the namespace tests, and if not, why.
    python -m tests.netns.harness cleanup
        removes leftover swimtest-* namespaces of a run that was SIGKILLed (kills the
        processes inside them by pid first). Do not run it while tests are running.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import functools
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError
from agent.demo import agent_command
from agent.procs import stop, until
from swim import PROFILES
from tests.netns.delayer import DelayerProcess, DelaySpec

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "swimtest-"
PORT = 7946
POLL_S = 0.1

_LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
_COMMENT_RE = re.compile(r"/\* (\S+) \*/")
_MEMBER_RE = re.compile(r"^(\S+ \S+) \[\w+\] \S+: member (\S+) (\w+) \(incarnation (\d+), ")


class HarnessError(RuntimeError):
    """A namespace, link, rule or agent could not be set up or removed."""


def _run(*args: str, check: bool = True, timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and out.returncode != 0:
        raise HarnessError(f"{' '.join(args)}: exit {out.returncode}: {out.stderr.strip()}")
    return out


@functools.cache
def unavailable_reason() -> str | None:
    """None if namespaces, veths and ``iptables -m statistic`` work here; else why not."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespace tests need root (euid is {os.geteuid()})"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt: iproute2 iptables)"
    probe = f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        out = _run("ip", "netns", "add", probe, check=False)
        if out.returncode != 0:
            return f"'ip netns add' is not permitted here: {out.stderr.strip()}"
        steps = [
            ("ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"),
            ("ip", "-n", probe, "link", "add", "br0", "type", "bridge"),
            (
                "ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-m", "statistic",
                "--mode", "random", "--probability", "0.5", "-j", "DROP",
            ),
        ]  # fmt: skip
        for step in steps:
            out = _run(*step, check=False)
            if out.returncode != 0:
                return f"'{' '.join(step)}' failed: {out.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot set up a network namespace: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _run("ip", "netns", "del", probe, check=False)
    return None


def delay_unavailable_reason() -> str | None:
    """None if NFQUEUE can delay packets here (``Testbed.delay``); else why not."""
    if unavailable_reason():
        return unavailable_reason()
    if not Path("/proc/net/netfilter/nfnetlink_queue").exists():
        return "nfnetlink_queue is not loaded (modprobe nfnetlink_queue xt_NFQUEUE)"
    return None


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    out = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(prefix)]


def namespace_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process inside ``ns`` by pid (only processes started inside it) and
    wait until they are gone."""
    stop(*namespace_pids(ns), sig=signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class Counter:
    """One iptables rule's packet count; ``target`` is the listing's third column (the
    protocol where the rule has no target), ``comment`` its ``-m comment`` text."""

    packets: int
    target: str
    comment: str | None


@dataclass(frozen=True, slots=True)
class MemberEvent:
    """One ``member X <kind>`` line of an agent's log."""

    at: float  # time.time() of the log line
    observer: str
    member: str
    kind: str  # joined | updated | suspect | alive | dead | left | reaped
    incarnation: int


class NsAgent:
    """One agent process inside a host's namespace."""

    def __init__(
        self,
        host: Host,
        profile: str,
        join: Host | None,
        extra: list[str],
        sock_dir: Path,
        workdir: Path,
    ) -> None:
        self.host = host
        self.name = host.node
        self.control = sock_dir / f"{host.node}.sock"
        with contextlib.suppress(FileNotFoundError):
            self.control.unlink()  # a SIGKILLed predecessor leaves its socket file behind
        self.log_path = workdir / f"{host.node}.log"
        self._log = self.log_path.open("ab")  # a restart appends: one history per host
        agent = agent_command(
            host.node,
            PORT,
            self.control,
            profile,
            None if join is None else PORT,
            retry_ms=500,
            host=host.ip,
            join_host="" if join is None else join.ip,
        )
        cmd = ["ip", "netns", "exec", host.ns, *agent, "--log-level", "info", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.client = ControlClient(self.control, timeout_s=5)
        self.started_at = time.time()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def members(self) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.client.request("members")}

    def info(self) -> dict[str, Any]:
        result: dict[str, Any] = self.client.request("info")
        return result

    def ready(self) -> bool:
        """Whether its control socket answers; raises if the agent exited."""
        if not self.running():
            raise HarnessError(f"{self.name} exited: {self.log_tail()}")
        try:
            self.client.request("info")
        except ControlError:
            return False
        return True

    def wait_ready(self, timeout_s: float = 20) -> None:
        try:
            until(self.ready, timeout_s, f"{self.name} ready", poll_s=0.05)
        except TimeoutError as exc:
            raise HarnessError(f"{exc}: {self.log_tail()}") from exc

    def stop(self, sig: int = signal.SIGKILL, timeout_s: float = 10) -> None:
        stop(self.proc, sig=sig, timeout_s=timeout_s)
        if not self._log.closed:
            self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_text()[-chars:]


SERF = shutil.which("serf")
SERF_RPC = "127.0.0.1:7373"  # each namespace has its own loopback: the same port everywhere
_SERF_EVENT_RE = re.compile(
    r"^(\d+\.\d+) .*(?:serf: (EventMemberJoin|EventMemberFailed|EventMemberLeave): (\S+)"
    r"|memberlist: (Suspect) (\S+) has failed)"
)
_SERF_KINDS = {
    "EventMemberJoin": "joined",
    "EventMemberFailed": "dead",
    "EventMemberLeave": "left",
    "Suspect": "suspect",
}


class NsSerf:
    """One real ``serf agent`` inside a host's namespace, bound to the host's address, its
    RPC on the namespace's own loopback. Serf stamps its log lines to the second, so a
    reader thread prefixes each line with ``time.time()`` as it arrives (as
    bench/watched.py does on loopback); ``events`` parses those lines into ``MemberEvent``s
    with the same kinds as our agent's (joined, suspect, dead, left)."""

    def __init__(self, host: Host, profile: str, join: Host | None, workdir: Path) -> None:
        if SERF is None:
            raise HarnessError("serf is not installed (apt-get install -y serf)")
        self.host = host
        self.name = host.node
        self.log_path = workdir / f"{host.node}.serf.log"
        self._log = self.log_path.open("ab")
        cmd = [
            *("ip", "netns", "exec", host.ns, SERF, "agent", f"-node={host.node}"),
            *(f"-bind={host.ip}:{PORT}", f"-rpc-addr={SERF_RPC}", f"-profile={profile}"),
            "-log-level=info",
        ]
        if join is not None:
            cmd += [f"-retry-join={join.ip}:{PORT}", "-retry-interval=1s"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.started_at = time.time()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._log.write(f"{time.time():.3f} ".encode() + raw)
            self._log.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def members(self) -> dict[str, dict[str, Any]]:
        """``serf members`` run inside the namespace; {} while the agent does not answer."""
        assert SERF is not None
        out = _run(
            "ip", "netns", "exec", self.host.ns, SERF, "members", f"-rpc-addr={SERF_RPC}",
            "-format=json", check=False, timeout_s=10,
        )  # fmt: skip
        if out.returncode != 0:
            return {}
        try:
            return {m["name"]: m for m in json.loads(out.stdout)["members"]}
        except (ValueError, KeyError):
            return {}

    def stop(self, sig: int = signal.SIGKILL, timeout_s: float = 10) -> None:
        stop(self.proc, sig=sig, timeout_s=timeout_s)
        self._reader.join(timeout=5)
        if not self._log.closed:
            self._log.close()

    def events(self, since: float = 0.0) -> list[MemberEvent]:
        found: list[MemberEvent] = []
        if not self.log_path.exists():
            return found
        for line in self.log_path.read_text(errors="replace").splitlines():
            m = _SERF_EVENT_RE.match(line)
            if m is None or float(m[1]) < since:
                continue
            kind, member = (m[2], m[3]) if m[2] else (m[4], m[5])
            found.append(MemberEvent(float(m[1]), self.name, member, _SERF_KINDS[kind], 0))
        return found


@dataclass(slots=True)
class Host:
    index: int  # 1..K
    ns: str
    ip: str
    node: str  # the agent's node name, n<index>
    agent: NsAgent | None = None
    serf: NsSerf | None = None


class Testbed:
    """K hosts (namespaces) on one bridge, at most one agent each. Always ``close()`` it."""

    __test__ = False  # not a pytest test class

    def __init__(self, k: int, workdir: Path, uid: str | None = None) -> None:
        if not 1 <= k <= 200:
            raise ValueError("k must be 1..200")
        self.uid = uid or secrets.token_hex(3)
        self.workdir = workdir
        self.subnet = random.Random().randrange(1, 255)
        self.bridge_ns = f"{PREFIX}{self.uid}-br"
        self.hosts = [
            Host(i, f"{PREFIX}{self.uid}-{i}", f"10.77.{self.subnet}.{i}", f"n{i}")
            for i in range(1, k + 1)
        ]
        self.faults: list[str] = []  # human-readable log of what was injected
        self._sock_dir = Path(tempfile.mkdtemp(prefix="swimns-"))  # short: sun_path limit
        self._created: list[str] = []
        self._closed = False
        self.delayers: list[DelayerProcess] = []
        self.delayer_stats: list[dict[str, Any]] = []  # of the delayers undelay() stopped
        self._next_queue = 100
        atexit.register(self.close)

    # --- lifecycle ------------------------------------------------------------------------

    def up(self) -> Testbed:
        """Create the namespaces, the bridge and one veth pair per host."""
        try:
            self._netns_add(self.bridge_ns)
            br = ("ip", "-n", self.bridge_ns)
            _run(*br, "link", "add", "br0", "type", "bridge")
            _run(*br, "link", "set", "br0", "up")
            for h in self.hosts:
                self._netns_add(h.ns)
                _run("ip", "-n", h.ns, "link", "set", "lo", "up")
                port = f"v{h.index}"
                _run(
                    *br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", h.ns
                )
                _run(*br, "link", "set", port, "master", "br0")
                _run(*br, "link", "set", port, "up")
                _run("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
                _run("ip", "-n", h.ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _netns_add(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._created.append(ns)

    def close(self) -> None:
        """Kill every agent by pid, delete every namespace; raise if any is left."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        try:
            self.undelay()
        except (OSError, subprocess.SubprocessError, TimeoutError, HarnessError) as exc:
            errors.append(f"stopping delayers: {exc}")
        for h in self.hosts:
            if h.agent is not None:
                try:
                    h.agent.stop(signal.SIGKILL)
                except (OSError, subprocess.SubprocessError, TimeoutError) as exc:
                    errors.append(f"stopping {h.node} (pid {h.agent.pid}): {exc}")
            if h.serf is not None:
                try:
                    h.serf.stop(signal.SIGKILL)
                except (OSError, subprocess.SubprocessError, TimeoutError) as exc:
                    errors.append(f"stopping serf {h.node} (pid {h.serf.pid}): {exc}")
        for ns in reversed(self._created):
            try:
                _kill_namespace(ns)
            except TimeoutError as exc:
                errors.append(f"processes in {ns}: {exc}")
            out = _run("ip", "netns", "del", ns, check=False)
            if out.returncode != 0:
                errors.append(f"ip netns del {ns}: {out.stderr.strip()}")
        shutil.rmtree(self._sock_dir, ignore_errors=True)
        left = list_namespaces(f"{PREFIX}{self.uid}-")
        if left:
            errors.append(f"namespaces still listed: {left}")
        atexit.unregister(self.close)
        if errors:
            raise HarnessError("; ".join(errors))

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- agents ---------------------------------------------------------------------------

    def host(self, i: int) -> Host:
        return self.hosts[i - 1]

    def agent(self, i: int) -> NsAgent:
        a = self.host(i).agent
        if a is None:
            raise HarnessError(f"host {i} runs no agent")
        return a

    def running(self) -> list[NsAgent]:
        return [h.agent for h in self.hosts if h.agent is not None and h.agent.running()]

    def start_agent(
        self,
        i: int,
        profile: str = "local",
        join: int | None = None,
        extra: Iterable[str] = (),
        config_toml: str | None = None,
    ) -> NsAgent:
        """Start (or restart) host i's agent; it retry-joins host ``join`` (default host 1,
        or host 2 for host 1) every 500 ms until that works."""
        h = self.host(i)
        if h.agent is not None and h.agent.running():
            raise HarnessError(f"{h.node} is already running (pid {h.agent.pid})")
        if join is None:
            join = 1 if i != 1 or len(self.hosts) == 1 else 2
        args: list[str] = []
        if config_toml is not None:
            path = self.workdir / f"{h.node}.toml"
            path.write_text(config_toml)
            args += ["--config", str(path)]
        args += list(extra)
        peer = None if join == i else self.host(join)
        h.agent = NsAgent(h, profile, peer, args, self._sock_dir, self.workdir)
        return h.agent

    def start_agents(self, profile: str = "local", **kwargs: Any) -> list[NsAgent]:
        agents = [self.start_agent(h.index, profile, **kwargs) for h in self.hosts]
        for a in agents:
            a.wait_ready()
        return agents

    def start_serf(self, i: int, profile: str = "lan", join: int | None = None) -> NsSerf:
        """Start (or restart) a real ``serf agent`` on host i (instead of ours); it
        retry-joins host ``join`` (default as ``start_agent``) every second."""
        h = self.host(i)
        if h.serf is not None and h.serf.running():
            raise HarnessError(f"serf {h.node} is already running (pid {h.serf.pid})")
        if join is None:
            join = 1 if i != 1 or len(self.hosts) == 1 else 2
        peer = None if join == i else self.host(join)
        h.serf = NsSerf(h, profile, peer, self.workdir)
        return h.serf

    def serfs(self) -> list[NsSerf]:
        return [h.serf for h in self.hosts if h.serf is not None and h.serf.running()]

    def serf_converged(self) -> bool:
        """Every running serf lists exactly the running serfs as alive."""
        serfs = self.serfs()
        names = {s.name for s in serfs}
        for s in serfs:
            alive = {n for n, m in s.members().items() if m.get("status") == "alive"}
            if alive != names:
                return False
        return True

    def serf_events(
        self, since: float = 0.0, kinds: Iterable[str] | None = None
    ) -> list[MemberEvent]:
        """Membership events from every serf's log (restarts included), oldest first."""
        wanted = set(kinds) if kinds is not None else None
        found = [
            e
            for h in self.hosts
            if h.serf is not None
            for e in h.serf.events(since)
            if wanted is None or e.kind in wanted
        ]
        return sorted(found, key=lambda e: e.at)

    def kill_serf(self, i: int, sig: int = signal.SIGKILL) -> float:
        """Signal host i's serf by pid, wait for it to exit; returns time.time() of the kill."""
        s = self.host(i).serf
        if s is None:
            raise HarnessError(f"host {i} runs no serf")
        at = time.time()
        s.stop(sig)
        return at

    def kill(self, i: int, sig: int = signal.SIGKILL) -> float:
        """Signal host i's agent by pid, wait for it to exit; returns time.time() of the kill."""
        a = self.agent(i)
        at = time.time()
        a.stop(sig)
        return at

    def status(self, observer: int, member: int | str) -> str | None:
        name = member if isinstance(member, str) else self.host(member).node
        m = self.agent(observer).members().get(name)
        return None if m is None else str(m["status"])

    def statuses(self) -> dict[str, dict[str, str]]:
        """observer -> member -> status, for every running agent."""
        return {a.name: {n: m["status"] for n, m in a.members().items()} for a in self.running()}

    def wait_converged(self, timeout_s: float = 30) -> float:
        """Until every running agent sees exactly the running agents alive; seconds taken."""
        return until(
            self.converged, timeout_s, "the running agents to see each other alive", poll_s=POLL_S
        )

    def converged(self) -> bool:
        agents = self.running()
        names = {a.name for a in agents}
        try:
            return all(
                {n for n, m in a.members().items() if m["status"] == "alive"} == names
                for a in agents
            )
        except ControlError:
            return False

    def events(self, since: float = 0.0, kinds: Iterable[str] | None = None) -> list[MemberEvent]:
        """Membership events from every agent's log (restarts included), oldest first."""
        wanted = set(kinds) if kinds is not None else None
        found: list[MemberEvent] = []
        for h in self.hosts:
            path = self.workdir / f"{h.node}.log"
            if not path.exists():
                continue
            for line in path.read_text(errors="replace").splitlines():
                m = _MEMBER_RE.match(line)
                if m is None:
                    continue
                at = datetime.datetime.strptime(m[1], _LOG_TIME).timestamp()
                if at >= since and (wanted is None or m[3] in wanted):
                    found.append(MemberEvent(at, h.node, m[2], m[3], int(m[4])))
        return sorted(found, key=lambda e: e.at)

    def log_count(self, i: int, text: str) -> int:
        path = self.workdir / f"{self.host(i).node}.log"
        return path.read_text(errors="replace").count(text) if path.exists() else 0

    # --- faults ---------------------------------------------------------------------------

    def iptables(self, i: int, *rule: str) -> None:
        _run("ip", "netns", "exec", self.host(i).ns, "iptables", "-w", "5", *rule)

    def rules(self, i: int) -> list[str]:
        out = _run("ip", "netns", "exec", self.host(i).ns, "iptables", "-S")
        return [r for r in out.stdout.splitlines() if not r.startswith("-P")]

    def _indices(self, hosts: Iterable[int] | None) -> list[int]:
        return [h.index for h in self.hosts] if hosts is None else list(hosts)

    def host_loss(self, p: float, hosts: Iterable[int] | None = None) -> None:
        """Drop each packet arriving at each of ``hosts`` (default all) with probability p."""
        for i in self._indices(hosts):
            self.iptables(i, "-A", "INPUT", "-i", "eth0")  # no target: counts arrivals
            self.iptables(i, "-A", "INPUT", "-i", "eth0", *_statistic(p), "-j", "DROP")
            self.faults.append(f"loss {p:g} into {self.host(i).node}")

    def packet_counts(self, i: int) -> tuple[int, int]:
        """(packets counted by target-less rules, packets dropped by DROP rules) at host i
        since its rules were added; ``host_loss`` adds a counting rule before its DROP."""
        counted = dropped = 0
        for chain in ("INPUT", "OUTPUT"):
            for rule in self.counters(i, chain):
                if rule.target == "DROP":
                    dropped += rule.packets
                elif rule.target in ("", "all", "udp", "tcp", "0"):
                    counted += rule.packets
        return counted, dropped

    def counters(self, i: int, chain: str) -> list[Counter]:
        """Every rule of ``chain`` (filter table) at host i with its packet count."""
        out = _run(
            "ip", "netns", "exec", self.host(i).ns, "iptables", "-w", "5",
            "-L", chain, "-v", "-x", "-n",
        )  # fmt: skip
        found = []
        for line in out.stdout.splitlines()[2:]:
            fields = line.split()
            if not fields or not fields[0].isdigit():
                continue
            # pkts bytes [target] prot opt in out source destination ... [/* comment */]
            comment = _COMMENT_RE.search(line)
            target = fields[2] if len(fields) > 2 else ""
            found.append(Counter(int(fields[0]), target, comment[1] if comment else None))
        return found

    def link_loss(self, a: int, b: int, p: float, both: bool = True) -> None:
        """Drop packets from a to b (and b to a if ``both``) with probability p."""
        for src, dst in [(a, b), (b, a)] if both else [(a, b)]:
            self.iptables(dst, "-A", "INPUT", "-s", self.host(src).ip, *_statistic(p), "-j", "DROP")
            self.faults.append(f"loss {p:g} {self.host(src).node}->{self.host(dst).node}")

    def block(self, src: int, dst: int) -> None:
        """Drop everything from src to dst (one direction)."""
        self.iptables(dst, "-A", "INPUT", "-s", self.host(src).ip, "-j", "DROP")
        self.faults.append(f"block {self.host(src).node}->{self.host(dst).node}")

    def cut(self, a: int, b: int) -> None:
        """No traffic between a and b, either way."""
        self.block(a, b)
        self.block(b, a)

    def partition(
        self, side_a: Iterable[int], side_b: Iterable[int], asymmetric: bool = False
    ) -> None:
        """Block every pair across; with ``asymmetric`` only side_a -> side_b is dropped."""
        side_b = list(side_b)
        for a in side_a:
            for b in side_b:
                self.block(a, b)
                if not asymmetric:
                    self.block(b, a)

    def block_udp(self, i: int) -> None:
        """UDP in and out of host i is dropped; TCP still works."""
        self.iptables(i, "-A", "INPUT", "-i", "eth0", "-p", "udp", "-j", "DROP")
        self.iptables(i, "-A", "OUTPUT", "-o", "eth0", "-p", "udp", "-j", "DROP")
        self.faults.append(f"udp blocked at {self.host(i).node}")

    def delay(
        self,
        group_a: Iterable[int],
        group_b: Iterable[int],
        mean_ms: float,
        jitter_ms: float = 0.0,
        *,
        both: bool = True,
        dist: str = "uniform",
        seed: int = 0,
    ) -> list[DelayerProcess]:
        """Hold every packet from a host of group_a to a host of group_b (and back, if
        ``both``) for ``mean_ms`` ± ``jitter_ms`` (``dist``: uniform | normal), drawn per
        packet; one delayer process per sending host, seeded ``seed`` + its index."""
        spec = DelaySpec(mean_ms, jitter_ms, dist)
        side_a, side_b = list(group_a), list(group_b)
        pairs = [(side_a, side_b), (side_b, side_a)] if both else [(side_a, side_b)]
        started: list[tuple[DelayerProcess, list[int]]] = []
        for senders, receivers in pairs:
            for src in senders:
                h = self.host(src)
                queue = self._next_queue
                self._next_queue += 1
                log = self.workdir / f"delayer-{h.node}-q{queue}.log"
                d = DelayerProcess(h.ns, queue, spec, seed + src, log)
                self.delayers.append(d)
                started.append((d, receivers))
        for d, receivers in started:  # the rules only once the queue is bound: no stray bypass
            d.wait_ready()
            src_i = next(h.index for h in self.hosts if h.ns == d.ns)
            for dst in receivers:
                self.iptables(
                    src_i, "-t", "mangle", "-A", "OUTPUT", "-d", self.host(dst).ip,
                    "-j", "NFQUEUE", "--queue-num", str(d.queue), "--queue-bypass",
                )  # fmt: skip
        arrow = "<->" if both else "->"
        self.faults.append(f"delay {mean_ms:g}±{jitter_ms:g} ms {side_a}{arrow}{side_b}")
        return [d for d, _ in started]

    def undelay(self) -> None:
        """Remove every delay rule, then stop the delayers; their stats go to
        ``delayer_stats``."""
        if not self.delayers:
            return
        for ns in {d.ns for d in self.delayers}:
            _run("ip", "netns", "exec", ns, "iptables", "-w", "5", "-t", "mangle", "-F", "OUTPUT",
                 check=False)  # fmt: skip
        delayers, self.delayers = self.delayers, []
        for d in delayers:
            self.delayer_stats.append({"ns": d.ns, **d.stop()})
        self.faults.append("undelay")

    def heal(self, hosts: Iterable[int] | None = None) -> None:
        for i in self._indices(hosts):
            self.iptables(i, "-F", "INPUT")
            self.iptables(i, "-F", "OUTPUT")
        self.faults.append("heal")


def _statistic(p: float) -> list[str]:
    if not 0.0 < p <= 1.0:
        raise ValueError(f"loss probability must be in (0, 1], got {p}")
    return ["-m", "statistic", "--mode", "random", "--probability", f"{p:.4f}"]


class Testbeds:
    """Creates testbeds and closes every one of them at exit, errors included."""

    __test__ = False

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._beds: list[Testbed] = []

    def __call__(self, k: int) -> Testbed:
        bed = Testbed(k, self.workdir)
        self._beds.append(bed)
        return bed.up()

    def __enter__(self) -> Testbeds:
        return self

    def __exit__(self, *exc: object) -> None:
        errors = []
        for bed in self._beds:
            try:
                bed.close()
            except HarnessError as err:
                errors.append(str(err))
        if errors:
            raise HarnessError("; ".join(errors))


@contextlib.contextmanager
def testbeds(workdir: Path) -> Iterator[Testbeds]:
    with Testbeds(workdir) as make:
        yield make


# --- command line -------------------------------------------------------------------------


def _cleanup() -> int:
    leftover = list_namespaces()
    for ns in leftover:
        _kill_namespace(ns)
        _run("ip", "netns", "del", ns, check=False)
    print(f"removed {len(leftover)} namespace(s): {' '.join(leftover) or '-'}")
    return 1 if list_namespaces() else 0


def _up(k: int, profile: str, config: Path | None) -> int:
    reason = unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="swim-netns-"))

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with Testbed(k, workdir) as bed:
        toml = config.read_text() if config else None
        for h in bed.hosts:
            bed.start_agent(h.index, profile, config_toml=toml)
        for a in bed.running():
            a.wait_ready()
        took = bed.wait_converged(60)
        print(f"{k} agents converged after {took:.1f}s (profile {profile}); logs in {workdir}")
        for h in bed.hosts:
            a = bed.agent(h.index)
            print(f"\n{h.node}  ns {h.ns}  {h.ip}:{PORT}  pid {a.pid}  log {a.log_path}")
            print(f"  {sys.executable} -m agent.cli --control {a.control} members")
            print(f"  ip netns exec {h.ns} iptables -A INPUT -i eth0 -m statistic "
                  "--mode random --probability 0.1 -j DROP")  # fmt: skip
            print(f"  ip netns exec {h.ns} iptables -F INPUT")
        print("\nCtrl-C removes everything.")
        try:
            while all(a.running() for a in bed.running()):
                time.sleep(1)
            print("an agent exited; tearing down", file=sys.stderr)
        except KeyboardInterrupt:
            pass
    print("removed all namespaces and agents")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.netns.harness",
        description="Namespaced swim agents for debugging (see the module docstring).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start K namespaced agents until Ctrl-C")
    up.add_argument("-k", type=int, default=4)
    up.add_argument("--profile", default="local", choices=list(PROFILES))
    up.add_argument("--config", type=Path, help="agent TOML given to every agent")
    sub.add_parser("check", help="can this machine run the namespace tests?")
    sub.add_parser("cleanup", help="remove leftover swimtest-* namespaces")
    args = parser.parse_args(argv)
    if args.cmd == "check":
        reason = unavailable_reason()
        print(reason or "ok: namespaces, veths, bridges and iptables -m statistic work")
        return 1 if reason else 0
    if args.cmd == "cleanup":
        return _cleanup()
    return _up(args.k, args.profile, args.config)


if __name__ == "__main__":
    sys.exit(main())
