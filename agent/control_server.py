"""The agent side of the control API (schema in ``agent.control``): a Unix socket, mode 0600.

Access: the socket file is mode 0600 (owner only). Where the kernel reports the peer's
credentials (Linux ``SO_PEERCRED``), a connection from any uid other than the agent's own
and root is also refused (an error reply, then closed, logged with the peer's uid and pid),
so a socket whose mode was widened, or one reached through a descriptor passed along,
still serves only its owner. Elsewhere the file mode is the only check.

Rules: a connection carries requests one after another; each is answered in order. Every
request is bounded in size (``MAX_FRAME_BYTES``) and time (a client that sends nothing is
dropped after ``IDLE_TIMEOUT_S``); a bad request gets an error reply and never affects the
agent. Commands that change the node run in the node task via ``Agent.command``.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from agent import serf
from agent.control import (
    MAX_PROBE_NODES,
    STREAMING_OPS,
    ControlError,
    FrameDecoder,
    default_control_path,
    encode_frame,
    error,
    ok,
    parse_request,
)
from agent.watch import MAX_WATCHERS, job_view, serve_watch
from swim import Member, NodeStateType

if TYPE_CHECKING:
    from agent.runtime import Agent

log = logging.getLogger("swim.agent")
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = MAX_WATCHERS
"""Every training process's watch (one per local rank, see agent/watch.py) plus room for
tools: a node with many GPUs must not lock ``swimctl`` out."""
STATUSES = tuple(s.name.lower() for s in NodeStateType)


class ControlServer:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.path = agent.config.control or default_control_path()
        self._limiter = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = _bind_unix(self.path)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
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
            refusal = _refuse_peer(stream.socket)
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
                    if not await self._answer(stream, frame):
                        return

    async def _answer(self, stream: trio.SocketStream, frame: dict[str, Any]) -> bool:
        try:
            op, args = parse_request(frame)
            if op == "watch":
                await serve_watch(self.agent, stream, args)
                return False
            if op in STREAMING_OPS:
                await self._monitor(stream)
                return False
            result = await getattr(self, f"_op_{op}")(**args)
        except TypeError as exc:
            return await _send(stream, error(f"bad arguments: {exc}"))
        except (ControlError, ValueError) as exc:  # JobError is a ValueError
            return await _send(stream, error(str(exc)))
        except Exception as exc:  # a bug in one request must not take the agent down
            log.exception("control request %r failed", frame.get("op"))
            return await _send(stream, error(f"internal error: {exc}"))
        return await _send(stream, ok(result))

    # --- operations -------------------------------------------------------------------

    async def _op_members(self, status: str | None = None) -> list[dict[str, Any]]:
        if status is not None and status not in STATUSES:
            raise ControlError(f"unknown status {status!r}; one of {', '.join(STATUSES)}")
        agent = self.agent
        now = _now()
        phi = agent.phi_values()
        members = [member_json(m, phi.get(m.name), now) for m in agent.all_members()]
        return [m for m in members if status is None or m["status"] == status]

    async def _op_info(self) -> dict[str, Any]:
        agent = self.agent
        node = agent._node()
        counts = {s: 0 for s in STATUSES}
        for m in agent.all_members():
            counts[m.state.name.lower()] += 1
        st = node.stats
        return {
            "node": node.name,
            "addr": node.address.host,
            "port": node.address.port,
            "incarnation": node.incarnation,
            "health_score": node.health_score,
            "members": counts,
            "profile": agent.config.profile,
            "encrypted": node.keyring is not None,
            "tags": dict(agent.tags),
            "uptime_ms": _now() - agent.started_ms,
            "stats": {
                "packets_in": st.packets_in,
                "packets_out": st.packets_out,
                "bytes_in": st.bytes_in,
                "bytes_out": st.bytes_out,
                "probes_sent": st.probes_sent,
                "probes_failed": st.probes_failed,
                "suspicions_raised": st.suspicions_raised,
                "refutations": st.refutations,
                "deaths_declared": st.deaths_declared,
                "urgent_probes": dict(st.urgent_probes),
                "urgent_probes_failed": st.urgent_probes_failed,
                "dropped": dict(st.dropped),
                "broadcast_queue": node.broadcast_queue_depth,
                "stalls": agent.stalls,
                "stall_datagrams": agent.stall_datagrams,
            },
            "version": _version(),
        }

    async def _op_join(self, addrs: list[str]) -> dict[str, Any]:
        if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) for a in addrs):
            raise ControlError("join needs a list of HOST:PORT addresses")
        return await self.agent.join(addrs)

    async def _op_leave(self) -> dict[str, Any]:
        await self.agent.leave_cluster()
        self.agent.request_shutdown()
        return {"left": True}

    async def _op_force_leave(self, node: str) -> dict[str, Any]:
        agent = self.agent
        member = await agent.command(lambda t: agent.force_leave(node, t))
        agent._send_leave_intent(node)
        return {"node": node, "status": member.state.name.lower() if member else "left"}

    async def _op_tags(
        self, set: dict[str, str] | None = None, delete: list[str] | None = None
    ) -> dict[str, Any]:
        for key, value in (set or {}).items():
            if not isinstance(key, str) or not key or not isinstance(value, str):
                raise ControlError(f"tag {key!r}: keys and values must be strings")
        if not isinstance(delete or [], list) or not all(isinstance(k, str) for k in delete or []):
            raise ControlError("delete must be a list of tag names")
        return {"tags": await self.agent.update_tags(set or {}, delete or [])}

    async def _op_probe(self, nodes: list[str]) -> dict[str, Any]:
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise ControlError("probe needs a non-empty list of member names")
        if len(nodes) > MAX_PROBE_NODES:
            raise ControlError(f"probe takes at most {MAX_PROBE_NODES} names, got {len(nodes)}")
        return await self.agent.probe_now(nodes)

    async def _op_view(self, job: str) -> dict[str, Any]:
        return job_view(self.agent, job)

    async def _op_keys(self, action: str = "list", key: str | None = None) -> dict[str, Any]:
        agent = self.agent
        node = agent._node()
        keyring = node.keyring
        if keyring is None:
            raise ControlError("encryption is not enabled on this agent")
        if action != "list":
            if key is None:
                raise ControlError(f"keys {action} needs a key")
            try:
                raw = base64.b64decode(key, validate=True)
            except ValueError:
                raise ControlError("the key is not valid base64") from None
            ops = {"install": node.install_key, "use": node.use_key, "remove": node.remove_key}
            if action not in ops:
                raise ControlError(f"unknown keys action {action!r}")
            await agent.command(lambda t: ops[action](raw))
            agent.persist_keyring()
        return {
            "keys": [base64.b64encode(k).decode() for k in keyring.keys],
            "primary": base64.b64encode(keyring.primary_key).decode(),
        }

    async def _monitor(self, stream: trio.SocketStream) -> None:
        events = self.agent.subscribe()
        if not await _send(stream, ok({"subscribed": True})):
            return
        async with events:
            async for event in events:
                if not await _send(stream, {"event": event}):
                    return


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


async def _send(stream: trio.SocketStream, frame: dict[str, Any]) -> bool:
    try:
        await stream.send_all(encode_frame(frame))
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return False


def _now() -> int:
    return int(trio.current_time() * 1000)


def _version() -> str:
    try:
        from importlib.metadata import version

        from agent import DISTRIBUTION

        return version(DISTRIBUTION)
    except Exception:
        return "unknown"


def peer_credentials(sock: Any) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of a Unix socket's peer, or None where the platform cannot tell."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _refuse_peer(sock: Any) -> str | None:
    """Why a connection is refused: its peer is neither the agent's user nor root."""
    creds = peer_credentials(sock)
    if creds is None:
        return None  # no SO_PEERCRED here: the socket's file mode is the check
    pid, uid, _ = creds
    if uid in (0, os.geteuid()):
        return None
    return f"refused: peer uid {uid} (pid {pid}) is neither the agent's user nor root"


def _bind_unix(path: Path) -> socket.socket:
    """Bind the control socket at ``path`` with mode 0600, replacing a stale one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock
