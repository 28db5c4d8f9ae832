"""Formation at scale: how long n ranks take to agree on a new group, for n up to 512.

What one formation is here: the agreement step of ``torchhook.formation`` and nothing
else (no process group is built): the leader (the oldest node's local rank 0) writes a
fresh token into a fresh store and offers it in its directory; every other rank reads the
offer, checks the token, claims its rank and waits for the plan; the leader checks for
every claim, reads them in one ``multi_get``, decides (``torchhook.strategy.decide``, gloo
rules) and publishes the plan. Every rank runs the real ``FormationOn.agree`` as one
thread of this process (store requests release the GIL while they wait), with
``--ranks-per-node`` ranks per node (default 8: 64 nodes × 8 = 512).

The stores: one real TCPStore server on loopback and one client connection per rank,
made once before anything is timed; the directory and each formation's fresh store are
fresh key prefixes on that server (``Prefixed``), so every request of the protocol goes
over TCP to a TCPStore as in a job, but no connection is made while timing. The reason:
in this sandbox each TCPStore connection looks up both socket addresses in reverse DNS,
and the resolver drops about one query in fifty, which stalls that connection for 5 s;
a cluster's resolver (or a cache) does not, and there each rank connects from its own
host in parallel (one connection to the formation's store, which the process group needs
anyway).

Timed: from releasing every rank at once to the last rank holding its agreement, for each
of ``--runs`` formations per size (after one untimed). Printed as a table and as one JSON
line. Every rank shares this machine's 2 cores with the store's server: on a cluster each
rank runs on its own host, so these times are an upper bound for the exchange itself.

Processes: by default every rank is a thread of this one process, so every rank's Python
work (decoding the offer and the plan, each O(nodes)) runs under one interpreter lock, one
rank after another, which no job does: its ranks are processes, each with its own. With
``--processes P`` the nodes are split over P worker processes (spawned; the leader's node
in the first), each rank a thread of its node's worker, released through one barrier and
timed on the system-wide monotonic clock; this process keeps only the store's server.

    python -m bench.formation_scale [--sizes 8,64,128,256,512] [--runs 7] [--processes 8]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

from bench import results
from bench.formation_stores import JOIN_TIMEOUT_S, Prefixed, RankNet, Server
from torchhook import formation_wire as wire
from torchhook.client import JobMember, View
from torchhook.formation import Agreement, FormationOn
from torchhook.strategy import Layout, Plan, RankInfo, decide

DEFAULT_SIZES = (8, 64, 128, 256, 512)


def gloo_decide(layout: Layout, infos: list[RankInfo]) -> Plan:
    return decide(layout, infos, backend="gloo", supports_shrinking=False)


@dataclass
class Round:
    """One formation: every rank's end time and result."""

    ends: list[float]
    results: list[Any]


@dataclass
class Cluster:
    """``nodes`` × ``ranks`` participants, one thread each, reused across formations; of
    those, the ranks of the nodes in ``here`` (all of them by default) run in this
    process."""

    server: Server
    nodes: int
    ranks: int
    here: range | None = None
    formations: list[FormationOn[Prefixed]] = field(default_factory=list)
    places: list[tuple[str, int]] = field(default_factory=list)
    view: View | None = None

    def __post_init__(self) -> None:
        size = self.nodes * self.ranks
        for n in self.here if self.here is not None else range(self.nodes):
            for lr in range(self.ranks):
                leader = n == 0 and lr == 0
                self.places.append((f"n{n:02d}", lr))
                self.formations.append(
                    FormationOn(
                        lambda: self._view(),
                        # only the leader serves a directory (argument 0 makes one)
                        local_rank=0 if leader else 1,
                        beat=lambda: None,
                        timeout_s=JOIN_TIMEOUT_S,
                        store_host="127.0.0.1",
                        op_timeout=timedelta(seconds=JOIN_TIMEOUT_S),
                        net=RankNet(self.server, len(self.places) - 1, size),
                    )
                )
        members = tuple(
            JobMember(
                f"n{n:02d}",
                "127.0.0.1",
                7946,
                Server.DIRECTORY if n == 0 else 0,
                n + 1,
                "",
                "alive",
                self.ranks,
            )
            for n in range(self.nodes)
        )
        self.view = View("bench", 1, f"{self.nodes}x{self.ranks}", members)

    def _view(self) -> View:
        assert self.view is not None
        return self.view

    @property
    def size(self) -> int:
        return len(self.formations)


def run_rounds(cluster: Cluster, rounds: int) -> list[tuple[float, str]]:
    """``rounds`` formations; each: (seconds until the last rank agreed, error or "")."""
    return [
        (max(ends) - began, check([outcome]))
        for began, ends, outcome in run_local(cluster, rounds, time.monotonic)
    ]


