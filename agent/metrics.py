"""Prometheus metrics for one agent (agent/metrics_http.py serves them over HTTP).

Every agent owns its own ``CollectorRegistry`` (never prometheus_client's global one), so
several agents can live in one process (tests, simulations) without clashing.

Most values are read from the sans-IO ``swim.Node`` at scrape time by a custom collector:
the agent is a single-threaded trio program and the scrape runs in the same thread as the
task that owns the node, so reading ``node.stats`` and ``node.members()`` in the scrape is
race-free and costs nothing between scrapes. The one value the node does not aggregate —
the probe round-trip time distribution — is a real ``Histogram`` fed by the agent through
``AgentMetrics.observe_probe_rtt_ms`` for every ``ProbeResult``.

Metric names (all prefixed ``swim_``; counters end in ``_total``; base units):

- ``swim_members{state}`` gauge (alive, suspect, dead, left — always all four)
- ``swim_member_table_size`` gauge
- ``swim_probes_sent_total``, ``swim_probes_failed_total``,
  ``swim_indirect_probes_sent_total``, ``swim_tcp_fallback_probes_total``,
  ``swim_tcp_fallback_rescues_total``, ``swim_nacks_received_total``
- ``swim_suspicions_raised_total``, ``swim_suspicions_refuted_total``,
  ``swim_refutations_total``, ``swim_deaths_declared_total``,
  ``swim_suspicion_timeouts_degraded_total``, ``swim_suspicion_verifications_total``,
  ``swim_suspicions_held_starved_total``,
  ``swim_cross_check_probes_total``, ``swim_cross_check_probes_failed_total``
- ``swim_address_conflicts_total`` (alives refused: a live member holds the name elsewhere)
- ``swim_health_score``, ``swim_broadcast_queue_depth``, ``swim_incarnation`` gauges
- ``swim_packets_received_total``, ``swim_packets_sent_total``,
  ``swim_received_bytes_total``, ``swim_sent_bytes_total``
- ``swim_messages_received_total{type}``, ``swim_messages_sent_total{type}``
- ``swim_dropped_inputs_total{reason}`` (every ``DropReason``, zeros included)
- ``swim_streams_opened_total``, ``swim_streams_failed_total``, ``swim_push_pulls_total``
- ``swim_urgent_probes_total{outcome}`` (``Node.probe_now`` requests: ``started`` or the
  refusal reason, every ``UrgentProbeOutcome`` value, zeros included),
  ``swim_urgent_probes_failed_total``
- ``swim_member_phi{member}`` (bounded, see below), ``swim_member_phi_max``,
  ``swim_member_phi_omitted`` gauges
- ``swim_member_unhealthy{member,status}``, ``swim_member_unhealthy_since_seconds{member,
  status}``, ``swim_member_unhealthy_omitted{status}`` gauges: the suspect, dead and left
  members by name (agent/member_metrics.py: alive members get no per-member series; bounded)
- ``swim_probe_rtt_seconds`` histogram
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

import swim
from agent.member_metrics import MAX_UNHEALTHY_MEMBERS, member_label, unhealthy_families
from swim import DropReason

__all__ = [
    "CONTENT_TYPE_LATEST",
    "DEFAULT_MAX_PHI_MEMBERS",
    "MAX_UNHEALTHY_MEMBERS",
    "PROBE_RTT_BUCKETS_S",
    "AgentMetrics",
]


DEFAULT_MAX_PHI_MEMBERS = 256
"""Why a bound: every label value of ``swim_member_phi`` is a separate time series in
Prometheus. Each agent sees every member, so an unbounded per-member gauge on an N-node
cluster costs N² series fleet-wide (10⁸ at 10 000 nodes) and churns with membership. The
members an operator looks at are the suspicious ones, so the collector exports only the
``max_phi_members`` highest phi values; ``swim_member_phi_max`` summarises all of them and
``swim_member_phi_omitted`` says how many were left out."""

PROBE_RTT_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
"""LAN round trips are sub-millisecond to a few ms; the tail reaches the probe timeout
(500 ms in ``Config.lan()``) and TCP fallback probes (seconds)."""

_STATE_LABELS: tuple[tuple[swim.NodeStateType, str], ...] = (
    (swim.NodeStateType.ALIVE, "alive"),
    (swim.NodeStateType.SUSPECT, "suspect"),
    (swim.NodeStateType.DEAD, "dead"),
    (swim.NodeStateType.LEFT, "left"),
)


@dataclass(frozen=True, slots=True)
class _Scalar:
    name: str
    """Without the ``_total`` suffix for counters (prometheus_client appends it)."""
    help: str
    counter: bool
    read: Callable[[swim.Node], float]


_SCALARS: tuple[_Scalar, ...] = (
    _Scalar(
        "swim_member_table_size",
        "Members in the local member table (alive, suspect, and dead or left members not "
        "yet reaped), this node included.",
        False,
        lambda n: n.num_members(),
    ),
    _Scalar(
        "swim_probes_sent",
        "Direct probes (pings) sent by the probe cycle.",
        True,
        lambda n: n.stats.probes_sent,
    ),
    _Scalar(
        "swim_probes_failed",
        "Probe rounds that got no ack by their deadline (direct, indirect and TCP).",
        True,
        lambda n: n.stats.probes_failed,
    ),
    _Scalar(
        "swim_indirect_probes_sent",
        "Indirect probe requests (ping-req) sent to helpers.",
        True,
        lambda n: n.stats.indirect_probes_sent,
    ),
    _Scalar(
        "swim_tcp_fallback_probes",
        "TCP fallback probes started after a failed UDP probe.",
        True,
        lambda n: n.stats.tcp_fallback_probes,
    ),
    _Scalar(
        "swim_tcp_fallback_rescues",
        "Probes that failed over UDP but succeeded over the TCP fallback (a sign of UDP "
        "loss or filtering).",
        True,
        lambda n: n.stats.tcp_fallback_rescues,
    ),
    _Scalar(
        "swim_nacks_received",
        "Nacks received from indirect probe helpers (Lifeguard).",
        True,
        lambda n: n.stats.nacks_received,
    ),
    _Scalar(
        "swim_suspicions_raised",
        "Members this node started suspecting.",
        True,
        lambda n: n.stats.suspicions_raised,
    ),
    _Scalar(
        "swim_suspicions_refuted",
        "Suspicions of other members that ended because the member refuted them.",
        True,
        lambda n: n.stats.suspicions_refuted_by_others,
    ),
    _Scalar(
        "swim_refutations",
        "Times this node refuted a suspicion or death claim about itself.",
        True,
        lambda n: n.stats.refutations,
    ),
    _Scalar(
        "swim_deaths_declared",
        "Members this node declared dead after their suspicion timed out.",
        True,
        lambda n: n.stats.deaths_declared,
    ),
    _Scalar(
        "swim_address_conflicts",
        "Alive messages refused because a live member holds their name at another address "
        "(two processes under one name; docs/runbook.md).",
        True,
        lambda n: n.stats.address_conflicts,
    ),
    _Scalar(
        "swim_suspicion_timeouts_degraded",
        "Suspicions that timed out with fewer independent confirmations than Lifeguard "
        "expects (memberlist's degraded timeouts).",
        True,
        lambda n: n.stats.suspicion_timeouts_degraded,
    ),
    _Scalar(
        "swim_suspicion_verifications",
        "Last-chance pings to an unconfirmed suspect before declaring it dead "
        "(verify_unconfirmed_suspicion, the fast profile).",
        True,
        lambda n: n.stats.suspicion_verifications,
    ),
    _Scalar(
        "swim_suspicions_held_starved",
        "Suspicions held to their maximum window because this agent was itself starved of "
        "CPU meanwhile (starved_lag_ms, the fast profile).",
        True,
        lambda n: n.stats.suspicions_held_starved,
    ),
    _Scalar(
        "swim_cross_check_probes",
        "Probes of a member just heard accused by another (suspicion_cross_checks, the fast "
        "profile).",
        True,
        lambda n: n.stats.cross_check_probes,
    ),
    _Scalar(
        "swim_cross_check_probes_failed",
        "Cross-checks that got no answer: this node's own confirmation of the suspicion.",
        True,
        lambda n: n.stats.cross_check_probes_failed,
    ),
    _Scalar(
        "swim_urgent_probes_failed",
        "Urgent probes (a member reported lost, probed at once) that got no answer by their "
        "deadline; also counted in swim_probes_failed_total.",
        True,
        lambda n: n.stats.urgent_probes_failed,
    ),
    _Scalar(
        "swim_health_score",
        "Lifeguard local health multiplier (0 = healthy; higher = this node is slow and "
        "stretches its probe timeouts).",
        False,
        lambda n: n.health_score,
    ),
    _Scalar(
        "swim_broadcast_queue_depth",
        "Messages waiting in the piggyback broadcast queues (membership and user).",
        False,
        lambda n: n.broadcast_queue_depth,
    ),
    _Scalar(
        "swim_incarnation",
        "This node's current incarnation number.",
        False,
        lambda n: n.incarnation,
    ),
    _Scalar(
        "swim_packets_received",
        "UDP datagrams handed to the node.",
        True,
        lambda n: n.stats.packets_in,
    ),
    _Scalar(
        "swim_packets_sent",
        "UDP datagrams the node asked to send.",
        True,
        lambda n: n.stats.packets_out,
    ),
    _Scalar(
        "swim_received_bytes",
        "Bytes of UDP datagrams handed to the node.",
        True,
        lambda n: n.stats.bytes_in,
    ),
    _Scalar(
        "swim_sent_bytes",
        "Bytes of UDP datagrams the node asked to send.",
        True,
        lambda n: n.stats.bytes_out,
    ),
    _Scalar(
        "swim_streams_opened",
        "TCP streams the node asked to open (push-pull, TCP probes, reliable user messages).",
        True,
        lambda n: n.stats.streams_opened,
    ),
    _Scalar(
        "swim_streams_failed",
        "TCP streams that failed or timed out.",
        True,
        lambda n: n.stats.streams_failed,
    ),
    _Scalar(
        "swim_push_pulls",
        "Completed push-pull state exchanges (joins and periodic anti-entropy).",
        True,
        lambda n: n.stats.push_pulls,
    ),
)


def _phi_rank(item: tuple[str, float]) -> tuple[float, str]:
    """Sort key, smallest first: highest phi first, NaN (no data yet) last, ties by name
    so that the exported set is stable between scrapes."""
    name, value = item
    return (math.inf if math.isnan(value) else -value, name)


class _NodeCollector:
    """Reads the node (and the phi source) on every scrape."""

    def __init__(
        self,
        node: swim.Node,
        phi: Callable[[], Mapping[str, float]],
        max_phi_members: int,
        members: Callable[[], Iterable[swim.Member]],
        now_ms: Callable[[], int] | None,
        max_unhealthy_members: int,
    ) -> None:
        self._node = node
        self._phi = phi
        self._max_phi_members = max_phi_members
        self._members = members
        self._now_ms = now_ms
        self._max_unhealthy_members = max_unhealthy_members

    def describe(self) -> Iterable[Metric]:
        # Lets the registry detect name clashes without calling the node or the phi source.
        return list(self._families(sampled=False))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(sampled=True))

    def _families(self, *, sampled: bool) -> Iterator[Metric]:
        node = self._node

        members = GaugeMetricFamily(
            "swim_members", "Members this node knows, by state.", labels=["state"]
        )
        if sampled:
            counts = dict.fromkeys((s for s, _ in _STATE_LABELS), 0)
            for member in node.members():
                counts[member.state] = counts.get(member.state, 0) + 1
            for state, label in _STATE_LABELS:
                members.add_metric([label], counts[state])
        yield members

        for spec in _SCALARS:
            family: CounterMetricFamily | GaugeMetricFamily
            if spec.counter:
                family = CounterMetricFamily(spec.name, spec.help)
            else:
                family = GaugeMetricFamily(spec.name, spec.help)
            if sampled:
                family.add_metric([], spec.read(node))
            yield family

        stats = node.stats
        received = CounterMetricFamily(
            "swim_messages_received",
            "Protocol messages received (compound packets counted per part), by type.",
            labels=["type"],
        )
        sent = CounterMetricFamily(
            "swim_messages_sent",
            "Protocol messages sent (piggybacked parts counted), by type.",
            labels=["type"],
        )
        dropped = CounterMetricFamily(
            "swim_dropped_inputs",
            "Inputs (datagrams, message parts, streams) dropped by the node, by reason.",
            labels=["reason"],
        )
        if sampled:
            for kind, count in sorted(stats.messages_in.items()):
                received.add_metric([kind], count)
            for kind, count in sorted(stats.messages_out.items()):
                sent.add_metric([kind], count)
            # Every known reason is exported, zeros included, so rate() works from the start
            # and an alert on a reason does not depend on it having happened once.
            reasons = dict.fromkeys((r.value for r in DropReason), 0)
            reasons.update(stats.dropped)
            for reason, count in sorted(reasons.items()):
                dropped.add_metric([reason], count)
        urgent = CounterMetricFamily(
            "swim_urgent_probes",
            "Requests to probe a member at once (a trainer reported it lost), by outcome: "
            "started, or why it was refused.",
            labels=["outcome"],
        )
        if sampled:
            outcomes = dict.fromkeys((o.value for o in swim.UrgentProbeOutcome), 0)
            outcomes.update(stats.urgent_probes)
            for outcome, count in sorted(outcomes.items()):
                urgent.add_metric([outcome], count)
        yield received
        yield sent
        yield dropped
        yield urgent

        yield from self._phi_families(sampled=sampled)
        yield from unhealthy_families(
            self._members if sampled else None, self._now_ms, self._max_unhealthy_members
        )

    def _phi_families(self, *, sampled: bool) -> Iterator[Metric]:
        per_member = GaugeMetricFamily(
            "swim_member_phi",
            "Phi accrual suspicion level per member. Bounded cardinality: only the members "
            "with the highest phi are exported (see swim_member_phi_omitted).",
            labels=["member"],
        )
        max_phi = GaugeMetricFamily(
            "swim_member_phi_max",
            "Highest phi accrual suspicion level over all members (0 when there are none).",
        )
        omitted = GaugeMetricFamily(
            "swim_member_phi_omitted",
            "Members whose phi was not exported per member because of the cardinality bound.",
        )
        if sampled:
            values = self._phi()
            top = heapq.nsmallest(self._max_phi_members, values.items(), key=_phi_rank)
            exported: set[str] = set()
            for name, value in top:
                # a name that is not valid UTF-8 would fail the whole page; two that spell
                # the same label would be a duplicate series (agent/member_metrics.py)
                if (label := member_label(name)) not in exported:
                    exported.add(label)
                    per_member.add_metric([label], value)
            finite = [v for v in values.values() if not math.isnan(v)]
            max_phi.add_metric([], max(finite, default=0.0))
            omitted.add_metric([], len(values) - len(exported))
        yield per_member
        yield max_phi
        yield omitted


class AgentMetrics:
    """The Prometheus metrics of one agent, in their own registry."""

    def __init__(
        self,
        node: swim.Node,
        phi: Callable[[], Mapping[str, float]],
        max_phi_members: int = DEFAULT_MAX_PHI_MEMBERS,
        *,
        members: Callable[[], Iterable[swim.Member]] | None = None,
        now_ms: Callable[[], int] | None = None,
        max_unhealthy_members: int = MAX_UNHEALTHY_MEMBERS,
    ) -> None:
        """``phi`` returns member name → current phi; it is called once per scrape.
        ``members`` lists the members for the per-member unhealthy series (the node's table
        by default; the agent passes its listed members, departed ones included) and
        ``now_ms`` is the node's clock, for their ages (omitted without it)."""
        if max_phi_members < 0:
            raise ValueError("max_phi_members must be ≥ 0")
        if max_unhealthy_members < 0:
            raise ValueError("max_unhealthy_members must be ≥ 0")
        self.node = node
        self.registry = CollectorRegistry()
        self._collector = _NodeCollector(
            node,
            phi,
            max_phi_members,
            node.members if members is None else members,
            now_ms,
            max_unhealthy_members,
        )
        self.registry.register(self._collector)
        self.probe_rtt = Histogram(
            "swim_probe_rtt_seconds",
            "Round-trip time of successful probes, in seconds.",
            buckets=PROBE_RTT_BUCKETS_S,
            registry=self.registry,
        )

    def observe_probe_rtt_ms(self, rtt_ms: int) -> None:
        """Record one probe round trip (``ProbeResult.rtt_ms``)."""
        self.probe_rtt.observe(max(rtt_ms, 0) / 1000.0)

    def render(self) -> bytes:
        """The text exposition format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
