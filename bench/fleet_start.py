"""A fleet that starts or restarts at once: false suspicions and deaths of starting members.

A rack power cycle or a cluster-wide upgrade starts many agents at the same moment on busy
machines. No starting member may be declared dead: its peers must wait until it answers.
Two scenarios, each for real agents on loopback (ours or ``serf agent``):

- ``start``: a seed, then N − 1 agents started at once joining it; until every agent has
  seen every other join, then ``--settle-s`` more.
- ``restart``: a settled fleet of N; R of them SIGKILLed at once, declared dead by the
  others, then restarted at once under the same names and addresses, ``--cycles`` times.

Counted from each agent's log, timestamped as lines arrive (bench/watched.py): suspect and
dead events about a member while it was running (false: every member is alive here, except
a killed one between its kill and its restart), the suspicions each agent raised itself
(its own failed probe) and the deaths it declared itself (its suspicion timed out), split
by whether the accuser or the accused was starting (less than ``STARTING_S`` since its
launch); the time until every restarted member is alive in every view; flapping (suspect
events after that, until the end of the settle time); and the incarnations every view
holds of every member at the end (they agree once the fleet settled).

    python -m bench.fleet_start --runs swim:fast,serf:local --n 128
    python -m bench.fleet_start --scenario restart --n 40 --restart 32 --cycles 5

Writes one result JSON under results/ (``fleet-start-…`` / ``fleet-restart-…``);
``--cpus 0`` pins every agent to CPU 0 (a smaller box); ``FLEET_KEEP=DIR`` keeps the
agents' logs in DIR for reading afterwards (``python -m bench.fleet_logs DIR`` says who
accused whom, how late, and what preceded each death); ``--protocol KEY=INT`` overrides a
swim.Config field of our agents (e.g. the rules off: ``recovered_hold_ms=0``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.control import ControlClient, ControlError
from agent.procs import stop, until
from bench import results
from bench.compare_serf import parse_runs
from bench.procs import SERF
from bench.watched import Proc, start

CONVERGE_S = 180.0
"""How long a fleet may take to converge (128 agents on 2 busy cores take about 60 s)."""
STARTING_S = 10.0
"""A member launched less than this long ago counts as starting (interpreter start, bind,
join, first push-pull: about 1–5 s each on a busy 2-core box)."""


@dataclass
class Tally:
    """What one scenario run saw."""

    impl: str
    profile: str
    n: int
    restarted: int = 0
    cycles: int = 0
    suspect_events: int = 0
    dead_events: int = 0
    raised_by_starting: int = 0
    raised_by_settled: int = 0
    declared_by_starting: int = 0
    declared_by_settled: int = 0
    alive_everywhere_s: list[float] = field(default_factory=list)
    flapping: int = 0
    incarnations_agree: bool | None = None
    max_incarnation: int | None = None
    load: list[float] = field(default_factory=list)
    missing_joins: int = 0
    timeouts: int = 0
    """Restart waits (dead everywhere 60 s, alive everywhere 120 s) that ran out."""
    """Joins not yet seen when the wait for convergence (``CONVERGE_S``) ended."""
    about: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        alive = (
            f"{min(self.alive_everywhere_s):.1f}–{max(self.alive_everywhere_s):.1f}"
            if self.alive_everywhere_s
            else "n/a"
        )
        return (
            f"{self.impl}:{self.profile} N={self.n} R={self.restarted}×{self.cycles}: "
            f"false suspect {self.suspect_events}, false dead {self.dead_events} "
            f"(suspicions raised by starting/settled {self.raised_by_starting}/"
            f"{self.raised_by_settled}, deaths declared by starting/settled "
            f"{self.declared_by_starting}/{self.declared_by_settled}); alive everywhere "
            f"{alive} s (joins missing {self.missing_joins}, waits timed out {self.timeouts}); "
            f"flapping {self.flapping}; "
            f"incarnations agree "
            f"{self.incarnations_agree} (max {self.max_incarnation}); load {self.load}"
        )


class Fleet:
    """N agents of one implementation; each slot's launches (a restart appends one)."""

    def __init__(
        self,
        impl: str,
        profile: str,
        workdir: Path,
        cpus: set[int] | None = None,
        protocol: dict[str, int] | None = None,
    ) -> None:
        self.impl, self.profile, self.workdir, self.cpus = impl, profile, workdir, cpus
        self.config: Path | None = None
        if protocol and impl == "swim":  # swim.Config overrides (agent/config.py [protocol])
            self.config = workdir / "protocol.toml"
            lines = ["[protocol]", *(f"{k} = {v}" for k, v in protocol.items())]
            self.config.write_text("\n".join(lines) + "\n")
        self.procs: dict[str, Proc] = {}
        self.all: list[Proc] = []
        self.launched: dict[str, list[float]] = {}
        self.killed: dict[str, list[float]] = {}
        self.seed_port: int | None = None

    def launch(self, name: str, port: int | None = None) -> Proc:
        p = start(self.impl, name, self.profile, self.seed_port, self.workdir, port, self.config)
        if self.cpus:  # a smaller box: every agent on these CPUs
            with contextlib.suppress(OSError):
                os.sched_setaffinity(p.popen.pid, self.cpus)
        if self.seed_port is None:
            self.seed_port = p.port
        self.procs[name] = p
        self.all.append(p)
        self.launched.setdefault(name, []).append(time.monotonic())
        return p

    def kill(self, names: list[str]) -> None:
        now = time.monotonic()
        stop(*(self.procs[n].popen for n in names), sig=signal.SIGKILL)
        for n in names:
            self.killed.setdefault(n, []).append(now)

    def live(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.popen.poll() is None]

    def alive_everywhere(self, names: list[str], since: float) -> bool:
        """Every live agent logged ``names`` joined (or alive again) since ``since``."""
        return all(
            any(p.seen(kind, n, since) for kind in ("join", "alive"))
            for p in self.live()
            for n in names
            if n != p.name
        )

    def running(self, name: str, t: float) -> bool:
        """Whether ``name`` had a live process at ``t`` (launched before, not killed since)."""
        starts = [s for s in self.launched.get(name, []) if s <= t]
        if not starts:
            return False
        return not any(max(starts) <= k <= t for k in self.killed.get(name, []))

    def starting(self, name: str, t: float) -> bool:
        starts = [s for s in self.launched.get(name, []) if s <= t]
        return bool(starts) and t - max(starts) < STARTING_S

    def close(self) -> None:
        stop(*(p.popen for p in self.all), sig=signal.SIGKILL)