def run_processes(
    server: Server, nodes: int, ranks: int, processes: int, rounds: int, decode: bool
) -> list[tuple[float, str]]:
    """``rounds`` formations with the nodes split over ``processes`` worker processes
    (contiguous, the leader's node in the first), each rank a thread of its node's
    worker; released at once through one barrier, timed on the system-wide monotonic
    clock."""
    ctx = multiprocessing.get_context("spawn")  # this process runs the store's threads
    parked: Queue[int] = ctx.Queue()
    go = [ctx.Event() for _ in range(rounds)]
    outcomes: Queue[tuple[float, Outcome]] = ctx.Queue()
    bounds = [nodes * p // processes for p in range(processes + 1)]
    offset = server.formations + 1000 * nodes  # fresh prefixes, unused by other sizes
    workers = [
        ctx.Process(
            target=_worker,
            args=(server.port, nodes, ranks, range(lo, hi), offset, parked, go, outcomes),
            kwargs={"decode": decode},
            daemon=True,
        )
        for lo, hi in itertools.pairwise(bounds)
    ]
    for w in workers:
        w.start()
    out: list[tuple[float, str]] = []
    try:
        for release in go:
            for _ in workers:  # every worker's ranks are parked (spawning imports torch)
                parked.get(timeout=4 * JOIN_TIMEOUT_S)
            began = time.monotonic()
            release.set()
            got = [outcomes.get(timeout=JOIN_TIMEOUT_S) for _ in workers]
            out.append((max(end for end, _ in got) - began, check([o for _, o in got])))
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
                w.join(5)
    return out


def _worker(
    port: int,
    nodes: int,
    ranks: int,
    here: range,
    offset: int,
    parked: Queue[int],
    go: list[Event],
    outcomes: Queue[tuple[float, Outcome]],
    *,
    decode: bool,
) -> None:
    """One worker process of ``run_processes``: its nodes' ranks, ``rounds`` formations."""
    if decode:
        decode_once()
    server = Server(len(here) * ranks, port=port, formations=offset)
    cluster = Cluster(server, nodes, ranks, here=here)

    released = iter(go)

    def release() -> float:
        parked.put(here.start)
        if not next(released).wait(JOIN_TIMEOUT_S):
            raise TimeoutError("not released")
        return 0.0

    for _, ends, outcome in run_local(cluster, len(go), release):
        outcomes.put((max(ends), outcome))


def run_local(
    cluster: Cluster, rounds: int, release: Callable[[], float]
) -> Iterator[tuple[float, list[float], Outcome]]:
    """``rounds`` formations of this process's ranks, each started by ``release`` (which
    returns the start time) once every rank is parked, yielded as each ends: (start,
    every rank's end time, what the ranks agreed)."""
    n = cluster.size
    start = threading.Barrier(n + 1)
    done = threading.Barrier(n + 1)
    stop = threading.Event()
    current = Round([0.0] * n, [None] * n)
    info = RankInfo("", None, 0, False)

    def rank(i: int) -> None:
        node, lr = cluster.places[i]
        formation = cluster.formations[i]
        while True:
            start.wait()
            if stop.is_set():
                return
            try:
                current.results[i] = formation.agree(cluster._view(), node, lr, info, gloo_decide)
            except Exception as exc:  # reported, not raised: the others must finish
                current.results[i] = exc
            current.ends[i] = time.monotonic()
            done.wait()

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        for _ in range(rounds):
            while start.n_waiting < n:  # every rank is parked: release them at once
                time.sleep(0.001)
            began = release()
            start.wait(JOIN_TIMEOUT_S)
            done.wait(JOIN_TIMEOUT_S)
            yield began, list(current.ends), summarize(current.results)
            current.results[:] = [None] * n  # drop this formation's stores
    finally:
        stop.set()
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait(5)
        for t in threads:
            t.join(5)


@dataclass(frozen=True)
class Outcome:
    """What some ranks of one formation agreed (picklable, for a worker process)."""

    errors: tuple[str, ...]
    plans: frozenset[tuple[str, str]]
    """(the plan's repr, the token) of each agreement."""
    ranks: tuple[int, ...]


def summarize(results: list[Any]) -> Outcome:
    agreed = [r for r in results if isinstance(r, Agreement)]
    return Outcome(
        tuple(repr(r) for r in results if not isinstance(r, Agreement)),
        frozenset((repr(r.plan), r.token) for r in agreed),
        tuple(r.rank for r in agreed),
    )


def check(outcomes: list[Outcome]) -> str:
    """ "" when every rank agreed on one plan with distinct ranks, else what went wrong."""
    errors = [e for o in outcomes for e in o.errors]
    if errors:
        return f"{len(errors)} ranks failed, e.g. {errors[0]}"
    plans = frozenset().union(*(o.plans for o in outcomes))
    ranks = sorted(r for o in outcomes for r in o.ranks)
    if len(plans) != 1 or ranks != list(range(len(ranks))):
        return "ranks disagree"
    return ""


def decode_once() -> None:
    """Every rank decodes the same offer (its layout lists every node) and the same plan
    (its receivers may list every rank): O(n) work per rank, which on a cluster runs on n
    hosts at once, but here on one interpreter lock, one rank after another. This
    memoizes those decodes (in this process only), to show what the exchange costs
    without that serialised work."""
    wire.decode_plan = functools.lru_cache(maxsize=16)(wire.decode_plan)
    wire.decode_offer = functools.lru_cache(maxsize=16)(wire.decode_offer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="participants per run"
    )
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--runs", type=int, default=7, help="timed formations per size")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes the nodes are split over (1: every rank a thread of this one)",
    )
    parser.add_argument(
        "--decode-once",
        action="store_true",
        help="decode each distinct offer and plan once for all ranks (see decode_once)",
    )
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    started = results.machine()
    if args.decode_once:
        decode_once()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.runs < 1 or any(s < 1 or s % args.ranks_per_node for s in sizes):
        parser.error("--runs >= 1; every size a positive multiple of --ranks-per-node")
    if not 1 <= args.processes <= min(sizes) // args.ranks_per_node:
        parser.error("--processes from 1 to the nodes of the smallest size")
    print(f"{'ranks':>6} {'nodes':>6} {'median s':>9} {'min s':>7} {'max s':>7}")
    server = Server(max(sizes) if args.processes == 1 else 0)
    if args.processes == 1:
        print(f"{max(sizes)} connections in {server.connect_s:.1f} s (made once, untimed)")
    rows: list[dict[str, Any]] = []
    failed = False
    for size in sizes:
        nodes = size // args.ranks_per_node
        if args.processes == 1:
            timed = run_rounds(Cluster(server, nodes, args.ranks_per_node), args.runs + 1)
        else:
            timed = run_processes(
                server, nodes, args.ranks_per_node, args.processes, args.runs + 1, args.decode_once
            )
        errors = sorted({e for _, e in timed if e})
        failed = failed or bool(errors)
        rest = [t for t, _ in timed[1:]]
        row = {
            "participants": size,
            "nodes": nodes,
            "median_s": round(statistics.median(rest), 4),
            "min_s": round(min(rest), 4),
            "max_s": round(max(rest), 4),
            "runs": len(rest),
            "errors": errors,
        }
        rows.append(row)
        print(
            f"{size:>6} {nodes:>6} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
            f"{row['max_s']:>7.3f}" + (f"  {errors}" if errors else ""),
            flush=True,
        )
    print(
        json.dumps({"benchmark": "formation_scale", "decode_once": args.decode_once, "rows": rows})
    )
    if not failed:
        results.record(args, "bench.formation_scale", argv, started, _result(rows, args))
    return 1 if failed else 0


