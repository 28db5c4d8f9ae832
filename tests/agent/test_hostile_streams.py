"""Hostile streams cannot stall an agent.

A real 3-agent cluster (``agent.demo.start_cluster``, the ``fast`` profile, real processes
on loopback). An attacker in this process opens ``CONNECTIONS`` TCP connections at once to
one agent, the victim, for ``FLOOD_S`` seconds, each trickling one hostile stream in small
chunks (the pacing that made the old reader re-parse its growing buffer on every chunk):
push-pull streams announcing 65,536 states and sending them without end, push-pull and
user headers over the limits, a user message announcing 20 MiB, a compressed stream whose
buffer never ends, garbage; with encryption on, garbage and truncated encrypted streams and
plaintext streams. Meanwhile the victim's control API is asked ``info`` every
``POLL_S`` s. Asserted:

- no agent raises a suspicion (``stats.suspicions_raised``) or declares a death, and the
  victim refutes nothing: the flood never made anyone doubt the victim;
- the control API's p99 latency is below ``CONTROL_STALL_S``: a stall bound, not the
  target. The target (p99 < 50 ms) is a measured figure, printed here and recorded in
  RELIABILITY.md from a run on an idle box; asserting it would time the box (a loaded
  CI runner or a soak next door doubles it), while the reader this replaced had a p99
  of 1.2 s, which the stall bound still fails;
- the victim's RSS (/proc/<pid>/status VmRSS) stays below ``RSS_BOUND_MIB``;
- the victim counts the streams it cut, by reason (``stats.dropped``), for every kind sent.

Figures are printed (run with ``-s``); see RELIABILITY.md "Hostile input".
"""

from __future__ import annotations

import base64
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest

from agent.control import ControlClient
from agent.demo import LocalAgent, start_cluster, wait_converged
from swim import MsgType, NodeStateType, PushNodeState, encode_push_state

pytestmark = pytest.mark.slow

FLOOD_S = float(os.environ.get("SWIM_HOSTILE_STREAM_S", "20"))
CONNECTIONS = int(os.environ.get("SWIM_HOSTILE_STREAM_CONNECTIONS", "64"))
CHUNK_BYTES = 4096
CHUNK_PAUSE_S = 0.008
RECONNECT_PAUSE_S = 0.05  # a connection flood is not the subject here: the streams are
POLL_S = 0.05
CONTROL_STALL_S = 0.5
RSS_BOUND_MIB = 150.0
KEY = base64.b64encode(bytes(range(32))).decode()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def stream_kinds(encrypted: bool, rng: random.Random) -> dict[str, tuple[bytes, bytes, int | None]]:
    """name -> (head, body repeated after it, total bytes then close or None for endless)."""
    state = encode_push_state(
        PushNodeState("flood", bytes([10, 9, 9, 9]), 7946, b"m" * 100, 1, NodeStateType.ALIVE, b"")
    )

    def push_pull(nodes: int) -> bytes:
        header = {"Join": False, "Nodes": nodes, "UserStateLen": 0}
        return bytes([MsgType.PUSH_PULL]) + bytes(msgpack.packb(header))

    def user(length: int) -> bytes:
        return bytes([MsgType.USER]) + bytes(msgpack.packb({"UserMsgLen": length}))

    compressed = bytes([MsgType.COMPRESS]) + b"\x82" + msgpack.packb("Algo") + b"\x00"
    compressed += msgpack.packb("Buf") + b"\xc6" + struct.pack(">I", 20 * 1024 * 1024)
    noise = rng.randbytes(64 * 1024)
    kinds: dict[str, tuple[bytes, bytes, int | None]] = {
        "push_pull_endless": (push_pull(65_536), state * 64, None),
        "push_pull_oversized": (push_pull(70_000), state * 64, None),
        "user_endless": (user(20 * 1024 * 1024), noise, None),
        "user_oversized": (user(21 * 1024 * 1024), noise, None),
        "compressed_endless": (compressed, noise, None),
        "garbage": (b"\xff", noise, None),
    }
    if encrypted:
        kinds["encrypted_endless"] = (b"\x0a" + struct.pack(">I", 10_000_000), noise, None)
        kinds["encrypted_garbage"] = (b"\x0a" + struct.pack(">I", 100_000), noise, None)
        kinds["encrypted_truncated"] = (b"\x0a" + struct.pack(">I", 100_000), noise, 50_000)
        kinds["encrypted_oversized"] = (b"\x0a\xff\xff\xff\xff", noise, None)
    return kinds


class Attacker:
    """``CONNECTIONS`` threads, each opening stream after stream of one kind at the victim."""

    def __init__(self, port: int, encrypted: bool) -> None:
        self.port = port
        self.kinds = stream_kinds(encrypted, random.Random(16))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.opened: Counter[str] = Counter()
        self.closed_by_victim: Counter[str] = Counter()
        self.bytes_sent = 0
        self.errors: list[BaseException] = []
        names = sorted(self.kinds)
        self.threads = [
            threading.Thread(target=self._run, args=(names[i % len(names)],), daemon=True)
            for i in range(CONNECTIONS)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)

    def _run(self, kind: str) -> None:
        try:
            while not self.stop.is_set():
                self._one(kind)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def _one(self, kind: str) -> None:
        head, body, total = self.kinds[kind]
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        except OSError:
            time.sleep(0.05)
            return
        with self.lock:
            self.opened[kind] += 1
        sent = 0
        cut = False
        with s:
            try:
                s.sendall(head)
                offset = 0
                ring = body * 2  # the body repeats seamlessly: a chunk may span two copies
                while not self.stop.is_set() and (total is None or sent < total):
                    chunk = ring[offset : offset + CHUNK_BYTES]
                    offset = (offset + CHUNK_BYTES) % len(body)
                    s.sendall(chunk)
                    sent += len(chunk)
                    time.sleep(CHUNK_PAUSE_S)
            except OSError:
                cut = True
        with self.lock:
            self.bytes_sent += sent
            if cut:
                self.closed_by_victim[kind] += 1
        time.sleep(RECONNECT_PAUSE_S)


