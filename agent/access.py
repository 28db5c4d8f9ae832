"""Who may use the control socket, and which operations (the server side is
agent/control_server.py; each operation's class is its ``access`` in ``agent.control.OPS``).

Rules:
- The socket file belongs to the *control group* (setting ``control_group``, default
  ``swim``) with mode 0660, so the kernel lets only the owner, root and that group's
  members connect. A default ``swim`` that does not exist on the machine (a developer's
  laptop, a test run) falls back to the agent's own primary group, logged once at start;
  a configured group that does not exist is a configuration error (agent/config.py).
- Where the kernel reports the peer's credentials (Linux ``SO_PEERCRED``: pid, uid and
  primary gid as they were at ``connect``), the server checks them again, so a socket
  whose mode was widened, or a descriptor passed along, serves no one else. A connection
  is admitted from root, the agent's own uid, and any user whose primary or supplementary
  groups include the control group.
- The supplementary groups come from ``SO_PEERGROUPS`` (Linux 4.13+: also taken at
  ``connect``); failing that (an older kernel, or more than ``MAX_PEER_GROUPS`` groups),
  from the ``Groups:`` line of ``/proc/PID/status``, used only while that process's
  effective uid still matches (a pid reused by another user's process says nothing about
  the peer). If neither can be read (no /proc, a peer in a pid namespace the agent cannot
  see), only the primary gid counts: a member through a supplementary group is then
  refused, never a stranger admitted.
- Two classes of operations (``agent.control.OPS``): *read* (look and watch: members,
  info, view, watch and registering a job, probe, monitor) for everyone admitted, and
  *admin* (leave, force_leave, join, keys, tags: they change the cluster or this agent)
  for root, the agent's uid and members of the optional ``admin_group``. An admin-group
  member reaches the socket only through the control group too (the file mode), so an
  operator puts admins in both. A refused request gets an error reply naming what it
  needs, is logged with the peer's uid and pid and counted (``info`` stats
  ``control_refused_connections`` / ``control_refused_requests``); the connection stays
  open for the operations the peer may use.

Sources: unix(7) (``SO_PEERCRED``, ``SO_PEERGROUPS``), proc(5) (``/proc/PID/status``),
chown(2) (a non-root owner may give a file only to a group it belongs to).
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import AgentConfigError, group_id
from agent.control import OPS

log = logging.getLogger("swim.agent")

DEFAULT_CONTROL_GROUP = "swim"
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
"""Linux's value (asm-generic/socket.h); CPython does not name it."""
MAX_PEER_GROUPS = 256
"""Supplementary groups read through ``SO_PEERGROUPS``: CPython's ``getsockopt`` takes at
most 1,024 bytes (4 per gid). A peer with more falls back to /proc."""


@dataclass(frozen=True, slots=True)
class Peer:
    """A connected client's credentials: ``groups`` holds its primary gid and every
    supplementary gid the agent could read (see the module docstring)."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


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


def peer_of(sock: Any) -> Peer | None:
    """The peer's credentials with its groups, or None without ``SO_PEERCRED``."""
    creds = peer_credentials(sock)
    if creds is None:
        return None
    pid, uid, gid = creds
    extra = _socket_groups(sock)
    if extra is None:
        extra = proc_groups(pid, uid)
    return Peer(pid, uid, gid, frozenset({gid, *(extra or ())}))


def _socket_groups(sock: Any) -> tuple[int, ...] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_PEER_GROUPS)
    except OSError:  # ENOPROTOOPT before Linux 4.13, ERANGE past MAX_PEER_GROUPS
        return None
    count = len(raw) // 4
    return struct.unpack(f"{count}I", raw[: 4 * count])


def proc_groups(pid: int, uid: int, proc: Path = Path("/proc")) -> tuple[int, ...] | None:
    """Supplementary gids of process ``pid`` from its status file, if its effective uid is
    still ``uid``; None when it cannot be read or belongs to someone else now."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except (OSError, ValueError):
        return None
    fields = dict(line.partition(":")[::2] for line in text.splitlines())
    try:
        effective_uid = int(fields["Uid"].split()[1])
        groups = tuple(int(g) for g in fields["Groups"].split())
    except (KeyError, IndexError, ValueError):
        return None
    return groups if effective_uid == uid else None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(name: str, setting: str) -> tuple[str, int]:
    return name, group_id(name, setting)


class Access:
    """The access rules for one control socket, and the count of what they refused."""

    def __init__(self, control_group: str | None = None, admin_group: str | None = None) -> None:
        """``control_group`` None: ``swim`` if it exists, else the agent's primary group."""
        self.agent_uid = os.geteuid()
        self.agent_user = _user_name(self.agent_uid)
        self.defaulted = control_group is None
        if control_group is None:
            try:
                self.group, self.gid = _group(DEFAULT_CONTROL_GROUP, "control_group")
            except AgentConfigError:
                self.own_group(f"there is no group {DEFAULT_CONTROL_GROUP!r} on this machine")
        else:
            self.group, self.gid = _group(control_group, "control_group")
        self.admin = None if admin_group is None else _group(admin_group, "admin_group")
        self.refused_connections = 0
        self.refused_requests = 0

    def own_group(self, why: str) -> None:
        """Fall back to the agent's primary group (only for the default ``swim``)."""
        self.gid = os.getegid()
        try:
            self.group = grp.getgrgid(self.gid).gr_name
        except KeyError:
            self.group = str(self.gid)
        log.info(
            "control_group: %s; the control socket goes to the agent's own group %r, so "
            "only root, %s and members of %r may use it",
            why,
            self.group,
            self.agent_user,
            self.group,
        )

    def stats(self) -> dict[str, int]:
        return {
            "control_refused_connections": self.refused_connections,
            "control_refused_requests": self.refused_requests,
        }

    def _owner(self, peer: Peer) -> bool:
        return peer.uid in (0, self.agent_uid)

    def connection_refusal(self, peer: Peer | None) -> str | None:
        """Why a connection is refused, or None (also where the kernel cannot tell)."""
        if peer is None or self._owner(peer) or self.gid in peer.groups:
            return None
        if self.admin is not None and self.admin[1] in peer.groups:
            return None
        self.refused_connections += 1
        return (
            f"refused: peer uid {peer.uid} (pid {peer.pid}) is not root, the agent's user "
            f"({self.agent_user}) or a member of group {self.group!r}"
        )

    def request_refusal(self, op: str, peer: Peer | None) -> str | None:
        """Why this peer may not run ``op`` (its class in ``agent.control.OPS``), or None."""
        if OPS[op].access == "read" or peer is None or self._owner(peer):
            return None
        if self.admin is not None and self.admin[1] in peer.groups:
            return None
        self.refused_requests += 1
        group = f" or group {self.admin[0]!r}" if self.admin is not None else ""
        return f"{op} needs root, the agent's user ({self.agent_user}){group}"
