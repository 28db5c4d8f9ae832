"""Event handlers, Serf's contract: which handler an event goes to, and what it is given.

Pure: no trio, no processes (agent/handler_runner.py runs them). The contract is the one of
Serf's agent (``serf agent -event-handler``; HashiCorp Serf, cmd/serf/command/agent/
event_handler.go and invoke.go), so a Serf handler script works unchanged:

- A handler is ``[filter=]COMMAND``, split at the first ``=``. ``COMMAND`` is run by
  ``/bin/sh -c`` (so it may carry arguments). ``filter`` is a comma-separated list of
  ``member-join``, ``member-leave``, ``member-failed``, ``member-update``, ``member-reap``,
  ``user``, ``user:NAME``, ``query``, ``query:NAME``; no filter (or ``*``) is every Serf
  event. Ours on top: ``job-view`` / ``job-view:JOB`` (a training job's view changed,
  agent/jobs.py), and ``job-slow`` / ``job-slow:JOB`` (the set of a training job's nodes
  flagged slow changed, agent/slow_jobs.py); they go only to handlers that name them,
  never to ``*``, so a Serf script is never handed an event it does not know. A filter
  outside this list is a configuration error naming it.
- Our member events map to Serf's as Serf's agent maps memberlist's: joined (a new or a
  returning member) -> ``member-join``; dead -> ``member-failed``; left -> ``member-leave``;
  updated (tags) -> ``member-update``; reaped -> ``member-reap``. Suspect and a refuted
  suspicion are not Serf events.
- Environment (on top of the agent's own): ``SERF_EVENT`` (the event's name above),
  ``SERF_SELF_NAME``, ``SERF_SELF_ROLE`` (this agent's ``role`` tag, empty without one),
  ``SERF_TAG_<KEY>=value`` per tag of this agent (KEY upper-cased, every character outside
  ``[A-Z0-9_]`` replaced by ``_``); a user event adds ``SERF_USER_EVENT`` and
  ``SERF_USER_LTIME``, a query ``SERF_QUERY_NAME`` and ``SERF_QUERY_LTIME``. Ours:
  ``SWIM_CONTROL`` (this agent's control socket, so ``swimctl`` in a handler reaches this
  agent), and for ``job-view`` ``SWIM_JOB``, ``SWIM_JOB_GENERATION``,
  ``SWIM_JOB_FINGERPRINT``; for ``job-slow`` ``SWIM_JOB`` and ``SWIM_SLOW_NODES`` (the
  flagged nodes, comma-separated, empty once none is).
- Stdin: for member events one line per member, ``NAME<TAB>ADDRESS<TAB>ROLE<TAB>TAGS``
  (address without port; TAGS ``k=v,k=v``; tabs and newlines in name, role and tags
  written as ``\\t`` and ``\\n``, nothing else escaped, as Serf); for a user event or a
  query its payload, with a newline added if it has none (an empty payload stays empty);
  for ``job-view`` one line per node in the view, oldest registration first, in the same
  shape, TAGS being the view's fields (``status``, ``ranks``, ``store_port``, ``group``,
  ``registered_ms``); for ``job-slow`` one line per flagged node, slowest first, with an
  empty address and role and the tags ``ratio`` (its step time over the job's median)
  and ``new`` (``1`` if this change flagged it).
- Member events that wait in the queue together are coalesced as Serf coalesces them:
  one invocation per kind with one line per member (``coalesce``).

Where we differ from Serf (docs/runbook.md "Reacting to verdicts: event handlers"): tags on
stdin are sorted by key (Serf writes them in Go's random map order); a NUL in a value is
dropped from the environment (Serf's invocation fails on it); a handler whose filters match
an event twice (``user,user:deploy``) runs once for it (Serf runs it twice).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from swim import EventKind

SERF_EVENTS = (
    "member-join",
    "member-leave",
    "member-failed",
    "member-update",
    "member-reap",
    "user",
    "query",
)
"""Serf's event names (event_handler.go ``EventFilter.Valid``)."""
JOB_VIEW = "job-view"
JOB_SLOW = "job-slow"
JOB_EVENTS = (JOB_VIEW, JOB_SLOW)
"""Ours: only for handlers that name them (``*`` is Serf's events)."""
NAMED_EVENTS = ("user", "query", *JOB_EVENTS)
"""Events a filter may narrow to one name (``user:deploy``, ``job-view:llm``)."""
MEMBER_EVENTS: Mapping[EventKind, str] = {
    EventKind.JOINED: "member-join",
    EventKind.LEFT: "member-leave",
    EventKind.DEAD: "member-failed",
    EventKind.UPDATED: "member-update",
    EventKind.REAPED: "member-reap",
}
"""Our member events as Serf names them; the others (suspect, alive) are not Serf events."""
ROLE_TAG = "role"
_SANITIZE = re.compile(r"[^A-Z0-9_]")


