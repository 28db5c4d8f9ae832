"""The status page's JSON endpoints: what agent/metrics_http.py serves under ``/v1/`` and
``/healthz``, and what the page (agent/status_page.py) polls. Read-only: every endpoint
reads through ``agent.api.AgentAPI`` and none changes the agent.

Every body is a JSON object; ``<``, ``>`` and ``&`` are written as ``\\u003c``, ``\\u003e``
and ``\\u0026``, so no response can be read as markup whatever a member's name holds.
Names and tags that are not UTF-8 (memberlist carries Go strings, any bytes) arrive as
lone surrogates ``\\udcXX`` (the wire's ``surrogateescape``). Times: ``time_ms``,
``formed_ms`` and ``registered_ms`` are wall-clock milliseconds since the Unix epoch;
``since_ms``, ``uptime_ms`` and ``rtt_ms`` are durations; an event's ``at_ms`` is the
agent's monotonic clock. Schemas:

- ``GET /v1/members[?status=alive|suspect|dead|left]`` → ``{"node": str, "members":
  [member]}``; a member is the control API's ``members`` object (agent/control.py:
  ``name, addr, port, status, incarnation, phi, tags, protocol, since_ms``) plus
  ``"rtt_ms": int|null`` (this agent's last direct probe of it). An unknown status is 400.
- ``GET /v1/events`` → ``{"capacity": int, "missed": int, "events": [event]}``, oldest
  first, at most ``RECENT_EVENTS`` (agent/status_events.py); an event is the control API's
  ``monitor`` event plus ``"seq": int`` (increasing) and ``"time_ms"`` (when this agent
  saw it); a user event carries ``payload_bytes`` (its length) instead of its payload.
  ``missed``: times the reader fell behind the agent and events were lost.
- ``GET /v1/jobs`` → ``{"jobs": [job], "omitted": int}``, by name, at most
  ``MAX_JOBS_LISTED`` (``omitted`` counts the rest); a job: ``{"job": str, "fingerprint":
  str, "formations": int, "formed_ms": int|null, "ranks": int, "training": int,
  "spares": int, "nodes": [node], "hung_nodes": [str], "local": local|null}``. ``nodes``:
  every member carrying the job's tag, the view's members first (``{"name", "status",
  "in_view": bool, "health": ok|hung, "ranks": int, "registered_ms": int, "group": str,
  "role": training|spare}``); ``ranks`` sums the view's training nodes' ranks;
  ``training`` and ``spares`` count the view's nodes by role (``agent.control.ROLES``);
  ``formations`` counts the view's fingerprint changes this agent saw (its first sight
  counts one) and ``formed_ms`` is the last one's time. ``local`` (this node's own
  registration): ``{"local_world_size": int, "registered": [int], "complete": bool,
  "steps": {"<local rank>": int}, "hung_ranks": [int], "paused": [{"local_rank": int,
  "reason": str, "left_ms": int}]}`` (a step of -1: no heartbeat yet; ``paused``: ranks in
  a declared pause, spared from hang scoring until ``left_ms`` runs out), ``"slow": {node:
  ratio}`` (the job's nodes flagged slow, as this node's trainers reported: agent/slow_jobs.py),
  ``"target": int|null`` (the job's target number of training nodes, as this node's local
  rank 0 reported it).
- ``GET /v1/info`` → the control API's ``info`` result plus ``"process": {"pid": int,
  "cpu_s": float, "wall_s": float, "rss_bytes": int|null, "max_rss_bytes": int}``
  (``cpu_s``/``wall_s``: process CPU and a monotonic clock, so two polls give the CPU
  share) and ``"time_ms"``.
- ``GET /healthz`` → 200 ``{"ok": true, "node": str}`` when the node task answers within
  ``HEALTHZ_TIMEOUT_S``, else 503 ``{"ok": false, "error": str}``.
- Errors (400 for a bad query, 503 when the agent is too busy): ``{"error": str}``.

Work: what reads the Node runs in the node task, through ``AgentAPI`` (a copy); building
and encoding a reply over every member runs in one worker thread at a time, the JSON in
slices (``json_body_in_slices``), so the node task is not held for a whole reply.
Measured with 10,000 members (2.3 MB of JSON, 110-240 ms of CPU to build): a 1 ms timer in
the same trio loop ran up to 110-240 ms late when the reply was built inline, 24-40 ms
late with the worker thread (8-11 ms idle, on a loaded 2-core host).

No response carries key material: ``info`` says only whether encryption is on, and the
``keys`` operation has no endpoint. Bounds: ``AGENT_WAIT_S`` per read of the agent (503
beyond it), ``MAX_JOBS_LISTED`` jobs, the events ring (agent/status_events.py).
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import trio

from agent.api import AgentAPI, Snapshot
from agent.control import ROLE_SPARE, ROLE_TRAINING
from agent.control_server import STATUSES, answer, member_json
from agent.jobs import HEALTH_HUNG, TAG_PREFIX, VIEW_STATES, JobTag, fingerprint, job_members
from agent.status_events import RecentEvents
from agent.watch import member_tags
from swim import Member

__all__ = [
    "AGENT_WAIT_S",
    "HEALTHZ_TIMEOUT_S",
    "JOB_TRACK_INTERVAL_S",
    "JSON_SLICE",
    "MAX_JOBS_LISTED",
    "MAX_QUERY_FIELDS",
    "Reply",
    "StatusEndpoints",
    "json_body",
    "json_body_in_slices",
]

AGENT_WAIT_S = 2.0
"""How long one endpoint waits for the node task; a busier agent answers 503, inside the
HTTP server's own deadline for the whole exchange."""
HEALTHZ_TIMEOUT_S = 1.0
"""``/healthz``: the node task must answer a no-op within this (liveness, not load)."""
MAX_JOBS_LISTED = 64
"""Jobs in one ``/v1/jobs`` reply (and formations tracked). Every node's tags share its
512-byte metadata, so the nodes per job are bounded by the member table already."""
JSON_SLICE = 200
"""List items per call of the JSON encoder in a worker thread (~1 ms each)."""
MAX_QUERY_FIELDS = 8
"""Query parameters parsed per request (only ``status`` means anything)."""
JOB_TRACK_INTERVAL_S = 1.0
"""At most this often the job formations are recomputed after a change, so a burst of
membership events costs one recomputation, not one each ("Formed" is as exact as this)."""


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes


