"""A probe schedule every member computes alike (``Config.coordinated_probes``; ours).

Why: with SWIM's randomized round robin (SWIM §4.3) each member picks its next target from
its own shuffled order, so in a given probe interval nobody picks a particular member with
probability (1 − 1/(n−1))^(n−1) ≈ e^−1, and a crashed member waits > 4 intervals for its
first probe in 1 % of crashes. That wait is most of the tail of a `fast` detection
(simulations/RESULTS.md §8).

Rules:
- The ring is the name-sorted list of the members this node holds alive or suspect,
  itself included (dead and left members are not probed, as in memberlist).
- In round r the member at position i probes position ``(i + 1 + r mod (n − 1)) mod n``.
  For a fixed r this is a rotation of the ring, so when the members' rings agree each one
  is probed by exactly one other member per round; over n − 1 consecutive rounds each
  member probes every other member once (the round robin's coverage).
- The round number comes from the caller (wall-clock milliseconds // probe interval), so
  members whose clocks agree to a small fraction of the interval agree on r. Rings that
  differ (a join or a death not yet heard everywhere) or clocks that disagree only make
  the assignment less even for a while; every member still probes one member per round.
- Work: O(log n) per round and per change (bisect into a Python list; inserting or
  removing moves pointers in C, fast even at 65,536 members); memory one list of names.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = ["ProbeRing"]


class ProbeRing:
    """The name-sorted ring of live members and the target of each round."""

    def __init__(self, local_name: str) -> None:
        self._local = local_name
        self._names: list[str] = [local_name]

    def __len__(self) -> int:
        return len(self._names)

    def reset(self, live: Iterable[str]) -> None:
        """Start over from the members held alive or suspect (after a bootstrap)."""
        self._names = sorted({self._local, *live})

    def update(self, name: str, live: bool) -> None:
        """``name`` is now alive or suspect (``live``), or dead or left."""
        if live:
            self.add(name)
        else:
            self.discard(name)

    def add(self, name: str) -> None:
        """``name`` is alive or suspect (idempotent)."""
        names = self._names
        i = bisect.bisect_left(names, name)
        if i == len(names) or names[i] != name:
            names.insert(i, name)

    def discard(self, name: str) -> None:
        """``name`` is dead, left or forgotten (idempotent; the local member stays)."""
        if name == self._local:
            return
        names = self._names
        i = bisect.bisect_left(names, name)
        if i < len(names) and names[i] == name:
            del names[i]

    def target(self, round_no: int) -> str | None:
        """The member this node probes in round ``round_no``; None when it is alone."""
        names = self._names
        n = len(names)
        if n < 2:
            return None
        i = bisect.bisect_left(names, self._local)
        return names[(i + 1 + round_no % (n - 1)) % n]