def _result(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The run as a result file's content (bench/results.py); the largest size is the
    headline figure."""
    top = rows[-1]
    how = " (each distinct offer and plan decoded once for all ranks)" if args.decode_once else ""
    return {
        "question": "formation-scale"
        + ("-decode-once" if args.decode_once else "")
        + (f"-{args.processes}-processes" if args.processes > 1 else ""),
        "title": f"Formation at scale: up to {top['participants']} ranks agreeing on a group{how}"
        + (f", the nodes over {args.processes} processes" if args.processes > 1 else ""),
        "method": (
            "The agreement step of torchhook.formation alone (offer, token check, claims, "
            "plan; no process group built) on one real TCPStore on loopback, every rank a "
            + (
                "thread of one process"
                if args.processes == 1
                else f"thread of its node's worker, the nodes split over {args.processes} "
                "worker processes"
            )
            + f", {args.ranks_per_node} ranks per node, connections made "
            "once before timing; timed from releasing every rank to the last one holding "
            f"its agreement, {args.runs} formations per size after one untimed. All ranks "
            "share this host's cores with the store's server, so this is an upper bound "
            "for the exchange on a cluster, where each rank has its own host."
        ),
        "figures": {
            "formation_s": results.figure(
                f"{top['participants']} ranks ({top['nodes']} nodes): one formation, median",
                top["median_s"],
                "s",
                2,
                spread=(top["min_s"], top["max_s"]),
                runs=top["runs"],
            ),
        },
        "tables": [
            {
                "caption": "Time per formation by the number of ranks",
                "columns": [
                    {"key": "participants", "label": "ranks"},
                    {"key": "nodes", "label": "nodes"},
                    {"key": "time", "label": "one formation, s (median, min–max)"},
                ],
                "rows": [
                    {
                        "participants": r["participants"],
                        "nodes": r["nodes"],
                        "time": results.stat(r["median_s"], lo=r["min_s"], hi=r["max_s"]),
                    }
                    for r in rows
                ],
            }
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
