"""CPU per agent-second of two checkouts of the agent, measured in the same invocation.

For each repetition, each profile and each tree (``--trees``: repository roots, e.g. the
commit before a change checked out with ``git worktree add /tmp/cpu_base <commit>`` and this
checkout), it starts an N-agent cluster on loopback with the agent code of that tree (the
processes run ``python -m agent.cli`` with the tree as their working directory, so its
``agent``/``swim``/``phi`` are the ones imported), waits until every agent has logged every
other's join, lets it settle, reads utime+stime of every agent over a window
(/proc/PID/stat), and stops every process by pid (also on error). The order of the trees
alternates between repetitions, so a slow minute of a busy machine lands on both sides.

It prints CPU ms per agent-second for each run, and per profile the median of each tree and
the ratio to the first tree (below 1: cheaper). ``--profile-agent S`` instead records one
agent of the last tree's first profile with py-spy for S seconds (``--flame`` names the SVG;
its collapsed stacks go next to it as ``.txt``), and ``--summarize FILE.txt`` prints that
profile's top functions, self and cumulative, as markdown tables.

    python -m bench.agent_cpu --trees /tmp/cpu_base,. --sizes 32 --profiles fast,lan --reps 3
    python -m bench.agent_cpu --trees . --sizes 64 --profiles fast --profile-agent 30 \\
        --flame bench/profiles/fast64.svg
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.demo import agent_command
from agent.procs import free_port, stop, until
from bench import results as result_files

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
JOINED = re.compile(rb"member (\S+) joined")


@dataclass
class _Agent:
    name: str
    port: int
    popen: subprocess.Popen[bytes]
    joined: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _read(agent: _Agent) -> None:
    assert agent.popen.stdout is not None
    for line in agent.popen.stdout:
        match = JOINED.search(line)
        if match:
            with agent.lock:
                agent.joined.add(match.group(1).decode())


def _start(tree: Path, name: str, profile: str, join: int | None, work: Path) -> _Agent:
    port = free_port()
    args = agent_command(name, port, work / f"{name}.sock", profile, join, retry_ms=500)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    popen = subprocess.Popen(
        [*args, "--log-level", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tree,
        env=env,
    )
    agent = _Agent(name, port, popen)
    threading.Thread(target=_read, args=(agent,), daemon=True).start()
    return agent


@contextlib.contextmanager
def cluster(tree: Path, n: int, profile: str) -> Iterator[list[_Agent]]:
    """N agents of ``tree`` on loopback, converged; every one stopped by pid at the end."""
    agents: list[_Agent] = []
    with tempfile.TemporaryDirectory(prefix="agent-cpu-") as tmp:
        work = Path(tmp)
        try:
            agents.append(_start(tree, "a0", profile, None, work))
            time.sleep(1.0)  # the seed must be listening
            for i in range(1, n):
                agents.append(_start(tree, f"a{i}", profile, agents[0].port, work))
            names = {a.name for a in agents}

            def converged() -> bool:
                for a in agents:
                    if a.popen.poll() is not None:
                        raise RuntimeError(f"{a.name} exited with {a.popen.returncode}")
                    with a.lock:
                        if not a.joined >= names - {a.name}:
                            return False
                return True

            until(converged, 180, f"{n} agents of {tree} converged")
            yield agents
        finally:
            stop(*(a.popen for a in agents), sig=signal.SIGKILL)


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(utime, stime) of a process, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def measure(
    tree: Path, n: int, profile: str, settle_s: float, window_s: float
) -> tuple[float, float]:
    """Mean CPU ms per agent-second over the window, after convergence and settling, and
    the kernel's (stime's) share of it."""
    with cluster(tree, n, profile) as agents:
        time.sleep(settle_s)
        t0 = time.monotonic()
        ticks0 = [cpu_ticks(a.popen.pid) for a in agents]
        time.sleep(window_s)
        ticks1 = [cpu_ticks(a.popen.pid) for a in agents]
        elapsed = time.monotonic() - t0
    user = sum(b[0] - a[0] for a, b in zip(ticks0, ticks1, strict=True))
    system = sum(b[1] - a[1] for a, b in zip(ticks0, ticks1, strict=True))
    ms = (user + system) * 1000 / CLK_TCK / elapsed / len(agents)
    return ms, system / max(user + system, 1)


def record(tree: Path, n: int, profile: str, settle_s: float, seconds: int, flame: Path) -> None:
    """py-spy one agent (the second started) of an N-agent cluster for ``seconds``: a
    flame graph (SVG) and its collapsed stacks (the same path, ``.txt``)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with cluster(tree, n, profile) as agents:
        time.sleep(settle_s)
        pid = agents[1].popen.pid
        flame.parent.mkdir(parents=True, exist_ok=True)
        # --gil: only samples where the agent holds the GIL, i.e. runs Python (epoll waits
        # release it); both formats recorded at once, over the same seconds
        spies = [
            subprocess.Popen(
                [
                    *(py_spy, "record", "--pid", str(pid), "--duration", str(seconds)),
                    *("--rate", "1000", "--gil", "--nonblocking", "--format", fmt),
                    *("--output", str(path)),
                ]
            )
            for fmt, path in (("flamegraph", flame), ("raw", flame.with_suffix(".txt")))
        ]
        try:
            for spy in spies:
                spy.wait(seconds + 60)
        finally:
            stop(*spies, sig=signal.SIGKILL)


