"""The control API's latency while an agent is flooded: trickled push-pull streams and
connection floods.

One ``fast`` agent (the victim) and two peers, real processes on loopback
(``agent.demo.start_cluster``). The control API of the victim is asked ``members`` and
``info`` in turn, each over a fresh connection as ``swimctl`` does
(``agent.control.ControlClient``), every ``--poll-ms``, for ``--seconds`` per phase:

- ``quiet``: nothing else;
- ``streams``: ``--streams`` connections (default 24) each trickle an oversized push-pull
  stream (announcing 65,536 or 70,000 states, then valid states 4 KiB every 8 ms without
  end), reconnecting 50 ms after the victim cuts it;
- ``gossip-connects``: TCP connections to the gossip port, opened and closed at once, at
  ``--connect-rate`` per second;
- ``control-connects``: the same at the control socket.

Attackers run in a child process, so their threads do not share the measuring client's
GIL. Printed per phase: p50/p99/max of the round trips, the attack's achieved rate,
suspicions and deaths raised by any of the three agents, and the victim's CPU. Before each
phase the benchmark waits for the 1-minute load average to fall below ``--quiet-load``
(all waits together at most ``--quiet-wait-s``): the figure is for a quiet machine, and
each phase records the load it started under. Writes ``results/hostile-control-flood/``
(bench/results.py).

    python -m bench.control_flood                  # all four phases, 15 s each
    python -m bench.control_flood --phases quiet,streams --seconds 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import msgpack

from agent.control import ControlClient, ControlError
from agent.demo import LocalAgent, start_cluster, wait_converged
from bench import results
from swim import MsgType, NodeStateType, PushNodeState, encode_push_state

PHASES = ("quiet", "streams", "gossip-connects", "control-connects")
CHUNK_BYTES = 4096
CHUNK_PAUSE_S = 0.008
RECONNECT_PAUSE_S = 0.05
CONNECT_THREADS = 8


def _push_pull(nodes: int) -> bytes:
    header = {"Join": False, "Nodes": nodes, "UserStateLen": 0}
    return bytes([MsgType.PUSH_PULL]) + bytes(msgpack.packb(header))


def _trickle(port: int, head: bytes, stop: Event, opened: list[int], chunk: int) -> None:
    """Open stream after stream: ``head``, then valid states in 4 KiB chunks until cut."""
    state = encode_push_state(
        PushNodeState("flood", bytes([10, 9, 9, 9]), 7946, b"m" * 100, 1, NodeStateType.ALIVE, b"")
    )
    body = state * 64
    ring = body * 2  # the body repeats seamlessly: a chunk may span two copies
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                opened[0] += 1
                s.sendall(head)
                offset = 0
                while not stop.is_set():
                    s.sendall(ring[offset : offset + chunk])
                    offset = (offset + chunk) % len(body)
                    time.sleep(CHUNK_PAUSE_S)
        except OSError:
            pass
        time.sleep(RECONNECT_PAUSE_S)


def _connects(target: str | int, rate: float, stop: Event, opened: list[int]) -> None:
    """Open and close connections at ``rate`` per second (TCP port or Unix socket path)."""
    interval = 1.0 / rate
    due = time.monotonic()
    while not stop.is_set():
        try:
            if isinstance(target, int):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.settimeout(1)
                s.connect(("127.0.0.1", target))
            else:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(1)
                s.connect(target)
            s.close()
            opened[0] += 1
        except OSError:
            s.close()
        due += interval
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -1.0:
            due = time.monotonic()  # fell behind: do not burst to catch up


def _attack(phase: str, port: int, control: str, args: Any, stop: Event, out: Any) -> None:
    """The child process: run one phase's attackers until ``stop``; put the count opened."""
    opened = [0]
    threads: list[threading.Thread] = []
    if phase == "streams":
        heads = {
            "mixed": [_push_pull(65_536), _push_pull(70_000)],
            "endless": [_push_pull(65_536)],
            "over": [_push_pull(70_000)],
        }[args.kinds]
        for i in range(args.streams):
            head = heads[i % len(heads)]
            trickle = (port, head, stop, opened, args.chunk_bytes)
            threads.append(threading.Thread(target=_trickle, args=trickle))
    elif phase in ("gossip-connects", "control-connects"):
        where: str | int = port if phase == "gossip-connects" else control
        rate = args.connect_rate / CONNECT_THREADS
        for _ in range(CONNECT_THREADS):
            threads.append(threading.Thread(target=_connects, args=(where, rate, stop, opened)))
    for t in threads:
        t.daemon = True
        t.start()
    stop.wait()
    for t in threads:
        t.join(5)
    out.put(opened[0])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _counters(agents: list[LocalAgent]) -> dict[str, int]:
    out = {"suspicions": 0, "deaths": 0}
    for a in agents:
        stats = a.client.request("info")["stats"]
        out["suspicions"] += int(stats["suspicions_raised"])
        out["deaths"] += int(stats["deaths_declared"])
    return out


def wait_quiet(limit: float, deadline: float) -> float:
    """Wait until the 1-minute load average is below ``limit`` (at most until ``deadline``,
    the run's whole budget for waiting: a busy machine delays the run, never stalls it)."""
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return round(os.getloadavg()[0], 2)


def _pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[max(0, min(len(sorted_ms) - 1, int(len(sorted_ms) * q + 0.5) - 1))]


