"""Side-by-side benchmark: N swim agents vs N serf agents, same machine, same run.

For each N it starts a cluster of each implementation on loopback and measures:
- join convergence: from the start of the last process until every agent has seen every
  other join (each agent's own log, timestamped as lines arrive);
- detection after SIGKILL of one agent: first suspicion anywhere, first and last survivor
  to declare it dead/failed (median and nearest-rank p99 over the kills);
- false positives: dead/failed (and suspect) events about a member that was not killed,
  or before it was;
- steady-state CPU per agent per second (/proc/PID/stat utime+stime over a window);
- RSS per agent (/proc/PID/status VmRSS);
- UDP packets and bytes sent per agent per second (iptables byte/packet counters on each
  agent's source port; the same measurement for both implementations).

Log lines are timestamped by reader threads as they arrive (serf's own log timestamps
have one-second resolution), so both sides are timed the same way.

    python -m bench.compare_serf [--sizes 8,32,64] [--profile lan] [--out REPORT.md]
    python -m bench.compare_serf --sizes 64 --runs serf:local,swim:fast,swim:lan --kills 20

``--runs`` lists implementation:profile pairs, run one after another for each N (serf knows
lan, wan and local; ``fast`` is ours); the first is the baseline of the ratio table.
``--profile P`` is short for ``--runs serf:P,swim:P``.

Every run writes its result file under results/ (bench/detection_results.py; ``--results
DIR``, ``--no-results``); ``python -m bench.render`` then renders BENCHMARKS.md from the
newest result of each question. ``--out`` appends the Markdown report to a file of your own.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent.procs import stop, until
from bench import detection_results, results
from bench.procs import SERF
from bench.watched import CLK_TCK, PATTERNS, PortCounters, Proc, cpu_ticks, rss_mib, start
from swim import PROFILES

SERF_PROFILES = ("lan", "wan", "local")

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Kill:
    first_suspect_s: float | None
    first_dead_s: float | None
    last_dead_s: float | None

    @property
    def suspicion_s(self) -> float | None:
        """First suspicion → first death anywhere: the suspicion window as it ran."""
        if self.first_suspect_s is None or self.first_dead_s is None:
            return None
        return self.first_dead_s - self.first_suspect_s

    @property
    def spread_s(self) -> float | None:
        """First death → the last survivor's: the verdict's dissemination."""
        if self.first_dead_s is None or self.last_dead_s is None:
            return None
        return self.last_dead_s - self.first_dead_s


@dataclass
class Result:
    impl: str
    profile: str
    n: int
    converge_s: float | None
    converge_ready_s: float | None
    cpu_ms_per_s: float
    rss_mib_mean: float
    rss_mib_max: float
    pkts_per_s: float | None
    bytes_per_s: float | None
    kills: list[Kill]
    false_dead: int = 0
    false_suspect: int = 0
    startup_false_dead: int = 0
    startup_false_suspect: int = 0
    load_1m: tuple[float, float] = (0.0, 0.0)  # the box's 1-minute load: converged, end

    def p99(self, attr: str) -> float | None:
        """Nearest-rank 99th percentile (the maximum below 100 kills)."""
        values: list[float] = sorted(v for k in self.kills if (v := getattr(k, attr)) is not None)
        if not values or len(values) != len(self.kills):
            return None
        return values[max(0, -(-99 * len(values) // 100) - 1)]

    def median(self, attr: str) -> float | None:
        values = [v for k in self.kills if (v := getattr(k, attr)) is not None]
        return statistics.median(values) if len(values) == len(self.kills) else None

    def spread(self, attr: str) -> str:
        values = [v for k in self.kills if (v := getattr(k, attr)) is not None]
        return f"{min(values):.2f}–{max(values):.2f}" if values else "n/a"

    def stat(self, attr: str, p99: bool = True) -> dict[str, float] | None:
        """Median, range and (``p99``) nearest-rank p99 over the kills, for the result file."""
        values = [v for k in self.kills if (v := getattr(k, attr)) is not None]
        if not values:
            return None
        return results.stat(
            self.median(attr),
            lo=min(values),
            hi=max(values),
            p99=self.p99(attr) if p99 else None,
        )

    def row(self) -> dict[str, object]:
        """This cluster's row of the result file (bench/detection_results.py ``Row``)."""
        return {
            "impl": self.impl,
            "profile": self.profile,
            "n": self.n,
            "kills": len(self.kills),
            "converge_s": self.converge_s,
            "converge_ready_s": self.converge_ready_s,
            "first_suspect_s": self.stat("first_suspect_s"),
            "first_dead_s": self.stat("first_dead_s", p99=False),
            "last_dead_s": self.stat("last_dead_s"),
            "suspicion_s": self.stat("suspicion_s"),
            "spread_s": self.stat("spread_s"),
            "false_dead": self.false_dead,
            "false_suspect": self.false_suspect,
            "startup_false_dead": self.startup_false_dead,
            "startup_false_suspect": self.startup_false_suspect,
            "cpu_ms": self.cpu_ms_per_s,
            "rss_mib_mean": self.rss_mib_mean,
            "rss_mib_max": self.rss_mib_max,
            "load_1m_converged": self.load_1m[0],
            "load_1m_end": self.load_1m[1],
            "pkts": self.pkts_per_s,
            "bytes": self.bytes_per_s,
        }