class HandlerConfigError(ValueError):
    """An event handler setting that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class EventFilter:
    """One filter: an event name (``*``: every Serf event) and optionally one name."""

    event: str
    name: str = ""

    def matches(self, event: HandlerEvent) -> bool:
        if self.event == "*":
            return event.kind not in JOB_EVENTS
        if event.kind != self.event:
            return False
        return not self.name or self.name == event.name

    def __str__(self) -> str:
        return f"{self.event}:{self.name}" if self.name else self.event


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """``[filter=]command``: run ``command`` for every event a filter matches."""

    filters: tuple[EventFilter, ...]
    command: str

    def wants(self, event: HandlerEvent) -> bool:
        return any(f.matches(event) for f in self.filters)

    def __str__(self) -> str:
        return f"{','.join(str(f) for f in self.filters)}={self.command}"


def parse_filter(text: str) -> tuple[EventFilter, ...]:
    """Serf's ``ParseEventFilter``: comma-separated events; empty means ``*``."""
    if not text:
        return (EventFilter("*"),)
    out = []
    for item in text.split(","):
        event, sep, name = item.partition(":")
        if event == "*" and not sep:
            out.append(EventFilter("*"))
            continue
        if event not in (*SERF_EVENTS, *JOB_EVENTS):
            raise HandlerConfigError(
                f"event handler filter {item!r} is not one of "
                f"{', '.join((*SERF_EVENTS, *JOB_EVENTS))} ({', '.join(NAMED_EVENTS)} take :NAME)"
            )
        if sep and event not in NAMED_EVENTS:
            raise HandlerConfigError(
                f"event handler filter {item!r}: only {', '.join(NAMED_EVENTS)} take a :NAME"
            )
        out.append(EventFilter(event, name))
    return tuple(out)


def parse_handler(text: str) -> HandlerSpec:
    """Serf's ``ParseEventScript``: ``[filter=]command``, split at the first ``=``."""
    if not isinstance(text, str):
        raise HandlerConfigError(f"event handler {text!r} must be a string")
    filter_text, sep, command = text.partition("=")
    if not sep:
        filter_text, command = "", text
    if not command.strip():
        raise HandlerConfigError(f"event handler {text!r} has no command")
    return HandlerSpec(parse_filter(filter_text), command)


@dataclass(frozen=True, slots=True)
class MemberLine:
    """One member as a handler sees it on stdin."""

    name: str
    addr: str
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HandlerEvent:
    """What the handlers are invoked for. ``kind``: a Serf event name or ``job-view``;
    ``name``: the user event's, query's or job's; ``reply``: for a query, what the runner
    needs to answer it (opaque here)."""

    kind: str
    name: str = ""
    ltime: int = 0
    payload: bytes = b""
    members: tuple[MemberLine, ...] = ()
    generation: int = 0
    fingerprint: str = ""
    reply: object = None


def member_event(
    kind: EventKind, name: str, addr: str, tags: Mapping[str, str]
) -> HandlerEvent | None:
    """Our member event as Serf's, or None when Serf has no such event."""
    serf_kind = MEMBER_EVENTS.get(kind)
    if serf_kind is None:
        return None
    return HandlerEvent(serf_kind, members=(MemberLine(name, addr, dict(tags)),))


def job_view_event(view: Mapping[str, object], roles: Mapping[str, str]) -> HandlerEvent:
    """A job view (the ``view`` schema, agent/control.py) as a ``job-view`` event;
    ``roles``: each member's ``role`` tag."""
    lines = []
    members = view.get("members")
    for m in members if isinstance(members, list) else []:
        fields = {
            "status": m["status"],
            "ranks": m["ranks"],
            "store_port": m["store_port"],
            "group": m["group"],
            "registered_ms": m["registered_ms"],
        }
        tags = {k: str(v) for k, v in fields.items()}
        if m.get("role", "training") != "training":
            tags["job_role"] = str(m["role"])  # a hot spare; the Serf ``role`` is the node's
        if roles.get(m["name"]):
            tags[ROLE_TAG] = roles[m["name"]]
        lines.append(MemberLine(m["name"], m["addr"], tags))
    generation = view.get("generation")
    return HandlerEvent(
        JOB_VIEW,
        name=str(view.get("job", "")),
        members=tuple(lines),
        generation=generation if isinstance(generation, int) else 0,
        fingerprint=str(view.get("fingerprint", "")),
    )


