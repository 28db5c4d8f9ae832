"""The ``view``, ``jobs`` and ``watch`` control operations (schema in ``agent.control``; the
job rules in ``agent.jobs``).

``watch`` holds one connection per training process (one per local rank):
- the agent pushes ``{"view": ...}`` whenever the job's view changes (first frame at once);
- with ``register``, the connection *is* the local rank's registration: once every local
  rank of the node has registered the job tag is set, and it is removed as soon as any of
  them closes, so a crashed trainer on a live host takes its node out of the view as soon
  as its socket closes (gossip then carries the change);
- the client sends ``{"heartbeat": {"step": int}}`` per training step and
  ``{"group": str}`` when it enters a process group (local rank 0's is gossiped); the agent
  scores heartbeats with Phi accrual per rank and flags the node ``hung`` while any rank's
  stop (the tag's health field); with ``job_stall_drop``, a job whose ranks here all
  heartbeat without a new step (blocked on a collective) leaves a suspect out of this
  agent's job view early (agent/stall_evidence.py; checked every ``HEALTH_CHECK_S``);
- ``{"role": "training"|"spare"}``: what the job's trainers made this node (local rank
  0's is gossiped in the job tag, like the group): every agent's view shows it; the
  fingerprint and ``registered_ms`` stay (a role is not a membership change). A role
  whose tag would not fit the node's metadata is refused, the old role kept.
- ``{"target": int}``: the job's target number of training nodes as the trainers know it
  (``check_target``): kept here for ``jobs``, the status page and metrics, not gossiped.
- ``{"lost": [node, ...]}``: the trainer's collectives lost these peers (a connection
  error). Evidence, not a verdict: the agent probes them at once (``Agent.probe_now``)
  instead of at their round-robin turn, and only the probe cycle can suspect them; with
  ``job_early_drop`` a suspect that a local trainer lost and whose probe was refused
  leaves this agent's job view early (agent/crash_evidence.py).
- ``{"slow": {"nodes": {name: ratio}}}``: the job's nodes flagged slow now, on a change
  (the trainers' verdict, agent/slow_jobs.py): the ``job-slow`` event, metrics, ``jobs``.
- ``{"pause": {"reason", "max_s"}}`` and ``{"resume": true}``: the rank stops stepping on
  purpose and steps again (``Registration.pause``); a pause is answered on the same
  connection (``{"pause": {"ok": ...}}``), so the trainer knows it holds before it stops.
  Replies and views share the stream under one lock (a trio stream takes one sender).
A refused frame (a bad pause, group, role, target or lost report) changes nothing, is
logged and counted (``Registration.refused_frames``); the connection stays.
Bounded: ``MAX_REGISTRATIONS`` registrations and ``MAX_WATCHERS`` connections per agent,
``MAX_LOST_NAMES`` names per report, frame sizes by the control framing. A bad frame
closes that connection only. The job tag is recomputed and set by the agent's
``JobRegistry`` (agent/registrations.py) under one lock, so concurrent ranks cannot
publish a stale tag over a newer one. The watch sees the agent only through
``agent.api.AgentAPI``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import trio

from agent import serf
from agent.api import AgentAPI
from agent.control import ControlError, FrameDecoder, check_target, encode_frame, error, ok
from agent.jobs import (
    HEALTH_OK,
    MAX_REGISTRATIONS,
    JobError,
    Registration,
    check_group,
    check_job,
    check_node_role,
)
from agent.slow_jobs import check_slow
from swim import Member

log = logging.getLogger("swim.agent")
HEALTH_CHECK_S = 0.05
"""How often a registration's phi is compared with its threshold."""
MAX_WATCHERS = MAX_REGISTRATIONS + 64
"""Control connections per agent (the control server's bound): every registration plus
observers and tools (swimctl, the torchrun backend's own watch)."""
MAX_LOST_NAMES = 64
"""Peers named in one ``lost`` report (a trainer's group; the agent bounds its own probes)."""


@functools.lru_cache(maxsize=4096)
def _tags(meta: bytes) -> Mapping[str, str]:
    try:
        return serf.decode_tags(meta) if meta else {}
    except ValueError:
        return {}


