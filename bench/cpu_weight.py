"""Does a ``fast`` agent keep answering probes when data loaders saturate every core? False
suspicions and deaths per minute, by the CPU weight of the agents' cgroup.

Setup (root, cgroup v1's ``cpu`` controller at /sys/fs/cgroup/cpu): one parent cgroup
``swimbench-<pid>`` with two children, ``loaders`` (``--loaders`` busy loops, default 4× the
cores, at the default ``cpu.shares`` 1024, as a training job's data loaders in their own
cgroup) and ``agents`` (``--agents`` ``fast`` agents on loopback, one process each, joined
into one cluster). The agents run throughout; each case moves them to the cgroup and nice
it names, lets them settle, then reads every agent's ``info`` counters before and after a
``--window-s`` window. Every agent is alive all along, so every suspicion and death is
false. Cases:

- ``equal``: agents' cgroup at shares 1024 (systemd's default CPUWeight=100);
- ``low``: shares 100 (a unit with a CPUWeight of about 10);
- ``shipped``: shares 10240 (CPUWeight=1000, packaging/swim-agent.service; systemd maps
  CPUWeight=W to cpu.shares=W*1024/100 on cgroup v1);
- ``same-cgroup``: agents in the loaders' cgroup at nice 0 (no cgroup of their own, e.g.
  a host where systemd does not manage the cpu controller), and ``same-cgroup-nice``: the
  same at nice -5 (the unit's Nice=).

It prints one row per case: failed direct probes, suspicions raised, deaths declared,
refutations and stalls (the agent's loop > 100 ms late) summed over the agents, per
minute, and the agents' CPU share of the window. Everything it started is stopped by pid
and the cgroups removed, also on error or Ctrl-C. The parent cgroup competes with the rest
of the machine as one group, so the loaders take at most its share from other work.

    sudo python -m bench.cpu_weight                      # 5 cases x 60 s, ~6 minutes
    sudo python -m bench.cpu_weight --cases equal,low --window-s 30

It also writes a result file under results/ (``--results DIR``, ``--no-results``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError
from agent.demo import agent_command
from agent.procs import free_port, stop, until
from bench import results

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
CLK_TCK = os.sysconf("SC_CLK_TCK")
COUNTERS = ("probes_failed", "suspicions_raised", "deaths_declared", "refutations", "stalls")


@dataclass(frozen=True)
class Case:
    name: str
    shares: int | None  # the agents' own cgroup's cpu.shares; None: in the loaders' cgroup
    nice: int


CASES = {
    c.name: c
    for c in (
        Case("equal", 1024, 0),
        Case("low", 100, 0),
        Case("shipped", 10240, 0),
        Case("same-cgroup", None, 0),
        Case("same-cgroup-nice", None, -5),
    )
}


@contextlib.contextmanager
def cgroups() -> Iterator[tuple[Path, Path]]:
    """``(loaders, agents)``: two fresh cgroups under one parent, removed at the end."""
    if not (CPU_ROOT / "cpu.shares").exists():
        sys.exit(f"needs cgroup v1's cpu controller at {CPU_ROOT} (and root)")
    parent = CPU_ROOT / f"swimbench-{os.getpid()}"
    loaders, agents = parent / "loaders", parent / "agents"
    for path in (parent, loaders, agents):
        path.mkdir()
    try:
        yield loaders, agents
    finally:
        for path in (loaders, agents, parent):
            with contextlib.suppress(OSError):
                path.rmdir()


def _move(pid: int, cgroup: Path) -> None:
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")


def _renice(pid: int, nice: int) -> None:
    """Every thread of ``pid`` (nice is per thread on Linux; systemd's Nice= is set before
    exec, so all threads have it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _counters(clients: list[ControlClient]) -> dict[str, int]:
    total = dict.fromkeys(COUNTERS, 0)
    for client in clients:
        stats = client.request("info")["stats"]
        for key in COUNTERS:
            total[key] += int(stats[key])
    return total


def _all_alive(clients: list[ControlClient], n: int) -> bool:
    try:
        return all(sum(m["status"] == "alive" for m in c.request("members")) == n for c in clients)
    except ControlError:
        return False


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case's row: its counters per minute and the agents' CPU in cores."""
    rows: list[dict[str, Any]] = []
    procs: list[subprocess.Popen[Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="swim-cpuw-"))
    with cgroups() as (loaders_cg, agents_cg):
        try:
            loop = [sys.executable, "-c", "while True: pass"]
            for _ in range(args.loaders):
                procs.append(subprocess.Popen(loop))
                _move(procs[-1].pid, loaders_cg)
            agents: list[subprocess.Popen[Any]] = []
            clients: list[ControlClient] = []
            first_port = None
            for i in range(args.agents):
                port, control = free_port(), workdir / f"a{i}.sock"
                cmd = agent_command(f"a{i}", port, control, "fast", first_port, retry_ms=500)
                log = (workdir / f"a{i}.log").open("wb")
                agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
                procs.append(agents[-1])
                _move(agents[-1].pid, agents_cg)
                clients.append(ControlClient(control, timeout_s=10))
                first_port = first_port or port
            until(lambda: _all_alive(clients, args.agents), 60, "the cluster converged", poll_s=0.5)
            print(
                f"{args.agents} fast agents, {args.loaders} busy loops on {os.cpu_count()} cores,"
                f" {args.window_s:g} s per case"
            )
            print(
                "| case | agents' cpu.shares | nice | failed probes/min | suspicions/min "
                "| deaths/min | refutations/min | stalls/min | agents' CPU (cores) |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for name in args.cases.split(","):
                case = CASES[name]
                target = loaders_cg if case.shares is None else agents_cg
                if case.shares is not None:
                    (agents_cg / "cpu.shares").write_text(str(case.shares))
                for agent in agents:
                    _move(agent.pid, target)
                    _renice(agent.pid, case.nice)
                time.sleep(args.settle_s)
                with contextlib.suppress(TimeoutError):  # a case may leave some suspect
                    until(lambda: _all_alive(clients, args.agents), 30, "all alive", poll_s=0.5)
                before, ticks0, t0 = (
                    _counters(clients),
                    sum(map(_cpu_ticks, [a.pid for a in agents])),
                    time.monotonic(),
                )
                time.sleep(args.window_s)
                after, ticks1, t1 = (
                    _counters(clients),
                    sum(map(_cpu_ticks, [a.pid for a in agents])),
                    time.monotonic(),
                )
                minutes = (t1 - t0) / 60
                rates = [(after[k] - before[k]) / minutes for k in COUNTERS]
                cores = (ticks1 - ticks0) / CLK_TCK / (t1 - t0)
                shares = "(loaders')" if case.shares is None else str(case.shares)
                print(
                    f"| {name} | {shares} | {case.nice} | "
                    + " | ".join(f"{r:.1f}" for r in rates)
                    + f" | {cores:.2f} |",
                    flush=True,
                )
                rows.append(
                    {"case": name, "shares": shares, "nice": case.nice, "cores": cores}
                    | dict(zip(COUNTERS, rates, strict=True))
                )
        finally:
            stop(*procs, sig=signal.SIGKILL)
            for path in workdir.iterdir():
                path.unlink()
            workdir.rmdir()
    return rows


def as_result(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    per_minute = [results.column(k, f"{k.replace('_', ' ')}/min", 1) for k in COUNTERS]
    return {
        "question": "cpu-weight",
        "title": "The agent's CPU share on a saturated host",
        "method": (
            f"{args.agents} `fast` agents on loopback, {args.loaders} busy loops in a cgroup at "
            "the default cpu.shares 1024 (cgroup v1); each case moves the agents to the cgroup "
            f"and nice it names, lets them settle {args.settle_s:g} s and counts, over "
            f"{args.window_s:g} s, what their `info` counters say (summed over the agents). "
            "Every agent is alive throughout, so every suspicion and death is false."
        ),
        "figures": {
            f"{r['case']}.suspicions": results.figure(
                f"{r['case']} (shares {r['shares']}, nice {r['nice']}): false suspicions",
                r["suspicions_raised"],
                "per minute",
                1,
            )
            for r in rows
        },
        "tables": [
            {
                "caption": "Each case, per minute",
                "columns": [
                    results.column("case", "case"),
                    results.column("shares", "agents' cpu.shares"),
                    results.column("nice", "nice"),
                    *per_minute,
                    results.column("cores", "agents' CPU (cores)"),
                ],
                "rows": rows,
            }
        ],
    }


def main() -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--loaders", type=int, default=4 * cores, help="busy loops (4x cores)")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--cases", default=",".join(CASES), help=", ".join(CASES))
    results.add_arguments(parser)
    args = parser.parse_args()
    started = results.machine()
    # clean up on SIGTERM and SIGINT too (a shell's background job ignores SIGINT)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(CASES)}")
    rows = run(args)
    if rows:
        results.record(args, "bench.cpu_weight", None, started, as_result(rows, args))


if __name__ == "__main__":
    main()
