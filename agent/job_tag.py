"""The job tag: how a node's registration in a training job travels to every peer.

A registration rides the node's metadata (memberlist's extension point; plain Serf and
memberlist peers read it as an ordinary tag), one tag per job:

    key   ``swim.job/<job>``
    value ``<registered_ms>,<store_port>,<health>,<group>,<ranks>[,<role>]``

- ``registered_ms``: wall-clock milliseconds when the node's registration became complete
  (every local rank registered), set once by the agent: the same on every peer, so
  ``(registered_ms, name)`` orders the job's nodes by join age everywhere.
- ``store_port``: where local rank 0 serves its rendezvous store (0: none).
- ``health``: ``ok`` or ``hung`` (a local rank stopped heartbeating: agent/jobs.py).
- ``group``: an opaque token local rank 0 sets for the process group it is in (at most
  ``MAX_GROUP_CHARS`` of ``[A-Za-z0-9_.-]``).
- ``ranks``: the node's local world size (``1..MAX_LOCAL_RANKS``).
- ``role``: what the job's trainers made the node, ``agent.control.ROLES``; written only
  when it is not ``training`` (a spare's tag ends in ``,spare``), so a training node's tag
  is unchanged and older agents keep reading it.

Compatibility: a four-field value (agents before multi-rank jobs) means one rank, a
five-field value (agents before spares) means ``training``. Agents before spares ignore a
six-field value as malformed, so they do not list spare nodes (which do not train).

Size: a job name of at most 64 characters and a group of at most 32 keep one tag under
140 bytes encoded (key 73, value at most 66 with the role), so several jobs fit a node's
512-byte metadata (docs/design.md §8); a tag change that would not fit is refused by the
agent before anything changes (``Agent.update_tags``).

Pure: no trio, no sockets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.control import ROLE_TRAINING, ROLES, ControlError, check_role

__all__ = [
    "GROUP_CHARS",
    "HEALTH_HUNG",
    "HEALTH_OK",
    "JOB_NAME",
    "MAX_GROUP_CHARS",
    "MAX_LOCAL_RANKS",
    "TAG_PREFIX",
    "JobError",
    "JobTag",
    "check_group",
    "check_job",
    "check_node_role",
    "tag_key",
]

TAG_PREFIX = "swim.job/"
JOB_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_GROUP_CHARS = 32
GROUP_CHARS = re.compile(r"^[A-Za-z0-9_.\-]*$")
HEALTH_OK = "ok"
HEALTH_HUNG = "hung"
MAX_LOCAL_RANKS = 64
"""Local ranks per node and job: 8 GPUs is the common node, 64 leaves room for CPU jobs and
future hosts while bounding a node's registration state."""


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


def check_node_role(role: object) -> str:
    """``agent.control.check_role`` as a ``JobError`` (what the agent's handlers catch)."""
    try:
        return check_role(role)
    except ControlError as exc:
        raise JobError(str(exc)) from None


def tag_key(job: str) -> str:
    return TAG_PREFIX + job


@dataclass(frozen=True, slots=True)
class JobTag:
    registered_ms: int
    store_port: int
    health: str
    group: str
    ranks: int = 1
    role: str = ROLE_TRAINING

    def encode(self) -> str:
        value = f"{self.registered_ms},{self.store_port},{self.health},{self.group},{self.ranks}"
        return value if self.role == ROLE_TRAINING else f"{value},{self.role}"

    @classmethod
    def decode(cls, value: str) -> JobTag | None:
        """Parse a peer's tag; a malformed one (hostile or a future format) is ignored."""
        parts = value.split(",")
        if len(parts) == 4:
            parts.append("1")  # an agent from before multi-rank jobs
        if len(parts) == 5:
            parts.append(ROLE_TRAINING)  # an agent from before spares
        if len(parts) != 6:
            return None
        registered, port, health, group, ranks, role = parts
        if not (_count(registered) and _count(port) and _count(ranks)):
            return None
        if health not in (HEALTH_OK, HEALTH_HUNG) or not 1 <= int(ranks) <= MAX_LOCAL_RANKS:
            return None
        if int(port) > 65_535 or len(group) > MAX_GROUP_CHARS or not GROUP_CHARS.match(group):
            return None
        if role not in ROLES:
            return None
        return cls(int(registered), int(port), health, group, int(ranks), role)


def _count(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes ``²``, which ``int`` refuses."""
    return text.isascii() and text.isdigit()
