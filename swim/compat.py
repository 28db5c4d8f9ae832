"""Protocol-version compatibility of a push-pull, as memberlist's ``verifyProtocol``.

Rules (hashicorp/memberlist @ 1b4c746 state.go ``verifyProtocol``): over every *alive* node
on both sides that advertises versions, compute the highest minimum and the lowest maximum
of the protocol and delegate ranges; then every node on both sides must speak a current
version (PCur, DCur) inside those ranges. Otherwise the state is not merged and the
exchange fails with a message naming the node (the first one, remote side first, among
those sharing the failing versions).

A side is reduced to a ``VersionSummary`` (bounds plus one node per distinct current
version), so a summary of a large table can be computed once and reused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from swim.messages import NodeStateType


@dataclass(frozen=True, slots=True)
class Versions:
    name: str
    state: NodeStateType
    vsn: bytes | tuple[int, ...]


_NO_BOUNDS = (0, 255, 0, 255)


@dataclass(frozen=True, slots=True)
class VersionSummary:
    """What ``verifyProtocol`` needs from one side, in O(distinct versions) space.

    ``bounds``: (highest pmin, lowest pmax, highest dmin, lowest dmax) over the alive nodes
    that advertise versions. ``currents``: the first node (in order) for each distinct
    (pcur, dcur) that must be checked against the bounds of both sides.
    """

    bounds: tuple[int, int, int, int]
    currents: tuple[tuple[str, int, int], ...]


def combine_bounds(
    a: tuple[int, int, int, int], b: tuple[int, int, int, int]
) -> tuple[int, int, int, int]:
    return (max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]))


def summarize(nodes: Iterable[Versions], *, remote: bool) -> VersionSummary:
    """One side's summary. Remote nodes without versions count as version 0 (memberlist
    reads a missing Vsn so); local nodes without a full vector are not checked."""
    max_pmin = max_dmin = 0
    min_pmax = min_dmax = 255
    currents: dict[tuple[int, int], str] = {}
    for node in nodes:
        vsn = node.vsn
        if node.state == NodeStateType.ALIVE and len(vsn) >= 5:
            max_pmin = max(max_pmin, vsn[0])
            min_pmax = min(min_pmax, vsn[1])
            max_dmin = max(max_dmin, vsn[3])
            min_dmax = min(min_dmax, vsn[4])
        if len(vsn) >= 6:
            currents.setdefault((vsn[2], vsn[5]), node.name)
        elif remote:
            currents.setdefault((0, 0), node.name)
    return VersionSummary(
        (max_pmin, min_pmax, max_dmin, min_dmax),
        tuple((name, p, d) for (p, d), name in currents.items()),
    )


def verify_summaries(local: VersionSummary, remote: VersionSummary) -> str | None:
    """``verify_protocol`` on summaries: None when compatible, else the reason."""
    bounds = combine_bounds(local.bounds, remote.bounds)
    for name, pcur, dcur in (*remote.currents, *local.currents):
        problem = _check(name, pcur, dcur, bounds)
        if problem:
            return problem
    return None


def verify_protocol(local: Iterable[Versions], remote: Iterable[Versions]) -> str | None:
    """None when compatible, else the reason (memberlist's error text)."""
    return verify_summaries(summarize(local, remote=False), summarize(remote, remote=True))


def _check(name: str, pcur: int, dcur: int, bounds: tuple[int, int, int, int]) -> str:
    max_pmin, min_pmax, max_dmin, min_dmax = bounds
    if not max_pmin <= pcur <= min_pmax:
        return f"node '{name}' protocol version ({pcur}) is incompatible: [{max_pmin}, {min_pmax}]"
    if not max_dmin <= dcur <= min_dmax:
        return (
            f"node '{name}' delegate protocol version ({dcur}) is incompatible: "
            f"[{max_dmin}, {min_dmax}]"
        )
    return ""
