"""Real latency and jitter between network namespaces (``Testbed.delay``, NFQUEUE).

- a one-way 30 ± 5 ms delay really adds ~30 ms to a UDP round trip and to a TCP connect,
  and reorders datagrams sent 1 ms apart (a ping-like exchange between two namespaces:
  ``python -m tests.netns.test_latency echo|ping``);
- a ``fast`` cluster of 6 agents, 2 of them in a "far rack" 30 ± 10 ms away each way (so
  round trips of 40–80 ms against adaptive probe timeouts of 20–125 ms), suspects nobody
  in 20 s and probes the far rack directly, where the same cluster with one static 20 ms
  timeout sends every probe across the racks indirect (``far_rack``; ``python -m
  tests.netns.test_latency far-rack --help`` runs one arm with loss, other delays, other
  profiles: the WAN rows of RELIABILITY.md).

Each prints a ``NETNS-RESULT`` line (``-s``). Skipped where namespaces or nfnetlink_queue
are missing. Bounded to about two minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from agent.procs import stop, until
from tests.netns import delayer, harness
from tests.netns.harness import Testbed, Testbeds, delay_unavailable_reason

pytestmark = pytest.mark.slow

ECHO_PORT = 9000
WINDOW_S = float(os.environ.get("SWIM_NETNS_LATENCY_WINDOW_S", "20"))
CRASH_BOUND_S = 20.0  # fast declares a crash dead in ~1-2 s; a bound, not a target
_PING = struct.Struct("!Iq")  # sequence number, send time (ns, the client's monotonic clock)


@pytest.fixture
def _nfqueue_guard() -> None:
    reason = delay_unavailable_reason()
    if reason:
        pytest.skip(reason)


def report(scenario: str, **figures: object) -> None:
    text = " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()
    )
    print(f"\nNETNS-RESULT {scenario} {text}", flush=True)


# --- the ping-like exchange, run inside namespaces ------------------------------------------


def _echo(ip: str, seconds: float) -> int:
    """Echo UDP datagrams and accept TCP connections on ip:ECHO_PORT for ``seconds``."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((ip, ECHO_PORT))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((ip, ECHO_PORT))
    tcp.listen(16)
    tcp.settimeout(0)
    udp.settimeout(0.05)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data, addr = udp.recvfrom(64)
            udp.sendto(data, addr)
        except TimeoutError:
            pass
        try:
            conn, _ = tcp.accept()
            conn.close()
        except BlockingIOError:
            pass
    return 0


