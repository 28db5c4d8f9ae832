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

    python -m bench.formation_scale [--sizes 8,64,128,256,512] [--runs 7]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import TCPStore

from bench import results
from torchhook import formation_wire as wire
from torchhook.client import JobMember, View
from torchhook.formation import Agreement, FormationOn
from torchhook.stores import TcpNet
from torchhook.strategy import Layout, Plan, RankInfo, decide

DEFAULT_SIZES = (8, 64, 128, 256, 512)
JOIN_TIMEOUT_S = 60.0
"""A formation that has not ended by then is reported as failed (it should take < 1 s)."""


def gloo_decide(layout: Layout, infos: list[RankInfo]) -> Plan:
    return decide(layout, infos, backend="gloo", supports_shrinking=False)


@dataclass
class Round:
    """One formation: every rank's end time and result."""

    ends: list[float]
    results: list[Any]


class Prefixed:
    """A store on the shared benchmark server: ``client``'s keys under ``prefix``. Stands
    for a fresh store (a fresh prefix per formation) reached over an open connection."""

    def __init__(self, client: TCPStore, prefix: str, port: int) -> None:
        self.client = client
        self.prefix = prefix
        self._port = port

    def _keys(self, keys: list[str]) -> list[str]:
        return [self.prefix + k for k in keys]

    def set(self, key: str, value: str) -> None:
        self.client.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        return self.client.get(self.prefix + key)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self.client.compare_set(self.prefix + key, expected_value, desired_value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.client.multi_get(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        return self.client.delete_key(self.prefix + key)

    def check(self, keys: list[str]) -> bool:
        return self.client.check(self._keys(keys))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.client.wait(self._keys(keys), timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        """The connection is shared: it keeps its own timeout."""

    @property
    def port(self) -> int:
        return self._port


class Server:
    """One TCPStore server and a client per rank, connected once for every size."""

    DIRECTORY = 1

    def __init__(self, clients: int) -> None:
        self.store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        )
        began = time.perf_counter()
        made: list[TCPStore | None] = [None] * clients

        def connect(i: int) -> None:
            made[i] = TCPStore(
                "127.0.0.1",
                self.store.port,
                is_master=False,
                timeout=timedelta(seconds=JOIN_TIMEOUT_S),
            )

        threads = [threading.Thread(target=connect, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.connect_s = time.perf_counter() - began
        self.clients = [c for c in made if c is not None]
        assert len(self.clients) == clients, "every client connected"
        self.formations = 0


class RankNet(TcpNet):
    """``TcpNet`` on the shared server: the directory and each formation's store are
    prefixes there (ports are names for them), reached over this rank's connection."""

    def __init__(self, server: Server, index: int, size: int) -> None:
        self.server = server
        self.client = server.clients[index]
        self.directory = f"dir{size}/"
        self.served = 0

    def serve(self, host: str, timeout: timedelta) -> Prefixed:  # type: ignore[override]
        self.served += 1
        if self.served == 1:
            return Prefixed(self.client, self.directory, Server.DIRECTORY)
        self.server.formations += 1  # a fresh prefix per formation, never reused
        port = 1000 + self.server.formations
        return Prefixed(self.client, f"f{port}/", port)

    def connect(  # type: ignore[override]
        self, addr: str, port: int, what: str, beat: Callable[[], None]
    ) -> Prefixed:
        prefix = self.directory if port == Server.DIRECTORY else f"f{port}/"
        return Prefixed(self.client, prefix, port)


@dataclass
class Cluster:
    """``nodes`` × ``ranks`` participants, one thread each, reused across formations."""

    server: Server
    nodes: int
    ranks: int
    formations: list[FormationOn[Prefixed]] = field(default_factory=list)
    places: list[tuple[str, int]] = field(default_factory=list)
    view: View | None = None

    def __post_init__(self) -> None:
        size = self.nodes * self.ranks
        for n in range(self.nodes):
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
            current.ends[i] = time.perf_counter()
            done.wait()

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    out: list[tuple[float, str]] = []
    try:
        for _ in range(rounds):
            while start.n_waiting < n:  # every rank is parked: release them at once
                time.sleep(0.001)
            began = time.perf_counter()
            start.wait(JOIN_TIMEOUT_S)
            done.wait(JOIN_TIMEOUT_S)
            out.append((max(current.ends) - began, check(current.results)))
            current.results[:] = [None] * n  # drop this formation's stores
    finally:
        stop.set()
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait(5)
        for t in threads:
            t.join(5)
    return out


def check(results: list[Any]) -> str:
    """ "" when every rank agreed on one plan with distinct ranks, else what went wrong."""
    errors = [r for r in results if not isinstance(r, Agreement)]
    if errors:
        return f"{len(errors)} ranks failed, e.g. {errors[0]!r}"
    plans = {(r.plan, r.token) for r in results}
    if len(plans) != 1 or sorted(r.rank for r in results) != list(range(len(results))):
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
    print(f"{'ranks':>6} {'nodes':>6} {'median s':>9} {'min s':>7} {'max s':>7}")
    server = Server(max(sizes))
    print(f"{max(sizes)} connections in {server.connect_s:.1f} s (made once, untimed)")
    rows: list[dict[str, Any]] = []
    failed = False
    for size in sizes:
        cluster = Cluster(server, size // args.ranks_per_node, args.ranks_per_node)
        timed = run_rounds(cluster, args.runs + 1)
        errors = sorted({e for _, e in timed if e})
        failed = failed or bool(errors)
        rest = [t for t, _ in timed[1:]]
        row = {
            "participants": size,
            "nodes": cluster.nodes,
            "median_s": round(statistics.median(rest), 4),
            "min_s": round(min(rest), 4),
            "max_s": round(max(rest), 4),
            "runs": len(rest),
            "errors": errors,
        }
        rows.append(row)
        print(
            f"{size:>6} {cluster.nodes:>6} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
            f"{row['max_s']:>7.3f}" + (f"  {errors}" if errors else ""),
            flush=True,
        )
        del cluster
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
        "question": "formation-scale" + ("-decode-once" if args.decode_once else ""),
        "title": f"Formation at scale: up to {top['participants']} ranks agreeing on a group{how}",
        "method": (
            "The agreement step of torchhook.formation alone (offer, token check, claims, "
            "plan; no process group built) on one real TCPStore on loopback, every rank a "
            f"thread of one process, {args.ranks_per_node} ranks per node, connections made "
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