def _stats(agent: LocalAgent) -> dict[str, Any]:
    stats: dict[str, Any] = agent.client.request("info")["stats"]
    return stats


@pytest.mark.parametrize("encrypted", [False, True], ids=["plaintext", "encrypted"])
def test_hostile_streams_do_not_stall_the_victim(tmp_path: Path, encrypted: bool) -> None:
    extra = ["--encrypt", KEY] if encrypted else []
    agents = start_cluster(3, tmp_path, "fast", extra)
    try:
        wait_converged(agents, 30)
        time.sleep(1)
        victim, others = agents[0], agents[1:]
        before = {a.name: _stats(a) for a in agents}
        client = ControlClient(victim.control, timeout_s=10)
        baseline = rss_mib(victim.proc.pid)
        attacker = Attacker(victim.port, encrypted)
        latencies: list[float] = []
        peak = baseline
        not_alive: Counter[str] = Counter()
        cpu_before = cpu_s(victim.proc.pid)
        start = time.monotonic()
        attacker.start()
        try:
            polls = 0
            while time.monotonic() - start < FLOOD_S:
                t0 = time.monotonic()
                client.request("info")
                latencies.append(time.monotonic() - t0)
                polls += 1
                if polls % 10 == 0:
                    peak = max(peak, rss_mib(victim.proc.pid))
                    for other in others:
                        status = other.members().get(victim.name, {}).get("status", "missing")
                        if status != "alive":
                            not_alive[f"{other.name}:{status}"] += 1
                assert victim.proc.poll() is None, "the victim died"
                time.sleep(max(0.0, POLL_S - (time.monotonic() - t0)))
        finally:
            attacker.join()
        flood_s = time.monotonic() - start
        victim_cpu = (cpu_s(victim.proc.pid) - cpu_before) / flood_s
        peak = max(peak, rss_mib(victim.proc.pid))
        time.sleep(3)  # the last streams reach their deadline
        after = {a.name: _stats(a) for a in agents}

        def delta(name: str, key: str) -> int:
            return int(after[name][key]) - int(before[name][key])

        dropped = Counter(after[victim.name]["dropped"])
        dropped.subtract(before[victim.name]["dropped"])
        latencies.sort()
        p99 = latencies[int(len(latencies) * 0.99) - 1]
        suspicions = {a.name: delta(a.name, "suspicions_raised") for a in agents}
        deaths = {a.name: delta(a.name, "deaths_declared") for a in agents}
        report = {
            "encrypted": encrypted,
            "seconds": round(time.monotonic() - start, 1),
            "streams_opened": dict(attacker.opened),
            "streams_per_s": round(sum(attacker.opened.values()) / flood_s),
            "streams_cut_by_victim": dict(attacker.closed_by_victim),
            "mib_sent": round(attacker.bytes_sent / 2**20, 1),
            "victim_cpu_cores": round(victim_cpu, 2),
            "dropped": {k: v for k, v in dropped.items() if v},
            "suspicions_raised": suspicions,
            "deaths_declared": deaths,
            "victim_refutations": delta(victim.name, "refutations"),
            "victim_seen_not_alive": dict(not_alive),
            "control_calls": len(latencies),
            "control_p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
            "control_p99_ms": round(p99 * 1000, 1),
            "control_max_ms": round(latencies[-1] * 1000, 1),
            "rss_baseline_mib": round(baseline, 1),
            "rss_peak_mib": round(peak, 1),
            "stalls": delta(victim.name, "stalls"),
        }
        print("\nHOSTILE_STREAMS", report)

        assert not attacker.errors, attacker.errors
        assert sum(suspicions.values()) == 0, report
        assert sum(deaths.values()) == 0, report
        assert report["victim_refutations"] == 0, report
        assert not not_alive, report
        assert p99 < CONTROL_STALL_S, report
        assert peak < RSS_BOUND_MIB, report
        assert set(attacker.opened) == set(attacker.kinds), report
        # every kind was cut by the victim and counted: deadline, size, garbage, crypto
        assert set(attacker.closed_by_victim) == set(attacker.kinds) - {"encrypted_truncated"}
        assert dropped["stream_timeout"] > 0, report
        assert dropped["oversized"] > 0, report
        if not encrypted:
            assert dropped["unexpected_type"] > 0, report
        else:
            assert dropped["decrypt_failed"] > 0 and dropped["not_encrypted"] > 0, report
            assert dropped["malformed"] > 0, report  # the truncated encrypted streams
    finally:
        for a in agents:
            a.stop()