def _ping(ip: str, count: int, spacing_ms: float) -> int:
    """Send ``count`` datagrams ``spacing_ms`` apart, then time one TCP connect; print JSON
    (round trips in send order, the order echoes came back, the connect time)."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.connect((ip, ECHO_PORT))
    udp.settimeout(0)
    rtt_ms: dict[int, float] = {}
    order: list[int] = []

    def drain() -> None:
        while True:
            try:
                data = udp.recv(64)
            except (BlockingIOError, ConnectionRefusedError):
                return
            seq, sent = _PING.unpack(data)
            rtt_ms[seq] = (time.monotonic_ns() - sent) / 1e6
            order.append(seq)

    start = time.monotonic()
    for seq in range(count):
        while time.monotonic() < start + seq * spacing_ms / 1000:
            drain()
        udp.send(_PING.pack(seq, time.monotonic_ns()))
    end = time.monotonic() + 1.0
    while time.monotonic() < end and len(order) < count:
        drain()
        time.sleep(0.001)
    t0 = time.monotonic()
    with socket.create_connection((ip, ECHO_PORT), timeout=5):
        connect_ms = (time.monotonic() - t0) * 1000
    print(json.dumps({"rtt_ms": [rtt_ms.get(s) for s in range(count)], "order": order,
                      "connect_ms": connect_ms}))  # fmt: skip
    return 0


def _in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.netns.test_latency", *args]


def ping(bed: Testbed, src: int, dst: int, count: int = 300, spacing_ms: float = 1.0) -> Any:
    """One ping-like exchange from host src to host dst; the client's JSON."""
    root = Path(__file__).resolve().parents[2]
    server = subprocess.Popen(
        _in_ns(bed.host(dst).ns, "echo", bed.host(dst).ip, "--seconds", "20"),
        stdout=subprocess.PIPE, text=True, cwd=root,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(
            _in_ns(bed.host(src).ns, "ping", bed.host(dst).ip, "--count", str(count),
                   "--spacing-ms", str(spacing_ms)),
            capture_output=True, text=True, timeout=30, cwd=root, check=True,
        )  # fmt: skip
        return json.loads(out.stdout)
    finally:
        stop(server, timeout_s=5)
        if server.stdout is not None:
            server.stdout.close()


def inversions(order: list[int]) -> int:
    """Echoes that came back after one sent later than them (adjacent pairs)."""
    return sum(1 for a, b in itertools.pairwise(order) if b < a)


STATIC_TIMEOUT_TOML = "[protocol]\nadaptive_probe_timeout = false\nprobe_timeout_ms = 20\n"
"""``fast`` with one fixed 20 ms probe timeout: the adaptive timeout's floor, the value a
uniform 1 ms fabric would get from it, used for everyone as a static setting would be."""


def far_rack(
    bed: Testbed,
    far: list[int],
    mean_ms: float,
    jitter_ms: float,
    *,
    loss: float = 0.0,
    window_s: float = WINDOW_S,
    profile: str = "fast",
    config_toml: str | None = None,
    seed: int = 11,
    crash_bound_s: float | None = None,
) -> dict[str, Any]:
    """Start ``profile`` agents on ``bed`` with hosts ``far`` ``mean_ms`` ± ``jitter_ms``
    away from the rest each way (and ``loss`` into every host), watch ``window_s`` after
    they converge; the figures: suspect/dead events about far and near members, and the
    probe work (from each agent's ``info`` stats, window only) it took. With
    ``crash_bound_s``, then SIGKILL the last far host and time its ``dead`` at every other
    agent (first and last observer; at most that long)."""
    n = len(bed.hosts)
    near = [i for i in range(1, n + 1) if i not in far]
    bed.delay(near, far, mean_ms, jitter_ms, seed=seed)  # the racks are apart from the start
    if loss:
        bed.host_loss(loss)
    started = time.time()
    for i in range(1, n + 1):
        bed.start_agent(i, profile, config_toml=config_toml)
    for i in range(1, n + 1):
        bed.agent(i).wait_ready()
    join_s = bed.wait_converged(60)
    joining = bed.events(started, kinds=("suspect", "dead"))
    since = time.time()
    before = [bed.agent(i).info()["stats"] for i in range(1, n + 1)]
    health_max = 0
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        dead = [a.name for a in (bed.agent(i) for i in range(1, n + 1)) if not a.running()]
        assert not dead, f"agent(s) exited: {dead}"
        health_max = max([health_max] + [bed.agent(i).info()["health_score"] for i in far])
        time.sleep(1)
    after = [bed.agent(i).info()["stats"] for i in range(1, n + 1)]
    events = bed.events(since, kinds=("suspect", "dead"))
    converged = bed.converged()
    detection: dict[str, Any] = {}
    if crash_bound_s is not None:
        victim = bed.host(far[-1]).node
        killed_at = bed.kill(far[-1])
        observers = {bed.host(i).node for i in range(1, n + 1) if i != far[-1]}

        def dead_at() -> dict[str, float]:
            found: dict[str, float] = {}
            for e in bed.events(killed_at, kinds=("dead",)):
                if e.member == victim and e.observer in observers:
                    found.setdefault(e.observer, e.at - killed_at)
            return found

        with contextlib.suppress(TimeoutError):
            until(lambda: len(dead_at()) == len(observers), crash_bound_s, "crash detected")
        seen = sorted(dead_at().values())
        detection = {
            "crash_detected_at": f"{len(seen)}/{len(observers)}",
            "crash_first_s": seen[0] if seen else float("nan"),
            "crash_last_s": seen[-1] if seen else float("nan"),
        }
    bed.undelay()
    far_names = {bed.host(i).node for i in far}

    def window(key: str) -> int:
        return sum(
            int(a.get(key, 0)) - int(b.get(key, 0)) for a, b in zip(after, before, strict=True)
        )

    packets = sum(st.get("packets", 0) for st in bed.delayer_stats)
    delay_sum = sum(st.get("delay_mean_ms", 0) * st.get("packets", 0) for st in bed.delayer_stats)
    return {
        "agents": n,
        "far": len(far),
        "mean_ms": mean_ms,
        "jitter_ms": jitter_ms,
        "loss": loss,
        "static": config_toml is not None,
        "window_s": window_s,
        "join_s": join_s,
        "suspicions_while_joining": len(joining),
        "far_suspect_events": sum(e.kind == "suspect" and e.member in far_names for e in events),
        "near_suspect_events": sum(
            e.kind == "suspect" and e.member not in far_names for e in events
        ),
        "dead_events": sum(e.kind == "dead" for e in events),
        "suspicions_raised": window("suspicions_raised"),
        "probes": window("probes_sent"),
        "indirect_probes": window("indirect_probes_sent"),
        "tcp_fallback_probes": window("tcp_fallback_probes"),
        "tcp_fallback_rescues": window("tcp_fallback_rescues"),
        "nacks": window("nacks_received"),
        "health_score_max_far": health_max,
        "converged": converged,
        "delayed_packets": packets,
        "delay_mean_ms": delay_sum / max(packets, 1),
        **detection,
    }


# --- tests ----------------------------------------------------------------------------------


def test_nfqueue_messages_encode_and_parse() -> None:
    """The delayer's netlink encoding, without a kernel: config, packet, verdict, error."""
    (cfg,) = delayer.parse_messages(
        delayer.config_msg(7, 3, delayer.cfg_cmd(delayer.NFQNL_CFG_CMD_BIND),
                           delayer.cfg_maxlen(512))
    )  # fmt: skip
    assert (cfg.kind, cfg.seq) == (delayer.msg_type(delayer.NFQNL_MSG_CONFIG), 3)
    assert cfg.flags == delayer.NLM_F_REQUEST | delayer.NLM_F_ACK
    assert cfg.payload[:4] == bytes([socket.AF_INET, 0, 0, 7])
    attrs = delayer.parse_attrs(cfg.payload[4:])
    assert attrs[delayer.NFQA_CFG_CMD] == struct.pack("!BxH", 1, socket.AF_INET)
    assert attrs[delayer.NFQA_CFG_QUEUE_MAXLEN] == struct.pack("!I", 512)
    assert len(delayer.cfg_params(delayer.NFQNL_COPY_META)) == 12  # 4 + packed 5, padded

    hdr = delayer.nlattr(delayer.NFQA_PACKET_HDR, struct.pack("!IHB", 0xABCDEF, 0x0800, 3))
    payload = bytes([socket.AF_INET, 0, 0, 7]) + hdr + delayer.nlattr(delayer.NFQA_PAYLOAD, b"x")
    two = delayer.nlmsg(delayer.msg_type(delayer.NFQNL_MSG_PACKET), 0, 0, payload) * 2
    packets = [delayer.parse_packet(m) for m in delayer.parse_messages(two)]
    assert packets == [delayer.QueuedPacket(7, 0xABCDEF, 0x0800, 3)] * 2
    assert list(delayer.parse_messages(two[:-3])) == list(delayer.parse_messages(two))[:1]

    (v,) = delayer.parse_messages(delayer.verdict_msg(7, 0xABCDEF))
    assert delayer.parse_attrs(v.payload[4:])[delayer.NFQA_VERDICT_HDR] == struct.pack(
        "!II", delayer.NF_ACCEPT, 0xABCDEF
    )
    err = delayer.nlmsg(delayer.NLMSG_ERROR, 0, 3, struct.pack("=i", -16) + cfg.payload)
    assert [delayer.parse_error(m) for m in delayer.parse_messages(err)] == [16]


def test_delay_draws_stay_in_their_bounds() -> None:
    rng = random.Random(1)
    uniform = [delayer.DelaySpec(30, 5).draw_ms(rng) for _ in range(2000)]
    assert 25 <= min(uniform) < 26 and 34 < max(uniform) <= 35
    normal = [delayer.DelaySpec(30, 10, "normal").draw_ms(rng) for _ in range(2000)]
    assert min(normal) >= 0 and max(normal) <= 70 and 9 < statistics.stdev(normal) < 11
    with pytest.raises(ValueError):
        delayer.DelaySpec(10, 11)


@pytest.mark.usefixtures("_nfqueue_guard")
def test_one_way_delay_adds_its_mean_and_jitter_reorders(testbed: Testbeds) -> None:
    bed = testbed(2)
    base = ping(bed, 1, 2)
    base_rtts = [r for r in base["rtt_ms"] if r is not None]
    bed.delay([1], [2], 30, 5, both=False, seed=7)
    got = ping(bed, 1, 2)
    bed.undelay()
    rtts = [r for r in got["rtt_ms"] if r is not None]
    stats = bed.delayer_stats[0]
    figures = {
        "base_median_ms": statistics.median(base_rtts),
        "median_ms": statistics.median(rtts),
        "min_ms": min(rtts),
        "max_ms": max(rtts),
        "stdev_ms": statistics.stdev(rtts),
        "received": len(rtts),
        "reordered": inversions(got["order"]),
        "base_reordered": inversions(base["order"]),
        "tcp_connect_ms": got["connect_ms"],
        "base_tcp_connect_ms": base["connect_ms"],
        "delayer_packets": stats["packets"],
        "delayer_late_max_ms": stats["late_max_ms"],
    }
    report("delay-30ms-jitter-5ms", **figures)
    assert len(rtts) >= 290  # the delayer loses nothing
    assert 28 <= figures["median_ms"] <= 45, figures  # 30 ms added, ~ms of scheduling
    assert figures["min_ms"] >= 24.5, figures  # nothing overtakes the lowest draw (25 ms)
    assert 2 <= figures["stdev_ms"] <= 8, figures  # uniform ±5 ms: σ = 2.9 ms
    assert figures["reordered"] >= 20, figures  # 10 ms of spread over 1 ms spacing
    assert got["connect_ms"] >= 24.5, figures  # the SYN is delayed too (TCP, not just UDP)
    assert stats["packets"] >= 300


@pytest.mark.usefixtures("_nfqueue_guard")
def test_far_rack_adaptive_timeouts_against_a_static_one(testbed: Testbeds) -> None:
    """Both arms in one run: ``fast`` as shipped (adaptive per-peer timeouts) and ``fast``
    with one static 20 ms timeout, on 6 hosts of which 2 sit 30 ± 10 ms away each way."""
    adaptive = far_rack(testbed(6), [5, 6], 30, 10, crash_bound_s=CRASH_BOUND_S)
    report("far-rack-30ms-jitter-10ms-fast-n6", **adaptive)
    static = far_rack(
        testbed(6), [5, 6], 30, 10, config_toml=STATIC_TIMEOUT_TOML, crash_bound_s=CRASH_BOUND_S
    )
    report("far-rack-30ms-jitter-10ms-fast-static-20ms-n6", **static)
    for arm in (adaptive, static):
        assert arm["delayed_packets"] > 0, arm
        assert arm["dead_events"] == 0, arm
        assert arm["converged"], arm
        assert arm["crash_detected_at"] == "5/5", arm  # then n6 killed: dead everywhere
    # adaptive: each peer's timeout follows its own round trips, so far members answer
    # direct probes in time and nobody is suspected
    assert adaptive["far_suspect_events"] == adaptive["near_suspect_events"] == 0, adaptive
    assert adaptive["indirect_probes"] <= 0.02 * adaptive["probes"], adaptive
    # static: every probe across the racks (about half of them) outlives 20 ms and goes
    # indirect; a late direct ack still lands within the probe interval, so without loss
    # nobody is suspected either, at the price of the indirect round (RELIABILITY.md has
    # the runs with loss, where the static arm raises suspicions and the adaptive one none)
    assert static["indirect_probes"] >= 0.3 * static["probes"], static


def _main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.netns.test_latency")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("echo")
    e.add_argument("ip")
    e.add_argument("--seconds", type=float, default=20)
    q = sub.add_parser("ping")
    q.add_argument("ip")
    q.add_argument("--count", type=int, default=300)
    q.add_argument("--spacing-ms", type=float, default=1.0)
    f = sub.add_parser("far-rack", help="one far-rack run; prints its NETNS-RESULT line")
    f.add_argument("--agents", type=int, default=6)
    f.add_argument("--far", type=int, default=2, help="the last N hosts are the far rack")
    f.add_argument("--mean-ms", type=float, default=30)
    f.add_argument("--jitter-ms", type=float, default=10)
    f.add_argument("--loss", type=float, default=0.0)
    f.add_argument("--window-s", type=float, default=30)
    f.add_argument("--profile", default="fast")
    f.add_argument("--static", action="store_true", help="fixed 20 ms probe timeouts")
    f.add_argument("--seed", type=int, default=11)
    f.add_argument("--crash-bound-s", type=float, help="then kill a far host, time its death")
    args = p.parse_args()
    if args.cmd == "far-rack":

        def interrupted(signum: int, _frame: object) -> None:
            raise KeyboardInterrupt  # so the testbed is torn down

        signal.signal(signal.SIGTERM, interrupted)
        with harness.testbeds(Path(tempfile.mkdtemp(prefix="swim-far-rack-"))) as make:
            bed = make(args.agents)
            figures = far_rack(
                bed,
                list(range(args.agents - args.far + 1, args.agents + 1)),
                args.mean_ms,
                args.jitter_ms,
                loss=args.loss,
                window_s=args.window_s,
                profile=args.profile,
                config_toml=STATIC_TIMEOUT_TOML if args.static else None,
                seed=args.seed,
                crash_bound_s=args.crash_bound_s,
            )
        report("far-rack", **figures)
        return 0
    if args.cmd == "echo":
        return _echo(args.ip, args.seconds)
    return _ping(args.ip, args.count, args.spacing_ms)


if __name__ == "__main__":
    sys.exit(_main())
