"""Training jobs on top of membership: registrations, worker heartbeats and numbered views.

A training process on a node *registers* for a job through the control API (``watch``
with ``register``). The registration travels to every peer as one tag in the node's
metadata, ``swim.job/<job>`` (format, compatibility and size in agent/job_tag.py), so views
need no extra protocol.

A node runs ``ranks`` training processes (*local ranks*, one per GPU; torchrun's
``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), each on its own ``watch`` connection. The node is one
member of the job: its tag appears only once every local rank ``0..ranks-1`` has
registered, and disappears as soon as any of them unregisters (its process died) or
stops heartbeating. So a dead, left or hung node, or one hung GPU worker on a live node,
takes all of the node's ranks out of the view at once. Why the whole node: a GPU worker
that stops on a live host usually means trouble with the host (a stuck GPU, an NVLink or
driver fault), its node-mates are likely next; and the layouts that matter here shard a
model *within* a node (HSDP), where one missing rank leaves the node's replica incomplete
anyway. A rank-granular exclusion would be correct only for pure data parallelism and is
not offered.

- ``registered_ms``: wall-clock milliseconds when the node's registration became complete
  (its last local rank registered), set once by the agent. Every peer sees the same value,
  so ordering by ``(registered_ms, name)`` gives the same "join age" order everywhere,
  whatever the clock skew between hosts. A node whose registration broke and completed
  again is a new member (a new ``registered_ms``).
- ``store_port``: a TCP port where local rank 0 serves its rendezvous store (0: none).
- ``health``: ``ok`` or ``hung``. The agent scores each local rank's per-step heartbeats
  with Phi accrual (Hayashibara et al.; ``phi/``) and flips the node to ``hung`` while any
  of them stops stepping on a live host, which SWIM alone cannot see (docs/training.md
  §1). A rank that declared a pause (``Registration.pause``: a sync checkpoint, an eval
  pass; at most ``agent.control.MAX_PAUSE_S``) is not scored until it resumes or its
  ``max_s`` passes; then silence counts from that moment (``PhiAccrualDetector.rebase``),
  so the pause's gap is neither a hang nor a sample of the step rhythm, and an overrun is
  caught after the usual tolerance. Pauses are local: peers see only the health.
- ``group``: an opaque token local rank 0 sets for the process group it is in (at most
  ``MAX_GROUP_CHARS``), so peers can tell that a member has moved to a newer group.
- ``ranks``: the node's local world size (``1..MAX_LOCAL_RANKS``).
- ``role``: ``training`` or ``spare`` (``agent.control.ROLES``), set by local rank 0 (at
  registration or with a ``role`` frame): the job's trainers decide which nodes train and
  which wait as hot spares; the agent only carries it. A role change is not a membership
  change: ``registered_ms``, the fingerprint and the generation stay, and watchers get the
  view with the new role.

The *view* of a job is every member that is alive or suspect (SWIM §4.2: a suspect has not
been declared failed yet) and carries a healthy registration, hot spares included, less
the suspects this agent leaves out on strong crash evidence or a stalled job
(agent/crash_evidence.py, agent/stall_evidence.py), ordered by join age; global ranks
follow that order and, within a node, the local rank (a job with hot spares numbers only
its training nodes, as its trainers decide). Its ``fingerprint``
hashes the ordered (name, registered_ms, ranks) triples, not the roles: equal on every
node that sees the same member set. ``generation`` is this agent's count of fingerprint changes: it
numbers the views one client sees, it is not comparable across nodes.

Everything here is pure (no trio, no sockets): the control server owns the I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from agent.control import ROLE_SPARE, ROLE_TRAINING, ControlError, JobMember, check_pause
from agent.job_tag import (
    HEALTH_HUNG,
    HEALTH_OK,
    JOB_NAME,
    MAX_GROUP_CHARS,
    MAX_LOCAL_RANKS,
    TAG_PREFIX,
    JobError,
    JobTag,
    check_group,
    check_job,
    check_node_role,
    tag_key,
)
from agent.step_clock import StepClock
from phi import PhiAccrualDetector, PhiConfig
from swim import Member, NodeStateType

__all__ = [
    "DEFAULT_HEARTBEAT_PAUSE_MS",
    "DEFAULT_HEARTBEAT_THRESHOLD",
    "HEALTH_HUNG",
    "HEALTH_OK",
    "JOB_NAME",
    "MAX_GROUP_CHARS",
    "MAX_LISTED_JOBS",
    "MAX_LOCAL_RANKS",
    "MAX_REGISTRATIONS",
    "MAX_WATCHED_JOBS",
    "TAG_PREFIX",
    "VIEW_STATES",
    "Generations",
    "JobError",
    "JobTag",
    "LocalJobs",
    "NodeJob",
    "Pause",
    "Registration",
    "check_group",
    "check_job",
    "check_node_role",
    "fingerprint",
    "job_members",
    "summaries",
    "tag_key",
    "view",
]

MAX_WATCHED_JOBS = 256
"""Jobs with a generation counter on one agent; the oldest is forgotten beyond it."""
MAX_LISTED_JOBS = MAX_WATCHED_JOBS
"""Jobs in one ``jobs`` reply (the rest are counted, not listed): the reply stays a small
frame, and one listing numbers no more jobs than the generation counters hold."""
MAX_REGISTRATIONS = 256
"""Registered training processes per agent, all jobs together (each holds a connection, a
Phi detector and a health check)."""
DEFAULT_HEARTBEAT_PAUSE_MS = 30_000
"""Silence tolerated on top of the mean step time before a worker counts as hung: a
checkpoint or an evaluation pass must not get a node excluded."""
DEFAULT_HEARTBEAT_THRESHOLD = 8.0
"""Akka cluster's phi threshold (phi/detector.py)."""
VIEW_STATES = (NodeStateType.ALIVE, NodeStateType.SUSPECT)


