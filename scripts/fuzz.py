"""A longer fuzz run of the codec and the Node than CI does.

    .venv/bin/python scripts/fuzz.py --minutes 10 [--seed N] [--workers 2]

Runs the engine of tests/swim/test_fuzz.py (mutated serf golden packets and streams: bit
flips, truncations, splices, length-field edits, compound bombs, msgpack type confusion
behind valid CRC/LZW/AES-GCM layers, random bytes) against fresh Nodes, checking the same
properties as the tests: only ``WireError`` from the decoder, nothing from the Node, no
state change or uncounted drop from undecodable input, bounded state. Each worker uses its
own seed (``seed + worker``); a failure prints the seed and the traceback, and the failing
input is in the assertion message (hex). Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(args: tuple[int, float]) -> tuple[int, int, float, dict[str, int], str]:
    from tests.swim import test_fuzz

    seed, seconds = args
    start = time.monotonic()
    deadline = start + seconds
    total = 0
    dropped: Counter[str] = Counter()
    rng = random.Random(seed)
    try:
        while time.monotonic() < deadline:
            tally = test_fuzz.run(rng, 20_000, deadline=deadline)
            total += tally.inputs
            dropped.update(tally.dropped)
            dropped.update({f"stream:{k}": v for k, v in tally.parse_results.items()})
    except Exception:
        return seed, total, time.monotonic() - start, dict(dropped), traceback.format_exc()
    return seed, total, time.monotonic() - start, dict(dropped), ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--workers", type=int, default=1)
    opts = parser.parse_args()
    jobs = [(opts.seed + i, opts.minutes * 60) for i in range(opts.workers)]
    with multiprocessing.Pool(opts.workers) as pool:
        results = pool.map(_worker, jobs)
    failed = False
    inputs = 0
    dropped: Counter[str] = Counter()
    for seed, total, elapsed, drops, error in results:
        inputs += total
        dropped.update(drops)
        print(f"seed {seed}: {total} inputs in {elapsed:.0f} s ({total / elapsed:.0f}/s)")
        if error:
            failed = True
            print(f"seed {seed} FAILED:\n{error}")
    print(f"total inputs: {inputs}")
    print("drops and stream parse results:", dict(sorted(dropped.items())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
