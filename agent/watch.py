"""The ``view`` and ``watch`` control operations (schema in ``agent.control``; the job rules
in ``agent.jobs``).

``watch`` holds one connection per training process:
- the agent pushes ``{"view": ...}`` whenever the job's view changes (first frame at once);
- with ``register``, the connection *is* the registration: the job tag is set when it opens
  and removed when it closes, so a crashed trainer on a live host leaves the view as soon
  as its socket closes (gossip then carries the change);
- the client sends ``{"heartbeat": {"step": int}}`` per training step and
  ``{"group": str}`` when it enters a process group; the agent scores heartbeats with Phi
  accrual and flags the registration ``hung`` when they stop (the tag's health field).
Bounded: one registration per job per agent, ``MAX_WATCHERS`` connections, frame sizes by
the control framing. A bad frame closes that connection only.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from agent import serf
from agent.control import ControlError, FrameDecoder, encode_frame, ok
from agent.jobs import (
    HEALTH_OK,
    JobError,
    JobTag,
    Registration,
    check_group,
    check_job,
    tag_key,
    view,
)
from swim import Member

if TYPE_CHECKING:
    from agent.runtime import Agent

log = logging.getLogger("swim.agent")
HEALTH_CHECK_S = 0.05
"""How often a registration's phi is compared with its threshold."""
MAX_WATCHERS = 64


@functools.lru_cache(maxsize=4096)
def _tags(meta: bytes) -> dict[str, str]:
    try:
        return serf.decode_tags(meta) if meta else {}
    except ValueError:
        return {}


def _member_tags(m: Member) -> dict[str, str]:
    return _tags(m.meta)


def job_view(agent: Agent, job: object) -> dict[str, Any]:
    return view(check_job(job), agent._node().members(), _member_tags, agent.generations)


async def serve_watch(agent: Agent, stream: trio.SocketStream, args: dict[str, Any]) -> None:
    job = check_job(args.get("job"))
    register = args.get("register")
    if register is not None and not isinstance(register, dict):
        raise ControlError("register must be a map")
    reg = None
    if register is not None:
        if job in agent.local_jobs:
            raise ControlError(f"job {job!r} is already registered on this node")
        if len(agent.local_jobs) >= MAX_WATCHERS:
            raise ControlError(f"at most {MAX_WATCHERS} registrations per agent")
        try:
            reg = Registration.create(job, int(time.time() * 1000), **register)
        except TypeError as exc:
            raise ControlError(f"bad register arguments: {exc}") from None
        agent.local_jobs.add(job)
    try:
        if reg is not None:
            await _set_tag(agent, reg)
        await stream.send_all(encode_frame(ok({"node": agent._node().name, "job": job})))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_push_views, agent, stream, job)
            if reg is not None:
                nursery.start_soon(_watch_health, agent, reg)
            await _read_client(agent, stream, reg)
            nursery.cancel_scope.cancel()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        if reg is not None:
            agent.local_jobs.discard(job)
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await agent.update_tags({}, [tag_key(job)])
            log.info("job %s: registration closed", job)


async def _set_tag(agent: Agent, reg: Registration) -> None:
    await agent.update_tags({tag_key(reg.job): reg.tag.encode()}, [])


async def _push_views(agent: Agent, stream: trio.SocketStream, job: str) -> None:
    last: dict[str, Any] | None = None
    while True:
        changed = agent.changed
        current = job_view(agent, job)
        if current != last:
            await stream.send_all(encode_frame({"view": current}))
            last = current
        await changed.wait()


async def _watch_health(agent: Agent, reg: Registration) -> None:
    while True:
        await trio.sleep(HEALTH_CHECK_S)
        health = reg.health_at(_now_ms())
        if health != reg.tag.health:
            log.warning(
                "job %s: local worker %s (phi %.1f after step %d)",
                reg.job,
                "recovered" if health == HEALTH_OK else "stopped heartbeating: flagged hung",
                reg.phi(_now_ms()),
                reg.last_step,
            )
            reg.tag = JobTag(reg.tag.registered_ms, reg.tag.store_port, health, reg.tag.group)
            await _set_tag(agent, reg)


async def _read_client(agent: Agent, stream: trio.SocketStream, reg: Registration | None) -> None:
    decoder = FrameDecoder()
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        try:
            frames = decoder.feed(data)
        except ControlError as exc:
            log.warning("watch: dropping a client that sent a bad frame: %s", exc)
            return
        for frame in frames:
            if reg is None:
                continue  # an observer has nothing to report
            if "heartbeat" in frame:
                beat = frame["heartbeat"]
                reg.heartbeat(beat.get("step") if isinstance(beat, dict) else None, _now_ms())
            if "group" in frame:
                try:
                    group = check_group(frame["group"])
                except JobError as exc:
                    log.warning("watch: ignoring a bad group: %s", exc)
                    continue
                if group != reg.tag.group:
                    reg.tag = JobTag(
                        reg.tag.registered_ms, reg.tag.store_port, reg.tag.health, group
                    )
                    await _set_tag(agent, reg)


def _now_ms() -> int:
    return int(trio.current_time() * 1000)