def _tally(fleet: Fleet, t: Tally, since: float, until_t: float, flap_from: float) -> None:
    for p in fleet.all:
        with p.lock:
            events = list(p.events)
        for when, kind, name in events:
            if not since <= when < until_t or name == p.name:
                continue
            if kind in ("suspect", "dead", "raised", "declared") and fleet.running(name, when):
                if kind == "suspect":
                    t.suspect_events += 1
                    if when >= flap_from:
                        t.flapping += 1
                elif kind == "dead":
                    t.dead_events += 1
                    t.about[name] = t.about.get(name, 0) + 1
                else:
                    who = "starting" if fleet.starting(p.name, when) else "settled"
                    attr = f"{kind}_by_{who}"
                    setattr(t, attr, getattr(t, attr) + 1)


def _incarnations(fleet: Fleet, t: Tally) -> None:
    """Whether every live agent holds the same incarnation of every member (ours only)."""
    if fleet.impl != "swim":
        return
    seen: dict[str, set[int]] = {}
    for p in fleet.live():
        try:
            members = ControlClient(fleet.workdir / f"{p.name}.sock", timeout_s=5).request(
                "members"
            )
        except (ControlError, OSError):
            t.incarnations_agree = False
            return
        for m in members:
            seen.setdefault(m["name"], set()).add(int(m["incarnation"]))
    t.incarnations_agree = all(len(v) == 1 for v in seen.values())
    t.max_incarnation = max((max(v) for v in seen.values()), default=None)


