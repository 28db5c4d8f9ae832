"""One starved host among five: false suspicions and deaths of it and raised by it.

Five namespaced hosts (tests/netns/harness.py: one network namespace and one agent each,
on one bridge), every one alive throughout, so every suspicion and death is false. Host
n5's agent is put under one condition at a time for ``--window-s`` seconds:

- ``quota``: its own cgroup-v1 ``cpu`` cgroup with ``cpu.cfs_quota_us`` = ``--quota-pct``
  % of one core per 100 ms period (systemd's ``CPUQuota=``; below 1 % per 1 s period, as
  the kernel's smallest quota is 1 ms), nothing else running;
- ``weight``: ``--loaders`` busy processes (default 4x the cores) in a "job" cgroup at the
  default ``cpu.shares`` 1024, the agent in a cgroup of its own at shares 100 (a
  CPUWeight of about 10: a low-priority slice);
- ``threads``: ``--threads`` runnable threads (default 300, in 3 processes; each hashes a
  1 MiB buffer in a loop, which CPython does without the GIL, so all of them are runnable
  at once, as a data loader's worker threads in C code are) in the job cgroup, the agent
  in that same cgroup at nice 0 (no cpu cgroup of its own: systemd on cgroup v1 creates
  one only for units that set a CPU property);
- ``memory``: the agent starts in a cgroup-v1 ``memory`` cgroup of its own (so its pages
  are charged there); the case sets ``memory.limit_in_bytes`` to its anonymous memory plus
  ``--memory-slack-mib``, so the kernel must evict the file pages charged to it (code and
  data it read first) to make room: read back on use, counted as major faults. The host
  has no swap, so anonymous memory cannot be evicted: a tighter limit is an OOM kill, of
  this agent only (the cgroup's), never the machine's. Dropping the machine's whole page
  cache (``drop_caches``) is not done: other work on a shared machine would pay for it.

Each condition runs ``bare`` (as above) and ``shipped``: the agent in its own cpu cgroup at
``cpu.shares`` 10240 and nice -5, what packaging/swim-agent.service's ``CPUWeight=1000``
and ``Nice=`` give on cgroup v1 (under ``quota`` the quota stays; under ``memory`` the limit
stays). ``--settings`` also takes ``nice-N`` (bare placement at nice -N: an agent that does
not get a cgroup of its own) and ``shipped-nice-N``. The parent cgroup of the job and the
agent competes with the rest of the machine as one group at shares 1024, so the load
takes at most that share from other work.

Per case (condition x settings x profile): from the moment the condition is applied until
``--window-s`` later, then released, until all five see each other alive again (the tail:
a starved agent's late verdicts count): suspect and dead events about n5 at the other four
(log lines ``member n5 suspect|dead``, one per observer), suspect and dead events about
the healthy four (raised by n5, or by each other where the machine's other work starves
them: they run in the root cgroup beside it; n5's own counters say which), n5's own
counters (``swimctl info``: suspicions raised, deaths declared, refutations, failed
probes, ``stalls`` = its loop ran > 100 ms late, datagrams read late), how long n5 takes
to answer ``swimctl info`` every 200 ms (its control server shares the trio loop that
answers pings: p50/p99/max), its CPU (cores) and major page faults over the window, and
the load average (which counts the condition's own threads). Everything it started (namespaces,
agents, load processes, cgroups) is removed also on error, Ctrl-C or SIGTERM.

    sudo python -m bench.starved_host --window-s 60                       # full grid
    sudo python -m bench.starved_host --profiles fast --cases threads --window-s 600

It writes a result file under results/ (``--results DIR``, ``--no-results``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError
from agent.procs import stop, until
from bench import results
from bench.cpu_weight import CLK_TCK, CPU_ROOT, _cpu_ticks, _move, _renice
from tests.netns.harness import Testbed, unavailable_reason

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
CONDITIONS = ("quota", "weight", "threads", "memory")
SETTINGS = ("bare", "shipped")
SHIPPED_SHARES, SHIPPED_NICE = 10240, -5
LOW_SHARES = 100
PERIOD_US = 100_000
STARVED = 5  # the starved host's index
COUNTERS = (
    "suspicions_raised",
    "deaths_declared",
    "refutations",
    "probes_failed",
    "stalls",
    "stall_datagrams",
)
HASHER = (
    "import hashlib, threading\n"
    "buf = bytes(1 << 20)\n"
    "def spin():\n"
    "    while True: hashlib.sha256(buf).digest()\n"
    "ts = [threading.Thread(target=spin, daemon=True) for _ in range({n})]\n"
    "[t.start() for t in ts]; [t.join() for t in ts]\n"
)
"""A process of ``n`` threads that are all runnable: sha256 of a buffer over 2047 bytes
releases the GIL for the hashing."""


@dataclass
class Case:
    profile: str
    condition: str
    settings: str
    window_s: float
    figures: dict[str, Any] = field(default_factory=dict)


class Starver:
    """The cgroups and the load processes; ``starve(pid, condition, settings)`` applies one
    case to the agent's pid and ``release(pid)`` undoes it; ``close`` removes everything."""

    def __init__(self, args: argparse.Namespace) -> None:
        if not (CPU_ROOT / "cpu.shares").exists():
            sys.exit(f"needs cgroup v1's cpu controller at {CPU_ROOT} (and root)")
        self.args = args
        self.parent = CPU_ROOT / f"swimbench-starve-{os.getpid()}"
        self.job, self.own = self.parent / "job", self.parent / "agent"
        self.memory = MEMORY_ROOT / f"swimbench-starve-{os.getpid()}"
        self.load: list[subprocess.Popen[Any]] = []
        self.charged_mib = (0.0, 0.0)
        """(anonymous, page cache) MiB charged to the agent's memory cgroup at the last limit."""
        if not (MEMORY_ROOT / "memory.limit_in_bytes").exists():
            sys.exit(f"needs cgroup v1's memory controller at {MEMORY_ROOT}")
        for path in (self.parent, self.job, self.own, self.memory):
            path.mkdir()

    def starve(self, pid: int, condition: str, settings: str) -> None:
        shipped, nice = parse_settings(settings)
        (self.own / "cpu.shares").write_text(str(SHIPPED_SHARES if shipped else 1024))
        (self.own / "cpu.cfs_quota_us").write_text("-1")
        if condition == "quota":
            # below 1 % of a core a longer period: the kernel's smallest quota is 1 ms
            period = PERIOD_US if self.args.quota_pct >= 1 else 10 * PERIOD_US
            (self.own / "cpu.cfs_period_us").write_text(str(period))
            quota = max(1000, int(period * self.args.quota_pct / 100))
            (self.own / "cpu.cfs_quota_us").write_text(str(quota))
        elif condition == "weight":
            self._start_load([sys.executable, "-c", "while True: pass"], self.args.loaders)
            if not shipped:
                (self.own / "cpu.shares").write_text(str(LOW_SHARES))
        elif condition == "threads":
            per = -(-self.args.threads // 3)
            code = HASHER.replace("{n}", str(per))
            self._start_load([sys.executable, "-c", code], 3)
        elif condition == "memory":
            self._limit_memory(pid)
        _move(pid, self.job if condition == "threads" and not shipped else self.own)
        _renice(pid, nice)

    def _start_load(self, cmd: list[str], count: int) -> None:
        for _ in range(count):
            self.load.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            _move(self.load[-1].pid, self.job)

    def _limit_memory(self, pid: int) -> None:
        stat = self.memory_stat()
        self.charged_mib = (stat["rss"] / 2**20, stat["cache"] / 2**20)
        limit = stat["rss"] + self.args.memory_slack_mib * 1024 * 1024
        (self.memory / "memory.limit_in_bytes").write_text(str(limit))

    def memory_stat(self) -> dict[str, int]:
        lines = (self.memory / "memory.stat").read_text().splitlines()
        return {k: int(v) for k, v in (ln.split() for ln in lines)}

    @contextlib.contextmanager
    def charged(self) -> Iterator[None]:
        """Processes started inside this block start in the memory cgroup (a moved process
        leaves its pages charged where they were, and kernels since 6.x no longer move them
        along), so the limit applies to the agent's own pages."""
        (self.memory / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            (MEMORY_ROOT / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def release(self, pid: int) -> None:
        """The agent back to the root cpu cgroup at nice 0, no memory limit, the load
        stopped."""
        with contextlib.suppress(ProcessLookupError, OSError):
            _move(pid, CPU_ROOT)
            _renice(pid, 0)
        (self.memory / "memory.limit_in_bytes").write_text("-1")
        stop(*self.load, sig=signal.SIGKILL)
        self.load.clear()

    def close(self) -> None:
        stop(*self.load, sig=signal.SIGKILL)
        for path, root in (
            (self.job, CPU_ROOT),
            (self.own, CPU_ROOT),
            (self.parent, CPU_ROOT),
            (self.memory, MEMORY_ROOT),
        ):
            if path.exists():
                for task in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (root / "cgroup.procs").write_text(task)
                _rmdir(path)


def parse_settings(settings: str) -> tuple[bool, int]:
    """(own cgroup at the unit's weight?, nice): ``bare`` (False, 0), ``shipped`` (True,
    -5), ``nice-N`` (False, -N: bare placement at nice -N), ``shipped-nice-N`` (True, -N)."""
    if settings in SETTINGS:
        return settings == "shipped", SHIPPED_NICE if settings == "shipped" else 0
    shipped = settings.startswith("shipped-")
    rest = settings.removeprefix("shipped-")
    if rest.startswith("nice-") and rest[5:].isdigit() and int(rest[5:]) <= 20:
        return shipped, -int(rest[5:])
    raise ValueError(f"settings {settings!r}: bare, shipped, nice-N or shipped-nice-N")


def _rmdir(path: Path) -> None:
    def gone() -> bool:  # the kernel frees a cgroup a moment after its last task left
        path.rmdir()
        return True

    until(gone, 5, f"rmdir {path}", poll_s=0.1, ignore=(OSError,))


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _majflt(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[9])


class Sampler:
    """Times ``swimctl info`` on the starved agent every ``SAMPLE_S`` in a thread: the
    control server runs in the agent's trio loop, so the answer time is how late that loop
    gets to anything, an ack included (a lower bound on an ack's extra delay)."""

    SAMPLE_S = 0.2

    def __init__(self, bed: Testbed) -> None:
        self.client = ControlClient(bed.agent(STARVED).control, timeout_s=10)
        self.ms: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            t0 = time.monotonic()
            try:
                self.client.request("info")
            except ControlError:
                self.failed += 1
                continue
            self.ms.append((time.monotonic() - t0) * 1000)

    def close(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=15)
        ms = sorted(self.ms) or [0.0]
        return {
            "answer_p50_ms": ms[len(ms) // 2],
            "answer_p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            "answer_max_ms": ms[-1],
            "answer_over_100ms": sum(m > 100 for m in ms),
        }


def _counters(bed: Testbed, i: int) -> dict[str, int]:
    stats = bed.agent(i).info()["stats"]
    return {k: int(stats[k]) for k in COUNTERS}


def run_case(bed: Testbed, starver: Starver, case: Case) -> None:
    """One window; fills ``case.figures``."""
    until(bed.converged, 90, "all five alive everywhere before the case", poll_s=0.5)
    agent = bed.agent(STARVED)
    pid, name = agent.pid, agent.name
    before = _counters(bed, STARVED)
    others_before = [_counters(bed, h.index) for h in bed.hosts if h.index != STARVED]
    load0 = os.getloadavg()[0]
    ticks0, flt0, t0, start = _cpu_ticks(pid), _majflt(pid), time.monotonic(), time.time()
    rss_kib = _status_kib(pid, "VmRSS")
    sampler = Sampler(bed)
    try:
        starver.starve(pid, case.condition, case.settings)
        time.sleep(case.window_s)
        ticks1, flt1, t1 = _cpu_ticks(pid), _majflt(pid), time.monotonic()
        load1 = os.getloadavg()[0]
    finally:
        starver.release(pid)
        answers = sampler.close()
    if not agent.running():
        case.figures.update(exited=True, log_tail=agent.log_tail(400))
        return
    tail_s = until(bed.converged, 120, "all five alive again after the case", poll_s=0.2)
    time.sleep(2)  # late verdicts of the just-released agent
    after = _counters(bed, STARVED)
    others_after = [_counters(bed, h.index) for h in bed.hosts if h.index != STARVED]
    events = [e for e in bed.events(since=start) if e.kind in ("suspect", "dead")]
    of = [e for e in events if e.member == name and e.observer != name]
    by = [e for e in events if e.member != name]
    case.figures.update(
        {
            "suspect_of": sum(e.kind == "suspect" for e in of),
            "dead_of": sum(e.kind == "dead" for e in of),
            "suspect_by": sum(e.kind == "suspect" for e in by),
            "dead_by": sum(e.kind == "dead" for e in by),
            **{k: after[k] - before[k] for k in COUNTERS},
            "others_suspicions": sum(
                a["suspicions_raised"] - b["suspicions_raised"]
                for a, b in zip(others_after, others_before, strict=True)
            ),
            "cores": (ticks1 - ticks0) / CLK_TCK / (t1 - t0),
            "majflt": flt1 - flt0,
            "rss_mib": rss_kib / 1024,
            "load": max(load0, load1),
            "tail_s": tail_s,
            **answers,
            "charged_mib": "{:.1f}+{:.1f}".format(*starver.charged_mib)
            if case.condition == "memory"
            else "",
        }
    )


HEADER = (
    "| profile | condition | settings | window | suspect/dead events OF n5 | suspect/dead "
    "events about the other four | n5 raised susp./deaths | n5 refutations | n5 stalls "
    "| n5 failed probes | n5 answers p50/p99/max ms | n5 CPU (cores) | major faults | load |"
)


def row_text(c: Case) -> str:
    f = c.figures
    if f.get("exited"):
        return f"| {c.profile} | {c.condition} | {c.settings} | {c.window_s:g} s | agent exited |"
    return (
        f"| {c.profile} | {c.condition} | {c.settings} | {c.window_s:g} s "
        f"| {f['suspect_of']}/{f['dead_of']} | {f['suspect_by']}/{f['dead_by']} "
        f"| {f['suspicions_raised']}/{f['deaths_declared']} | {f['refutations']} "
        f"| {f['stalls']} | {f['probes_failed']} | {f['answer_p50_ms']:.0f}/"
        f"{f['answer_p99_ms']:.0f}/{f['answer_max_ms']:.0f} | {f['cores']:.3f} | {f['majflt']} "
        f"| {f['load']:.1f} |" + (f" charged {f['charged_mib']} MiB" if f["charged_mib"] else "")
    )


def run(args: argparse.Namespace) -> list[Case]:
    cases: list[Case] = []
    workdir = Path(tempfile.mkdtemp(prefix="swim-starved-"))
    starver = Starver(args)
    try:
        print(HEADER + "\n" + "|---" * 14 + "|", flush=True)
        for profile in args.profiles.split(","):
            (workdir / profile).mkdir()
            with Testbed(5, workdir / profile) as bed:
                with starver.charged():  # n5's pages are charged to the memory cgroup
                    bed.start_agent(STARVED, profile)
                for h in bed.hosts[:-1]:
                    bed.start_agent(h.index, profile)
                for a in bed.running():
                    a.wait_ready()
                bed.wait_converged(60)
                for condition in args.cases.split(","):
                    for settings in args.settings.split(","):
                        case = Case(profile, condition, settings, args.window_s)
                        run_case(bed, starver, case)
                        cases.append(case)
                        print(row_text(case), flush=True)
                        if case.figures.get("exited"):
                            bed.start_agent(STARVED, profile)
                            bed.agent(STARVED).wait_ready()
        print(f"logs in {workdir}", file=sys.stderr)
    finally:
        starver.close()
    return cases


def as_result(cases: list[Case], args: argparse.Namespace) -> dict[str, Any]:
    rows = [
        {"profile": c.profile, "condition": c.condition, "settings": c.settings}
        | {"window_s": c.window_s}
        | {k: v for k, v in c.figures.items() if k != "log_tail"}
        for c in cases
    ]
    keys = [
        ("suspect_of", "suspect events of n5"),
        ("dead_of", "dead events of n5"),
        ("suspect_by", "suspect events by n5"),
        ("dead_by", "dead events by n5"),
        ("refutations", "n5 refutations"),
        ("stalls", "n5 stalls"),
        ("cores", "n5 CPU (cores)"),
        ("majflt", "major faults"),
        ("load", "load"),
    ]
    return {
        "question": f"starved-host-{int(args.window_s)}s",
        "title": (
            f"One starved host among five, {args.window_s:g} s per case: "
            "false suspicions and deaths"
        ),
        "method": (
            "5 namespaced hosts (one agent each, on one bridge); host n5's agent under one "
            f"condition for {args.window_s:g} s per case: a CPU quota of {args.quota_pct:g} % "
            f"of a core; cpu.shares {LOW_SHARES} beside {args.loaders} busy processes; "
            f"{args.threads} runnable threads in a cgroup, the agent in theirs; a memory "
            f"limit of its anonymous memory + {args.memory_slack_mib} MiB. `shipped`: its own "
            "cgroup at "
            f"cpu.shares {SHIPPED_SHARES} and nice {SHIPPED_NICE} (the unit's CPUWeight=1000, "
            "Nice=-5). Events from every agent's log from the start of the window until all "
            "five are alive everywhere again; every member was alive throughout."
        ),
        "figures": {
            f"{c.profile}.{c.condition}.{c.settings}.dead_of": results.figure(
                f"{c.profile}, {c.condition}, {c.settings}: dead events of the starved host",
                c.figures.get("dead_of", -1),
                f"per {c.window_s:g} s",
            )
            for c in cases
        },
        "tables": [
            {
                "caption": "Each case (condition x settings x profile)",
                "columns": [
                    results.column("profile", "profile"),
                    results.column("condition", "condition"),
                    results.column("settings", "settings"),
                    results.column("window_s", "window (s)"),
                    *(results.column(k, label) for k, label in keys),
                ],
                "rows": rows,
            }
        ],
    }


def main() -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default="fast,lan")
    parser.add_argument("--cases", default=",".join(CONDITIONS), help=", ".join(CONDITIONS))
    parser.add_argument("--settings", default=",".join(SETTINGS), help=", ".join(SETTINGS))
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--quota-pct", type=float, default=1.0, help="%% of one core")
    parser.add_argument("--loaders", type=int, default=4 * cores, help="busy processes")
    parser.add_argument("--threads", type=int, default=300, help="runnable threads")
    parser.add_argument("--memory-slack-mib", type=int, default=1)
    results.add_arguments(parser)
    args = parser.parse_args()
    for settings in args.settings.split(","):
        try:
            parse_settings(settings)
        except ValueError as exc:
            parser.error(str(exc))
    for value, known, what in (
        (args.cases, CONDITIONS, "case"),
        (args.profiles, ("fast", "lan", "local", "wan"), "profile"),
    ):
        unknown = set(value.split(",")) - set(known)
        if unknown:
            parser.error(f"unknown {what} {', '.join(sorted(unknown))}; known: {known}")
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    started = results.machine()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cases = run(args)
    if cases:
        results.record(args, "bench.starved_host", None, started, as_result(cases, args))


if __name__ == "__main__":
    main()
