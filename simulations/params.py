"""Command line of the operator's parameter table (``simulations.reports.params``,
docs/tuning.md).

    python -m simulations.params [--nodes 10,100,1000,10000] [--rtt-ms 2]
    python -m simulations.params --measured simulations/results/tuning [MORE_DIRS...]
    python -m simulations.params --compare simulations/results/baseline

Prints the computed rows per profile and size; with ``--measured`` or ``--compare`` the
rows condensed from a ``simulations.scaling`` result directory instead (``--measured``
takes several: a later one's cells replace an earlier one's, see ``measured_rows``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from simulations.reports.params import (
    COMPARE_COLS,
    COMPUTED_COLS,
    MEASURED_COLS,
    NODES,
    compare_rows,
    computed_row,
    measured_rows,
    table,
)
from swim import PROFILES


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default=",".join(map(str, NODES)))
    parser.add_argument("--rtt-ms", type=int, default=2, help="typical RTT (derived windows)")
    parser.add_argument(
        "--measured", type=Path, nargs="+", help="simulations.scaling result dir(s)"
    )
    parser.add_argument("--compare", type=Path, help="a simulations.scaling result dir")
    args = parser.parse_args(argv)
    for paths, rows_of, cols in (
        (args.measured, measured_rows, MEASURED_COLS),
        (None if args.compare is None else [args.compare], compare_rows, COMPARE_COLS),
    ):
        if paths is not None:
            for path in paths:
                if not (path / "cells.csv").exists():
                    raise SystemExit(f"{path}: no cells.csv (run simulations.scaling first)")
            print("\n".join(table(rows_of(*paths), cols)))
            return 0
    nodes = [int(x) for x in args.nodes.split(",")]
    rows = [computed_row(p, n, args.rtt_ms) for p in PROFILES for n in nodes]
    print("\n".join(table(rows, COMPUTED_COLS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