def _workdir(tmp: str) -> Path:
    """``FLEET_KEEP`` (kept afterwards) or the temporary directory."""
    keep = os.environ.get("FLEET_KEEP")
    if keep is None:
        return Path(tmp)
    path = Path(keep)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _start_fleet(fleet: Fleet, n: int) -> list[str]:
    fleet.launch(f"{fleet.impl}-0")
    time.sleep(1.0 if fleet.impl == "swim" else 0.3)  # the seed must be listening
    for i in range(1, n):
        fleet.launch(f"{fleet.impl}-{i}")
    names = [f"{fleet.impl}-{i}" for i in range(n)]
    with contextlib.suppress(TimeoutError):  # a fleet that never converges is a result too
        until(
            lambda: all(p.joined() >= set(names) - {p.name} for p in fleet.live()),
            CONVERGE_S,
            f"{fleet.impl} N={n} converged",
        )
    return names


def run_start(
    impl: str,
    profile: str,
    n: int,
    settle_s: float,
    cpus: set[int] | None = None,
    protocol: dict[str, int] | None = None,
) -> Tally:
    """A seed, then ``n`` − 1 agents started at once; until converged, then ``settle_s``."""
    t = Tally(impl, profile, n)
    with tempfile.TemporaryDirectory(prefix=f"fleet-{impl}-") as tmp:
        fleet = Fleet(impl, profile, _workdir(tmp), cpus, protocol)
        try:
            t0 = time.monotonic()
            names = _start_fleet(fleet, n)
            t.missing_joins = sum(len(set(names) - {p.name} - p.joined()) for p in fleet.live())
            if not t.missing_joins:
                t.alive_everywhere_s.append(time.monotonic() - t0)
            converged = time.monotonic()
            time.sleep(settle_s)
            t.load = _load()
            _tally(fleet, t, 0.0, time.monotonic(), converged)
            _incarnations(fleet, t)
        finally:
            fleet.close()
    return t


def run_restart(
    impl: str,
    profile: str,
    n: int,
    restart: int,
    cycles: int,
    settle_s: float,
    cpus: set[int] | None = None,
    protocol: dict[str, int] | None = None,
) -> Tally:
    """A fleet of ``n``; its last ``restart`` agents SIGKILLed at once, declared dead by
    the others, restarted at once under the same names and ports, ``cycles`` times."""
    t = Tally(impl, profile, n, restart, cycles)
    with tempfile.TemporaryDirectory(prefix=f"fleet-{impl}-") as tmp:
        fleet = Fleet(impl, profile, _workdir(tmp), cpus, protocol)
        try:
            names = _start_fleet(fleet, n)
            time.sleep(settle_s)
            begin = time.monotonic()
            flap_from = begin
            rack = names[n - restart :]
            for _ in range(cycles):
                killed = time.monotonic()
                ports = {name: fleet.procs[name].port for name in rack}
                fleet.kill(rack)
                survivors = fleet.live()
                try:  # a survivor that already held one dead logs no second death of it
                    until(
                        lambda s=survivors, k=killed: all(  # type: ignore[misc]
                            p.seen("dead", v, k) for p in s for v in rack
                        ),
                        60,
                        "the rack dead everywhere",
                    )
                except TimeoutError:
                    t.timeouts += 1
                back = time.monotonic()
                for name in rack:
                    fleet.launch(name, ports[name])
                try:
                    until(
                        lambda b=back: fleet.alive_everywhere(rack, b),  # type: ignore[misc]
                        120,
                        "the rack alive everywhere",
                    )
                    t.alive_everywhere_s.append(time.monotonic() - back)
                except TimeoutError:
                    t.timeouts += 1
                flap_from = time.monotonic()
                time.sleep(settle_s)
            t.load = _load()
            _tally(fleet, t, begin, time.monotonic(), flap_from)
            _incarnations(fleet, t)
        finally:
            fleet.close()
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a fleet started or restarted at once")
    parser.add_argument("--scenario", choices=("start", "restart"), default="start")
    parser.add_argument("--runs", default="swim:fast,serf:local")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--restart", type=int, default=32)
    parser.add_argument("--cycles", type=int, default=1)
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--cpus", help="pin every agent to these CPUs, e.g. 0 or 0,1")
    parser.add_argument(
        "--protocol",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="a swim.Config override for our agents, e.g. recovered_hold_ms=0 (repeatable)",
    )
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    started = results.machine()
    runs = parse_runs(args.runs, "lan")
    if any(impl == "serf" for impl, _ in runs) and SERF is None:
        print("serf is not installed (scripts/setup.sh installs it)", file=sys.stderr)
        return 2
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else None
    protocol = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.protocol)}
    tallies = []
    for impl, profile in runs:
        print(f"-- {impl}:{profile} {args.scenario} N={args.n} ...", file=sys.stderr, flush=True)
        if args.scenario == "start":
            tally = run_start(impl, profile, args.n, args.settle_s, cpus, protocol)
        else:
            tally = run_restart(
                impl,
                profile,
                args.n,
                min(args.restart, args.n - 1),
                args.cycles,
                args.settle_s,
                cpus,
                protocol,
            )
        print(tally.line(), flush=True)
        tallies.append(tally)
    results.record(args, "bench.fleet_start", argv, started, _built(args, tallies))
    return 0


