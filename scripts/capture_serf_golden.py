#!/usr/bin/env python3
"""Capture golden memberlist/Serf packets from real ``serf`` agents on loopback.

The tool starts three ``serf agent`` processes on 127.0.0.1 (distinct gossip and
RPC ports), drives them through a scripted life cycle (join, steady state, a user
event, a UDP black-hole that forces TCP fallback pings, SIGSTOP until the node is
declared dead, SIGCONT and refutation, a graceful leave) while ``tcpdump`` records
the loopback traffic of the gossip ports, once in plaintext and once with
encryption (including a key rotation).  It then parses the pcap files in pure
Python, reassembles the TCP streams, decodes every packet far enough to describe
it (decrypting with the known keys and undoing Go's LZW compression), and writes
a small deduplicated corpus plus ``manifest.json`` and ``README.md``.

Which agent sent a TCP segment cannot be told from the ephemeral source port, so
every agent runs with its own group id and an iptables ``mangle/OUTPUT`` rule
stamps its packets with a distinct DSCP value; the pcap parser maps the IPv4 TOS
byte back to the node name.

Needs root (tcpdump, iptables, setgid), ``serf`` and ``tcpdump`` on PATH.  Every
process, iptables rule and pcap file the tool creates is removed again, also on
failure.  Reproduce with::

    .venv/bin/python scripts/capture_serf_golden.py --out tests/golden/serf
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from agent.procs import stop, until

# --------------------------------------------------------------------------- config

GOSSIP_BASE_PORT = 27946
RPC_BASE_PORT = 27373
GID_BASE = 47101  # one group id per agent, used by the iptables owner match
NODE_NAMES = ("a", "b", "c")

# Fixed keys so the corpus can be decrypted by tests.  k1 (AES-128) is the key the
# encrypted cluster starts with; k2 (AES-256) is installed and made primary halfway.
KEYS: dict[str, str] = {
    "k1": "3C1WjrC+MImqascFiR2BkQ==",
    "k2": "vREx0vqoIGayhPzoLApegna8qFqaGT74EPF7D1tV4L0=",
}

USER_EVENT_NAME = "golden-deploy"
USER_EVENT_PAYLOAD = "payload-0123456789"

MSG_NAMES: dict[int, str] = {
    0: "ping",
    1: "indirectPing",
    2: "ack",
    3: "suspect",
    4: "alive",
    5: "dead",
    6: "pushPull",
    7: "compound",
    8: "user",
    9: "compress",
    10: "encrypt",
    11: "nack",
    12: "crc",
    13: "err",
}
NODE_STATES: dict[int, str] = {0: "alive", 1: "suspect", 2: "dead", 3: "left"}
SERF_MSG_NAMES: dict[int, str] = {
    0: "leave",
    1: "join",
    2: "pushPull",
    3: "userEvent",
    4: "query",
    5: "queryResponse",
    6: "conflictResponse",
    7: "keyRequest",
    8: "keyResponse",
    9: "relay",
}

# Kinds the corpus must contain, checked against the summaries: name -> (transport, pattern).
REQUIRED_KINDS: dict[str, tuple[str | None, str]] = {
    "ping": ("udp", r"(?<![A-Za-z])ping\b"),
    "ack": ("udp", r"\back\b"),
    "indirectPing": ("udp", r"\bindirectPing\b"),
    "nack": ("udp", r"\bnack\b"),
    "suspect": ("udp", r"\bsuspect\b"),
    "alive": ("udp", r"\balive\b"),
    "dead(failed)": ("udp", r"\bdead\b(?!\(left\))"),
    "dead(left)": ("udp", r"\bdead\(left\)"),
    "compound": ("udp", r"\bcompound\["),
    "compress": (None, r"\bcompress>"),
    "crc": ("udp", r"\bcrc>"),
    "user": ("udp", r"\buser\("),
    "user(serf:userEvent)": ("udp", r"user\(serf:userEvent\)"),
    "pushPull(join)": ("tcp", r"pushPull\(join=true"),
    "pushPull(periodic)": ("tcp", r"pushPull\(join=false"),
    "tcp ping": ("tcp", r"(?<![A-Za-z])ping\b"),
    "tcp ack": ("tcp", r"\back\b"),
    "encrypted udp": ("udp", r"^encrypted v"),
    "encrypted tcp": ("tcp", r"^encrypted v"),
}

# --------------------------------------------------------------------------- helpers


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


# --------------------------------------------------------------------------- scenario


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


# --------------------------------------------------------------------------- pcap


@dataclass(frozen=True)
class Frame:
    ts: float
    proto: int
    tos: int
    src: str
    sport: int
    dst: str
    dport: int
    payload: bytes
    seq: int = 0
    flags: int = 0


TCP_FIN, TCP_SYN, TCP_RST, TCP_ACK = 0x01, 0x02, 0x04, 0x10


def _link_payload(linktype: int, rec: bytes) -> bytes | None:
    if linktype == 1:  # DLT_EN10MB
        off, ethertype = 14, struct.unpack_from("!H", rec, 12)[0]
        while ethertype in (0x8100, 0x88A8) and len(rec) >= off + 4:
            ethertype = struct.unpack_from("!H", rec, off + 2)[0]
            off += 4
        return rec[off:] if ethertype == 0x0800 else None
    if linktype == 113:  # DLT_LINUX_SLL
        return rec[16:] if struct.unpack_from("!H", rec, 14)[0] == 0x0800 else None
    if linktype == 276:  # DLT_LINUX_SLL2
        return rec[20:] if struct.unpack_from("!H", rec, 0)[0] == 0x0800 else None
    if linktype in (0, 108):  # DLT_NULL (host order) / DLT_LOOP (network order)
        fam_le, fam_be = struct.unpack_from("<I", rec)[0], struct.unpack_from(">I", rec)[0]
        return rec[4:] if 2 in (fam_le, fam_be) else None
    if linktype in (12, 101, 228):  # raw IP
        return rec if rec and rec[0] >> 4 == 4 else None
    raise ValueError(f"unsupported pcap link type {linktype}")


def read_pcap(path: Path) -> Iterator[Frame]:
    data = path.read_bytes()
    magics = {
        b"\xd4\xc3\xb2\xa1": ("<", 1e6),
        b"\xa1\xb2\xc3\xd4": (">", 1e6),
        b"\x4d\x3c\xb2\xa1": ("<", 1e9),
        b"\xa1\xb2\x3c\x4d": (">", 1e9),
    }
    if data[:4] not in magics:
        raise ValueError(f"{path}: not a pcap file (pcapng is not supported)")
    endian, frac_div = magics[data[:4]]
    linktype = struct.unpack_from(endian + "I", data, 20)[0] & 0xFFFF
    pos = 24
    while pos + 16 <= len(data):
        sec, frac, incl, _orig = struct.unpack_from(endian + "IIII", data, pos)
        rec = data[pos + 16 : pos + 16 + incl]
        pos += 16 + incl
        ip = _link_payload(linktype, rec)
        if ip is None or len(ip) < 20 or ip[0] >> 4 != 4:
            continue
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack_from("!H", ip, 2)[0]
        if struct.unpack_from("!H", ip, 6)[0] & 0x3FFF:
            continue  # IP fragment: never happens on lo (MTU 64 KiB)
        seg = ip[ihl:total]
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        ts = sec + frac / frac_div
        if ip[9] == 17 and len(seg) >= 8:
            sport, dport, ulen = struct.unpack_from("!HHH", seg)
            yield Frame(ts, 17, ip[1], src, sport, dst, dport, bytes(seg[8:ulen]))
        elif ip[9] == 6 and len(seg) >= 20:
            sport, dport, seq = struct.unpack_from("!HHI", seg)
            doff = (seg[12] >> 4) * 4
            yield Frame(ts, 6, ip[1], src, sport, dst, dport, bytes(seg[doff:]), seq, seg[13])


@dataclass
class TcpConn:
    cid: int
    client: tuple[str, int]
    server: tuple[str, int]
    t_start: float
    client_tos: int = 0
    isn: dict[str, int] = field(default_factory=dict)  # "c2s"/"s2c" -> first data seq
    segs: dict[str, list[tuple[int, bytes, float]]] = field(
        default_factory=lambda: {"c2s": [], "s2c": []}
    )

    def stream(self, direction: str) -> tuple[bytes, float | None, bool]:
        """The reassembled bytes of one direction, its first data time, gap flag."""
        segs = self.segs[direction]
        if not segs:
            return b"", None, False
        base = self.isn.get(direction, min(s for s, _, _ in segs))
        out = bytearray()
        first_ts: float | None = None
        gap = False
        for seq, data, ts in sorted(segs, key=lambda s: ((s[0] - base) % 2**32, s[2])):
            rel = (seq - base) % 2**32
            if rel > len(out):
                gap = True
                break
            if rel + len(data) <= len(out):
                continue  # retransmission / duplicate
            if first_ts is None:
                first_ts = ts
            out += data[len(out) - rel :]
        return bytes(out), first_ts, gap


def reassemble(frames: Sequence[Frame], server_ports: set[int]) -> list[TcpConn]:
    conns: list[TcpConn] = []
    open_: dict[tuple[tuple[str, int], tuple[str, int]], TcpConn] = {}
    for f in frames:
        if f.proto != 6:
            continue
        a, b = (f.src, f.sport), (f.dst, f.dport)
        syn_only = f.flags & TCP_SYN and not f.flags & TCP_ACK
        key = (a, b) if (a, b) in open_ else (b, a)
        conn = open_.get(key)
        if syn_only or conn is None:
            if syn_only or f.dport in server_ports:
                client, server = a, b
            else:
                client, server = b, a
            conn = TcpConn(len(conns) + 1, client, server, f.ts)
            conns.append(conn)
            open_[(client, server)] = conn
            open_.pop((server, client), None)
        direction = "c2s" if a == conn.client else "s2c"
        if direction == "c2s" and f.tos and not conn.client_tos:
            conn.client_tos = f.tos
        if f.flags & TCP_SYN:
            conn.isn[direction] = (f.seq + 1) % 2**32
        if f.payload:
            conn.segs[direction].append((f.seq, f.payload, f.ts))
    return conns


# --------------------------------------------------------------------------- decoding


def lzw_decompress(data: bytes) -> bytes:
    """Go's compress/lzw reader, LSB bit order, 8-bit literals (memberlist's lzwAlgo)."""
    clear, eof, max_width = 256, 257, 12
    width, hi, overflow = 9, eof, 1 << 9
    last: int | None = None
    table: dict[int, bytes] = {}
    out = bytearray()
    bits = nbits = pos = 0
    while True:
        while nbits < width:
            if pos >= len(data):
                raise ValueError("lzw: unexpected end of data")
            bits |= data[pos] << nbits
            pos += 1
            nbits += 8
        code = bits & ((1 << width) - 1)
        bits >>= width
        nbits -= width
        if code < clear:
            cur = bytes((code,))
        elif code == clear:
            width, hi, overflow, last = 9, eof, 1 << 9, None
            table.clear()
            continue
        elif code == eof:
            return bytes(out)
        elif code <= hi:
            if code == hi and last is not None:
                prev = table[last] if last > eof else bytes((last,))
                cur = prev + prev[:1]
            elif code in table:
                cur = table[code]
            else:
                raise ValueError(f"lzw: undefined code {code}")
        else:
            raise ValueError(f"lzw: invalid code {code}")
        if last is not None:
            prev = table[last] if last > eof else bytes((last,))
            table[hi] = prev + cur[:1]
        out += cur
        last, hi = code, hi + 1
        if hi >= overflow:
            if width == max_width:
                last = None
                hi -= 1
            else:
                width += 1
                overflow <<= 1


_FIXED_FORMATS: dict[int, str] = {
    0xC0: "nil",
    0xC2: "false",
    0xC3: "true",
    0xC4: "bin8",
    0xC5: "bin16",
    0xC6: "bin32",
    0xC7: "ext8",
    0xC8: "ext16",
    0xC9: "ext32",
    0xCA: "float32",
    0xCB: "float64",
    0xCC: "uint8",
    0xCD: "uint16",
    0xCE: "uint32",
    0xCF: "uint64",
    0xD0: "int8",
    0xD1: "int16",
    0xD2: "int32",
    0xD3: "int64",
    0xD4: "fixext1",
    0xD5: "fixext2",
    0xD6: "fixext4",
    0xD7: "fixext8",
    0xD8: "fixext16",
    0xD9: "str8",
    0xDA: "str16",
    0xDB: "str32",
    0xDC: "array16",
    0xDD: "array32",
    0xDE: "map16",
    0xDF: "map32",
}


def mp_format(b: int) -> str:
    if b <= 0x7F:
        return "posfixint"
    if b <= 0x8F:
        return "fixmap"
    if b <= 0x9F:
        return "fixarray"
    if b <= 0xBF:
        return "fixstr"
    if b >= 0xE0:
        return "negfixint"
    return _FIXED_FORMATS.get(b, f"0x{b:02x}")


def mp_skip(buf: bytes, pos: int) -> int:
    """Offset just past the msgpack object that starts at ``pos``."""
    b = buf[pos]
    fmt = mp_format(b)
    sizes = {
        "uint8": 1,
        "int8": 1,
        "uint16": 2,
        "int16": 2,
        "uint32": 4,
        "int32": 4,
        "float32": 4,
        "uint64": 8,
        "int64": 8,
        "float64": 8,
    }
    if fmt in ("posfixint", "negfixint", "nil", "true", "false"):
        return pos + 1
    if fmt in sizes:
        return pos + 1 + sizes[fmt]
    if fmt == "fixstr":
        return pos + 1 + (b & 0x1F)
    lenfmt = {"str8": "B", "bin8": "B", "str16": "H", "bin16": "H", "str32": "I", "bin32": "I"}
    if fmt in lenfmt:
        n: int = struct.unpack_from("!" + lenfmt[fmt], buf, pos + 1)[0]
        return pos + 1 + struct.calcsize(lenfmt[fmt]) + n
    if fmt.startswith("fixext"):
        return pos + 2 + {"1": 1, "2": 2, "4": 4, "8": 8, "16": 16}[fmt[6:]]
    if fmt in ("ext8", "ext16", "ext32"):
        lf = {"ext8": "B", "ext16": "H", "ext32": "I"}[fmt]
        n = int(struct.unpack_from("!" + lf, buf, pos + 1)[0])
        return pos + 2 + struct.calcsize(lf) + n
    if fmt in ("fixarray", "array16", "array32", "fixmap", "map16", "map32"):
        if fmt.startswith("fix"):
            n, p = b & 0x0F, pos + 1
        else:
            lf = "H" if fmt.endswith("16") else "I"
            n, p = struct.unpack_from("!" + lf, buf, pos + 1)[0], pos + 1 + struct.calcsize(lf)
        for _ in range(n * (2 if "map" in fmt else 1)):
            p = mp_skip(buf, p)
        return p
    raise ValueError(f"msgpack: unknown type byte 0x{b:02x}")


def mp_shape(buf: bytes, pos: int) -> str:
    """The msgpack format of the object at ``pos``, with element formats for arrays."""
    fmt = mp_format(buf[pos])
    if fmt in ("fixarray", "array16", "array32"):
        n = buf[pos] & 0x0F if fmt == "fixarray" else 0
        p = pos + 1 if fmt == "fixarray" else pos + (3 if fmt == "array16" else 5)
        if fmt != "fixarray":
            n = struct.unpack_from("!H" if fmt == "array16" else "!I", buf, pos + 1)[0]
        inner: set[str] = set()
        for _ in range(n):
            inner.add(mp_format(buf[p]))
            p = mp_skip(buf, p)
        return f"{fmt}[{'|'.join(sorted(inner))}]" if inner else fmt
    return fmt


def mp_map_fields(buf: bytes, pos: int) -> dict[str, str]:
    """Field name -> value format for the msgpack map at ``pos`` (Go structs are maps)."""
    fmt = mp_format(buf[pos])
    if fmt == "fixmap":
        n, p = buf[pos] & 0x0F, pos + 1
    elif fmt == "map16":
        n, p = struct.unpack_from("!H", buf, pos + 1)[0], pos + 3
    elif fmt == "map32":
        n, p = struct.unpack_from("!I", buf, pos + 1)[0], pos + 5
    else:
        return {"<top>": fmt}
    out: dict[str, str] = {}
    for _ in range(n):
        kend = mp_skip(buf, p)
        try:
            key = msgpack.unpackb(buf[p:kend], raw=True)
            kname = key.decode() if isinstance(key, bytes) else str(key)
        except Exception:
            kname = "?"
        out[kname] = f"{mp_format(buf[p])}:{mp_shape(buf, kend)}"
        p = mp_skip(buf, kend)
    return out


def unpack_one(buf: bytes) -> tuple[Any, int]:
    """First msgpack object of ``buf`` (raw=True) and the number of bytes it used."""
    unp = msgpack.Unpacker(raw=True, strict_map_key=False)
    unp.feed(buf)
    obj = unp.unpack()
    return obj, unp.tell()


def fget(obj: Any, name: str) -> Any:
    return obj.get(name.encode()) if isinstance(obj, dict) else None


@dataclass
class Decoded:
    summary: str
    key: str | None = None
    enc_version: int | None = None


class Describer:
    """Turns raw packets / streams into summaries, collecting msgpack format statistics."""

    def __init__(self, keys: dict[str, bytes]) -> None:
        self.keys = keys
        self.formats: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
        self.key_orders: dict[str, Counter[tuple[str, ...]]] = defaultdict(Counter)
        self._key: str | None = None
        self._vsn: int | None = None

    def note(self, what: str, buf: bytes, pos: int = 0) -> None:
        """Record the msgpack format of every field, and the field order, of a map."""
        try:
            fields = mp_map_fields(buf, pos)
        except (IndexError, ValueError, struct.error):
            self.formats[what]["<undecodable>"]["?"] += 1
            return
        for fname, fmt in fields.items():
            self.formats[what][fname][fmt] += 1
        self.key_orders[what][tuple(fields)] += 1

    def _decrypt(self, payload: bytes, aad: bytes) -> bytes | None:
        if len(payload) < 1 + 12 + 16 or payload[0] not in (0, 1):
            return None
        for kname, key in self.keys.items():
            try:
                plain = AESGCM(key).decrypt(payload[1:13], payload[13:], aad or None)
            except InvalidTag:
                continue
            if payload[0] == 0 and plain:  # version 0 adds PKCS#7 padding
                plain = plain[: -plain[-1]]
            self._key, self._vsn = kname, payload[0]
            return plain
        return None

    def describe(self, buf: bytes, stream: bool, encrypted: bool) -> Decoded:
        self._key = self._vsn = None
        try:
            summary = self._outer(buf, stream, encrypted)
        except Exception as exc:
            summary = f"undecodable({type(exc).__name__}: {exc})"
        return Decoded(summary, self._key, self._vsn)

    def _outer(self, buf: bytes, stream: bool, encrypted: bool) -> str:
        if not buf:
            return "empty"
        if encrypted and not stream:
            plain = self._decrypt(buf, b"")
            if plain is not None:
                return f"encrypted v{self._vsn}>{self._msg(plain, stream=False)}"
        return self._msg(buf, stream)

    def _msg(self, buf: bytes, stream: bool) -> str:
        if not buf:
            return "empty"
        t, body = buf[0], buf[1:]
        name = MSG_NAMES.get(t, f"type{t}")
        if t == 10 and stream:
            length = struct.unpack_from("!I", body)[0]
            plain = self._decrypt(body[4 : 4 + length], buf[:5])
            if plain is None:
                return "encrypted(no key)"
            rest = self._trailing(len(body) - 4 - length)
            return f"encrypted v{self._vsn}>{self._msg(plain, stream=True)}{rest}"
        if t == 12:
            crc = struct.unpack_from("!I", body)[0]
            ok = zlib.crc32(body[4:]) == crc
            return ("crc>" if ok else "crc(BAD)>") + self._msg(body[4:], stream)
        if t == 9:
            obj, used = unpack_one(body)
            self.note("compress", body)
            algo, data = fget(obj, "Algo"), fget(obj, "Buf")
            if algo != 0 or not isinstance(data, bytes):
                return f"compress(algo={algo})"
            return (
                "compress>"
                + self._msg(lzw_decompress(data), stream)
                + self._trailing(len(body) - used)
            )
        if t == 7:
            n = body[0]
            lens = struct.unpack_from(f"!{n}H", body, 1)
            p = 1 + 2 * n
            parts = []
            for ln in lens:
                if p + ln > len(body):
                    parts.append("truncated")
                    break
                parts.append(self._msg(body[p : p + ln], stream=False))
                p += ln
            return f"compound[{', '.join(parts)}]" + self._trailing(len(body) - p)
        if t == 6:
            return self._push_pull(body)
        if t == 8:
            if stream:
                _hdr, used = unpack_one(body)
                self.note("userMsgHeader", body)
                return "user>" + self._serf(body[used:])
            return f"user({self._serf(body)})"
        obj, used = unpack_one(body)
        self.note(name, body)
        label = name
        if t == 5 and fget(obj, "From") == fget(obj, "Node"):
            label = "dead(left)"
        elif t == 1 and fget(obj, "Nack"):
            label = "indirectPing(nack)"
        elif t == 2 and fget(obj, "Payload"):
            label = "ack(payload)"
        if t in (4, 6):
            meta = fget(obj, "Meta")
            if isinstance(meta, bytes) and meta[:1] == b"\xff":
                self.note("serf:tags", meta, 1)
        return label + self._trailing(len(body) - used)

    @staticmethod
    def _trailing(n: int) -> str:
        return f"+trailing({n})" if n > 0 else ""

    def _push_pull(self, body: bytes) -> str:
        hdr, p = unpack_one(body)
        self.note("pushPullHeader", body)
        nodes = fget(hdr, "Nodes") or 0
        states: set[str] = set()
        for _ in range(nodes):
            self.note("pushNodeState", body, p)
            node, used = unpack_one(body[p:])
            meta = fget(node, "Meta")
            if isinstance(meta, bytes) and meta[:1] == b"\xff":
                self.note("serf:tags", meta, 1)
            states.add(NODE_STATES.get(fget(node, "State"), str(fget(node, "State"))))
            p += used
        ulen = fget(hdr, "UserStateLen") or 0
        user = body[p : p + ulen]
        join = "true" if fget(hdr, "Join") else "false"
        desc = f"pushPull(join={join},nodes={nodes},states={'+'.join(sorted(states))})"
        if user:
            desc += f"+state({self._serf(user)})"
        return desc + self._trailing(len(body) - p - ulen)

    def _serf(self, buf: bytes) -> str:
        if not buf:
            return "empty"
        t = buf[0]
        name = SERF_MSG_NAMES.get(t, f"type{t}")
        if t == 9:  # relay: header then the relayed message
            _hdr, used = unpack_one(buf[1:])
            self.note("serf:relay", buf, 1)
            return f"serf:relay>{self._serf(buf[1 + used :])}"
        obj, used = unpack_one(buf[1:])
        self.note(f"serf:{name}", buf, 1)
        label = f"serf:{name}"
        if t == 4:
            qname = fget(obj, "Name")
            if isinstance(qname, bytes) and qname.startswith(b"_serf_"):
                label += f":{qname.decode(errors='replace')}"
        elif t == 5 and isinstance(fget(obj, "Flags"), int) and fget(obj, "Flags") & 1:
            label += "(ack)"
        return label + self._trailing(len(buf) - 1 - used)


# --------------------------------------------------------------------------- corpus


@dataclass
class Item:
    scenario: str
    transport: str
    ts: float
    src: str
    dst: str
    src_port: int
    dst_port: int
    data: bytes
    decoded: Decoded
    conn: int | None = None
    direction: str | None = None
    gap: bool = False


def phase_at(run: ScenarioRun, ts: float) -> str:
    current = "pre"
    for t, name in run.phases:
        if t <= ts:
            current = name
    return current


def analyse(run: ScenarioRun, nodes: list[NodeSpec], desc: Describer) -> list[Item]:
    by_port = {n.gossip_port: n.name for n in nodes}
    by_tos = {n.tos: n.name for n in nodes}
    frames = list(read_pcap(run.pcap))
    items: list[Item] = []
    for f in frames:
        if f.proto != 17 or not f.payload:
            continue
        src = by_port.get(f.sport, "?")
        if by_tos.get(f.tos, src) != src:
            run.notes.append(f"udp {f.sport}->{f.dport}: TOS says {by_tos[f.tos]}, port {src}")
        items.append(
            Item(
                run.name,
                "udp",
                f.ts,
                src,
                by_port.get(f.dport, "?"),
                f.sport,
                f.dport,
                f.payload,
                desc.describe(f.payload, False, run.encrypted),
            )
        )
    for conn in reassemble(frames, set(by_port)):
        client = by_tos.get(conn.client_tos, "?")
        server = by_port.get(conn.server[1], "?")
        for direction, (src, dst, sp, dp) in (
            ("initiator", (client, server, conn.client[1], conn.server[1])),
            ("responder", (server, client, conn.server[1], conn.client[1])),
        ):
            data, ts, gap = conn.stream("c2s" if direction == "initiator" else "s2c")
            if not data or ts is None:
                continue
            items.append(
                Item(
                    run.name,
                    "tcp",
                    ts,
                    src,
                    dst,
                    sp,
                    dp,
                    data,
                    desc.describe(data, True, run.encrypted),
                    conn.cid,
                    direction,
                    gap,
                )
            )
    items.sort(key=lambda it: it.ts)
    return items


def spread(seq: Sequence[Any], k: int) -> list[Any]:
    """Up to ``k`` elements spread evenly over ``seq`` (first and last included)."""
    if len(seq) <= k:
        return list(seq)
    if k == 1:
        return [seq[0]]
    idx = sorted({round(i * (len(seq) - 1) / (k - 1)) for i in range(k)})
    return [seq[i] for i in idx]


def select(items: list[Item], per_summary: int) -> tuple[list[Item], Counter[tuple[str, ...]]]:
    """Dedupe: UDP by (scenario, summary); TCP by connection (both directions' summaries)."""
    observed: Counter[tuple[str, ...]] = Counter()
    udp_groups: dict[tuple[str, str], list[Item]] = defaultdict(list)
    conns: dict[tuple[str, int], list[Item]] = defaultdict(list)
    for it in items:
        observed[(it.scenario, it.transport, it.decoded.summary)] += 1
        if it.transport == "udp":
            udp_groups[(it.scenario, it.decoded.summary)].append(it)
        else:
            assert it.conn is not None
            conns[(it.scenario, it.conn)].append(it)
    tcp_groups: dict[tuple[str, str], list[list[Item]]] = defaultdict(list)
    for (scenario, _cid), parts in conns.items():
        parts.sort(key=lambda it: it.direction != "initiator")
        key = " || ".join(f"{p.direction}:{p.decoded.summary}" for p in parts)
        tcp_groups[(scenario, key)].append(parts)
    chosen: list[Item] = []
    for group in udp_groups.values():
        chosen += spread(group, per_summary)
    for cgroup in tcp_groups.values():
        for parts in spread(cgroup, per_summary):
            chosen += parts
    chosen.sort(key=lambda it: (it.scenario != "plain", it.ts))
    return chosen, observed


def coverage(entries: list[dict[str, Any]]) -> dict[str, list[str]]:
    cov: dict[str, list[str]] = {}
    for kind, (transport, pattern) in REQUIRED_KINDS.items():
        cov[kind] = [
            e["file"]
            for e in entries
            if (transport is None or e["transport"] == transport)
            and re.search(pattern, e["summary"])
        ]
    rotated = [e["file"] for e in entries if e.get("key") == "k2"]
    cov["encrypted under rotated key k2"] = rotated
    fallback = {
        (e["scenario"], e["conn"])
        for e in entries
        if e["transport"] == "tcp"
        and e["direction"] == "initiator"
        and re.search(REQUIRED_KINDS["tcp ping"][1], e["summary"])
    }
    cov["tcp fallback ping+ack (same connection)"] = [
        e["file"]
        for e in entries
        if e["transport"] == "tcp"
        and (e["scenario"], e["conn"]) in fallback
        and e["direction"] == "responder"
        and re.search(r"\back\b", e["summary"])
    ]
    return cov


# --------------------------------------------------------------------------- output


def write_corpus(
    out: Path,
    runs: list[ScenarioRun],
    chosen: list[Item],
    observed: Counter[tuple[str, ...]],
    desc: Describer,
    nodes: list[NodeSpec],
    serf_version: str,
) -> dict[str, Any]:
    for sub in ("plain", "encrypted"):
        d = out / sub
        if d.is_dir():
            for old in d.glob("*.bin"):
                old.unlink()
        d.mkdir(parents=True, exist_ok=True)
    runs_by_name = {r.name: r for r in runs}
    counters: Counter[tuple[str, str]] = Counter()
    entries: list[dict[str, Any]] = []
    conn_ids: dict[tuple[str, int], int] = {}
    for it in chosen:
        run = runs_by_name[it.scenario]
        if it.transport == "udp":
            counters[(it.scenario, "udp")] += 1
            fname = f"{it.scenario}/udp-{counters[(it.scenario, 'udp')]:04d}.bin"
        else:
            assert it.conn is not None
            ckey = (it.scenario, it.conn)
            if ckey not in conn_ids:
                counters[(it.scenario, "tcp")] += 1
                conn_ids[ckey] = counters[(it.scenario, "tcp")]
            fname = f"{it.scenario}/tcp-{conn_ids[ckey]:04d}-{it.direction}.bin"
        (out / fname).write_bytes(it.data)
        entry: dict[str, Any] = {
            "file": fname,
            "transport": it.transport,
            "scenario": it.scenario,
            "src": it.src,
            "dst": it.dst,
            "src_port": it.src_port,
            "dst_port": it.dst_port,
            "first_byte": it.data[0],
            "length": len(it.data),
            "sha256": hashlib.sha256(it.data).hexdigest(),
            "summary": it.decoded.summary,
            "t": round(it.ts - run.t0, 3),
            "phase": phase_at(run, it.ts),
        }
        if it.transport == "tcp":
            entry["conn"] = conn_ids[(it.scenario, it.conn)] if it.conn is not None else None
            entry["direction"] = it.direction
            if it.gap:
                entry["gap"] = True
        if it.decoded.key is not None:
            entry["key"] = it.decoded.key
            entry["encryption_version"] = it.decoded.enc_version
        entries.append(entry)

    cov = coverage(entries)
    manifest: dict[str, Any] = {
        "description": (
            "Golden memberlist/Serf packets captured from real serf agents on loopback; "
            "see README.md"
        ),
        "generator": "scripts/capture_serf_golden.py",
        "reproduce": ".venv/bin/python scripts/capture_serf_golden.py --out tests/golden/serf",
        "captured_at": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "serf_version": serf_version.splitlines()[0] if serf_version else "",
        "serf_version_output": serf_version,
        "serf_package": serf_package(),
        "host": {"kernel": platform.release(), "python": platform.python_version()},
        "nodes": [
            {
                "name": n.name,
                "address": "127.0.0.1",
                "gossip_port": n.gossip_port,
                "rpc_addr": n.rpc_addr,
                "tags": n.tags,
                "gid": n.gid,
                "dscp": n.dscp,
            }
            for n in nodes
        ],
        "keys": {
            name: {"base64": b64, "bytes": len(base64.b64decode(b64))} for name, b64 in KEYS.items()
        },
        "key_usage": (
            "encrypted scenario starts with k1 as the only key; k2 is installed with "
            "`serf keys -install` and made primary with `serf keys -use` (phase key-use); "
            "each encrypted entry's `key` names the key that decrypts it"
        ),
        "user_event": {"name": USER_EVENT_NAME, "payload": USER_EVENT_PAYLOAD},
        "scenarios": {
            r.name: {
                "encrypted": r.encrypted,
                "phases": [{"t": round(t - r.t0, 2), "name": name} for t, name in r.phases],
                "commands": r.commands,
                "tcpdump": r.tcpdump_stats,
                "notes": r.notes,
            }
            for r in runs
        },
        "summary_grammar": (
            "layers outer>inner: 'encrypted vN' (AES-GCM, version byte N), 'crc' (type 12, "
            "CRC32 verified), 'compress' (type 9, LZW undone); 'compound[a, b]' lists parts; "
            "'user(serf:X)' is a memberlist user message carrying Serf message X; "
            "'pushPull(join=..,nodes=N,states=..)+state(serf:pushPull)' a push/pull listing N "
            "nodes in those memberlist states, with Serf's state appended; "
            "'dead(left)' a dead message with From == Node; '+trailing(n)' unexpected bytes"
        ),
        "observed_counts": [
            {"scenario": s, "transport": t, "summary": summ, "count": n}
            for (s, t, summ), n in sorted(observed.items())
        ],
        "msgpack_formats": {
            msg: {f: sorted(c) for f, c in sorted(fields.items())}
            for msg, fields in sorted(desc.formats.items())
        },
        "msgpack_key_orders": {
            msg: [list(order) for order in orders]
            for msg, orders in sorted(desc.key_orders.items())
        },
        "coverage": cov,
        "missing": [k for k, files in cov.items() if not files],
        "entries": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "README.md").write_text(render_readme(manifest))
    return manifest


WIRE_NOTES = [
    "## Wire-format observations (Debian's serf 0.9.4 build)",
    "",
    "* Go structs are msgpack **maps** keyed by the field name (fixstr), and the keys",
    "  come **sorted by name**, not in Go declaration order (e.g. ping is",
    "  Node, SeqNo, SourceAddr, SourceNode, SourcePort; alive is Addr, Incarnation,",
    "  Meta, Node, Port, Vsn). `omitempty` fields are absent when empty.",
    "* Strings **and `[]byte`** use the old msgpack raw family only: fixstr (0xa0-0xbf)",
    "  and str16 (0xda) even for 32..255 bytes (presumably str32 0xdb past 64 KiB); never",
    "  str8 (0xd9) and never bin8/16/32 (0xc4-0xc6). That covers Addr (4-byte IPv4),",
    "  Meta (serf tags: 0xff then a msgpack map), Vsn (`[]uint8`, a 6-byte raw string",
    "  pmin,pmax,pcur,dmin,dmax,dcur = 01 05 02 02 05 05), ack Payload, the compress",
    "  Buf and serf payloads. A nil `[]byte` is nil (0xc0).",
    "* Integers take the smallest **unsigned** format whatever the Go type (also for",
    "  `int` fields such as UserStateLen = 0xcd uint16, and State): positive fixint,",
    "  uint16 (0xcd) for ports, uint32 (0xce) for serf query IDs and timeouts.",
    "  No value in 128..255 and no negative integer occurs in this capture, so",
    "  uint8 (0xcc) and the signed formats are not exercised here.",
    "  Booleans are 0xc2/0xc3; serf's coordinates are float64 (0xcb).",
    "* Compression (type 9, LZW LSB/8) is used on UDP only when it makes the packet",
    "  smaller, but always on TCP streams. The CRC header (type 12) is only added",
    "  when memberlist is handed the destination node (gossip, and the probe's",
    "  ping+suspect compound), so plain pings/acks/nacks carry no CRC. Layering is",
    "  encrypt(crc(compress(msg))).",
    "* With encryption every UDP packet starts with the version byte 1 (AES-GCM,",
    "  12-byte nonce, no padding, empty AAD); TCP streams are 10, 4-byte BE length,",
    "  then the same, with those first five bytes as AAD.",
    "",
]


def render_readme(m: dict[str, Any]) -> str:
    lines = [
        "# Golden Serf/memberlist packets",
        "",
        "Raw UDP payloads and reassembled TCP byte streams captured from **real `serf` agents**",
        "talking to each other on loopback. The codec tests decode every file and check that",
        "our encoder produces the same layout. Generated by `scripts/capture_serf_golden.py`;",
        "do not edit by hand.",
        "",
        f"* captured: {m['captured_at']} (kernel {m['host']['kernel']})",
        f"* serf: `serf version` says `{m['serf_version']}`; {m['serf_package']}",
        "* three agents `a`, `b`, `c` on 127.0.0.1, `-profile=local`, compression on (default):",
        "",
        "| node | gossip | rpc | tags |",
        "|---|---|---|---|",
    ]
    for n in m["nodes"]:
        tags = ", ".join(f"{k}={v}" for k, v in n["tags"].items())
        lines.append(f"| {n['name']} | 127.0.0.1:{n['gossip_port']} | {n['rpc_addr']} | {tags} |")
    lines += [
        "",
        "## Reproduce",
        "",
        "Needs root (tcpdump, iptables, setgid), `serf` and `tcpdump`:",
        "",
        "```",
        m["reproduce"],
        "```",
        "",
        "Two runs, each its own tcpdump capture (`tcpdump -i lo -n -U -s 0 -w X.pcap` with a",
        "BPF filter on the three gossip ports): `plain` and `encrypted` (`-encrypt` with key",
        "k1, later `serf keys -install k2` and `serf keys -use k2`). Each run: join (b and c",
        "join a), steady state, `serf event` from b, a periodic push/pull, an iptables DROP of",
        "UDP to c's port (TCP fallback pings, indirect pings, nacks), SIGSTOP of c until a",
        "declares it failed (suspect, dead), SIGCONT (refutation: alive with a higher",
        "incarnation), `serf leave` on c (dead with From == Node). The exact commands with",
        "their time offsets are in `manifest.json` (`scenarios.*.commands`).",
        "",
        "Senders of TCP streams are identified by running each agent under its own gid and",
        "marking its packets with a per-node DSCP value (iptables mangle/OUTPUT owner match);",
        "the parser maps the IPv4 TOS byte back to the node.",
        "",
        "## Layout",
        "",
        "* `plain/udp-NNNN.bin`, `encrypted/udp-NNNN.bin`: one UDP payload each.",
        "* `*/tcp-NNNN-initiator.bin` / `tcp-NNNN-responder.bin`: the two directions of one",
        "  TCP connection, reassembled (retransmissions dropped).",
        "* `manifest.json`: one entry per file (`file`, `transport`, `scenario`, `src`, `dst`,",
        "  ports, `first_byte`, `length`, `sha256`, `summary`, `t`, `phase`, plus `conn` and",
        "  `direction` for TCP and `key`/`encryption_version` for encrypted data), the keys",
        "  (base64), the nodes, the commands, every summary observed with its count",
        "  (`observed_counts`), the msgpack formats seen per message field",
        "  (`msgpack_formats`), and `coverage`/`missing`.",
        "",
        f"Summary notation: {m['summary_grammar']}.",
        "",
        "Keys: "
        + ", ".join(f"`{k}` = `{v['base64']}` ({v['bytes']} bytes)" for k, v in m["keys"].items()),
        "",
        "## Inventory",
        "",
        "| scenario | transport | summary | kept | observed |",
        "|---|---|---|---|---|",
    ]
    kept: Counter[tuple[str, str, str]] = Counter(
        (e["scenario"], e["transport"], e["summary"]) for e in m["entries"]
    )
    for row in m["observed_counts"]:
        k = (row["scenario"], row["transport"], row["summary"])
        summ = row["summary"].replace("|", "\\|")
        lines.append(f"| {k[0]} | {k[1]} | `{summ}` | {kept.get(k, 0)} | {row['count']} |")
    lines += ["", "## Coverage", ""]
    for kind, files in m["coverage"].items():
        shown = ", ".join(f"`{f}`" for f in files[:3]) + (" …" if len(files) > 3 else "")
        lines.append(
            f"* {kind}: {len(files)} file(s) {shown}" if files else f"* {kind}: **missing**"
        )
    lines += [
        "",
        "## msgpack formats used by serf (go-codec `MsgpackHandle`)",
        "",
        "Per message and field: `key format:value format` as seen on the wire.",
        "",
    ]
    for msg, fields in m["msgpack_formats"].items():
        lines.append(
            f"* **{msg}**: " + "; ".join(f"{f} = {', '.join(v)}" for f, v in fields.items())
        )
    lines += ["", "Field order on the wire (`msgpack_key_orders`):", ""]
    for msg, orders in m["msgpack_key_orders"].items():
        lines.append(f"* **{msg}**: " + " / ".join(", ".join(o) for o in orders))
    lines += ["", *WIRE_NOTES]
    notes = [(s, n) for s, r in m["scenarios"].items() for n in r["notes"]]
    if notes:
        lines += ["", "## Capture notes", ""] + [f"* {s}: {n}" for s, n in notes]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=Path("tests/golden/serf"))
    ap.add_argument("--serf", default=shutil.which("serf") or "serf")
    ap.add_argument("--gossip-port", type=int, default=GOSSIP_BASE_PORT)
    ap.add_argument("--rpc-port", type=int, default=RPC_BASE_PORT)
    ap.add_argument("--per-summary", type=int, default=3, help="examples kept per summary")
    ap.add_argument("--scenarios", default="plain,encrypted")
    ap.add_argument(
        "--keep-work", type=Path, default=None, help="copy pcaps and agent logs here (debugging)"
    )
    args = ap.parse_args(argv)

    if os.geteuid() != 0:
        print("needs root (tcpdump, iptables, setgid)", file=sys.stderr)
        return 2
    for tool in (args.serf, "tcpdump", "iptables"):
        if shutil.which(tool) is None:
            print(f"missing tool: {tool}", file=sys.stderr)
            return 2
    nodes = make_nodes(args.gossip_port, args.rpc_port)
    busy = [p for n in nodes for p in (n.gossip_port, n.rpc_port) if not port_is_free(p)]
    if busy:
        print(f"ports in use: {busy}", file=sys.stderr)
        return 2
    serf_version = subprocess.run(
        [args.serf, "version"], capture_output=True, text=True, timeout=10
    ).stdout.strip()

    def on_term(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    res = Resources()
    runs: list[ScenarioRun] = []
    keys = {name: base64.b64decode(b64) for name, b64 in KEYS.items()}
    desc = Describer(keys)
    items: list[Item] = []
    with tempfile.TemporaryDirectory(prefix="serf-golden-") as tmp:
        work = Path(tmp)
        try:
            for name in args.scenarios.split(","):
                scen = Scenario(name, name == "encrypted", nodes, args.serf, work, res)
                try:
                    runs.append(scen.execute())
                finally:
                    res.close()
                    if args.keep_work is not None:
                        args.keep_work.mkdir(parents=True, exist_ok=True)
                        for f in work.iterdir():
                            shutil.copy(f, args.keep_work / f.name)
                items += analyse(runs[-1], nodes, desc)
        finally:
            res.close()
    chosen, observed = select(items, args.per_summary)
    manifest = write_corpus(args.out, runs, chosen, observed, desc, nodes, serf_version)
    total = sum(e["length"] for e in manifest["entries"])
    print(f"wrote {len(manifest['entries'])} files ({total} bytes) to {args.out}")
    if manifest["missing"]:
        print("missing kinds: " + ", ".join(manifest["missing"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
