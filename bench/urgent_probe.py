"""Crash to dead everywhere, with and without urgent probes (``Node.probe_now``), on the
simulator's virtual clock.

A model of the training hook's fast path: a SIGKILLed trainer shows up in the survivors' collectives
(gloo/NCCL connection errors) tens of milliseconds after the crash. Here every survivor
reports the victim ``--report-ms`` after the crash and its agent probes it at once; the
real trainer reports when its own collective errors, which this does not simulate
(``--reporters K``: only the K lowest-numbered survivors report, e.g. a ring's neighbours). Each
run is paired: the same seed, victim and crash time with and without the reports (the
runs are identical until the reports). The ``fast`` profile, bootstrapped clusters, 1–5 ms
uniform latency, no loss.

Prints, per n, the median over ``--seeds`` runs of: first suspicion anywhere, first death,
and death at the last survivor, all from the crash, in ms; and how many paired runs the
reports made slower at the last survivor.

    .venv/bin/python -m bench.urgent_probe [--sizes 3,16,64] [--seeds 25] [--report-ms 20]
        [--reporters K]

It also writes a result file under results/ (``--results DIR``, ``--no-results``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench import results
from simulations.model.world import World
from swim import Config, EventKind, MemberEvent

WARM_UP_MS = 10_000
"""Before the crash: every node has run 40 probe rounds (RTT samples, a settled table)."""
LIMIT_MS = 60_000
"""A run that has not seen the victim dead everywhere by then is reported as such."""


@dataclass(frozen=True, slots=True)
class Run:
    first_suspect_ms: int
    first_dead_ms: int
    last_dead_ms: int


class _Deaths:
    """Records when each observer first saw the victim suspect and dead."""

    def __init__(self, victim: str) -> None:
        self.victim = victim
        self.suspect: dict[int, int] = {}
        self.dead: dict[int, int] = {}
        self.now_ms = 0

    def on_event(self, idx: int, event: MemberEvent) -> None:
        if event.member.name != self.victim:
            return
        if event.kind == EventKind.SUSPECT:
            self.suspect.setdefault(idx, event.at_ms)
        elif event.kind == EventKind.DEAD:
            self.dead.setdefault(idx, event.at_ms)

    def on_lifecycle(self, kind: str, idx: int) -> None:
        pass


def run_once(n: int, seed: int, *, report_ms: int | None, reporters: int = 0) -> Run | None:
    """One crash; ``report_ms``: survivors probe the victim that long after it (all of
    them, or the first ``reporters``)."""
    world = World(n, seed=seed, config=Config.fast())
    world.start_all()
    victim = world.rng.randrange(n)
    crash_ms = WARM_UP_MS + world.rng.randrange(world.config.probe_interval_ms)
    deaths = _Deaths(world.names[victim])
    world.listeners.append(deaths)
    world.run_until(crash_ms)
    world.crash(victim)
    survivors = world.live_indices()
    if report_ms is not None:
        world.run_until(crash_ms + report_ms)
        for idx in survivors[:reporters] if reporters else survivors:
            world.probe_now(idx, world.names[victim])
    world.run_until_true(lambda: len(deaths.dead) == len(survivors), LIMIT_MS, step_ms=10)
    if len(deaths.dead) < len(survivors):
        return None
    return Run(
        min(deaths.suspect.values()) - crash_ms,
        min(deaths.dead.values()) - crash_ms,
        max(deaths.dead.values()) - crash_ms,
    )


def _median(values: Sequence[int]) -> str:
    return f"{statistics.median(values):.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="3,16,64")
    parser.add_argument("--seeds", type=int, default=25)
    parser.add_argument("--report-ms", type=int, default=20)
    parser.add_argument("--reporters", type=int, default=0, help="0: every survivor")
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    started = results.machine()
    figures: dict[str, results.Figure] = {}
    ratios: list[dict[str, object]] = []
    rows: list[dict[str, object]] = []
    print(
        "| n | reports | first suspect (ms) | first dead (ms) | dead at last survivor (ms) "
        "| runs slower with reports |"
    )
    print("|---|---|---|---|---|---|")
    who = f"{args.reporters} survivor(s)" if args.reporters else "all survivors"
    for n in (int(s) for s in args.sizes.split(",")):
        base: list[Run] = []
        fast: list[Run] = []
        for seed in range(1, args.seeds + 1):
            without = run_once(n, seed, report_ms=None)
            with_reports = run_once(n, seed, report_ms=args.report_ms, reporters=args.reporters)
            if without is None or with_reports is None:
                print(f"n={n} seed={seed}: not dead everywhere within {LIMIT_MS} ms")
                continue
            base.append(without)
            fast.append(with_reports)
        slower = sum(f.last_dead_ms > b.last_dead_ms for f, b in zip(fast, base, strict=True))
        for label, runs, extra in (
            ("none", base, ""),
            (f"{who} at +{args.report_ms} ms", fast, f"{slower}/{len(fast)}"),
        ):
            print(
                f"| {n} | {label} | {_median([r.first_suspect_ms for r in runs])} "
                f"| {_median([r.first_dead_ms for r in runs])} "
                f"| {_median([r.last_dead_ms for r in runs])} | {extra} |"
            )
            rows.append(
                {
                    "n": n,
                    "reports": label,
                    "first_suspect": statistics.median([r.first_suspect_ms for r in runs]),
                    "first_dead": statistics.median([r.first_dead_ms for r in runs]),
                    "last_dead": statistics.median([r.last_dead_ms for r in runs]),
                    "slower": extra or None,
                }
            )
        if fast:
            last = [r.last_dead_ms for r in fast]
            figures[f"n{n}.last_dead_ms"] = results.figure(
                f"n = {n}, with reports: crash → dead everywhere, median",
                statistics.median(last),
                "ms",
                0,
                spread=[min(last), max(last)],
                runs=len(last),
            )
            before = statistics.median([r.last_dead_ms for r in base])
            ratios.append(
                {
                    "label": f"with / without reports, n = {n}, dead everywhere",
                    "value": round(statistics.median(last) / before, 2),
                }
            )
    if figures:
        built = {
            "question": f"urgent-probe-{'-'.join(args.sizes.split(','))}-{args.reporters or 'all'}",
            "title": f"Urgent probes on a trainer's report, simulated: n = {args.sizes}, "
            + (f"{args.reporters} reporters" if args.reporters else "every survivor reports"),
            "method": (
                f"`fast`, bootstrapped clusters on the simulator's clock, 1–5 ms latency, no "
                f"loss; {args.seeds} seeds per size, each paired: the same victim and crash "
                f"with and without {who} reporting the victim {args.report_ms} ms after the "
                "crash (its agent then probes it at once)."
            ),
            "figures": figures,
            "peers": ["the same seeds without reports"],
            "ratios": ratios,
            "tables": [
                {
                    "caption": "Medians over the seeds, ms from the crash",
                    "columns": [
                        results.column("n", "n"),
                        results.column("reports", "reports"),
                        results.column("first_suspect", "first suspicion", 0),
                        results.column("first_dead", "first death", 0),
                        results.column("last_dead", "dead everywhere", 0),
                        results.column("slower", "runs slower with reports"),
                    ],
                    "rows": rows,
                }
            ],
        }
        results.record(args, "bench.urgent_probe", argv, started, built)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