def member_tags(m: Member) -> Mapping[str, str]:
    """A member's tags for job views, the status page and the event handlers: none for
    empty Meta (not serf's ``{"role": ""}``) and for Meta that does not decode. Cached by
    the Meta bytes (members keep the same Meta between changes), so the result is shared:
    read it, never change it."""
    return _tags(m.meta)


async def job_view(agent: AgentAPI, job: object) -> dict[str, Any]:
    name = check_job(job)
    return agent.jobs.view(name, await agent.live_members(), member_tags)


async def job_list(agent: AgentAPI) -> dict[str, Any]:
    """The ``jobs`` result: every job this agent knows, one summary each."""
    return agent.jobs.summaries(await agent.live_members(), member_tags)


async def serve_watch(agent: AgentAPI, stream: trio.abc.Stream, args: dict[str, Any]) -> None:
    job = check_job(args.get("job"))
    register = args.get("register")
    if register is not None and not isinstance(register, dict):
        raise ControlError("register must be a map")
    reg = None
    sending = trio.Lock()
    if register is not None:
        try:
            reg = Registration.create(job, **register)
        except TypeError as exc:
            raise ControlError(f"bad register arguments: {exc}") from None
        agent.jobs.add(reg, int(time.time() * 1000))  # JobError: refused, nothing kept
    try:
        if reg is not None:
            await agent.jobs.sync_tag(job)
        await stream.send_all(encode_frame(ok({"node": agent.name, "job": job})))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_push_views, agent, stream, job, sending)
            if reg is not None:
                nursery.start_soon(_watch_health, agent, reg)
            await _read_client(agent, stream, reg, sending)
            nursery.cancel_scope.cancel()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        if reg is not None:
            agent.jobs.remove(reg)
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await agent.jobs.sync_tag(job)
            log.info("job %s: local rank %d unregistered", job, reg.local_rank)


async def _push_views(
    agent: AgentAPI, stream: trio.abc.Stream, job: str, sending: trio.Lock
) -> None:
    last: dict[str, Any] | None = None
    while True:
        changed = agent.changed
        current = await job_view(agent, job)
        if current != last:
            async with sending:
                await stream.send_all(encode_frame({"view": current}))
            last = current
        await changed.wait()


async def _watch_health(agent: AgentAPI, reg: Registration) -> None:
    health = HEALTH_OK
    overruns = reg.overruns
    while True:
        await trio.sleep(HEALTH_CHECK_S)
        now = _now_ms()
        seen = reg.health_at(now)
        agent.jobs.check_stall(reg.job)
        if reg.overruns != overruns:
            overruns = reg.overruns
            log.warning(
                "job %s: local rank %d overran its pause: scored for hangs again",
                reg.job,
                reg.local_rank,
            )
        if seen != health:
            health = seen
            log.warning(
                "job %s: local rank %d %s (phi %.1f after step %d)",
                reg.job,
                reg.local_rank,
                "recovered" if health == HEALTH_OK else "stopped heartbeating: node flagged hung",
                reg.phi(now),
                reg.last_step,
            )
            await agent.jobs.sync_tag(reg.job)


async def _read_client(
    agent: AgentAPI, stream: trio.abc.Stream, reg: Registration | None, sending: trio.Lock
) -> None:
    decoder = FrameDecoder()
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        try:
            frames = decoder.feed(bytes(data))
        except ControlError as exc:
            log.warning("watch: dropping a client that sent a bad frame: %s", exc)
            return
        for frame in frames:
            if reg is None:
                if "pause" in frame:  # an observer has nothing to pause
                    await _reply(stream, sending, error("only a registration can pause"))
                continue  # nor anything to report
            if "heartbeat" in frame:
                beat = frame["heartbeat"]
                reg.heartbeat(beat.get("step") if isinstance(beat, dict) else None, _now_ms())
            if "pause" in frame:
                await _pause(stream, sending, reg, frame["pause"])
            if "resume" in frame:
                ended = reg.resume(_now_ms())
                if ended is not None:
                    log.info("job %s: local rank %d resumed", reg.job, reg.local_rank)
            if "group" in frame:
                try:
                    reg.group = check_group(frame["group"])
                except JobError as exc:
                    _refuse(reg, "group", exc)
                    continue
                if reg.local_rank == 0:
                    await agent.jobs.sync_tag(reg.job)
            if "role" in frame:
                await _set_role(agent, reg, frame["role"])
            if "target" in frame:
                _set_target(reg, frame["target"])
            if "lost" in frame:
                await _report_lost(agent, reg, frame["lost"])
            if "slow" in frame:
                _report_slow(agent, reg, frame["slow"])


