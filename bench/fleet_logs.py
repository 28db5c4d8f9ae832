"""Why members were declared dead: read the logs that ``FLEET_KEEP=DIR python -m
bench.fleet_start ...`` kept, one ``NAME.log`` per agent (each launch starts with its
"listening on" line).

Prints, from our agents' own lines:
- failed probes (``suspect X has failed``) by the age of accuser and accused (time since
  each one's launch), and the accuser's own timer lag and health score at that moment
  (logged with every failed probe): was the accuser starved, or the accused?
- deaths declared (``marking X as failed``) by their peer confirmations;
- how long an accused member took to refute: from the first failed probe about it to its
  own first "refuting" line;
- for each declared death, whether the member had refuted an accusation (or joined, in the
  declarer's view) within 10 and 30 s before: the evidence ``recovered_hold_ms`` keys on.

    python -m bench.fleet_logs DIR
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
FAILED = re.compile(
    r"suspect (\S+) has failed, no acks received.*our timers (\d+) ms late, health (\d+)"
)
DECLARED = re.compile(r"marking (\S+) as failed, suspect timeout reached \((\d+) peer")
JOINED = re.compile(r"member (\S+) (?:joined|alive)")


def _time(line: str) -> float | None:
    m = TS.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def _lines(directory: Path) -> dict[str, list[tuple[float, str]]]:
    logs = {}
    for path in sorted(directory.glob("*.log")):
        text = path.read_text(errors="replace").splitlines()
        logs[path.stem] = [(t, line) for line in text if (t := _time(line)) is not None]
    return logs


def _age(launches: list[float], t: float) -> str:
    before = [x for x in launches if x <= t]
    if not before:
        return "?"
    age = t - max(before)
    return "<10s" if age < 10 else "10-30s" if age < 30 else ">30s"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.fleet_logs DIR", file=sys.stderr)
        return 2
    logs = _lines(Path(args[0]))
    launches = {n: [t for t, line in ls if "listening on" in line] for n, ls in logs.items()}
    refuted = {n: [t for t, line in ls if "refuting" in line] for n, ls in logs.items()}
    failed, declared, joined = [], [], []
    for name, lines in logs.items():
        for t, line in lines:
            if m := FAILED.search(line):
                failed.append((t, name, m.group(1), int(m.group(2)), int(m.group(3))))
            elif m := DECLARED.search(line):
                declared.append((t, name, m.group(1), int(m.group(2))))
            elif m := JOINED.search(line):
                joined.append((t, name, m.group(1)))
    ages = Counter((_age(launches[a], t), _age(launches.get(b, []), t)) for t, a, b, *_ in failed)
    print(f"failed probes {len(failed)}, by (accuser age, accused age): {sorted(ages.items())}")
    if failed:
        lags = sorted(f[3] for f in failed)
        print(
            f"accuser's timer lag: median {statistics.median(lags):g} ms, "
            f"p90 {lags[int(0.9 * (len(lags) - 1))]} ms; >= 250 ms {sum(x >= 250 for x in lags)}"
            f"; health > 0 at {sum(f[4] > 0 for f in failed)}"
        )
    print(
        f"deaths declared {len(declared)}, by confirmations: "
        f"{sorted(Counter(d[3] for d in declared).items())}"
    )
    delays = []
    for accused in {f[2] for f in failed}:
        first = min(f[0] for f in failed if f[2] == accused)
        later = [t for t in refuted.get(accused, []) if t >= first - 0.5]
        if later:
            delays.append(later[0] - first)
    if delays:
        q = statistics.quantiles(delays, n=10) if len(delays) > 1 else delays * 9
        print(
            f"first failed probe -> its refutation: median {statistics.median(delays):.2f} s, "
            f"p90 {q[8]:.2f} s, max {max(delays):.2f} s"
        )
    for within in (10, 30):
        ref = sum(any(t - within <= r < t for r in refuted.get(b, [])) for t, _, b, _ in declared)
        join = sum(
            any(o2 == o and b2 == b and t - within <= j <= t for j, o2, b2 in joined)
            for t, o, b, _ in declared
        )
        print(
            f"deaths of a member that refuted within {within} s before: {ref}; "
            f"that joined in the declarer's view: {join}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
