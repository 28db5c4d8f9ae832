"""What holding a recovered member's suspicion costs: a member SIGKILLed a few seconds after
it joined, or after it restarted, and the time until every other agent says it is dead.

``fast`` holds a suspicion of a member that came back alive from suspect, dead or left less
than ``recovered_hold_ms`` ago to Lifeguard's maximum window and a last-chance ping
(swim/suspicion.py); a first join keeps the usual windows. Here, for real agents on
loopback: a fleet of N settles; one more agent joins; ``--after-s`` after every agent has
seen it join, it is SIGKILLed (``first join``); it is restarted under the same name and
port, and ``--after-s`` after every agent has seen it back, SIGKILLed again
(``restart``); ``--kills`` times each. Run it with the rule off and on in one call:

    python -m bench.young_kill --n 16 --after-s 5 --kills 3 --holds 0,30000

Prints the median and maximum time from the SIGKILL to a dead event in every other
agent's log, per case and setting, and the load; writes no result file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from agent.procs import until
from bench.fleet_start import Fleet, _start_fleet


def _dead_everywhere_s(fleet: Fleet, name: str, killed: float) -> float:
    others = [p for p in fleet.live() if p.name != name]
    until(lambda: all(p.seen("dead", name, killed) for p in others), 60, f"{name} dead")
    return max(p.seen("dead", name, killed) or 0.0 for p in others) - killed


def _seen_everywhere(fleet: Fleet, name: str, since: float) -> None:
    until(
        lambda: all(
            p.seen("join", name, since) or p.seen("alive", name, since)
            for p in fleet.live()
            if p.name != name
        ),
        60,
        f"{name} alive everywhere",
    )


def run(n: int, after_s: float, kills: int, hold_ms: int) -> dict[str, list[float]]:
    """Seconds from SIGKILL to dead everywhere, for ``first join`` and ``restart``."""
    out: dict[str, list[float]] = {"first join": [], "restart": []}
    with tempfile.TemporaryDirectory(prefix="young-kill-") as tmp:
        protocol = {"recovered_hold_ms": hold_ms}
        fleet = Fleet("swim", "fast", Path(tmp), None, protocol)
        try:
            _start_fleet(fleet, n)
            time.sleep(5.0)
            for i in range(kills):
                name = f"young-{i}"
                since = time.monotonic()
                proc = fleet.launch(name)
                _seen_everywhere(fleet, name, since)
                time.sleep(after_s)
                fleet.kill([name])
                out["first join"].append(_dead_everywhere_s(fleet, name, time.monotonic()))
                since = time.monotonic()
                fleet.launch(name, proc.port)
                _seen_everywhere(fleet, name, since)
                time.sleep(after_s)
                fleet.kill([name])
                out["restart"].append(_dead_everywhere_s(fleet, name, time.monotonic()))
        finally:
            fleet.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="detection of a member that just joined")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--after-s", type=float, default=5.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--holds", default="0,30000", help="recovered_hold_ms values")
    args = parser.parse_args(argv)
    for hold_ms in (int(h) for h in args.holds.split(",")):
        got = run(args.n, args.after_s, args.kills, hold_ms)
        for case, times in got.items():
            print(
                f"recovered_hold_ms={hold_ms} {case}, SIGKILL {args.after_s:g} s after: dead "
                f"everywhere median {statistics.median(times):.2f} s, max {max(times):.2f} s "
                f"({len(times)} kills, N={args.n}); load {os.getloadavg()}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
