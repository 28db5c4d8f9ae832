"""Per-job role metrics: how many of each job's nodes train and how many wait as hot spares.

Every agent sees every node's job tags (agent/job_tag.py), so every agent exports these for
every job it sees, not only for the jobs registered on it:

- ``swim_job_training_nodes{job}`` gauge: nodes in the job's view with role ``training``;
- ``swim_job_spare_nodes{job}`` gauge: nodes in the job's view with role ``spare``
  (registered and ready, waiting to take a failed node's place);
- ``swim_job_target_nodes{job}`` gauge: the job's target number of training nodes, only
  on the agents whose local rank 0 reported one (a ``{"target": int}`` watch frame);
- ``swim_job_metrics_omitted`` gauge: jobs seen but not exported (the bound below).

The view is the same as ``swimctl view``'s (alive or suspect members with a healthy tag,
agent/jobs.py); a job whose tags all sit on dead members is exported with zeros, so an
alert on "no spare left" sees the drop to 0 rather than a vanished series.

Read at scrape time from the node's member table (the scrape runs in the node task's
thread, agent/metrics.py), one pass over the members' tags. Bounded: ``MAX_METRIC_JOBS``
jobs by name, two or three series each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from agent.control import ROLE_SPARE
from agent.job_tag import HEALTH_OK, JOB_NAME, TAG_PREFIX, JobTag
from agent.jobs import VIEW_STATES
from swim import Member

__all__ = ["MAX_METRIC_JOBS", "register_job_metrics", "role_counts"]

MAX_METRIC_JOBS = 64
"""Jobs exported per agent (by name; the rest counted in ``swim_job_metrics_omitted``):
every agent exports every job it sees, so the series fleet-wide are agents × jobs × 3;
64 covers the jobs one cluster runs at once (the status page lists as many)."""


def role_counts(
    members: Iterable[Member], tags_of: Callable[[Member], Mapping[str, str]]
) -> dict[str, tuple[int, int]]:
    """``{job: (training nodes, spare nodes)}`` in each job's view, for every job a
    member's tag names (in any state)."""
    counts: dict[str, list[int]] = {}
    for m in members:
        for key, value in tags_of(m).items():
            job = key[len(TAG_PREFIX) :] if key.startswith(TAG_PREFIX) else ""
            if not JOB_NAME.match(job):
                continue
            seen = counts.setdefault(job, [0, 0])
            tag = JobTag.decode(value) if isinstance(value, str) else None
            if tag is None or m.state not in VIEW_STATES or tag.health != HEALTH_OK:
                continue
            seen[1 if tag.role == ROLE_SPARE else 0] += 1
    return {job: (c[0], c[1]) for job, c in counts.items()}


def register_job_metrics(
    registry: Any,
    members: Callable[[], Iterable[Member]],
    tags_of: Callable[[Member], Mapping[str, str]],
    targets: Callable[[], Mapping[str, int | None]],
) -> None:
    """Register the collector on the agent's registry (agent/metrics.py): ``members`` is
    the node's member table, ``targets`` the jobs registered here and their targets."""
    from prometheus_client.metrics_core import GaugeMetricFamily

    class Collector:
        def collect(self) -> Iterator[Any]:
            training = GaugeMetricFamily(
                "swim_job_training_nodes",
                "Nodes of a training job that train (in its view, role training).",
                labels=["job"],
            )
            spares = GaugeMetricFamily(
                "swim_job_spare_nodes",
                "Hot spares of a training job (in its view, role spare): ready to take a "
                "failed node's place.",
                labels=["job"],
            )
            target = GaugeMetricFamily(
                "swim_job_target_nodes",
                "A training job's target number of training nodes, as this node's "
                "trainers reported it.",
                labels=["job"],
            )
            omitted = GaugeMetricFamily(
                "swim_job_metrics_omitted",
                f"Jobs seen but not exported per job (at most {MAX_METRIC_JOBS} are).",
            )
            counts = role_counts(members(), tags_of)
            local = targets()
            names = sorted(set(counts) | set(local))
            for job in names[:MAX_METRIC_JOBS]:
                trained, spare = counts.get(job, (0, 0))
                training.add_metric([job], trained)
                spares.add_metric([job], spare)
                wanted = local.get(job)
                if wanted is not None:
                    target.add_metric([job], wanted)
            omitted.add_metric([], max(len(names) - MAX_METRIC_JOBS, 0))
            yield training
            yield spares
            yield target
            yield omitted

    registry.register(Collector())
