"""The agent side of the control API (schema in ``agent.control``): a Unix socket, mode 0660.

Access (rules in agent/access.py): the socket file is group-owned by ``control_group``
(default ``swim``) with mode 0660, in a directory that group can traverse (the agent creates
a missing one 0750 with that group; an existing one is left as it is, with a warning when
the group cannot pass it: under systemd it is ``RuntimeDirectory=swim``, mode 0750).
Where the kernel reports the peer's credentials (Linux ``SO_PEERCRED``), a connection from
anyone but root, the agent's uid and members of the control group (primary or
supplementary groups) is refused: an error reply, then closed, logged with the peer's uid
and pid. Each request is then checked against its op's class (``agent.control.OPS``
``access``): an admin op from a peer that is neither root, the agent's uid nor in
``admin_group`` gets an error reply naming what it needs, and the connection goes on.
Both refusals are counted (``info`` stats). Elsewhere the file mode is the only check.

Rules: a connection carries requests one after another; each is answered in order. Every
request is bounded in size (``MAX_FRAME_BYTES``) and time (a client that sends nothing is
dropped after ``IDLE_TIMEOUT_S``); a bad request gets an error reply and never affects the
agent. The server sees the agent only through ``agent.api.AgentAPI``; whatever touches the
Node runs in the node task behind that API.

Where a new control operation goes: its arguments in ``agent.control.OPS``, its handler in
``HANDLERS`` below (``STREAMS`` for one that streams), and, if it needs something new from
the agent, a method on ``AgentAPI``. ``answer`` runs one request without a socket.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from agent import serf
from agent.access import Access, Peer, peer_of
from agent.api import AgentAPI
from agent.config import AgentConfigError
from agent.control import (
    MAX_PROBE_NODES,
    OPS,
    ControlError,
    FrameDecoder,
    default_control_path,
    encode_frame,
    error,
    ok,
    parse_request,
)
from agent.watch import MAX_WATCHERS, job_list, job_view, serve_watch
from swim import Member, NodeStateType

log = logging.getLogger("swim.agent")
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = MAX_WATCHERS
"""Every training process's watch (one per local rank, see agent/watch.py) plus room for
tools: a node with many GPUs must not lock ``swimctl`` out."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before the accept: a client's connect to a Unix socket
whose queue is full fails at once (EAGAIN), so a burst of local connections (a connection
flood, or every rank of a large node starting at once) must not fill it in the few ms
between two accept passes; the kernel caps it at ``net.core.somaxconn``."""
STATUSES = tuple(s.name.lower() for s in NodeStateType)


class ControlServer:
    def __init__(
        self, agent: AgentAPI, path: Path | None = None, access: Access | None = None
    ) -> None:
        self.agent = agent
        self.path = path or default_control_path()
        self.access = access if access is not None else Access()
        self._limiter = trio.CapacityLimiter(MAX_CONNECTIONS)
        _version()
        self._sock: socket.socket | None = None

    def bind(self) -> None:
        """Create the socket (``serve`` does if this was not called): a configured group the
        agent cannot use raises ``AgentConfigError``, a live socket there ``ControlError``."""
        if self._sock is None:
            self._sock = _bind_unix(self.path, self.access)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.bind()
        assert self._sock is not None
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        log.info("control API on %s", self.path)
        try:
            task_status.started()
            await trio.serve_listeners(self._handle, [listener])
        finally:
            try:
                if self.path.is_socket():
                    self.path.unlink()
            except OSError:
                pass

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self._limiter.available_tokens == 0:
            await stream.aclose()
            return
        async with self._limiter, stream:
            try:
                await self._serve_connection(stream)
            except Exception:  # a bug in one connection must not take the agent down
                log.exception("control connection failed")

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        peer = peer_of(stream.socket)
        refusal = self.access.connection_refusal(peer)
        if refusal is not None:
            log.warning("control API: %s", refusal)
            await _send(stream, error(refusal))
            return
        decoder = FrameDecoder()
        while True:
            # only the wait for a request is bounded: a stream (monitor, watch) that
            # the request opens lasts as long as the client wants it
            data = b""
            with trio.move_on_after(IDLE_TIMEOUT_S):
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, OSError):
                    return
            if not data:
                return  # closed, or idle for too long
            try:
                frames = decoder.feed(data)
            except ControlError as exc:
                await _send(stream, error(str(exc)))
                return
            for frame in frames:
                if not await self._answer(stream, frame, peer):
                    return

    async def _answer(
        self, stream: trio.SocketStream, frame: dict[str, Any], peer: Peer | None
    ) -> bool:
        """Answer one request; False when the connection is done (a stream ended)."""
        try:
            op, args = parse_request(frame)
        except ControlError as exc:
            return await _send(stream, error(str(exc)))
        refusal = self.access.request_refusal(op, peer)
        if refusal is not None:
            assert peer is not None  # refusals need credentials
            log.warning("control API: refused %s from uid %d (pid %d)", op, peer.uid, peer.pid)
            return await _send(stream, error(refusal))
        if op in STREAMS:
            try:
                await STREAMS[op](self.agent, stream, args)
            except (ControlError, ValueError) as exc:  # JobError is a ValueError
                await _send(stream, error(str(exc)))
            except Exception as exc:  # a bug in one request must not take the agent down
                log.exception("control request %r failed", op)
                await _send(stream, error(f"internal error: {exc}"))
            return False
        return await _send(stream, await answer(self.agent, frame))


async def answer(agent: AgentAPI, frame: Mapping[str, Any]) -> dict[str, Any]:
    """The reply frame to one (non-streaming) request frame: ``ok`` or ``error``."""
    try:
        op, args = parse_request(frame)
        if op not in HANDLERS:
            raise ControlError(f"{op} streams: it needs a connection")
        result = await HANDLERS[op](agent, **args)
    except TypeError as exc:
        return error(f"bad arguments: {exc}")
    except (ControlError, ValueError) as exc:  # JobError and KeyringError are ValueErrors
        return error(str(exc))
    except Exception as exc:  # a bug in one request must not take the agent down
        log.exception("control request %r failed", frame.get("op"))
        return error(f"internal error: {exc}")
    return ok(result)


# --- operations (agent/control.py has their schema) -----------------------------------


async def _members(agent: AgentAPI, status: str | None = None) -> list[dict[str, Any]]:
    if status is not None and status not in STATUSES:
        raise ControlError(f"unknown status {status!r}; one of {', '.join(STATUSES)}")
    snap = await agent.snapshot()
    members = [member_json(m, snap.phi.get(m.name), snap.now_ms) for m in snap.members]
    return [m for m in members if status is None or m["status"] == status]


async def _info(agent: AgentAPI) -> dict[str, Any]:
    snap = await agent.snapshot()
    counts = {s: 0 for s in STATUSES}
    for m in snap.members:
        counts[m.state.name.lower()] += 1
    return {
        "node": snap.name,
        "addr": snap.address.host,
        "port": snap.address.port,
        "incarnation": snap.incarnation,
        "health_score": snap.health_score,
        "members": counts,
        "profile": snap.profile,
        "encrypted": snap.encrypted,
        "tags": dict(snap.tags),
        "uptime_ms": snap.uptime_ms,
        "stats": dict(snap.stats),
        "version": _version(),
    }


async def _join(agent: AgentAPI, addrs: list[str]) -> dict[str, Any]:
    if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) for a in addrs):
        raise ControlError("join needs a list of HOST:PORT addresses")
    return await agent.join(addrs)


async def _leave(agent: AgentAPI) -> dict[str, Any]:
    await agent.leave()
    return {"left": True}


async def _force_leave(agent: AgentAPI, node: str) -> dict[str, Any]:
    member = await agent.force_leave(node)
    return {"node": node, "status": member.state.name.lower() if member else "left"}


async def _tags(
    agent: AgentAPI, set: dict[str, str] | None = None, delete: list[str] | None = None
) -> dict[str, Any]:
    for key, value in (set or {}).items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise ControlError(f"tag {key!r}: keys and values must be strings")
    if not isinstance(delete or [], list) or not all(isinstance(k, str) for k in delete or []):
        raise ControlError("delete must be a list of tag names")
    return {"tags": await agent.update_tags(set or {}, delete or [])}


async def _probe(agent: AgentAPI, nodes: list[str]) -> dict[str, Any]:
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
        raise ControlError("probe needs a non-empty list of member names")
    if len(nodes) > MAX_PROBE_NODES:
        raise ControlError(f"probe takes at most {MAX_PROBE_NODES} names, got {len(nodes)}")
    return await agent.probe_now(nodes)


async def _view(agent: AgentAPI, job: str) -> dict[str, Any]:
    return await job_view(agent, job)


async def _jobs(agent: AgentAPI) -> dict[str, Any]:
    return await job_list(agent)


async def _keys(agent: AgentAPI, action: str = "list", key: str | None = None) -> dict[str, Any]:
    keys, primary = await agent.change_keys(action, key)
    return {
        "keys": [base64.b64encode(k).decode() for k in keys],
        "primary": base64.b64encode(primary).decode(),
    }


async def _monitor(agent: AgentAPI, stream: trio.abc.Stream, args: dict[str, Any]) -> None:
    events = agent.subscribe()
    if not await _send(stream, ok({"subscribed": True})):
        return
    async with events:
        async for event in events:
            if not await _send(stream, {"event": event}):
                return


Handler = Callable[..., Awaitable[Any]]
HANDLERS: dict[str, Handler] = {
    "members": _members,
    "info": _info,
    "join": _join,
    "leave": _leave,
    "force_leave": _force_leave,
    "tags": _tags,
    "probe": _probe,
    "view": _view,
    "jobs": _jobs,
    "keys": _keys,
}
"""Request/reply operations: ``handler(agent, **args)`` returns the ``result``."""
StreamHandler = Callable[[AgentAPI, trio.abc.Stream, dict[str, Any]], Awaitable[None]]
STREAMS: dict[str, StreamHandler] = {"monitor": _monitor, "watch": serve_watch}
"""Streaming operations: ``handler(agent, stream, args)`` owns the connection until done."""
if HANDLERS.keys() | STREAMS.keys() != OPS.keys() or HANDLERS.keys() & STREAMS.keys():
    raise RuntimeError("every operation in agent.control.OPS needs exactly one handler")


def member_json(m: Member, phi: float | None, now_ms: int) -> dict[str, Any]:
    try:
        # serf reads empty meta as {"role": ""}; for members without tags show none
        tags = serf.decode_tags(m.meta) if m.meta else {}
    except ValueError:
        tags = {"_meta": m.meta.hex()}
    return {
        "name": m.name,
        "addr": m.address.host,
        "port": m.address.port,
        "status": m.state.name.lower(),
        "incarnation": m.incarnation,
        "phi": None if phi is None else round(phi, 3),
        "tags": tags,
        "protocol": list(m.vsn),
        "since_ms": max(now_ms - m.state_change_ms, 0),
    }


async def _send(stream: trio.abc.Stream, frame: dict[str, Any]) -> bool:
    try:
        data = encode_frame(frame)
    except Exception as exc:  # too big, or a value msgpack cannot carry: this reply fails
        log.exception("control reply could not be encoded")
        data = encode_frame(error(f"internal error: the reply could not be encoded: {exc}"[:500]))
    try:
        await stream.send_all(data)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return False


@functools.cache
def _version() -> str:
    """This agent's installed version, read once (``ControlServer`` reads it at start): an
    upgrade installed under a running agent must not make it report the new version."""
    try:
        from importlib.metadata import version

        from agent import DISTRIBUTION

        return version(DISTRIBUTION)
    except Exception:
        return "unknown"


def _bind_unix(path: Path, access: Access) -> socket.socket:
    """Bind the control socket at ``path``, mode 0660 and the control group (see the module
    docstring for its directory), replacing a stale one."""
    made = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ControlError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody is listening
        else:
            raise ControlError(f"another agent is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    try:
        _give_to_group(path, access, made)
    except BaseException:
        sock.close()
        path.unlink()
        raise
    os.chmod(path, 0o660)
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def _give_to_group(path: Path, access: Access, made_dir: bool) -> None:
    """chgrp the socket (and a directory the agent made) to the control group. A non-root
    agent may only give files to its own groups: the default group falls back to the
    agent's, a configured one is a configuration error."""
    try:
        os.chown(path, -1, access.gid)
    except PermissionError:
        if not access.defaulted:
            raise AgentConfigError(
                f"control_group {access.group!r}: the agent's user ({access.agent_user}) may "
                "not give its socket to this group; make it a member, or run it as root"
            ) from None
        access.own_group(f"the agent's user may not give files to group {access.group!r}")
        os.chown(path, -1, access.gid)
    if made_dir:
        os.chown(path.parent, -1, access.gid)
    st = path.parent.stat()
    if not (st.st_mode & 0o001 or (st.st_gid == access.gid and st.st_mode & 0o010)):
        log.warning(
            "control socket directory %s (mode %o) cannot be passed by group %r: its members "
            "cannot reach the socket (give the directory that group and mode 0750)",
            path.parent,
            st.st_mode & 0o777,
            access.group,
        )
