"""Training jobs on top of membership: registrations, worker heartbeats and numbered views.

A training process on a node *registers* for a job through the control API (``watch``
with ``register``). The registration travels to every peer as one tag in the node's
metadata, so views need no extra protocol (DESIGN.md: additions ride memberlist's
extension points):

    key   ``swim.job/<job>``
    value ``<registered_ms>,<store_port>,<health>,<group>``

- ``registered_ms``: wall-clock milliseconds when the registration was made, set once by
  the agent. Every peer sees the same value, so ordering by ``(registered_ms, name)`` gives
  the same "join age" order everywhere, whatever the clock skew between hosts.
- ``store_port``: a TCP port where the registrant serves its rendezvous store (0: none).
- ``health``: ``ok`` or ``hung``. The agent scores the registrant's per-step heartbeats
  with Phi accrual (Hayashibara et al.; ``phi/``) and flips it to ``hung`` when a worker
  stops stepping on a live host, which SWIM alone cannot see (DESIGN.md "Phi accrual").
- ``group``: an opaque token the registrant sets for the process group it is in (at most
  ``MAX_GROUP_CHARS``), so peers can tell that a member has moved to a newer group.

The *view* of a job is every member that is alive or suspect (SWIM §4.2: a suspect has not
been declared failed yet) and carries a healthy registration, ordered by join age. Its
``fingerprint`` hashes the ordered (name, registered_ms) pairs: equal on every node that
sees the same member set. ``generation`` is this agent's count of fingerprint changes: it
numbers the views one client sees, it is not comparable across nodes.

Everything here is pure (no trio, no sockets): the control server owns the I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agent.control import JobMember
from phi import PhiAccrualDetector, PhiConfig
from swim import Member, NodeStateType

TAG_PREFIX = "swim.job/"
JOB_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_GROUP_CHARS = 32
GROUP_CHARS = re.compile(r"^[A-Za-z0-9_.\-]*$")
HEALTH_OK = "ok"
HEALTH_HUNG = "hung"
MAX_WATCHED_JOBS = 256
"""Jobs with a generation counter on one agent; the oldest is forgotten beyond it."""
DEFAULT_HEARTBEAT_PAUSE_MS = 30_000
"""Silence tolerated on top of the mean step time before a worker counts as hung: a
checkpoint or an evaluation pass must not get a node excluded."""
DEFAULT_HEARTBEAT_THRESHOLD = 8.0
"""Akka cluster's phi threshold (phi/detector.py)."""
VIEW_STATES = (NodeStateType.ALIVE, NodeStateType.SUSPECT)


class JobError(ValueError):
    """A registration or view request that cannot be honoured; the message says why."""


def check_job(job: object) -> str:
    if not isinstance(job, str) or not JOB_NAME.match(job):
        raise JobError(f"job must match {JOB_NAME.pattern}, got {job!r}")
    return job


def check_group(group: object) -> str:
    if not isinstance(group, str) or len(group) > MAX_GROUP_CHARS or not GROUP_CHARS.match(group):
        raise JobError(f"group must be <= {MAX_GROUP_CHARS} characters of [A-Za-z0-9_.-]")
    return group


def tag_key(job: str) -> str:
    return TAG_PREFIX + job


@dataclass(frozen=True, slots=True)
class JobTag:
    registered_ms: int
    store_port: int
    health: str
    group: str

    def encode(self) -> str:
        return f"{self.registered_ms},{self.store_port},{self.health},{self.group}"

    @classmethod
    def decode(cls, value: str) -> JobTag | None:
        """Parse a peer's tag; a malformed one (hostile or a future format) is ignored."""
        parts = value.split(",")
        if len(parts) != 4:
            return None
        registered, port, health, group = parts
        if not (registered.isdigit() and port.isdigit()) or health not in (HEALTH_OK, HEALTH_HUNG):
            return None
        if int(port) > 65_535 or len(group) > MAX_GROUP_CHARS or not GROUP_CHARS.match(group):
            return None
        return cls(int(registered), int(port), health, group)


def job_members(job: str, members: Iterable[Member], tags_of: Any) -> list[JobMember]:
    """The members of ``job``'s view, oldest registration first. ``tags_of(member)`` decodes
    a member's tags (the caller owns the tag codec)."""
    key = tag_key(job)
    found: list[JobMember] = []
    for m in members:
        if m.state not in VIEW_STATES:
            continue
        value = tags_of(m).get(key)
        tag = JobTag.decode(value) if isinstance(value, str) else None
        if tag is None or tag.health != HEALTH_OK:
            continue
        found.append(
            JobMember(
                m.name,
                m.address.host,
                m.address.port,
                tag.store_port,
                tag.registered_ms,
                tag.group,
                m.state.name.lower(),
            )
        )
    found.sort(key=lambda j: (j.registered_ms, j.name))
    return found


def fingerprint(members: Iterable[JobMember]) -> str:
    h = hashlib.sha256()
    for m in members:
        h.update(f"{m.name}@{m.registered_ms};".encode())
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
    job: str, members: Iterable[Member], tags_of: Any, generations: Generations
) -> dict[str, Any]:
    listed = job_members(job, members, tags_of)
    fp = fingerprint(listed)
    return {
        "job": job,
        "generation": generations.number(job, fp),
        "fingerprint": fp,
        "members": [m.as_dict() for m in listed],
    }


@dataclass
class Registration:
    """One local registrant: its tag and the Phi detector over its heartbeats."""

    job: str
    tag: JobTag
    threshold: float
    detector: PhiAccrualDetector
    last_step: int = -1
    heartbeats: int = 0

    @classmethod
    def create(
        cls,
        job: str,
        registered_ms: int,
        store_port: object = 0,
        heartbeat_pause_ms: object = DEFAULT_HEARTBEAT_PAUSE_MS,
        heartbeat_threshold: object = DEFAULT_HEARTBEAT_THRESHOLD,
        first_heartbeat_estimate_ms: object = 1000,
    ) -> Registration:
        if not isinstance(store_port, int) or not 0 <= store_port <= 65_535:
            raise JobError(f"store_port must be an int in 0..65535, got {store_port!r}")
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
        tag = JobTag(registered_ms, store_port, HEALTH_OK, "")
        return cls(check_job(job), tag, float(heartbeat_threshold), PhiAccrualDetector(config))

    def heartbeat(self, step: object, now_ms: int) -> None:
        if isinstance(step, int) and not isinstance(step, bool):
            self.last_step = step
        self.heartbeats += 1
        self.detector.heartbeat(now_ms)

    def phi(self, now_ms: int) -> float:
        """0 until the first heartbeat: loading a model is not a hang."""
        return 0.0 if self.heartbeats == 0 else self.detector.phi(now_ms)

    def health_at(self, now_ms: int) -> str:
        return HEALTH_HUNG if self.phi(now_ms) >= self.threshold else HEALTH_OK
