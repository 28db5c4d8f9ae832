"""Fail-slow reports of training jobs, as this agent hears them from its own trainers.

Every rank of a job reaches the same fail-slow verdict (torchhook/slowness.py: the ranks
share their step times in one all-gather per window; there is no central judge), and each
node's local rank 0 tells its own agent on its watch connection when the job's set of
flagged nodes changes: ``{"slow": {"nodes": {name: ratio}}}`` (ratio: the node's step
compute time over the job's median; an empty map clears). So every agent of the job's
nodes knows the verdict without any gossip; agents of other nodes do not.

What it feeds: the ``job-slow`` event for handlers (agent/handlers.py), the ``slow`` and
``slow_flags`` fields of the ``jobs`` operation (``swimctl jobs``), the status page's jobs
table, and the metrics ``swim_job_slow_nodes{job}`` (gauge) and
``swim_job_slow_flags_total{job}`` (nodes newly flagged, a counter).

Pure (no trio, no sockets). Bounded: ``MAX_SLOW_NODES`` names per report, names of at most
``MAX_NODE_NAME_CHARS``, one record per job registered here (``MAX_WATCHED_JOBS`` at most).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.jobs import MAX_WATCHED_JOBS, JobError

__all__ = ["MAX_SLOW_NODES", "SlowChange", "SlowJobs", "SlowReport", "check_slow"]

MAX_SLOW_NODES = 64
"""Nodes named in one report: a verdict flags a minority of a job's nodes, and a report
travels in one watch frame."""
MAX_NODE_NAME_CHARS = 256
"""A node name in a report (memberlist names are short strings; this bounds a bad one)."""


def check_slow(report: object) -> dict[str, float]:
    """A ``slow`` frame's content as ``{node: ratio}``; ``JobError`` names what is wrong."""
    nodes = report.get("nodes") if isinstance(report, dict) else None
    if not isinstance(nodes, dict) or len(nodes) > MAX_SLOW_NODES:
        raise JobError(f"slow must be {{nodes: {{name: ratio}}}} with <= {MAX_SLOW_NODES} nodes")
    out: dict[str, float] = {}
    for name, ratio in nodes.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NODE_NAME_CHARS:
            raise JobError(f"slow: a node name must be 1..{MAX_NODE_NAME_CHARS} characters")
        ok = isinstance(ratio, int | float) and not isinstance(ratio, bool)
        if not ok or not math.isfinite(ratio) or ratio < 0:
            raise JobError(f"slow: node {name!r} needs a finite ratio >= 0, got {ratio!r}")
        out[name] = float(ratio)
    return out


@dataclass
class SlowReport:
    """One job's flagged nodes as this agent last heard them."""

    nodes: dict[str, float] = field(default_factory=dict)
    since_ms: dict[str, int] = field(default_factory=dict)
    """Wall-clock ms when each flagged node was first reported (for operators)."""
    flags: int = 0
    """Nodes newly flagged, summed over the job's life on this agent."""


@dataclass(frozen=True, slots=True)
class SlowChange:
    """What one report changed: ``newly`` flagged and ``cleared`` nodes, and the flagged
    set now."""

    job: str
    nodes: dict[str, float]
    newly: tuple[str, ...]
    cleared: tuple[str, ...]


class SlowJobs:
    """The fail-slow reports by job, for the jobs registered on this agent."""

    def __init__(self) -> None:
        self._jobs: dict[str, SlowReport] = {}

    def update(self, job: str, nodes: Mapping[str, float], wall_ms: int) -> SlowChange | None:
        """Record a report; the change, or None when the flagged set is the same."""
        report = self._jobs.get(job)
        if report is None:
            if len(self._jobs) >= MAX_WATCHED_JOBS:
                del self._jobs[next(iter(self._jobs))]
            report = self._jobs[job] = SlowReport()
        newly = tuple(sorted(set(nodes) - set(report.nodes)))
        cleared = tuple(sorted(set(report.nodes) - set(nodes)))
        report.nodes = dict(nodes)
        report.since_ms = {n: report.since_ms.get(n, wall_ms) for n in nodes}
        report.flags += len(newly)
        if not newly and not cleared:
            return None
        return SlowChange(job, dict(nodes), newly, cleared)

    def forget(self, job: str) -> None:
        """The job has no rank registered here any more."""
        self._jobs.pop(job, None)

    def get(self, job: str) -> SlowReport | None:
        return self._jobs.get(job)

    def summary(self, job: str) -> dict[str, Any]:
        """The ``jobs`` fields: ``slow`` ({node: ratio}) and ``slow_flags``."""
        report = self._jobs.get(job)
        if report is None:
            return {"slow": {}, "slow_flags": 0}
        return {"slow": dict(report.nodes), "slow_flags": report.flags}

    def register_metrics(self, registry: Any) -> None:
        """``swim_job_slow_nodes{job}`` and ``swim_job_slow_flags_total{job}`` on the
        agent's Prometheus registry (agent/metrics.py); one series per job registered here."""
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        jobs = self._jobs

        class Collector:
            def collect(self) -> Iterator[Any]:
                nodes = GaugeMetricFamily(
                    "swim_job_slow_nodes",
                    "Nodes of a training job flagged slow now (its trainers' verdict).",
                    labels=["job"],
                )
                flags = CounterMetricFamily(
                    "swim_job_slow_flags",
                    "Nodes of a training job newly flagged slow.",
                    labels=["job"],
                )
                for job, report in sorted(jobs.items()):
                    nodes.add_metric([job], len(report.nodes))
                    flags.add_metric([job], report.flags)
                yield nodes
                yield flags

        registry.register(Collector())
