"""torchrun recovery after a node fault: the ``swim`` rendezvous backend vs stock ``c10d``.

Three "nodes" on loopback, each one torchrun (``--nnodes=2:3 --nproc-per-node=N``, N = 1
by default) running examples/torchrun_train.py, plus, for swim, one agent. A node's processes
share one marker in their environment, so the whole node (agent, torchrun, and the workers
torchrun starts in sessions of their own) is signalled at once: SIGKILL = crashed host,
SIGSTOP = hung host. The measure is the time from the fault to the first training step
completed in a new group without the victim (world 3N → 2N), read from the workers' step
logs (one JSON line per step and worker).

Stock c10d needs its keep-alive expiry and last call after a SIGKILL (~38 s measured here
before this benchmark existed) and does not recover from a SIGSTOP within 40 s at all: the
survivors wait out gloo's 30 min collective timeout (pytorch/pytorch#111646; docs/design.md
§7). The observation window here is bounded accordingly.

    python -m bench.torchrun_recovery [--nproc-per-node 1] [--window-s 40] [--c10d-kill-window-s 90]

Its result file goes under results/ (``--results DIR``, ``--no-results``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from agent.demo import agent_command
from agent.procs import free_port, stop, until
from bench import results, training_results

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "torchrun_train.py"
MARK = "SWIM_BENCH_NODE"
POLL_S = 0.1
Backend = Literal["swim", "c10d"]
Scenario = Literal["kill", "stop"]
Worker = tuple[str, int]  # (node name, local rank)


class Node:
    """One node: an agent (swim only) and a torchrun, each in a session of its own (a
    process cannot join a process group of another session), tied together by a marker."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        *,
        backend: Backend,
        job: str,
        endpoint: str,
        profile: str = "local",
        nnodes: str = "2:3",
        nproc_per_node: int = 1,
        max_restarts: int = 50,
        agent_port: int | None = None,
        rdzv_conf: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.nproc_per_node = nproc_per_node
        self.mark = f"{uuid.uuid4().hex}-{name}"
        # one file for all the node's workers: each record is one O_APPEND write, so lines
        # of different workers do not interleave
        self.steps = workdir / f"steps-{name}.jsonl"
        self.control = workdir / f"{name}.sock"
        self.port = agent_port if agent_port is not None else free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._log = (workdir / f"{name}.log").open("ab")
        self._env = {
            **os.environ,
            "LOGLEVEL": "INFO",  # torchrun's and the rendezvous's progress, in the node log
            **(env or {}),
            MARK: self.mark,
            "SWIM_CONTROL": str(self.control),
        }
        try:
            if backend == "swim":
                self._start_agent(profile)
            self._start_torchrun(backend, job, endpoint, nnodes, max_restarts, rdzv_conf)
        except BaseException:
            self.close()
            raise

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=self._env,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def _start_agent(self, profile: str) -> None:
        self._spawn(
            [*agent_command(self.name, self.port, self.control, profile), "--log-level", "info"]
        )
        until(self.control.exists, 20, f"{self.name}'s control socket", poll_s=POLL_S)

    def _start_torchrun(
        self, backend: str, job: str, endpoint: str, nnodes: str, restarts: int, conf: str
    ) -> None:
        args = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job}",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={restarts}",
            "--monitor-interval=0.1",
            "--local-addr=127.0.0.1",
        ]
        if conf:
            args.append(f"--rdzv-conf={conf}")
        self._spawn(
            [*args, str(TRAIN), "--trainer-node", self.name, "--steps-file", str(self.steps)]
        )

    def workers(self) -> set[Worker]:
        """The (node, local rank) pairs this node's torchrun starts in every group."""
        return {(self.name, i) for i in range(self.nproc_per_node)}

    def pids(self) -> list[int]:
        """Every live process of this node, found by its environment marker."""
        return list(_marked(self.mark))

    def signal(self, sig: int) -> None:
        """Signal the whole node. Stopping our sessions first means torchrun cannot start a
        worker between the scan and the signal."""
        for proc in self.procs:
            _quiet(os.killpg, proc.pid, signal.SIGSTOP)
        for pid in self.pids():
            _quiet(os.kill, pid, sig)
        for proc in self.procs:
            _quiet(os.killpg, proc.pid, sig)

    def close(self) -> None:
        """SIGCONT then SIGKILL every process of the node (stopped ones included), reap."""
        for sig in (signal.SIGSTOP, signal.SIGCONT, signal.SIGKILL):
            self.signal(sig)
        stop(*self.procs, sig=signal.SIGKILL, group=True)  # our sessions, reaped
        # the workers (sessions of their own, not our children; torchrun is gone, so no new
        # ones) until their pids are gone
        stop(*self.pids(), sig=signal.SIGKILL)
        self._log.close()


