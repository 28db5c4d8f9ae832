"""Slurm's side of a verdict, pure: who acts, which Slurm node, what to run.

The drain handler (``swim-slurm-handler``, agent/slurm_handler.py) runs on every agent for
every membership event, with Serf's event-handler contract: ``SERF_EVENT`` names the event
and stdin holds one line per member it is about, ``name<TAB>address<TAB>role<TAB>k=v,k=v``
(Serf's ``invoke.go``; the same lines our agent writes). This module holds every decision
the handler makes, as functions of their inputs, so they are tested without Slurm:

- **Who acts** (``elect``): rendezvous, or highest-random-weight, hashing (Thaler and
  Ravishankar, "Using name-based mappings to increase hit rates", 1998). Every agent
  scores each candidate as ``sha256(subject NUL candidate)`` and the highest score acts;
  ties (impossible in practice) go to the smaller name. The candidates are the members
  alive in this agent's view, less the subject, optionally only those carrying a tag
  (``--actor-tag KEY[=VALUE]``). Every agent with the same view picks the same one, so one
  agent of 1,000 calls ``scontrol``; the winner changes only for the subjects whose winner
  left, and the same agent acts on a member's failure and on its return when nothing else
  changed (so the two run in order, on one agent's handler queue).
- **Views differ for a moment** (gossip still spreading, or several members failing at
  once). Two agents may both think they won: both act, which is harmless, because every
  action is idempotent (below). Or the winner in some views is itself dead but not yet
  declared so, and nobody would act: so the next ``backups`` agents of the ranking
  (``ranking``; 2 by default) act too, after ``rank x backup delay`` (5 s by default), if
  Slurm's state still asks for it then. A verdict costs one ``scontrol update`` and at most
  ``1 + backups`` reads of the node's state.
- **Which node** (``slurm_node``): a map entry (``--map FILE``: ``member slurm-node`` per
  line, ``#`` comments) wins, then the member's own tag (``--node-tag KEY``), else the
  member's name as is.
- **What to run** (``decide``): on a drain event (``member-failed`` by default; add
  ``member-leave`` to also drain members that left gracefully), a node that is not yet
  drained gets ``scontrol update NodeName=N State=DRAIN Reason="swim: ..."``; a drained one
  is left alone, whatever its reason (the reason already there, ours or an admin's, is
  never rewritten). On ``member-join`` (a member alive again), with ``--resume``, a node
  that is drained *with our reason* gets ``State=RESUME``; a node drained for any other
  reason stays drained. Every other event, or a node Slurm does not know, does nothing.

Reasons start with ``REASON_PREFIX``; that prefix is how a later run recognises its own
drains, so an operator who wants to keep a node drained after swim drained it changes the
reason (``scontrol update NodeName=N Reason="..."``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_DRAIN_EVENTS",
    "DRAIN_EVENT_CHOICES",
    "MAX_MAP_ENTRIES",
    "REASON_PREFIX",
    "RESUME_EVENTS",
    "Action",
    "Member",
    "NodeState",
    "SlurmError",
    "candidates",
    "decide",
    "drain_reason",
    "elect",
    "parse_actor_tag",
    "parse_map",
    "parse_member_line",
    "parse_node",
    "ranking",
    "slurm_node",
    "update_command",
]

REASON_PREFIX = "swim:"
"""Every drain reason we write starts with this; only such drains are ever resumed."""

DEFAULT_DRAIN_EVENTS = frozenset({"member-failed"})
RESUME_EVENTS = frozenset({"member-join"})
DRAIN_EVENT_CHOICES = frozenset({"member-failed", "member-leave", "member-reap"})

MAX_MAP_ENTRIES = 100_000
"""Lines read from a map file: ten times the largest cluster the simulator models; a file
past it is refused rather than held (a wrong path pointing at a huge file)."""

_SLURM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
"""A Slurm node name we are willing to put on scontrol's command line: no spaces, no
``=``, no brackets (a hostlist expression would act on many nodes)."""


class SlurmError(ValueError):
    """A setting, a map file or scontrol's output that cannot be used; says which."""


@dataclass(frozen=True)
class Member:
    """One line of a handler's stdin."""

    name: str
    addr: str
    role: str
    tags: Mapping[str, str]


@dataclass(frozen=True)
class NodeState:
    """What ``scontrol show node`` says: the state's words (``IDLE+DRAIN`` gives
    ``{"IDLE", "DRAIN"}``) and the reason without Slurm's ``[user@time]`` suffix."""

    flags: frozenset[str]
    reason: str | None

    @property
    def drained(self) -> bool:
        return bool(self.flags & {"DRAIN", "DRAINED", "DRAINING"})

    @property
    def ours(self) -> bool:
        return self.reason is not None and self.reason.startswith(REASON_PREFIX)


@dataclass(frozen=True)
class Action:
    """What to do for one member: ``kind`` is ``drain``, ``resume`` or ``none``;
    ``why`` is the log line's explanation."""

    kind: str
    why: str
    reason: str | None = None


def parse_member_line(line: str) -> Member:
    """``name<TAB>address<TAB>role<TAB>k=v,k=v`` (trailing fields may be missing)."""
    fields = line.rstrip("\r\n").split("\t")
    if not fields[0]:
        raise SlurmError(f"member line without a name: {line!r}")
    fields += [""] * (4 - len(fields))
    tags: dict[str, str] = {}
    for pair in fields[3].split(","):
        if pair:
            key, _, value = pair.partition("=")
            tags[key] = value
    return Member(fields[0], fields[1], fields[2], tags)


