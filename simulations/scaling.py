"""Command line of the scaling sweep (method: ``simulations.experiments.scaling``; output:
``simulations.reports.scaling``).

    python -m simulations.scaling --nodes 10,100,1000 \\
        --variants lan,fast,heartbeat,heartbeat/fast --conditions clean,loss1,loss10,slow1 \\
        --crashes 3,8,3 --seeds 1,2,3,4,5:1,2:1 --out simulations/results/baseline [--lossy-tcp]
    python -m simulations.scaling --render DIR     # only re-draw DIR/scaling.png

Results are rewritten after each n, so a long sweep keeps what it finished.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from simulations.experiments.frontier import CONDITIONS, all_variants, explore
from simulations.experiments.scaling import Sweep
from simulations.model.gc_tuning import tune_for_simulation
from simulations.reports.scaling import load, plot, write


def _per_n(text: str, count: int, what: str) -> list[str]:
    parts = text.split(":") if ":" in text else [text]
    if len(parts) == 1:
        return parts * count
    if len(parts) != count:
        raise SystemExit(f"--{what}: one value or one per n ({count}), got {len(parts)}")
    return parts


def parse(argv: Sequence[str]) -> Sweep:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="10,100,1000")
    parser.add_argument("--variants", default="lan,fast,heartbeat,heartbeat/fast")
    parser.add_argument("--conditions", default="clean,loss1,loss10,slow1")
    parser.add_argument("--crashes", default="3,8,3", help="one, or one per n (commas)")
    parser.add_argument("--seeds", default="1,2,3,4,5:1,2:1", help="one list, or one per n (:)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("simulations/results/baseline"))
    parser.add_argument("--render", type=Path, help="only re-draw DIR/scaling.png from DIR")
    parser.add_argument(
        "--lossy-tcp", action="store_true", help="conditions with loss lose TCP segments too"
    )
    args = parser.parse_args(argv)
    nodes = [int(x) for x in args.nodes.split(",")]
    known = all_variants()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    bad = [v for v in variants if v not in known] + [c for c in conditions if c not in CONDITIONS]
    if bad:
        raise SystemExit(f"unknown {', '.join(bad)}; variants: {', '.join(known)}")
    crash_text = args.crashes.replace(",", ":") if "," in args.crashes else args.crashes
    crashes = [int(x) for x in _per_n(crash_text, len(nodes), "crashes")]
    seeds = [[int(s) for s in p.split(",")] for p in _per_n(args.seeds, len(nodes), "seeds")]
    sweep = Sweep(nodes, variants, conditions, crashes, seeds, args.jobs, args.out)
    sweep.command = "python -m simulations.scaling " + shlex.join(argv)
    sweep.render = args.render
    sweep.lossy_tcp = args.lossy_tcp
    return sweep


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep = parse(argv)
    if sweep.render is not None:
        print(plot(load(sweep.render), sweep.render / "scaling.png"))
        return 0
    messages: list[str] = []
    tune_for_simulation()
    for i, n in enumerate(sweep.nodes):
        wall0 = time.perf_counter()
        report = explore(sweep.options(i), progress=True)
        sweep.add(n, report, time.perf_counter() - wall0)
        messages = write(sweep, sweep.out)
        print(f"== n {n} done in {sweep.wall_s[n]:.0f} s, trace hash {report.trace_hash}")
    print("\n".join(messages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