def _quiet(fn: Callable[[int, int], None], pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        fn(pid, sig)


def _marked(mark: str) -> Iterable[int]:
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                yield int(entry.name)
        except OSError:
            continue


def read_steps(nodes: Iterable[Node]) -> list[dict[str, Any]]:
    """Every step logged by ``nodes``' workers, in time order (a torn last line is skipped)."""
    records: list[dict[str, Any]] = []
    for node in nodes:
        if not node.steps.exists():
            continue
        for line in node.steps.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return sorted(records, key=lambda r: float(r["t"]))


def group_of(record: dict[str, Any]) -> tuple[str, int]:
    """A worker group: its store address (new every round) and size. Not the restart
    count: it differs between the nodes of one group (a newcomer starts at 0)."""
    return (str(record["group"]), int(record["world"]))


def worker_of(record: dict[str, Any]) -> Worker:
    """Who logged ``record``; logs written before ``local_rank`` was recorded had one worker
    per node."""
    return (str(record["node"]), int(record.get("local_rank", 0)))


def ranks_of(records: Iterable[dict[str, Any]]) -> dict[Worker, int]:
    """Each worker's global rank in ``records`` (one group: a worker has one rank there)."""
    return {worker_of(r): int(r["rank"]) for r in records}


def wait_group(
    nodes: list[Node], names: set[str], timeout_s: float, after: float = 0.0, steps: int = 3
) -> list[dict[str, Any]]:
    """Wait until exactly ``names`` train together: one group with all their workers and
    nobody else, each worker having logged ``steps`` steps there after ``after``; returns
    that group's records."""
    workers = set().union(*(n.workers() for n in nodes if n.name in names))

    found: list[list[dict[str, Any]]] = []

    def formed() -> bool:
        by_group: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in read_steps(nodes):
            if float(r["t"]) > after and int(r["world"]) == len(workers):
                by_group.setdefault(group_of(r), []).append(r)
        for records in by_group.values():
            counts = Counter(worker_of(r) for r in records)
            if set(counts) == workers and min(counts.values()) >= steps:
                found.append(records)
                return True
        return False

    until(formed, timeout_s, f"group {sorted(names)}", poll_s=POLL_S)
    return found[-1]


def start_nodes(
    workdir: Path,
    backend: Backend,
    profile: str,
    count: int,
    job: str = "bench",
    nproc_per_node: int = 1,
) -> list[Node]:
    """``count`` nodes; swim's endpoint is node 0's agent, c10d's a store node 0 hosts."""
    nodes: list[Node] = []
    seed = free_port()
    try:
        for i in range(count):
            conf = "" if backend == "swim" else f"is_host={int(i == 0)}"
            nodes.append(
                Node(
                    f"node{i}",
                    workdir,
                    backend=backend,
                    job=job,
                    endpoint=f"127.0.0.1:{seed}",
                    profile=profile,
                    nproc_per_node=nproc_per_node,
                    agent_port=seed if i == 0 else None,
                    rdzv_conf=conf,
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if backend == "c10d" else None,
                )
            )
    except BaseException:
        for n in nodes:
            n.close()
        raise
    return nodes


def measure(
    profile: str,
    scenario: Scenario,
    backend: Backend,
    *,
    victim: int = 2,
    nproc_per_node: int = 1,
    start_timeout_s: float = 120.0,
    window_s: float = 40.0,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Start 3 nodes, wait until they train at world 3N, SIGKILL/SIGSTOP node ``victim`` and
    time the first step of a new 2-node group, world 2N (None if none within ``window_s``).
    That step is the group's: every worker of it logged a step there, and the earliest
    record counts, as no rank completes a step before all have sent their gradients."""
    with results.workdir(workdir, "swim-trbench-") as work:
        nodes = start_nodes(work, backend, profile, 3, nproc_per_node=nproc_per_node)
        try:
            started = time.monotonic()
            before = wait_group(nodes, {n.name for n in nodes}, start_timeout_s)
            startup_s = time.monotonic() - started
            fault_t = time.time()
            nodes[victim].signal(signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
            survivors = {n.name for i, n in enumerate(nodes) if i != victim}
            seen = {group_of(r) for r in before}
            try:
                after = wait_group(nodes, survivors, window_s, after=fault_t, steps=1)
                first = min(float(r["t"]) for r in after if group_of(r) not in seen)
                recovery_s: float | None = first - fault_t
            except TimeoutError:
                recovery_s = None
            return {
                "profile": profile if backend == "swim" else "-",
                "scenario": scenario,
                "backend": backend,
                "nproc_per_node": nproc_per_node,
                "world": f"{3 * nproc_per_node} → {2 * nproc_per_node}",
                "startup_s": startup_s,
                "recovery_s": recovery_s,
                "window_s": window_s,
            }
        finally:
            for n in nodes:
                n.close()


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | profile | fault | world | recovery (fault → first step in the new group) "
        "| startup |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rec = r["recovery_s"]
        shown = f"{rec:.1f} s" if rec is not None else f"none within {r['window_s']:.0f} s"
        lines.append(
            f"| {r['backend']} | {r['profile']} | {r['scenario']} | {r['world']} | {shown} "
            f"| {r['startup_s']:.1f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="workers per node (torchrun's option)"
    )
    parser.add_argument("--window-s", type=float, default=40.0)
    parser.add_argument(
        "--c10d-kill-window-s",
        type=float,
        default=90.0,
        help="c10d needs keep-alive expiry (15 s) + last call (30 s) after a crash",
    )
    parser.add_argument("--repeats", type=int, default=1)
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    started = results.machine()
    runs: list[tuple[Backend, str]] = [("swim", "local"), ("swim", "lan"), ("c10d", "local")]
    rows = []
    for backend, profile in runs:
        for scenario in ("kill", "stop"):
            for _ in range(args.repeats):
                window = args.window_s
                if (backend, scenario) == ("c10d", "kill"):
                    window = args.c10d_kill_window_s
                row = measure(
                    profile, scenario, backend, nproc_per_node=args.nproc_per_node, window_s=window
                )
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
    print(table(rows))
    if rows:
        results.record(args, "bench.torchrun_recovery", argv, started, as_result(rows, args))
    return 0


def as_result(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The result file's content (bench/training_results.py's table, one mode per backend
    and profile)."""
    runs = [
        {
            "mode": f"torchrun + swim (`{r['profile']}`)"
            if r["backend"] == "swim"
            else "torchrun + c10d (stock)",
            "fault": r["scenario"],
            "verdict_s": None,
            "resume_s": None,
            "total_s": r["recovery_s"],
            "startup_s": r["startup_s"],
            "window_s": r["window_s"],
        }
        for r in rows
    ]
    n = args.nproc_per_node
    built = training_results.recovery(runs, nodes=3, ranks=n, profile="local", step_sleep_s=0.05)
    return built | {
        "question": f"torchrun-recovery-3x{n}",
        "title": f"torchrun after a node fault, swim rendezvous against c10d: 3 nodes × {n}",
        "method": (
            f"Three nodes on loopback, each a torchrun (`--nnodes=2:3 --nproc-per-node={n}`) "
            "running examples/torchrun_train.py and, for swim, an agent; a whole node is "
            "SIGKILLed or SIGSTOPped and the time to the first step of a new group without it "
            f"is read from the workers' step logs (world {3 * n} → {2 * n}). Stock c10d is "
            f"watched for {args.window_s:g} s ({args.c10d_kill_window_s:g} s after a SIGKILL)."
        ),
    }


if __name__ == "__main__":
    raise SystemExit(main())