def run_phase(phase: str, agents: list[LocalAgent], args: Any) -> dict[str, Any]:
    victim = agents[0]
    load = wait_quiet(args.quiet_load, args.quiet_deadline)
    before = _counters(agents)
    client = ControlClient(victim.control, timeout_s=10)
    ctx = multiprocessing.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(
        target=_attack, args=(phase, victim.port, str(victim.control), args, stop, out)
    )
    child.start()
    time.sleep(1.0 if phase != "quiet" else 0)  # the flood reaches its pace first
    cpu0, start = _cpu_s(victim.proc.pid), time.monotonic()
    samples: list[float] = []
    failures = 0
    try:
        while time.monotonic() - start < args.seconds:
            t0 = time.monotonic()
            try:
                client.request("members" if len(samples) % 2 else "info")
                samples.append((time.monotonic() - t0) * 1000)
            except ControlError:
                failures += 1
            time.sleep(max(0.0, args.poll_ms / 1000 - (time.monotonic() - t0)))
    finally:
        elapsed = time.monotonic() - start
        cpu = (_cpu_s(victim.proc.pid) - cpu0) / elapsed
        stop.set()
        opened = out.get(timeout=30)
        child.join(10)
    time.sleep(2)  # the last streams reach their deadline
    after = _counters(agents)
    samples.sort()
    row = {
        "phase": phase,
        "load": load,
        "samples": len(samples),
        "failed": failures,
        "p50_ms": round(_pct(samples, 0.5), 1),
        "p99_ms": round(_pct(samples, 0.99), 1),
        "max_ms": round(samples[-1], 1),
        "attack_per_s": round(opened / (elapsed + 1.0)) if phase != "quiet" else 0,
        "suspicions": after["suspicions"] - before["suspicions"],
        "deaths": after["deaths"] - before["deaths"],
        "victim_cpu": round(cpu, 2),
    }
    print(
        f"{phase:17} load {load:4.2f}  p50 {row['p50_ms']:6.1f}  p99 {row['p99_ms']:6.1f}  "
        f"max {row['max_ms']:6.1f} ms  ({len(samples)} answers, {failures} failed)  "
        f"attack {row['attack_per_s']}/s  suspicions {row['suspicions']}  "
        f"deaths {row['deaths']}  victim CPU {row['victim_cpu']:.2f}",
        flush=True,
    )
    return row


def as_result(rows: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    figures: dict[str, results.Figure] = {}
    for r in rows:
        key = r["phase"].replace("-", "_")
        figures[f"{key}_p99_ms"] = results.figure(
            f"Control API p99, {r['phase']} (load {r['load']:.2f})", r["p99_ms"], "ms", 1
        )
    figures["suspicions"] = results.figure(
        "Suspicions and deaths raised by any agent, all phases",
        sum(r["suspicions"] + r["deaths"] for r in rows),
        "",
        0,
    )
    cols = [
        ("phase", "phase", None),
        ("load", "load (1 min) at start", 2),
        ("samples", "answers", None),
        ("p50_ms", "p50 ms", 1),
        ("p99_ms", "p99 ms", 1),
        ("max_ms", "max ms", 1),
        ("attack_per_s", "streams or connections / s", None),
        ("suspicions", "suspicions", None),
        ("deaths", "deaths", None),
        ("victim_cpu", "victim CPU (cores)", 2),
    ]
    return {
        "question": "hostile-control-flood",
        "title": "Control API under floods: trickled push-pull streams and connection floods",
        "method": (
            f"Three `fast` agents on loopback; the victim's control API is asked `info` and "
            f"`members` in turn over a fresh connection every {args.poll_ms} ms for "
            f"{args.seconds:g} s per phase: quiet; {args.streams} connections trickling "
            "oversized push-pull streams (65,536 or 70,000 states announced, valid states "
            "4 KiB every 8 ms); TCP connects to the gossip port and connects to the control "
            f"socket at {args.connect_rate:g}/s (opened and closed at once). Each phase "
            f"waits for a 1-minute load below {args.quiet_load} (up to {args.quiet_wait_s:g} s "
            "in all)."
        ),
        "figures": figures,
        "tables": [
            {
                "caption": "Each phase",
                "columns": [results.column(k, label, d) for k, label, d in cols],
                "rows": rows,
            }
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated")
    parser.add_argument("--seconds", type=float, default=15.0, help="per phase")
    parser.add_argument("--poll-ms", type=int, default=25)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--kinds", choices=("mixed", "endless", "over"), default="mixed")
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES)
    parser.add_argument("--connect-rate", type=float, default=3000.0, help="per second")
    parser.add_argument("--quiet-load", type=float, default=1.5)
    parser.add_argument(
        "--quiet-wait-s", type=float, default=600.0, help="the most the whole run waits"
    )
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(unknown)}; from {', '.join(PHASES)}")
    args.quiet_deadline = time.monotonic() + args.quiet_wait_s
    started = results.machine()
    with tempfile.TemporaryDirectory(prefix="control-flood-") as tmp:
        agents = start_cluster(3, Path(tmp), "fast")
        try:
            wait_converged(agents, 30)
            rows = [run_phase(p, agents, args) for p in phases]
        finally:
            for a in agents:
                a.stop()
    results.record(args, "bench.control_flood", argv, started, as_result(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