def job_members(
    job: str, members: Iterable[Member], tags_of: Any, excluded: Set[str] = frozenset()
) -> list[JobMember]:
    """The members of ``job``'s view, oldest registration first. ``tags_of(member)`` decodes
    a member's tags (the caller owns the tag codec); ``excluded``: names left out on strong
    crash evidence or a stalled job (agent/crash_evidence.py, agent/stall_evidence.py)."""
    key = tag_key(job)
    found: list[JobMember] = []
    for m in members:
        if m.name in excluded:
            continue
        value = tags_of(m).get(key)
        tag = JobTag.decode(value) if isinstance(value, str) else None
        if tag is not None and _in_view(m, tag):
            found.append(_job_member(m, tag))
    found.sort(key=_join_age)
    return found


def _in_view(m: Member, tag: JobTag) -> bool:
    return m.state in VIEW_STATES and tag.health == HEALTH_OK


def _job_member(m: Member, tag: JobTag) -> JobMember:
    return JobMember(
        m.name,
        m.address.host,
        m.address.port,
        tag.store_port,
        tag.registered_ms,
        tag.group,
        m.state.name.lower(),
        tag.ranks,
        tag.role,
    )


def _join_age(m: JobMember) -> tuple[int, str]:
    return (m.registered_ms, m.name)


