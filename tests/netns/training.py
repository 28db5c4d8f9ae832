"""Training nodes on separate network hosts: each node's agent and trainers in a network
namespace of its own (a ``Testbed`` host, tests/netns/harness.py: it owns the namespaces,
the bridge, the veths and their removal), so that a node can lose power.

Each node is an ``agent.training_nodes.TrainingNode`` placed on host i: every process runs
under ``ip netns exec``, the agent binds the host's address (the address the others join,
and the one the membership gives for the node, so the TCPStore directory and formation
stores are reached over the bridge), and the trainers get ``GLOO_SOCKET_IFNAME=eth0`` (gloo
binds the address of the host name otherwise, which is loopback on this kind of machine,
and the other hosts could not reach it).

A power loss (examples/job.py's ``power`` faults) drops every packet in and out of the
victim's eth0 in its namespace, then SIGKILLs its processes: the survivors see silence, as
from a host that lost power. A loopback kill sends the survivors a reset at once; so does a
SIGKILL here. To show which one a run saw, ``watch(victim)`` adds counting rules (no
target) at every survivor for what arrives from the victim: TCP resets, ICMP, and every
packet; ``counts`` reads them (zeroed by ``watch``) and the victim's DROP rules.

``NsTraining.close`` (also the context manager's exit) stops every node by pid, then closes
the testbed, which kills whatever is left in its namespaces by pid and deletes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.training_nodes import Placement, TrainingNode, start_nodes
from tests.netns.harness import Testbed

IFACE = "eth0"
"""The node's link in its namespace (the harness's name for it)."""

WATCHES = {  # comment -> what the rule matches, from the victim's address
    "swim-from-victim": [],
    "swim-rst-from-victim": ["-p", "tcp", "--tcp-flags", "RST", "RST"],
    "swim-icmp-from-victim": ["-p", "icmp"],
}


@dataclass(frozen=True, slots=True)
class Counts:
    """Packets since ``watch``: arriving at the survivors from the victim (``packets``,
    ``resets``: TCP RST, ``icmp``), and dropped by the victim's power-cut rules."""

    packets: int
    resets: int
    icmp: int
    dropped_in: int
    dropped_out: int

    def as_row(self) -> dict[str, Any]:
        return {
            "from_victim": self.packets,
            "resets": self.resets,
            "icmp": self.icmp,
            "dropped_in": self.dropped_in,
            "dropped_out": self.dropped_out,
        }


class NsTraining:
    """``k`` training nodes of ``ranks`` trainers, one per namespace; always ``close()``."""

    __test__ = False

    def __init__(
        self,
        k: int,
        workdir: Path,
        profile: str = "local",
        ranks: int = 1,
        agent_args: tuple[str, ...] = (),
    ) -> None:
        self.bed = Testbed(k, workdir)
        self.nodes: list[TrainingNode] = []
        try:
            self.bed.up()
            places = [self.placement(h.index) for h in self.bed.hosts]
            names = [h.node for h in self.bed.hosts]
            self.nodes = start_nodes(names, workdir, profile, ranks, places, agent_args)
        except BaseException:
            self.bed.close()
            raise

    def __enter__(self) -> NsTraining:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every node by pid, then remove the namespaces (the testbed raises if one
        stays)."""
        try:
            for n in self.nodes:
                n.stop()
        finally:
            self.bed.close()

    def placement(self, index: int) -> Placement:
        """Where host ``index``'s node runs (its namespace, address and gloo link): also
        for a node restarted there."""
        h = self.bed.host(index)
        return Placement(("ip", "netns", "exec", h.ns), h.ip, {"GLOO_SOCKET_IFNAME": IFACE})

    def index(self, node: TrainingNode) -> int:
        return self.nodes.index(node) + 1

    def watch(self, victim: TrainingNode) -> None:
        """Counting rules at every other host for what arrives from ``victim``; every
        counter of every host zeroed."""
        v = self.index(victim)
        for h in self.bed.hosts:
            if h.index != v:
                for comment, match in WATCHES.items():
                    self.bed.iptables(
                        h.index, "-A", "INPUT", "-i", IFACE, "-s", self.bed.host(v).ip,
                        *match, "-m", "comment", "--comment", comment,
                    )  # fmt: skip
            self.bed.iptables(h.index, "-Z")

    def counts(self, victim: TrainingNode) -> Counts:
        v = self.index(victim)
        seen = {c: 0 for c in WATCHES}
        for h in self.bed.hosts:
            if h.index != v:
                for rule in self.bed.counters(h.index, "INPUT"):
                    if rule.comment in seen:
                        seen[rule.comment] += rule.packets
        dropped = {
            chain: sum(r.packets for r in self.bed.counters(v, chain) if r.target == "DROP")
            for chain in ("INPUT", "OUTPUT")
        }
        return Counts(
            seen["swim-from-victim"],
            seen["swim-rst-from-victim"],
            seen["swim-icmp-from-victim"],
            dropped["INPUT"],
            dropped["OUTPUT"],
        )
