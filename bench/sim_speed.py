"""How fast and how small: N bootstrapped ``swim.Node``s on a minimal virtual-time loop.

Every node is a real ``swim.Node`` started with ``Node.bootstrap`` from one shared
``MembershipSnapshot`` (no join traffic), then the loop runs ``--sim-s`` simulated seconds:
packets are delivered after a uniform 1–5 ms latency, streams (push-pull, TCP ping) are
parsed with the receiver's own ``parse_stream`` and answered with ``handle_stream``, timers
fire at their deadlines. Optionally ``--crash`` nodes die at ``--crash-at-s`` so the run
includes suspicion and death gossip.

Prints wall time, node-seconds per wall second, events per second, and memory per node
(RSS growth while building and bootstrapping the nodes, and after the run).

    .venv/bin/python -m bench.sim_speed --nodes 1000 --sim-s 60

It also writes a result file under results/ (``--results DIR``, ``--no-results``).
"""

from __future__ import annotations

import argparse
import heapq
import random
import resource
import time
from dataclasses import dataclass
from typing import Any

from bench import results
from swim import Address, Config, MembershipSnapshot, Node, Output, SeedMember, WireError

TIMER, PACKET, SERVE, RESULT = 0, 1, 2, 3


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; falls back to the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Counters:
    events: int = 0
    packets: int = 0
    streams: int = 0
    member_events: int = 0