def _built(args: argparse.Namespace, tallies: list[Tally]) -> dict[str, object]:
    """The result file's question, figures and table (bench/results.py)."""
    runs = "-".join(f"{t.impl}-{t.profile}" for t in tallies)
    restart = args.scenario == "restart"
    question = f"fleet-{args.scenario}-{args.n}" + (
        f"-r{args.restart}x{args.cycles}" if restart else ""
    )
    if args.cpus:
        question += f"-cpus{args.cpus.replace(',', '-')}"
    for kv in args.protocol:  # an override is a different question
        question += "-" + kv.replace("_", "-").replace("=", "")
    question += f"-{runs}"
    what = (
        f"{args.restart} of {args.n} agents restarted at once, {args.cycles} times"
        if restart
        else f"{args.n} agents started at once"
    )
    pinned = f" on CPUs {args.cpus}" if args.cpus else ""
    figures = {}
    rows = []
    for t in tallies:
        key = f"{t.impl}_{t.profile}"
        figures[f"{key}_false_dead"] = results.figure(
            f"{t.impl} `{t.profile}`: dead events about running members", t.dead_events, "", 0
        )
        figures[f"{key}_false_suspect"] = results.figure(
            f"{t.impl} `{t.profile}`: suspect events about running members",
            t.suspect_events,
            "",
            0,
        )
        alive = t.alive_everywhere_s
        rows.append(
            {
                "run": f"{t.impl} `{t.profile}`",
                "dead": t.dead_events,
                "suspect": t.suspect_events,
                "raised": f"{t.raised_by_starting}/{t.raised_by_settled}",
                "declared": f"{t.declared_by_starting}/{t.declared_by_settled}",
                "alive_s": results.stat(max(alive), lo=min(alive), hi=max(alive))
                if alive
                else None,
                "flapping": t.flapping,
                "incarnations": t.incarnations_agree,
                "load": " / ".join(f"{x:.1f}" for x in t.load),
            }
        )
    columns = [
        results.column("run", "run"),
        results.column("dead", "false dead"),
        results.column("suspect", "false suspect"),
        results.column("raised", "suspicions raised by starting/settled"),
        results.column("declared", "deaths declared by starting/settled"),
        results.column("alive_s", "all alive everywhere s", 1),
        results.column("flapping", "suspect events after"),
        results.column("incarnations", "incarnations agree"),
        results.column("load", "load 1/5/15 min at the end"),
    ]
    return {
        "question": question,
        "title": f"A fleet {'restarted' if restart else 'started'} at once: {what}{pinned}",
        "method": (
            f"{what}{pinned} on loopback (bench/fleet_start.py), one implementation after "
            f"another; events counted from each agent's log as lines arrive; a member counts "
            f"as starting for {STARTING_S:g} s after its launch; settle {args.settle_s:g} s."
        ),
        "figures": figures,
        "tables": [{"caption": "Per run", "columns": columns, "rows": rows}],
    }


if __name__ == "__main__":
    raise SystemExit(main())