class NotConverged(Exception):
    """A cluster never reached full membership; its numbers would mean nothing."""


def _explain(procs: list[Proc], names: set[str], workdir: Path) -> None:
    """Say which agents did not converge, with the end of their logs."""
    for p in procs:
        missing = names - {p.name} - p.joined()
        if missing or p.popen.poll() is not None:
            log = (workdir / f"{p.name}.log").read_text(errors="replace")[-1500:]
            print(
                f"   {p.name} (exit {p.popen.poll()}) has not seen {sorted(missing)[:5]}"
                f"{'...' if len(missing) > 5 else ''}; log tail:\n{log}",
                file=sys.stderr,
            )


def _false_events(
    procs: list[Proc], killed_at: dict[str, float], since: float, until: float = math.inf
) -> tuple[int, int]:
    """(dead, suspect) events in [since, until) about members not killed, or not yet."""
    counts = {"dead": 0, "suspect": 0}
    for p in procs:
        with p.lock:
            for t, kind, name in p.events:
                if kind in counts and since <= t < min(until, killed_at.get(name, math.inf)):
                    counts[kind] += 1
    return counts["dead"], counts["suspect"]


def _kill_one(alive: list[Proc], killed_at: dict[str, float]) -> Kill:
    """SIGKILL the newest live agent and time how the others notice."""
    victim = alive.pop()
    killed = time.monotonic()
    killed_at[victim.name] = killed
    stop(victim.popen, sig=signal.SIGKILL)
    with contextlib.suppress(TimeoutError):  # a survivor that never saw it counts as None
        until(
            lambda: all(p.seen("dead", victim.name, killed) for p in alive), 120, "dead everywhere"
        )
    # since the kill: a suspicion of the victim during the start-up storm is not this one
    suspects = [t for p in alive if (t := p.seen("suspect", victim.name, killed))]
    deads = [t for p in alive if (t := p.seen("dead", victim.name, killed))]
    return Kill(
        min(suspects) - killed if suspects else None,
        min(deads) - killed if deads else None,
        max(deads) - killed if len(deads) == len(alive) else None,
    )


