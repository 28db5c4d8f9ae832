"""Protocol-version compatibility of a push-pull, as memberlist's ``verifyProtocol``.

Rules (hashicorp/memberlist @ 1b4c746 state.go ``verifyProtocol``): over every *alive* node
on both sides that advertises versions, compute the highest minimum and the lowest maximum
of the protocol and delegate ranges; then every node on both sides must speak a current
version (PCur, DCur) inside those ranges. Otherwise the state is not merged and the
exchange fails with a message naming the node.
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


def verify_protocol(local: Iterable[Versions], remote: Iterable[Versions]) -> str | None:
    """None when compatible, else the reason (memberlist's error text)."""
    local, remote = list(local), list(remote)
    max_pmin = max_dmin = 0
    min_pmax = min_dmax = 255
    for node in [*remote, *local]:
        if node.state != NodeStateType.ALIVE or len(node.vsn) < 5:
            continue
        max_pmin = max(max_pmin, node.vsn[0])
        min_pmax = min(min_pmax, node.vsn[1])
        max_dmin = max(max_dmin, node.vsn[3])
        min_dmax = min(min_dmax, node.vsn[4])
    for node in remote:
        # memberlist reads a missing Vsn on a remote state as version 0
        problem = _check(node, max_pmin, min_pmax, max_dmin, min_dmax)
        if problem:
            return problem
    for node in local:
        if len(node.vsn) >= 6:
            problem = _check(node, max_pmin, min_pmax, max_dmin, min_dmax)
            if problem:
                return problem
    return None


def _check(node: Versions, max_pmin: int, min_pmax: int, max_dmin: int, min_dmax: int) -> str:
    pcur, dcur = (node.vsn[2], node.vsn[5]) if len(node.vsn) >= 6 else (0, 0)
    if not max_pmin <= pcur <= min_pmax:
        return (
            f"node '{node.name}' protocol version ({pcur}) is incompatible: "
            f"[{max_pmin}, {min_pmax}]"
        )
    if not max_dmin <= dcur <= min_dmax:
        return (
            f"node '{node.name}' delegate protocol version ({dcur}) is incompatible: "
            f"[{max_dmin}, {min_dmax}]"
        )
    return ""