class Sim:
    """The smallest loop that drives nodes faithfully: a bucket per millisecond (FIFO
    within it, like a (time, sequence) heap) and a heap of the distinct times."""

    def __init__(self, n: int, seed: int, config: Config) -> None:
        self.rng = random.Random(seed)
        self.now_ms = 0
        self.times: list[int] = []
        self.buckets: dict[int, list[tuple[int, int, Any]]] = {}
        self.counters = Counters()
        self.crashed: set[int] = set()
        addresses = [
            Address(f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}", 7946) for i in range(n)
        ]
        self.index = {a: i for i, a in enumerate(addresses)}
        names = [f"node-{i:05d}" for i in range(n)]
        self.snapshot = MembershipSnapshot.build(
            [SeedMember(name, addr) for name, addr in zip(names, addresses, strict=True)]
        )
        self.nodes: list[Node] = []
        for i in range(n):
            node = Node(
                names[i],
                addresses[i],
                rng=random.Random(self.rng.getrandbits(64)),
                now_ms=0,
                config=config,
                nonce_source=self.rng.randbytes,
            )
            self.nodes.append(node)
            self.apply(i, node.start(0))
            self.apply(i, node.bootstrap(self.snapshot, 0))

    def push(self, at_ms: int, kind: int, i: int, payload: Any) -> None:
        bucket = self.buckets.get(at_ms)
        if bucket is None:
            bucket = self.buckets[at_ms] = []
            heapq.heappush(self.times, at_ms)
        bucket.append((kind, i, payload))

    def latency(self) -> int:
        return 1 + int(self.rng.random() * 5)

    def apply(self, i: int, out: Output) -> None:
        c = self.counters
        c.member_events += len(out.events)
        now = self.now_ms
        for timer in out.timers:
            self.push(timer.deadline_ms, TIMER, i, timer)
        if out.packets:
            source = self.nodes[i].address
            for packet in out.packets:
                c.packets += 1
                dst = self.index.get(packet.dest)
                if dst is not None and dst not in self.crashed:
                    self.push(now + self.latency(), PACKET, dst, (source, packet.data))
        for request in out.streams:
            c.streams += 1
            dst = self.index.get(request.dest)
            if dst is None or dst in self.crashed:
                self.push(now + self.latency(), RESULT, i, (request.stream_id, None, "refused"))
            else:
                self.push(now + self.latency(), SERVE, dst, (i, request))

    def serve(self, dst: int, src: int, request: Any) -> None:
        peer, node = self.nodes[dst], self.nodes[src]
        try:
            parsed = peer.parse_stream(request.data)
        except WireError as exc:
            peer.record_drop(exc.reason)
            parsed = None
        reply: Any = None
        if parsed is not None:
            out = peer.handle_stream(node.address, parsed[0], self.now_ms)
            self.apply(dst, out)
            if out.reply is not None:
                got = node.parse_stream(out.reply)
                reply = None if got is None else got[0]
        if request.expect_reply:
            result = (request.stream_id, reply, "" if reply is not None else "no reply")
            self.push(self.now_ms + self.latency(), RESULT, src, result)

    def run_until(self, end_ms: int) -> None:
        times, buckets, nodes, crashed = self.times, self.buckets, self.nodes, self.crashed
        pop, apply = heapq.heappop, self.apply
        while times and times[0] <= end_ms:
            at_ms = pop(times)
            bucket = buckets.pop(at_ms)
            self.now_ms = at_ms
            self.counters.events += len(bucket)
            for kind, i, payload in bucket:
                if i in crashed:
                    continue
                node = nodes[i]
                if kind == TIMER:
                    apply(i, node.handle_timer(payload, at_ms))
                elif kind == PACKET:
                    apply(i, node.handle_datagram(payload[0], payload[1], at_ms))
                elif kind == SERVE:
                    self.serve(i, payload[0], payload[1])
                else:
                    stream_id, reply, error = payload
                    apply(i, node.handle_stream_response(stream_id, reply, at_ms, error))
        self.now_ms = end_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--sim-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--crash", type=int, default=0, help="nodes to crash")
    parser.add_argument("--crash-at-s", type=float, default=10.0)
    parser.add_argument("--profile", help="write a cProfile of the run to this file")
    parser.add_argument(
        "--no-compression",
        action="store_true",
        help="Config.lan(enable_compression=False): no pure-Python LZW on gossip packets",
    )
    results.add_arguments(parser)
    args = parser.parse_args()
    started = results.machine()

    rss0 = rss_bytes()
    t0 = time.perf_counter()
    sim = Sim(args.nodes, args.seed, Config.lan(enable_compression=not args.no_compression))
    boot_s = time.perf_counter() - t0
    rss_boot = rss_bytes()
    grown = rss_boot - rss0
    print(
        f"nodes={args.nodes} bootstrap {boot_s:.2f} s wall, "
        f"RSS +{grown / 2**20:.1f} MiB = {grown / args.nodes / 1024:.2f} KiB/node"
    )

    end_ms = int(args.sim_s * 1000)
    crash_ms = int(args.crash_at_s * 1000)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t1, cpu1 = time.perf_counter(), time.process_time()
    if args.crash and crash_ms < end_ms:
        sim.run_until(crash_ms)
        sim.crashed.update(sim.rng.sample(range(args.nodes), args.crash))
    sim.run_until(end_ms)
    wall_s, cpu_s = time.perf_counter() - t1, time.process_time() - cpu1
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    rss_end = rss_bytes()
    c = sim.counters
    print(
        f"simulated {args.sim_s:g} s in {wall_s:.2f} s wall: "
        f"{args.nodes * args.sim_s / wall_s:,.0f} node-s/s, {c.events / wall_s:,.0f} events/s "
        f"({c.events:,} events, {c.packets:,} packets, {c.streams:,} streams, "
        f"{c.member_events:,} member events)"
    )
    print(
        f"CPU {cpu_s:.2f} s: {args.nodes * args.sim_s / cpu_s:,.0f} node-s per CPU second "
        "(wall time is inflated when other work shares the core)"
    )
    print(
        f"RSS after run +{(rss_end - rss0) / 2**20:.1f} MiB = "
        f"{(rss_end - rss0) / args.nodes / 1024:.2f} KiB/node; peak "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    node_s = args.nodes * args.sim_s
    built = {
        "question": f"sim-loop-{args.nodes}" + ("-plain" if args.no_compression else ""),
        "title": f"The minimal simulator loop: {args.nodes:,} members, {args.sim_s:g} simulated s"
        + (", no compression" if args.no_compression else ""),
        "method": (
            f"bench/sim_speed.py: {args.nodes:,} bootstrapped `swim.Node`s at `lan` settings on "
            "the smallest virtual-time loop (1–5 ms uniform latency, no loss), seed "
            f"{args.seed}, {args.crash} crashed at {args.crash_at_s:g} s."
        ),
        "figures": {
            "wall_s": results.figure("Wall time of the run", wall_s, "s", 2),
            "node_s_per_cpu_s": results.figure(
                "Node-seconds per CPU second", node_s / cpu_s, "", 0
            ),
            "events_per_s": results.figure("Events per wall second", c.events / wall_s, "", 0),
            "kib_per_node": results.figure(
                "Memory per node after the run", (rss_end - rss0) / args.nodes / 1024, "KiB", 2
            ),
        },
    }
    results.record(args, "bench.sim_speed", None, started, built)


if __name__ == "__main__":
    main()