async def _pause(
    stream: trio.abc.Stream, sending: trio.Lock, reg: Registration, args: object
) -> None:
    try:
        if not isinstance(args, dict):
            raise JobError("pause must be a map {reason, max_s}")
        pause = reg.pause(args.get("reason"), args.get("max_s"), _now_ms())
    except JobError as exc:
        reg.refused_frames += 1
        log.warning("job %s: local rank %d: refused a pause: %s", reg.job, reg.local_rank, exc)
        await _reply(stream, sending, error(str(exc)))
        return
    log.info(
        "job %s: local rank %d paused (%s) for at most %.1f s",
        reg.job,
        reg.local_rank,
        pause.reason,
        (pause.until_ms - pause.since_ms) / 1000,
    )
    await _reply(stream, sending, {"ok": True})


async def _reply(stream: trio.abc.Stream, sending: trio.Lock, reply: dict[str, Any]) -> None:
    async with sending:
        await stream.send_all(encode_frame({"pause": reply}))


def _refuse(reg: Registration, what: str, exc: Exception) -> None:
    """A frame refused: nothing changed; counted (``refused_frames``) and logged."""
    reg.refused_frames += 1
    log.warning("watch: ignoring a bad %s: %s", what, exc)


async def _set_role(agent: AgentAPI, reg: Registration, role: object) -> None:
    """Validate, then mutate: a bad role, or one whose tag the agent cannot publish (the
    node's metadata is full), is refused and counted; the rank keeps its old role."""
    try:
        checked = check_node_role(role)
    except JobError as exc:
        _refuse(reg, "role", exc)
        return
    before, reg.role = reg.role, checked
    if reg.local_rank != 0 or before == checked:
        return  # only local rank 0's role is the node's
    try:
        await agent.jobs.sync_tag(reg.job)
    except ValueError as exc:  # the tag would not fit the node's metadata
        reg.role = before
        reg.refused_frames += 1
        log.warning("job %s: refused role %s: %s", reg.job, checked, exc)
        return
    log.info("job %s: this node's role is now %s", reg.job, checked)


def _set_target(reg: Registration, target: object) -> None:
    try:
        reg.target_nodes = check_target(target)
    except ControlError as exc:
        _refuse(reg, "target", exc)


async def _report_lost(agent: AgentAPI, reg: Registration, names: object) -> None:
    if (
        not isinstance(names, list)
        or len(names) > MAX_LOST_NAMES
        or not all(isinstance(n, str) for n in names)
    ):
        log.warning(
            "watch: ignoring a bad lost report (a list of at most %d names)", MAX_LOST_NAMES
        )
        reg.refused_frames += 1
        return
    agent.jobs.report_lost(reg.job, names)  # before the probe, which may fail at once
    result = await agent.probe_now(names)
    log.info("job %s: local rank %d lost %s: probing %s", reg.job, reg.local_rank, names, result)


def _report_slow(agent: AgentAPI, reg: Registration, report: object) -> None:
    try:
        nodes = check_slow(report)
    except JobError as exc:
        _refuse(reg, "slow report", exc)
        return
    change = agent.jobs.report_slow(reg.job, nodes)
    if change is not None:
        for name in change.newly:
            log.warning("job %s: node %s flagged slow (%.2fx)", reg.job, name, nodes[name])
        for name in change.cleared:
            log.info("job %s: node %s no longer flagged slow", reg.job, name)


def _now_ms() -> int:
    return int(trio.current_time() * 1000)