def job_slow_event(job: str, nodes: Mapping[str, float], newly: Iterable[str]) -> HandlerEvent:
    """A change of ``job``'s flagged nodes (``{name: ratio}``) as a ``job-slow`` event."""
    fresh = set(newly)
    order = sorted(nodes, key=lambda n: (-nodes[n], n))
    lines = tuple(
        MemberLine(n, "", {"ratio": f"{nodes[n]:.2f}", "new": "1" if n in fresh else "0"})
        for n in order
    )
    return HandlerEvent(JOB_SLOW, name=job, members=lines)


def coalesce(first: HandlerEvent, later: HandlerEvent) -> HandlerEvent | None:
    """Two queued member events of one kind as one (serf/coalesce_member.go: one event per
    kind, one line per member, its latest state); None when they cannot be merged."""
    if first.kind != later.kind or not first.kind.startswith("member-"):
        return None
    merged = {m.name: m for m in first.members}
    for m in later.members:
        merged.pop(m.name, None)
        merged[m.name] = m
    return replace(first, members=tuple(merged.values()))


RECENT_USER_EVENTS = 512
"""User events remembered to hand each to the handlers once: Serf's ``EventBuffer``
(gossip may deliver one event more than once)."""


class RecentUserEvents:
    """The user events already handed over (serf.go ``handleUserEvent``'s event buffer:
    one event is its Lamport time, name and payload), the last ``RECENT_USER_EVENTS``."""

    def __init__(self, limit: int = RECENT_USER_EVENTS) -> None:
        self._limit = limit
        self._seen: dict[tuple[int, str, bytes], None] = {}

    def is_news(self, ltime: int, name: str, payload: bytes) -> bool:
        key = (ltime, name, payload)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._limit:
            del self._seen[next(iter(self._seen))]
        return True


def _clean(value: str) -> str:
    """invoke.go ``eventClean``."""
    return value.replace("\t", "\\t").replace("\n", "\\n")


def _env_value(value: str) -> str:
    return value.replace("\0", "")


def tag_env_name(key: str) -> str:
    """``SERF_TAG_<KEY>``: upper-cased, every character outside [A-Z0-9_] as ``_``."""
    return "SERF_TAG_" + _SANITIZE.sub("_", key.upper())


def handler_env(
    event: HandlerEvent,
    self_name: str,
    self_tags: Mapping[str, str],
    control_path: str,
) -> dict[str, str]:
    """The variables a handler gets on top of the agent's own environment."""
    env = {
        "SERF_EVENT": event.kind,
        "SERF_SELF_NAME": self_name,
        "SERF_SELF_ROLE": self_tags.get(ROLE_TAG, ""),
    }
    for key, value in self_tags.items():
        env[tag_env_name(key)] = value
    if event.kind == "user":
        env["SERF_USER_EVENT"] = event.name
        env["SERF_USER_LTIME"] = str(event.ltime)
    elif event.kind == "query":
        env["SERF_QUERY_NAME"] = event.name
        env["SERF_QUERY_LTIME"] = str(event.ltime)
    elif event.kind == JOB_SLOW:
        env["SWIM_JOB"] = event.name
        env["SWIM_SLOW_NODES"] = ",".join(m.name for m in event.members)
    elif event.kind == JOB_VIEW:
        env["SWIM_JOB"] = event.name
        env["SWIM_JOB_GENERATION"] = str(event.generation)
        env["SWIM_JOB_FINGERPRINT"] = event.fingerprint
    env["SWIM_CONTROL"] = control_path
    return {_env_value(k): _env_value(v) for k, v in env.items()}


def member_lines(members: Iterable[MemberLine]) -> bytes:
    """invoke.go ``memberEventStdin``: ``NAME\\tADDR\\tROLE\\tk=v,k=v`` per member."""
    out = []
    for m in members:
        tags = ",".join(f"{k}={v}" for k, v in sorted(m.tags.items()))
        role = m.tags.get(ROLE_TAG, "")
        out.append(f"{_clean(m.name)}\t{m.addr}\t{_clean(role)}\t{_clean(tags)}\n")
    return "".join(out).encode("utf-8", "surrogateescape")


def handler_stdin(event: HandlerEvent) -> bytes:
    """What a handler reads on stdin (invoke.go ``memberEventStdin``/``streamPayload``)."""
    if event.kind in ("user", "query"):
        payload = event.payload
        if payload and not payload.endswith(b"\n"):
            payload += b"\n"
        return payload
    return member_lines(event.members)