def parse_map(text: str) -> dict[str, str]:
    """A map file: ``member slurm-node`` per line (whitespace or ``=`` between them),
    blank lines and ``#`` comments ignored."""
    mapping: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        if number > MAX_MAP_ENTRIES:
            raise SlurmError(f"map: more than {MAX_MAP_ENTRIES} lines")
        line = raw.split("#", 1)[0].replace("=", " ").strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise SlurmError(f"map line {number}: expected 'member slurm-node', got {raw!r}")
        mapping[parts[0]] = _checked_node(parts[1], f"map line {number}")
    return mapping


def parse_actor_tag(text: str | None) -> tuple[str, str | None] | None:
    """``KEY`` (any value) or ``KEY=VALUE``; None or empty for no restriction."""
    if not text:
        return None
    key, sep, value = text.partition("=")
    if not key:
        raise SlurmError(f"actor tag: expected KEY or KEY=VALUE, got {text!r}")
    return key, value if sep else None


def _checked_node(name: str, where: str) -> str:
    if not _SLURM_NAME.match(name):
        raise SlurmError(f"{where}: {name!r} is not a single Slurm node name")
    return name


def slurm_node(member: Member, mapping: Mapping[str, str], node_tag: str | None) -> str:
    """The Slurm node a member stands for: map entry, else its ``node_tag`` tag, else its
    name. Raises ``SlurmError`` for a name scontrol must not see."""
    if member.name in mapping:
        return mapping[member.name]
    if node_tag and member.tags.get(node_tag):
        return _checked_node(member.tags[node_tag], f"tag {node_tag} of {member.name}")
    return _checked_node(member.name, f"member {member.name}")


def candidates(
    alive: Iterable[Mapping[str, object]],
    subject: str,
    actor_tag: tuple[str, str | None] | None,
) -> list[str]:
    """The names that may act for ``subject``: alive, not the subject, with the tag."""
    names = []
    for m in alive:
        if m.get("status", "alive") != "alive" or m["name"] == subject:
            continue
        tags = m.get("tags") or {}
        assert isinstance(tags, Mapping)
        if actor_tag is not None:
            key, value = actor_tag
            if key not in tags or (value is not None and tags[key] != value):
                continue
        names.append(str(m["name"]))
    return names


def _score(subject: str, candidate: str) -> bytes:
    data = subject.encode("utf-8", "surrogateescape") + b"\0"
    return hashlib.sha256(data + candidate.encode("utf-8", "surrogateescape")).digest()


def ranking(subject: str, names: Iterable[str]) -> list[str]:
    """The candidates for ``subject``, best first (highest score; ties by name)."""
    return sorted(names, key=lambda name: (_invert(_score(subject, name)), name))


def _invert(score: bytes) -> bytes:
    return bytes(255 - b for b in score)


def elect(subject: str, names: Iterable[str]) -> str | None:
    """The one candidate that acts for ``subject`` (None if there is none)."""
    ranked = ranking(subject, names)
    return ranked[0] if ranked else None


def parse_node(text: str) -> NodeState:
    """``scontrol show node NAME``'s output (one node, multi-line form)."""
    state = re.search(r"(?:^|\s)State=(\S+)", text)
    if state is None:
        raise SlurmError(f"no State= in scontrol's output: {text[:200]!r}")
    flags = frozenset(w for w in state.group(1).split("+") if w)
    found = re.search(r"^\s*Reason=(.*)$", text, re.MULTILINE)
    reason = None
    if found:
        reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", found.group(1)).strip() or None
        if reason == "(null)":
            reason = None
    return NodeState(flags, reason)


def drain_reason(event: str, member: Member, when: str, seen_by: str) -> str:
    """``swim: gpu2 failed at 2026-12-05T14:20:01Z, seen by gpu3``: what, when, by whom."""
    what = {"member-failed": "failed", "member-leave": "left", "member-reap": "was reaped"}
    return f"{REASON_PREFIX} {member.name} {what.get(event, event)} at {when}, seen by {seen_by}"


def decide(
    event: str,
    node: str,
    state: NodeState,
    *,
    reason: str,
    drain_events: frozenset[str] = DEFAULT_DRAIN_EVENTS,
    resume: bool = False,
) -> Action:
    """The action for one member's Slurm node, from the event and the node's state."""
    if event in drain_events:
        if state.drained:
            who = "by swim" if state.ours else f"for another reason ({state.reason})"
            return Action("none", f"{node} is drained already {who}; left as it is")
        return Action("drain", f"{node} is {'+'.join(sorted(state.flags))}", reason)
    if event in RESUME_EVENTS:
        if not resume:
            return Action("none", "resuming is off")
        if not state.drained:
            return Action("none", f"{node} is not drained")
        if not state.ours:
            return Action("none", f"{node} is drained for another reason ({state.reason}); kept")
        return Action("resume", f"{node} was drained by swim ({state.reason})")
    return Action("none", f"nothing to do on {event}")


def update_command(scontrol: str, node: str, action: Action) -> list[str]:
    """The scontrol command line for an action (never a shell string)."""
    if action.kind == "drain":
        assert action.reason is not None
        return [scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={action.reason}"]
    if action.kind == "resume":
        return [scontrol, "update", f"NodeName={node}", "State=RESUME"]
    raise ValueError(f"no command for {action.kind!r}")