def fingerprint(members: Iterable[JobMember]) -> str:
    h = hashlib.sha256()
    for m in members:
        # one-rank members hash as before multi-rank jobs, so mixed agents still agree
        ranks = "" if m.ranks == 1 else f"*{m.ranks}"
        h.update(f"{m.name}@{m.registered_ms}{ranks};".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


@dataclass
class Generations:
    """Per-job generation counters: +1 whenever a job's fingerprint changes. Bounded."""

    _last: dict[str, tuple[str, int]] = field(default_factory=dict)

    def number(self, job: str, fp: str) -> int:
        seen = self._last.get(job)
        if seen is None:
            if len(self._last) >= MAX_WATCHED_JOBS:
                del self._last[next(iter(self._last))]
            self._last[job] = (fp, 1)
            return 1
        if seen[0] != fp:
            self._last[job] = (fp, seen[1] + 1)
        return self._last[job][1]


def view(
    job: str,
    members: Iterable[Member],
    tags_of: Any,
    generations: Generations,
    excluded: Set[str] = frozenset(),
) -> dict[str, Any]:
    listed = job_members(job, members, tags_of, excluded)
    fp = fingerprint(listed)
    return {
        "job": job,
        "generation": generations.number(job, fp),
        "fingerprint": fp,
        "members": [m.as_dict() for m in listed],
    }


def summaries(
    members: Iterable[Member],
    tags_of: Any,
    generations: Generations,
    local_ranks: Mapping[str, int],
    paused: Mapping[str, list[dict[str, Any]]] | None = None,
    refused: Mapping[str, int] | None = None,
    excluded: Mapping[str, Set[str]] | None = None,
) -> dict[str, Any]:
    """The ``jobs`` result (schema in agent/control.py): every job named by a member's job
    tag (any state: a job whose nodes all died is listed with none) or registered here,
    by name, at most ``MAX_LISTED_JOBS``, the rest counted in ``omitted``. One pass over
    the members, not one per job; the same filter, order, fingerprint and generation as
    ``view``, so ``jobs`` and ``view JOB`` agree. ``local_ranks``: ranks registered here;
    ``paused`` and ``refused``: their pauses and refused frames (``NodeJob``); ``excluded``:
    by job, names left out of its view (``view``)."""
    names = set(local_ranks)
    left_out = excluded or {}
    in_view: dict[str, list[JobMember]] = {}
    hung: dict[str, int] = {}
    for m in members:
        for key, value in tags_of(m).items():
            job = key[len(TAG_PREFIX) :] if key.startswith(TAG_PREFIX) else ""
            if not JOB_NAME.match(job):
                continue
            names.add(job)
            tag = JobTag.decode(value) if isinstance(value, str) else None
            if tag is None or m.state not in VIEW_STATES or m.name in left_out.get(job, ()):
                continue
            if tag.health == HEALTH_OK:
                in_view.setdefault(job, []).append(_job_member(m, tag))
            else:
                hung[job] = hung.get(job, 0) + 1
    ordered = sorted(names)
    jobs = []
    for job in ordered[:MAX_LISTED_JOBS]:
        listed = sorted(in_view.get(job, ()), key=_join_age)
        fp = fingerprint(listed)
        jobs.append(
            {
                "job": job,
                "generation": generations.number(job, fp),
                "fingerprint": fp,
                "nodes": len(listed),
                "ranks": sum(m.ranks for m in listed if m.role == ROLE_TRAINING),
                "training": sum(m.role == ROLE_TRAINING for m in listed),
                "spares": sum(m.role == ROLE_SPARE for m in listed),
                "hung": hung.get(job, 0),
                "local_ranks": local_ranks.get(job, 0),
                "paused": (paused or {}).get(job, []),
                "refused_frames": (refused or {}).get(job, 0),
            }
        )
    return {"jobs": jobs, "omitted": max(len(ordered) - MAX_LISTED_JOBS, 0)}


@dataclass(frozen=True, slots=True)
class Pause:
    """A declared pause of one rank, on the registrations' clock (ms)."""

    reason: str
    since_ms: int
    until_ms: int


@dataclass
class Registration:
    """One local rank's registration: its place in the node, the Phi detector over its
    heartbeats and its declared pause."""

    job: str
    local_rank: int
    local_world_size: int
    store_port: int
    threshold: float
    detector: PhiAccrualDetector
    group: str = ""
    role: str = ROLE_TRAINING
    """The node's role in the job as this rank last set it (local rank 0's is gossiped)."""
    target_nodes: int | None = None
    """The job's target number of training nodes, as this rank last reported it (local
    rank 0's is shown by ``jobs``; not gossiped)."""
    last_step: int = -1
    steps: StepClock = field(default_factory=StepClock)
    """Its progress and step lengths (agent/stall_evidence.py reads them)."""
    heartbeats: int = 0
    paused: Pause | None = None
    pauses: int = 0
    overruns: int = 0
    """Pauses that ran past their ``max_s`` (scored again from their deadline)."""
    refused_frames: int = 0
    """Frames refused from this rank (a bad pause, group, role, target, lost or slow
    report): nothing changed."""

    @classmethod
    def create(
        cls,
        job: str,
        store_port: object = 0,
        heartbeat_pause_ms: object = DEFAULT_HEARTBEAT_PAUSE_MS,
        heartbeat_threshold: object = DEFAULT_HEARTBEAT_THRESHOLD,
        first_heartbeat_estimate_ms: object = 1000,
        local_rank: object = 0,
        local_world_size: object = 1,
        role: object = ROLE_TRAINING,
    ) -> Registration:
        port = _int_in("store_port", store_port, 0, 65_535)
        size = _int_in("local_world_size", local_world_size, 1, MAX_LOCAL_RANKS)
        rank = _int_in("local_rank", local_rank, 0, size - 1)
        checked_role = check_node_role(role)
        if not isinstance(heartbeat_threshold, int | float) or not heartbeat_threshold > 0:
            raise JobError(f"heartbeat_threshold must be > 0, got {heartbeat_threshold!r}")
        try:
            config = PhiConfig(
                threshold=float(heartbeat_threshold),
                max_sample_size=200,
                min_std_deviation_ms=50,
                acceptable_heartbeat_pause_ms=heartbeat_pause_ms,  # type: ignore[arg-type]
                first_heartbeat_estimate_ms=first_heartbeat_estimate_ms,  # type: ignore[arg-type]
            )
        except (TypeError, ValueError) as exc:
            raise JobError(f"bad heartbeat settings: {exc}") from None
        return cls(
            check_job(job),
            rank,
            size,
            port,
            float(heartbeat_threshold),
            PhiAccrualDetector(config),
            role=checked_role,
        )

    def heartbeat(self, step: object, now_ms: int) -> None:
        if isinstance(step, int) and not isinstance(step, bool):
            self.last_step = step
            self.steps.beat(step, now_ms)
        self.heartbeats += 1
        self.settle(now_ms)
        if self.paused is not None and self.detector.last_heartbeat_ms is not None:
            self.detector.rebase(now_ms)  # alive, but no sample of the step rhythm
        else:
            self.detector.heartbeat(now_ms)

    def pause(self, reason: object, max_s: object, now_ms: int) -> Pause:
        """Spare this rank from hang scoring for at most ``max_s`` seconds (``JobError``:
        refused, nothing changed). A new pause replaces a running one."""
        try:
            label, seconds = check_pause(reason, max_s)
        except ControlError as exc:
            raise JobError(str(exc)) from None
        self.settle(now_ms)
        self.paused = Pause(label, now_ms, now_ms + round(seconds * 1000))
        self.pauses += 1
        return self.paused

    def resume(self, now_ms: int) -> Pause | None:
        """The rank steps again: silence counts from now. The pause that ended, if any."""
        self.settle(now_ms)
        ended, self.paused = self.paused, None
        if ended is not None:
            self.detector.rebase(now_ms)
        return ended

    def settle(self, now_ms: int) -> None:
        """A pause past its deadline ends there: scoring resumes from the deadline.
        Every reader of the health calls it, so the end needs no timer of its own."""
        if self.paused is not None and now_ms >= self.paused.until_ms:
            self.detector.rebase(self.paused.until_ms)
            self.paused = None
            self.overruns += 1

    def phi(self, now_ms: int) -> float:
        """0 until the first heartbeat (loading a model is not a hang) and while paused."""
        self.settle(now_ms)
        if self.heartbeats == 0 or self.paused is not None:
            return 0.0
        return self.detector.phi(now_ms)

    def health_at(self, now_ms: int) -> str:
        return HEALTH_HUNG if self.phi(now_ms) >= self.threshold else HEALTH_OK


def _int_in(what: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise JobError(f"{what} must be an int in {lo}..{hi}, got {value!r}")
    return value


@dataclass
class NodeJob:
    """This node's registration in one job: its local ranks so far, and since when it has
    been complete (every local rank registered)."""

    local_world_size: int
    ranks: dict[int, Registration] = field(default_factory=dict)
    complete_since_ms: int | None = None

    def tag(self, now_ms: int) -> JobTag | None:
        """The tag to gossip now, or None while the node is incomplete."""
        if self.complete_since_ms is None:
            return None
        first = self.ranks[0]
        hung = any(r.health_at(now_ms) == HEALTH_HUNG for r in self.ranks.values())
        return JobTag(
            self.complete_since_ms,
            first.store_port,
            HEALTH_HUNG if hung else HEALTH_OK,
            first.group,
            self.local_world_size,
            first.role,
        )

    def hung_ranks(self, now_ms: int) -> list[int]:
        return sorted(r for r, reg in self.ranks.items() if reg.health_at(now_ms) == HEALTH_HUNG)

    def paused_ranks(self, now_ms: int) -> list[dict[str, Any]]:
        """This node's ranks in a declared pause (the ``jobs`` schema's ``paused``)."""
        listed = []
        for rank, reg in sorted(self.ranks.items()):
            reg.settle(now_ms)
            if reg.paused is not None:
                left_ms = reg.paused.until_ms - now_ms
                listed.append({"local_rank": rank, "reason": reg.paused.reason, "left_ms": left_ms})
        return listed

    def refused_frames(self) -> int:
        return sum(reg.refused_frames for reg in self.ranks.values())

    def target_nodes(self) -> int | None:
        """The job's target number of training nodes, as local rank 0 reported it."""
        first = self.ranks.get(0)
        return None if first is None else first.target_nodes


@dataclass
class LocalJobs:
    """Every local registration on this agent, by job (pure; the control server owns the
    connections and the clock). Validate, then mutate: a refused registration changes
    nothing."""

    jobs: dict[str, NodeJob] = field(default_factory=dict)

    def count(self) -> int:
        return sum(len(j.ranks) for j in self.jobs.values())

    def __contains__(self, job: object) -> bool:
        return job in self.jobs

    def add(self, reg: Registration, wall_ms: int) -> None:
        """Admit one local rank; the node's registration completes with its last rank."""
        node_job = self.jobs.get(reg.job)
        if node_job is not None and node_job.local_world_size != reg.local_world_size:
            raise JobError(
                f"job {reg.job!r}: this node registers {node_job.local_world_size} local "
                f"ranks, not {reg.local_world_size}"
            )
        if node_job is not None and reg.local_rank in node_job.ranks:
            raise JobError(
                f"job {reg.job!r} is already registered on this node"
                + (f" for local rank {reg.local_rank}" if reg.local_world_size > 1 else "")
            )
        if self.count() >= MAX_REGISTRATIONS:
            raise JobError(f"at most {MAX_REGISTRATIONS} registrations per agent")
        if node_job is None:
            node_job = self.jobs[reg.job] = NodeJob(reg.local_world_size)
        node_job.ranks[reg.local_rank] = reg
        if len(node_job.ranks) == node_job.local_world_size:
            node_job.complete_since_ms = wall_ms

    def remove(self, reg: Registration) -> None:
        """A local rank left: the node's registration is broken until it completes again
        (then as a new member)."""
        node_job = self.jobs.get(reg.job)
        if node_job is None or node_job.ranks.get(reg.local_rank) is not reg:
            return
        del node_job.ranks[reg.local_rank]
        node_job.complete_since_ms = None
        if not node_job.ranks:
            del self.jobs[reg.job]

    def tag(self, job: str, now_ms: int) -> JobTag | None:
        node_job = self.jobs.get(job)
        return None if node_job is None else node_job.tag(now_ms)
