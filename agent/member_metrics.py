"""Per-member Prometheus series for the members that are not alive (agent/metrics.py
registers them with the rest).

Rules:
- Only suspect, dead and left members get series; an alive member gets none. Every agent
  sees every member, so a per-member series for alive members would cost N² series
  fleet-wide (10⁶ on a 1,000-node cluster) and churn with membership, for no alert: the
  members an operator is paged about are the unhealthy ones.
- The members are the agent's listed members (Serf's view): the core's table plus the
  failed and left members it already reaped (agent/departed.py), so a dead node stays
  visible (and its alert firing) until it comes back, is force-left, or its reconnect
  timeout passes, not only for the 15–60 s the core keeps it.
- Two series per member: ``swim_member_unhealthy{member,status}`` (always 1, so that
  ``count by (member)`` across agents says how many see it) and
  ``swim_member_unhealthy_since_seconds{member,status}``, how long ago this agent saw the
  member enter that status (its own clock; omitted without one).
- Bounded: at most ``MAX_UNHEALTHY_MEMBERS`` members per scrape. Suspect and dead members
  come before left ones (a planned drain of hundreds of nodes must not hide a crash), then
  the most recently changed first, ties by name: a fresh failure is always exported and
  every agent picks the same set. ``swim_member_unhealthy_omitted{status}`` counts the rest.
- Label values are member names, which any peer chooses. prometheus_client escapes
  backslash, double quote and newline, but encodes the page as strict UTF-8, and names off
  the wire keep undecodable bytes as lone surrogates (``surrogateescape``): one such name
  would fail the whole scrape. ``member_label`` writes those bytes as ``\\xNN`` instead;
  two names that come out the same (only possible with such bytes) are exported once
  and the other is counted as omitted, so a page never holds a duplicate series.

Prometheus' own guidance (docs "Instrumentation", "Use labels"; "Metric and label naming")
is the source of the cardinality rule: keep a metric's label values bounded.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

import swim

__all__ = ["MAX_UNHEALTHY_MEMBERS", "UNHEALTHY_STATUS", "member_label", "unhealthy_families"]

MAX_UNHEALTHY_MEMBERS = 500
"""Why a bound: each exported member costs two series (the flag and its age), so one
agent's page carries at most 1,000 per-member series, and N agents at most N × 1,000
fleet-wide whatever fails at once (a rack, a whole partition). 500 names more nodes than an
operator reads through in an incident; past it the alerts still fire for the 500 newest
failures and ``swim_member_unhealthy_omitted{status}`` counts the rest."""

UNHEALTHY_STATUS: dict[swim.NodeStateType, str] = {
    swim.NodeStateType.SUSPECT: "suspect",
    swim.NodeStateType.DEAD: "dead",
    swim.NodeStateType.LEFT: "left",
}
"""The ``status`` label, as ``swimctl members --status`` spells it."""


def member_label(name: str) -> str:
    """A member name as a label value: itself when it is valid UTF-8, else with each
    undecodable byte (a lone surrogate from ``surrogateescape``) written as ``\\xNN``."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return name


def _rank(member: swim.Member) -> tuple[bool, int, str]:
    """Sort key, smallest first: failures before departures, then the newest change."""
    return (member.state == swim.NodeStateType.LEFT, -member.state_change_ms, member.name)


def unhealthy_families(
    members: Callable[[], Iterable[swim.Member]] | None,
    now_ms: Callable[[], int] | None,
    max_members: int,
) -> Iterator[Metric]:
    """The three families; ``members`` is None when describing (nothing is read)."""
    flag = GaugeMetricFamily(
        "swim_member_unhealthy",
        "1 for each member this node sees as suspect, dead or left (alive members have no "
        "series). Bounded: the most recently changed members first; see "
        "swim_member_unhealthy_omitted.",
        labels=["member", "status"],
    )
    since = GaugeMetricFamily(
        "swim_member_unhealthy_since_seconds",
        "Seconds since this node saw the member enter its status (same members as "
        "swim_member_unhealthy).",
        labels=["member", "status"],
    )
    omitted = GaugeMetricFamily(
        "swim_member_unhealthy_omitted",
        "Members left out of swim_member_unhealthy by its bound, by status (always all three).",
        labels=["status"],
    )
    if members is not None:
        unhealthy = [m for m in members() if m.state in UNHEALTHY_STATUS]
        now = None if now_ms is None else now_ms()
        left_out = dict.fromkeys(UNHEALTHY_STATUS.values(), 0)
        for m in unhealthy:
            left_out[UNHEALTHY_STATUS[m.state]] += 1
        exported: set[str] = set()
        for member in heapq.nsmallest(max_members, unhealthy, key=_rank):
            label = member_label(member.name)
            if label in exported:
                continue
            exported.add(label)
            status = UNHEALTHY_STATUS[member.state]
            left_out[status] -= 1
            flag.add_metric([label, status], 1)
            if now is not None:
                since.add_metric([label, status], max(now - member.state_change_ms, 0) / 1000)
        for status, count in left_out.items():
            omitted.add_metric([status], count)
    yield flag
    yield since
    yield omitted
