"""Command line of the frontier exploration (method: ``simulations.experiments.frontier``;
output: ``simulations.reports.frontier``).

    python -m simulations.frontier --nodes 64 [--seeds 1,2 | 1-400] [--variants a,b,...]
        [--conditions x,y,...] [--crashes K] [--jobs J] [--out DIR] [--ci] [--lossy-tcp]

Prints the sweep's trace hash and the per-variant table; writes runs, crashes, variants
and cells as CSV, a markdown summary and the Pareto plot under ``--out`` (default
``simulations/results/frontier-n<N>``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from simulations.experiments.frontier import CONDITIONS, Options, all_variants, explore
from simulations.experiments.variants import VARIANTS
from simulations.reports.frontier import budget_table, variant_table, write


def _names(text: str, known: Collection[str]) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in known]
    if unknown:
        raise SystemExit(f"unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def seeds(text: str) -> list[int]:
    """``--seeds``: comma-separated seeds or ranges (``1,2`` or ``1-400``)."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, last = part.partition("-")
        try:
            out += range(int(first), int(last or first) + 1)
        except ValueError:
            raise SystemExit(f"--seeds: {part!r} is not a seed or a range A-B") from None
    return out


def options_from(args: argparse.Namespace) -> Options:
    if args.ci:
        options = Options.ci(args.jobs)
        options.lossy_tcp = args.lossy_tcp
        return options
    return Options(
        nodes=args.nodes,
        seeds=seeds(args.seeds),
        variants=_names(args.variants, all_variants()) if args.variants else list(VARIANTS),
        conditions=_names(args.conditions, CONDITIONS) if args.conditions else list(CONDITIONS),
        crashes=args.crashes,
        jobs=args.jobs,
        lossy_tcp=args.lossy_tcp,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--variants", help=", ".join(all_variants()))
    parser.add_argument("--conditions", help=", ".join(CONDITIONS))
    parser.add_argument("--crashes", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ci", action="store_true", help="n=16, lan and fast, clean and loss10")
    parser.add_argument(
        "--lossy-tcp", action="store_true", help="conditions with loss lose TCP segments too"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    options = options_from(args)
    out = args.out or Path(f"simulations/results/frontier-n{options.nodes}")
    wall0 = time.perf_counter()
    report = explore(options, progress=True)
    report.command = "python -m simulations.frontier " + shlex.join(argv)
    messages = write(report, out)
    print(f"== frontier  n {options.nodes}  trace hash {report.trace_hash}")
    print("\n".join(variant_table(report.variants)))
    print("\ndetection budget, median / p99 (s):")
    print("\n".join(budget_table(report.crashes)))
    print(f"wall {time.perf_counter() - wall0:.1f}s")
    print("\n".join(messages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