def run_one(
    impl: str,
    n: int,
    profile: str,
    settle_s: float,
    window_s: float,
    kills: int = 5,
    pause_s: float = 5.0,
) -> Result:
    with tempfile.TemporaryDirectory(prefix=f"bench-{impl}-{n}-") as tmp:
        workdir = Path(tmp)
        procs: list[Proc] = []
        counters: PortCounters | None = None
        try:
            first = start(impl, f"{impl}-0", profile, None, workdir)
            procs.append(first)
            time.sleep(1.0 if impl == "swim" else 0.3)  # the seed must be listening
            for i in range(1, n):
                procs.append(start(impl, f"{impl}-{i}", profile, first.port, workdir))
            launched = time.monotonic()
            names = {p.name for p in procs}

            def converged() -> bool:
                return all(p.joined() >= names - {p.name} for p in procs)

            try:
                until(converged, 120, f"{impl} N={n} converged")
            except TimeoutError:
                _explain(procs, names, workdir)
                exited = [p.name for p in procs if p.popen.poll() is not None]
                raise NotConverged(
                    f"{impl} N={n} did not converge in 120 s; exited: {exited}"
                ) from None
            last = max(max(t for t, k, _ in p.events if k == "join") for p in procs)
            converge = max(last - launched, 0.0)
            converge_ready = None
            readies = [p.first("ready") for p in procs]
            if all(r is not None for r in readies):
                converge_ready = max(last - max(r for r in readies if r is not None), 0.0)
            load_converged = os.getloadavg()[0]
            time.sleep(settle_s)
            steady_from = time.monotonic()
            counters = PortCounters([p.port for p in procs])
            ticks0 = {p.name: cpu_ticks(p.popen.pid) for p in procs}
            net0 = counters.read()
            t0 = time.monotonic()
            time.sleep(window_s)
            elapsed = time.monotonic() - t0
            ticks1 = {p.name: cpu_ticks(p.popen.pid) for p in procs}
            net1 = counters.read()
            rss = [rss_mib(p.popen.pid) for p in procs]
            cpu = statistics.mean(
                (ticks1[p.name] - ticks0[p.name]) * 1000 / CLK_TCK / elapsed for p in procs
            )
            pkts = bytes_ = None
            if net0 and net1:
                pkts = statistics.mean((net1[p.port][0] - net0[p.port][0]) / elapsed for p in procs)
                bytes_ = statistics.mean(
                    (net1[p.port][1] - net0[p.port][1]) / elapsed for p in procs
                )
            timed: list[Kill] = []
            alive = list(procs)
            killed_at: dict[str, float] = {}
            for _ in range(min(kills, n - 2)):
                timed.append(_kill_one(alive, killed_at))
                time.sleep(pause_s)
            false_dead, false_suspect = _false_events(procs, killed_at, steady_from)
            startup = _false_events(procs, killed_at, 0.0, steady_from)
            return Result(
                impl,
                profile,
                n,
                converge,
                converge_ready,
                cpu,
                statistics.mean(rss),
                max(rss),
                pkts,
                bytes_,
                timed,
                false_dead,
                false_suspect,
                *startup,
                (load_converged, os.getloadavg()[0]),
            )
        finally:
            if counters is not None:
                counters.close()
            stop(*(p.popen for p in procs), sig=signal.SIGKILL)


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def report(results: list[Result], runs: list[tuple[str, str]], command: str) -> str:
    spelled = ", ".join(f"{impl} `{profile}`" for impl, profile in runs)
    lines = [
        f"## swim vs serf: {spelled} ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{command}`. Machine: {os.cpu_count()} CPUs; serf is Debian's 0.9.4. "
        "All runs in the same invocation, one cluster at a time. Detection: median over the "
        "SIGKILLs (range in brackets) from the kill to the first suspicion, the first observer "
        "and the last observer declaring the member dead (failed); p99 is nearest-rank (the "
        "maximum below 100 kills). False dead (suspect): events about members not (yet) killed, "
        "from the end of the settle time (after convergence) on; start-up: from launch until "
        "then (all N interpreters start at once on this machine's CPUs).",
        "",
        "| impl | profile | N | join converge s (from last ready) | first suspect s | "
        "first dead s | last dead s | last dead p99 s | kills | false dead (suspect) | "
        "same, during start-up | "
        "CPU ms/agent/s | RSS MiB mean (max) | UDP pkts/agent/s | UDP bytes/agent/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.impl} | {r.profile} | {r.n} | {_f(r.converge_s)} ({_f(r.converge_ready_s)}) | "
            f"{_f(r.median('first_suspect_s'))} [{r.spread('first_suspect_s')}] | "
            f"{_f(r.median('first_dead_s'))} [{r.spread('first_dead_s')}] | "
            f"{_f(r.median('last_dead_s'))} [{r.spread('last_dead_s')}] | "
            f"{_f(r.p99('last_dead_s'))} | {len(r.kills)} | "
            f"{r.false_dead} ({r.false_suspect}) | "
            f"{r.startup_false_dead} ({r.startup_false_suspect}) | {_f(r.cpu_ms_per_s)} | "
            f"{_f(r.rss_mib_mean, '{:.1f}')} ({_f(r.rss_mib_max, '{:.1f}')}) | "
            f"{_f(r.pkts_per_s, '{:.1f}')} | {_f(r.bytes_per_s, '{:.0f}')} |"
        )
    lines += [
        "",
        "Detection budget, median / p99 s over the kills: *to suspicion* (kill → first "
        "suspicion anywhere: waiting for a prober, the direct timeout, the indirect round), "
        "*suspicion* (→ first death: the window), *spread* (→ the last survivor's death).",
        "",
        "| impl | profile | N | to suspicion | suspicion | spread | total |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [
            f"{_f(r.median(a))} / {_f(r.p99(a))}"
            for a in ("first_suspect_s", "suspicion_s", "spread_s", "last_dead_s")
        ]
        lines.append(f"| {r.impl} | {r.profile} | {r.n} | " + " | ".join(cells) + " |")
    base_impl, base_profile = runs[0]
    lines += [
        "",
        f"Ratios to {base_impl} `{base_profile}` at the same N (below 1: faster or cheaper):",
        "",
        "| run | N | last dead (median) | last dead (p99) | first dead (median) | CPU | "
        "packets | bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r.impl, r.profile, r.n): r for r in results}
    loads: list[str] = []
    for n in sorted({r.n for r in results}):
        g = by.get((base_impl, base_profile, n))
        for impl, profile in runs[1:]:
            s = by.get((impl, profile, n))
            if s is None or g is None:
                continue
            lines.append(
                f"| {impl} `{profile}` | {n} | "
                f"{_ratio(s.median('last_dead_s'), g.median('last_dead_s'))} | "
                f"{_ratio(s.p99('last_dead_s'), g.p99('last_dead_s'))} | "
                f"{_ratio(s.median('first_dead_s'), g.median('first_dead_s'))} | "
                f"{_ratio(s.cpu_ms_per_s, g.cpu_ms_per_s)} | "
                f"{_ratio(s.pkts_per_s, g.pkts_per_s)} | {_ratio(s.bytes_per_s, g.bytes_per_s)} |"
            )
        lan, fast = by.get(("swim", "lan", n)), by.get(("swim", "fast", n))
        if lan is not None and fast is not None:
            loads.append(
                f"N={n}: swim `fast` / swim `lan`: UDP packets "
                f"{_ratio(fast.pkts_per_s, lan.pkts_per_s)}, bytes "
                f"{_ratio(fast.bytes_per_s, lan.bytes_per_s)}, CPU "
                f"{_ratio(fast.cpu_ms_per_s, lan.cpu_ms_per_s)} (target: load at most 5x lan)."
            )
    if loads:
        lines += ["", *loads]
    return "\n".join(lines) + "\n"


def parse_runs(spec: str | None, profile: str) -> list[tuple[str, str]]:
    """``serf:local,swim:fast`` -> [("serf", "local"), ("swim", "fast")]; checked."""
    if not spec:
        return [("serf", profile), ("swim", profile)]
    runs = []
    for item in spec.split(","):
        impl, _, prof = item.strip().partition(":")
        if impl not in PATTERNS or prof not in PROFILES:
            raise ValueError(f"bad run {item!r}: want IMPL:PROFILE, IMPL in serf|swim")
        if impl == "serf" and prof not in SERF_PROFILES:
            raise ValueError(f"serf has no profile {prof!r} (it knows {', '.join(SERF_PROFILES)})")
        runs.append((impl, prof))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="swim vs serf, side by side")
    parser.add_argument("--sizes", default="8,32,64")
    parser.add_argument("--profile", default="lan", choices=list(PROFILES))
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs per cluster")
    parser.add_argument("--runs", help="IMPL:PROFILE,... (default: serf:P,swim:P for --profile P)")
    parser.add_argument("--out", type=Path, help="append the report to this markdown file")
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    started = results.machine()
    if SERF is None:
        print("serf is not installed (scripts/setup.sh installs it)", file=sys.stderr)
        return 2
    try:
        runs = parse_runs(args.runs, args.profile)
    except ValueError as exc:
        parser.error(str(exc))
    sizes = [int(x) for x in args.sizes.split(",")]
    measured: list[Result] = []
    failures: list[str] = []
    for n in sizes:
        for impl, profile in runs:
            for attempt in (1, 2):
                print(
                    f"-- {impl} {profile} N={n} (attempt {attempt}) ...",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    result = run_one(impl, n, profile, args.settle_s, args.window_s, args.kills)
                except NotConverged as exc:
                    failures.append(str(exc))
                    print(f"   {exc}", file=sys.stderr, flush=True)
                    continue
                print(f"   {result}", file=sys.stderr, flush=True)
                measured.append(result)
                break
    command = "python -m bench.compare_serf " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(measured, runs, command.strip())
    if failures:
        text += "\nRuns that did not converge (retried once):\n\n"
        text += "".join(f"- {f}\n" for f in failures)
    print(text)
    if args.out is not None:
        with args.out.open("a") as fh:
            fh.write("\n" + text)
    if measured:
        built = detection_results.build(
            [r.row() for r in measured],
            runs,
            sizes,
            kills=args.kills,
            settle_s=args.settle_s,
            window_s=args.window_s,
        )
        notes = [f"Did not converge (retried once): {f}" for f in failures]
        results.record(args, "bench.compare_serf", argv, started, built, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