def summarize(stacks: Path, top: int = 15) -> str:
    """Markdown tables of the functions with the most samples in py-spy's collapsed stacks
    (``--format raw``): self (the innermost frame) and cumulative (anywhere on the stack)."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    where: Counter[str] = Counter()
    total = 0
    for line in stacks.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        # per function, not per line; the frames above the trio run (click, runpy) dropped
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        for i, frame in enumerate(frames):
            if frame.startswith("run (trio/"):
                frames = frames[i:]
                break
        own[frames[-1]] += n
        where[_package(frames[-1])] += n
        for frame in set(frames):
            anywhere[frame] += n
    lines = [f"{total} samples (py-spy --gil: only while the agent runs Python)", ""]
    for title, counter in (("self", own), ("cumulative", anywhere), ("self, by package", where)):
        lines += [f"| {title} % | function |", "|---:|---|"]
        lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in counter.most_common(top)]
        lines.append("")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    """a / b, NaN where b is 0 (a window too short for a clock tick)."""
    return a / b if b else math.nan


def _package(frame: str) -> str:
    """The package of a collapsed-stack frame ``name (path:line)``: swim, phi, agent, trio
    (with outcome, attrs and contextlib, which trio's cancel scopes use), or other."""
    path = frame.rpartition("(")[2]
    for package in ("swim", "phi", "agent", "trio", "msgpack"):
        if path.startswith(f"{package}/"):
            return package
    if path.startswith(("outcome/", "attr/", "contextlib.py", "<attrs generated")):
        return "trio"
    return "other"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="agent CPU per agent-second, tree by tree")
    parser.add_argument("--trees", default=".", help="comma-separated repository roots")
    parser.add_argument("--sizes", default="32")
    parser.add_argument("--profiles", default="fast,lan")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--profile-agent", type=int, default=0, metavar="SECONDS")
    parser.add_argument("--flame", type=Path, default=Path("bench/profiles/flame.svg"))
    parser.add_argument("--summarize", type=Path, help="print the top functions of a .txt")
    result_files.add_arguments(parser)
    args = parser.parse_args(argv)
    started = result_files.machine()
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    profiles = args.profiles.split(",")
    if args.profile_agent:
        record(trees[-1], sizes[0], profiles[0], args.settle_s, args.profile_agent, args.flame)
        return 0
    results: dict[tuple[int, str, Path], list[float]] = {}
    for rep in range(args.reps):
        order = trees if rep % 2 == 0 else trees[::-1]
        for n in sizes:
            for profile in profiles:
                for tree in order:
                    ms, system = measure(tree, n, profile, args.settle_s, args.window_s)
                    results.setdefault((n, profile, tree), []).append(ms)
                    print(
                        f"rep {rep} N={n} {profile} {tree}: {ms:.2f} ms/agent-s "
                        f"({100 * system:.0f}% of it in the kernel)",
                        flush=True,
                    )
    print(f"\n{args.reps} repetitions, window {args.window_s:g} s, trees alternating")
    for n in sizes:
        for profile in profiles:
            base = statistics.median(results[(n, profile, trees[0])])
            for tree in trees:
                runs = results[(n, profile, tree)]
                med = statistics.median(runs)
                each = ", ".join(f"{v:.2f}" for v in runs)
                paired = [
                    _ratio(v, b) for v, b in zip(runs, results[(n, profile, trees[0])], strict=True)
                ]
                print(
                    f"N={n} {profile:5} {tree}: median {med:.2f} ms/agent-s ({each}); "
                    f"ratio of medians to {trees[0]} {_ratio(med, base):.2f}, per repetition "
                    + ", ".join(f"{r:.2f}" for r in paired)
                )
    built = as_result(results, trees, sizes, profiles, args)
    argv_ = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv_):  # scratch checkouts by their commit, not their path
        if argv_[i - 1] == "--trees" or a.startswith("--trees="):
            named = ",".join(_tree_name(t) for t in trees)
            argv_[i] = f"--trees={named}" if a.startswith("--trees=") else named
    result_files.record(args, "bench.agent_cpu", argv_, started, built)
    return 0


