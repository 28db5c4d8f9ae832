"""Command line for the simulator's scenarios.

    python -m simulations.run --scenario NAME [--nodes N] [--seed S] [--duration-s D]
        [--out DIR] [--config lan|wan|local] [--lifeguard full|swim|lha-probe|lha-suspicion|
        buddy|all] [--slow K] [--loss P] [--latency uniform:1:5] [--ci] [--full-checks]
        [--set key=value ...] [--no-plots]

Prints the seed first, a progress line (simulated time, wall time, events/s) every few
wall seconds, and at the end a summary whose first lines are the seed and the trace hash;
writes CSVs, a markdown summary and PNG plots (if matplotlib is installed) under ``--out``.
Scenario-specific knobs are listed in each scenario's module docstring
(``simulations.experiments.scenarios``, ``simulations.experiments.scenarios_faults``),
e.g. ``--set crashes=10``, ``--set slow_delay_ms=150``, ``--set burst=0.01:0.3``
(Gilbert–Elliott p_gb:p_bg), ``--set duplicate=0.01``, ``--set reorder=0.05 --set
reorder_ms=30``, and any Config field as ``--set cfg.suspicion_mult=2``.

The scenarios (each also has ``--ci``, a small, short variant):

    python -m simulations.run --scenario steady --nodes 100 --duration-s 60
    python -m simulations.run --scenario crash --nodes 50 --set crashes=10
    python -m simulations.run --scenario dissemination --nodes 1000      # sweeps n up to N
    python -m simulations.run --scenario slow-members --nodes 50 --slow 4 --lifeguard all
    python -m simulations.run --scenario loss --nodes 100 --loss 0.1     # no --loss: 0/0.1/0.3
    python -m simulations.run --scenario partition --nodes 40 --set asymmetric=1
    python -m simulations.run --scenario churn --nodes 50 --set crash_per_min=4
    python -m simulations.run --scenario scale --nodes 10000 --duration-s 60
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from simulations.experiments.harness import LIFEGUARD, PRESETS, Params
from simulations.experiments.scenarios import REGISTRY, run
from simulations.model.gc_tuning import tune_for_simulation
from simulations.model.world import World
from simulations.reports import scenario as report
from simulations.reports.files import fmt


class ProgressPrinter:
    """Prints a line every ``every_s`` wall seconds (wall time lives here, not in the world)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self.started = time.perf_counter()
        self._last = self.started
        self._last_events = 0
        self._world_id = 0

    def __call__(self, world: World) -> None:
        now = time.perf_counter()
        if id(world) != self._world_id:
            # a scenario that runs several worlds (sweeps, ablations) starts counting anew
            self._world_id, self._last_events = id(world), 0
        if now - self._last < self.every_s:
            return
        events = world.events_processed
        rate = (events - self._last_events) / (now - self._last)
        print(
            f"  sim {world.now_ms / 1000:8.1f}s  wall {now - self.started:7.1f}s  "
            f"{rate:9.0f} events/s  live {len(world.live_indices())}",
            flush=True,
        )
        self._last, self._last_events = now, events


def _parse_set(values: Sequence[str]) -> dict[str, str]:
    extra = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        extra[key.strip()] = value.strip()
    return extra


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", required=True, choices=sorted(REGISTRY))
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float)
    parser.add_argument("--out", type=Path, default=Path("sim-results"))
    parser.add_argument("--config", choices=sorted(PRESETS), default="lan")
    parser.add_argument("--lifeguard", choices=[*LIFEGUARD, "all"], default="full")
    parser.add_argument("--slow", type=int, help="number of slow members (slow-members)")
    parser.add_argument("--loss", type=float, help="independent packet loss probability")
    parser.add_argument(
        "--latency",
        default="uniform:1:5",
        help="const:MS | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:FLOOR] | normal:MEAN:SD[:FLOOR]",
    )
    parser.add_argument("--ci", action="store_true", help="the small, short CI variant")
    parser.add_argument(
        "--full-checks",
        action="store_true",
        help="scan every node's table after every input (slow)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--progress-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.lifeguard == "all" and args.scenario != "slow-members":
        parser.error("--lifeguard all is only for --scenario slow-members")
    printer = ProgressPrinter(args.progress_s)
    params = Params(
        nodes=args.nodes,
        seed=args.seed,
        duration_s=args.duration_s,
        config=args.config,
        lifeguard=args.lifeguard,
        slow=args.slow,
        loss=args.loss,
        latency=args.latency,
        full_checks=args.full_checks,
        ci=args.ci,
        extra=_parse_set(args.set),
        progress=printer,
    )
    print(f"scenario {args.scenario}  seed {args.seed}", flush=True)
    tune_for_simulation()
    wall0 = time.perf_counter()
    result = run(args.scenario, params)
    wall = time.perf_counter() - wall0
    result.summary.setdefault("wall_s", wall)
    print(f"== summary of {result.scenario}")
    print(f"seed: {result.seed}")
    print(f"trace hash: {result.trace_hash}")
    for key, value in result.summary.items():
        print(f"  {key}: {fmt(value)}")
    for message in report.write(result, args.out, plots=not args.no_plots):
        print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