def json_body(value: Any) -> bytes:
    """Compact JSON, ASCII only, with ``<``, ``>`` and ``&`` escaped (they can occur only
    inside strings, where ``\\u003c`` means the same). A non-finite number (JSON has none;
    phi stays finite by design, phi/formulas.py) is written as null."""
    try:
        text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(value), ensure_ascii=True, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")).encode()


def json_body_in_slices(value: Any) -> bytes:
    """``json_body`` in slices of ``JSON_SLICE`` list items: the C encoder holds the GIL
    for a whole call, so one call over 10,000 members would hold the node task ~70 ms
    even from a worker thread. Same bytes as ``json_body``."""
    if isinstance(value, dict):
        return (
            b"{"
            + b",".join(json_body(str(k)) + b":" + json_body_in_slices(v) for k, v in value.items())
            + b"}"
        )
    if isinstance(value, list) and len(value) > JSON_SLICE:
        slices = (
            json_body(value[i : i + JSON_SLICE])[1:-1] for i in range(0, len(value), JSON_SLICE)
        )
        return b"[" + b",".join(slices) + b"]"
    if isinstance(value, list):
        return b"[" + b",".join(json_body_in_slices(v) for v in value) + b"]"
    return json_body(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _error(status: int, message: str) -> Reply:
    return Reply(status, json_body({"error": message}))


@dataclass
class Formations:
    """Per job: its view's last fingerprint, when it changed and how often (bounded by
    ``MAX_JOBS_LISTED``: jobs no longer seen are forgotten)."""

    seen: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """job → (fingerprint, formed wall ms, formations)."""

    def update(self, fingerprints: dict[str, str], wall_ms: int) -> None:
        fresh: dict[str, tuple[str, int, int]] = {}
        for job, fp in fingerprints.items():
            old = self.seen.get(job)
            if old is None:
                fresh[job] = (fp, wall_ms, 1)
            elif old[0] != fp:
                fresh[job] = (fp, wall_ms, old[2] + 1)
            else:
                fresh[job] = old
        self.seen = fresh


def _jobs(
    members: list[Member],
    local: dict[str, dict[str, Any]],
    formations: Formations,
    wall_ms: int,
) -> dict[str, Any]:
    """The ``/v1/jobs`` result (pure; run in a worker thread). One pass over the members
    sorts their job tags by job, so the work is members × tags, not members × jobs."""
    carriers: dict[str, list[tuple[Member, JobTag]]] = {job: [] for job in local}
    for m in sorted(members, key=lambda m: m.name):
        for key, value in member_tags(m).items():
            if key.startswith(TAG_PREFIX):
                tag = JobTag.decode(value)
                if tag is not None:
                    carriers.setdefault(key[len(TAG_PREFIX) :], []).append((m, tag))
    names = sorted(carriers)
    listed = names[:MAX_JOBS_LISTED]
    views = {job: job_members(job, (m for m, _ in carriers[job]), member_tags) for job in listed}
    formations.update({job: fingerprint(view) for job, view in views.items()}, wall_ms)
    jobs = []
    for job in listed:
        view = views[job]
        in_view = {j.name for j in view}
        nodes: list[dict[str, Any]] = [
            {
                "name": j.name,
                "status": j.status,
                "in_view": True,
                "health": "ok",
                "ranks": j.ranks,
                "registered_ms": j.registered_ms,
                "group": j.group,
                "role": j.role,
            }
            for j in view
        ]
        hung: list[str] = []
        for m, tag in carriers[job]:
            if m.name in in_view:
                continue
            if tag.health == HEALTH_HUNG and m.state in VIEW_STATES:
                hung.append(m.name)
            nodes.append(
                {
                    "name": m.name,
                    "status": m.state.name.lower(),
                    "in_view": False,
                    "health": tag.health,
                    "ranks": tag.ranks,
                    "registered_ms": tag.registered_ms,
                    "group": tag.group,
                    "role": tag.role,
                }
            )
        fp, formed_ms, count = formations.seen[job]
        jobs.append(
            {
                "job": job,
                "fingerprint": fp,
                "formations": count,
                "formed_ms": formed_ms,
                "ranks": sum(j.ranks for j in view if j.role == ROLE_TRAINING),
                "training": sum(j.role == ROLE_TRAINING for j in view),
                "spares": sum(j.role == ROLE_SPARE for j in view),
                "nodes": nodes,
                "hung_nodes": hung,
                "local": local.get(job),
            }
        )
    return {"jobs": jobs, "omitted": len(names) - len(listed)}


def _members_body(snap: Snapshot, status: str | None) -> bytes:
    """The ``/v1/members`` body (pure; run in a worker thread)."""
    listed = []
    for m in snap.members:
        if status is not None and m.state.name.lower() != status:
            continue
        row = member_json(m, snap.phi.get(m.name), snap.now_ms)
        row["rtt_ms"] = snap.rtt_ms.get(m.name)
        listed.append(row)
    return json_body_in_slices({"node": snap.name, "members": listed})


def _process() -> dict[str, Any]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss: int | None = None
    try:
        with open("/proc/self/statm", "rb") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass  # not Linux: only the peak is known
    return {
        "pid": os.getpid(),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "wall_s": round(time.monotonic(), 3),
        "rss_bytes": rss,
        "max_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
    }


class StatusEndpoints:
    """The JSON endpoints over one agent, and the two tasks that feed them (``run``)."""

    def __init__(self, agent: AgentAPI, *, wall_ms: Callable[[], int] | None = None) -> None:
        self.agent = agent
        self.events = RecentEvents()
        self.formations = Formations()
        self._wall_ms = wall_ms or (lambda: int(time.time() * 1000))
        self._worker = trio.CapacityLimiter(1)
        """Building a reply over every member: one worker thread at a time."""
        self.routes: dict[bytes, Callable[[dict[str, list[str]]], Any]] = {
            b"/healthz": self.healthz,
            b"/v1/members": self.members,
            b"/v1/events": self.recent_events,
            b"/v1/jobs": self.jobs,
            b"/v1/info": self.info,
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the agent's events into the ring and keep job formations current;
        started once subscribed, so no event after that is missed."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.events.follow, self.agent.subscribe, self._wall_ms)
            nursery.start_soon(self._track_jobs)
            task_status.started()

    async def _track_jobs(self) -> None:
        while True:
            changed = self.agent.changed
            try:
                with trio.fail_after(AGENT_WAIT_S):
                    await self._job_report(encode=False)
            except trio.TooSlowError:
                pass  # the node task is busy: the next change tries again
            await changed.wait()
            await trio.sleep(JOB_TRACK_INTERVAL_S)

    async def answer(self, path: bytes, query: bytes) -> Reply | None:
        """The reply for a GET of ``path``; None when no endpoint has that path."""
        route = self.routes.get(path)
        if route is None:
            return None
        try:
            args = parse_qs(query.decode("latin-1"), max_num_fields=MAX_QUERY_FIELDS)
        except ValueError:
            return _error(400, f"at most {MAX_QUERY_FIELDS} query parameters")
        try:
            with trio.fail_after(AGENT_WAIT_S):
                reply: Reply = await route(args)
                return reply
        except trio.TooSlowError:
            return _error(503, f"the agent did not answer within {AGENT_WAIT_S:g} s")

    # --- endpoints ---------------------------------------------------------------------

    async def healthz(self, args: dict[str, list[str]]) -> Reply:
        try:
            with trio.fail_after(HEALTHZ_TIMEOUT_S):
                await self.agent.ping()
        except trio.TooSlowError:
            message = f"the node task did not answer within {HEALTHZ_TIMEOUT_S:g} s"
            return Reply(503, json_body({"ok": False, "error": message}))
        return Reply(200, json_body({"ok": True, "node": self.agent.name}))

    async def members(self, args: dict[str, list[str]]) -> Reply:
        status = args.get("status", [None])[-1]
        if status is not None and status not in STATUSES:
            return _error(400, f"unknown status {status!r}; one of {', '.join(STATUSES)}")
        snap = await self.agent.snapshot()
        body = await trio.to_thread.run_sync(_members_body, snap, status, limiter=self._worker)
        return Reply(200, body)

    async def recent_events(self, args: dict[str, list[str]]) -> Reply:
        return Reply(200, json_body(self.events.as_json()))

    async def info(self, args: dict[str, list[str]]) -> Reply:
        reply = await answer(self.agent, {"v": 1, "op": "info", "args": {}})
        if not reply.get("ok"):
            return _error(500, str(reply.get("error")))
        result = dict(reply["result"])
        result["process"] = _process()
        result["time_ms"] = self._wall_ms()
        return Reply(200, json_body(result))

    async def jobs(self, args: dict[str, list[str]]) -> Reply:
        return Reply(200, await self._job_report(encode=True))

    async def _job_report(self, *, encode: bool) -> bytes:
        """The jobs report (as the body when ``encode``); updates the formations."""
        members = await self.agent.live_members()
        now_ms = int(trio.current_time() * 1000)  # the registrations' clock (agent/watch.py)
        local = {job: self._local(job, now_ms) for job in self.agent.jobs.local.jobs}

        def work() -> bytes:
            report = _jobs(members, local, self.formations, self._wall_ms())
            return json_body_in_slices(report) if encode else b""

        return await trio.to_thread.run_sync(work, limiter=self._worker)

    def _local(self, job: str, now_ms: int) -> dict[str, Any]:
        node_job = self.agent.jobs.local.jobs[job]
        return {
            "local_world_size": node_job.local_world_size,
            "registered": sorted(node_job.ranks),
            "complete": node_job.complete_since_ms is not None,
            "steps": {str(r): reg.last_step for r, reg in sorted(node_job.ranks.items())},
            "hung_ranks": node_job.hung_ranks(now_ms),
            "paused": node_job.paused_ranks(now_ms),
            "slow": self.agent.jobs.slow.summary(job)["slow"],
            "target": node_job.target_nodes(),
        }
