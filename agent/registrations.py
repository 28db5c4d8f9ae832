"""The owner of this node's training-job registrations (the rules are in agent/jobs.py).

``JobRegistry`` holds the local ranks registered through ``watch`` (``LocalJobs``), the
per-job view generations, and the lock under which a job's tag is recomputed and
published, so concurrent ranks cannot publish a stale tag over a newer one. It changes
tags only through the agent's ``update_tags`` (which runs in the node task).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import trio

from agent.crash_evidence import CrashEvidence
from agent.jobs import Generations, LocalJobs, Registration, summaries, tag_key, view
from agent.slow_jobs import SlowChange, SlowJobs
from agent.stall_evidence import StallEvidence, stalled_since_ms
from swim import Member, NodeStateType

log = logging.getLogger("swim.agent")
UpdateTags = Callable[[Mapping[str, str], Iterable[str]], Awaitable[dict[str, str]]]


class JobRegistry:
    """This node's registrations and the job tags they publish."""

    def __init__(self, tags: Callable[[], Mapping[str, str]], update_tags: UpdateTags) -> None:
        self._tags = tags
        self._update_tags = update_tags
        self.local = LocalJobs()
        self.generations = Generations()
        self.slow = SlowJobs()
        self.on_slow: Callable[[SlowChange], object] | None = None
        """Told of every change of a job's flagged set (the event handlers' runner)."""
        self.evidence = CrashEvidence()
        """Strong crash evidence (``enabled`` from the agent's ``job_early_drop``)."""
        self.stall = StallEvidence()
        """A stalled job's suspects (``enabled`` from the agent's ``job_stall_drop``)."""
        self._stalled: dict[str, bool] = {}
        """job → whether its ranks here were stalled at the last ``check_stall``."""
        self.notify_changed: Callable[[], None] = lambda: None
        """Wakes the view watchers: evidence can change a view without a member event."""
        self._lock = trio.Lock()

    def add(self, reg: Registration, wall_ms: int) -> None:
        """Admit one local rank (``JobError``: refused, nothing kept); then ``sync_tag``."""
        self.local.add(reg, wall_ms)

    def remove(self, reg: Registration) -> None:
        self.local.remove(reg)
        if reg.job not in self.local:
            self.slow.forget(reg.job)
            self.evidence.forget(reg.job)
            self.stall.forget(reg.job)
            self._stalled.pop(reg.job, None)

    def report_lost(self, job: str, names: Sequence[str]) -> None:
        """A local trainer of ``job`` lost these peers (agent/crash_evidence.py)."""
        if self.evidence.enabled:
            self.evidence.report_lost(job, names, _now_ms())
            self.notify_changed()

    def probe_refused(self, name: str) -> None:
        """This agent's probe of ``name`` failed, its TCP ping refused (``on_probe_refused``)."""
        if self.evidence.enabled:
            self.evidence.probe_refused(name, _now_ms())
            self.notify_changed()

    def check_stall(self, job: str) -> None:
        """Wake the view watchers when ``job``'s ranks here start or end a stall
        (agent/stall_evidence.py): a stall changes a view without a member event. Called
        by every registration's health watch, so within ``HEALTH_CHECK_S``. It probes
        nobody: an urgent probe from a node whose own link is down (its job stalls too)
        would only make live members suspect sooner."""
        if not self.stall.enabled:
            return
        node_job = self.local.jobs.get(job)
        stalled = node_job is not None and (
            stalled_since_ms(node_job.ranks.values(), _now_ms()) is not None
        )
        if stalled != self._stalled.get(job, False):
            self._stalled[job] = stalled
            self.notify_changed()

    def report_slow(self, job: str, nodes: Mapping[str, float]) -> SlowChange | None:
        """A trainer's fail-slow verdict (agent/slow_jobs.py), already checked."""
        change = self.slow.update(job, nodes, int(time.time() * 1000))
        if change is not None and self.on_slow is not None:
            self.on_slow(change)
        return change

    async def sync_tag(self, job: str) -> None:
        """Publish what the registrations say the node's tag for ``job`` is now (or remove
        it), under the lock."""
        key = tag_key(job)
        async with self._lock:
            tag = self.local.tag(job, int(trio.current_time() * 1000))
            value = None if tag is None else tag.encode()
            if value == self._tags().get(key):
                return
            if value is None:
                await self._update_tags({}, [key])
            else:
                await self._update_tags({key: value}, [])

    def targets(self) -> dict[str, int | None]:
        """Each job registered here and its target number of training nodes (or None), as
        local rank 0 reported it."""
        return {job: node_job.target_nodes() for job, node_job in self.local.jobs.items()}

    def view(self, job: str, members: Iterable[Member], tags_of: Any) -> dict[str, Any]:
        """The job's view over these members, numbered by this agent's generations, less the
        suspects left out on strong crash evidence."""
        members = list(members)
        return view(job, members, tags_of, self.generations, self._excluded(job, members))

    def summaries(self, members: Iterable[Member], tags_of: Any) -> dict[str, Any]:
        """Every job these members name or this node registers (the ``jobs`` op), numbered
        by the same generations as ``view``."""
        now_ms = int(trio.current_time() * 1000)
        jobs = self.local.jobs
        local = {job: len(node_job.ranks) for job, node_job in jobs.items()}
        paused = {job: node_job.paused_ranks(now_ms) for job, node_job in jobs.items()}
        refused = {job: node_job.refused_frames() for job, node_job in jobs.items()}
        members = list(members)
        excluded = {job: self._excluded(job, members) for job in jobs}
        result = summaries(members, tags_of, self.generations, local, paused, refused, excluded)
        for entry in result["jobs"]:
            node_job = jobs.get(entry["job"])
            entry["target"] = None if node_job is None else node_job.target_nodes()
            entry.update(self.slow.summary(entry["job"]))
        return result

    def _excluded(self, job: str, members: list[Member]) -> frozenset[str]:
        now_ms = _now_ms()
        node_job = self.local.jobs.get(job) if self.stall.enabled else None
        stalled = None if node_job is None else stalled_since_ms(node_job.ranks.values(), now_ms)
        silent = self.stall.excluded(job, members, stalled, now_ms)
        dropped = self.evidence.excluded(job, members) | silent
        newly, back = self.evidence.changes(job, dropped)
        for name in newly:
            log.warning(
                "job %s: %s left out of the view: %s; still a suspect member",
                job,
                name,
                "the job here is stalled"
                if name in silent
                else "crash evidence (a trainer here lost it and our probe was refused)",
            )
        states = {m.name: m.state for m in members}
        for name in back:
            if states.get(name) == NodeStateType.ALIVE:
                log.info("job %s: %s back in the view: it refuted", job, name)
        return dropped


def _now_ms() -> int:
    return int(trio.current_time() * 1000)