def _tree_name(tree: Path) -> str:
    """``.`` for this checkout, ``../swim-<commit>`` for another (a ``git worktree``)."""
    if tree == ROOT:
        return "."
    return f"../swim-{result_files.commit(tree) or tree.name}"


def as_result(
    measured: dict[tuple[int, str, Path], list[float]],
    trees: list[Path],
    sizes: list[int],
    profiles: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Medians per tree, size and profile, and each tree's ratio to the first."""
    figures: dict[str, Any] = {}
    ratios: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for n in sizes:
        for profile in profiles:
            base = statistics.median(measured[(n, profile, trees[0])])
            for i, tree in enumerate(trees):
                runs = measured[(n, profile, tree)]
                med = statistics.median(runs)
                name = _tree_name(tree)
                figures[f"{n}-{profile}-tree{i}.cpu_ms"] = result_files.figure(
                    f"{n} agents, `{profile}`, tree {name}: CPU per agent, median",
                    med,
                    "ms per agent-second",
                    spread=[min(runs), max(runs)],
                    runs=len(runs),
                )
                rows.append({"n": n, "profile": profile, "tree": name, "cpu": med})
                if i:
                    ratios.append(
                        {
                            "label": f"{name} / {_tree_name(trees[0])}, {n} agents, `{profile}`",
                            "value": round(_ratio(med, base), 2),
                        }
                    )
    return {
        "question": "agent-cpu-"
        + "-".join(str(n) for n in sizes)
        + "-"
        + "-".join(profiles)
        + f"-{len(trees)}-trees",
        "title": f"Agent CPU, {len(trees)} checkouts alternating: "
        + ", ".join(str(n) for n in sizes)
        + " agents, "
        + ", ".join(f"`{p}`" for p in profiles),
        "method": (
            "Clusters of N agents on loopback run the agent code of each checkout "
            f"({', '.join(_tree_name(t) for t in trees)}), the order alternating over "
            f"{args.reps} repetitions; CPU is read over a "
            f"{args.window_s:g} s window after a {args.settle_s:g} s settle."
        ),
        "figures": figures,
        "peers": [_tree_name(t) for t in trees],
        "ratios": ratios,
        "tables": [
            {
                "caption": "Median CPU ms per agent-second",
                "columns": [
                    result_files.column("n", "N"),
                    result_files.column("profile", "profile"),
                    result_files.column("tree", "checkout"),
                    result_files.column("cpu", "CPU ms/agent-s"),
                ],
                "rows": rows,
            }
        ],
    }


if __name__ == "__main__":
    raise SystemExit(main())
