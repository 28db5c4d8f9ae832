"""The local control API: schema, framing and a blocking client. Pure: no trio, no Node.

``swimctl`` and ``torchhook`` talk to the agent through this module only.

Transport: a Unix stream socket (mode 0660, group ``control_group``). Default path, first
that applies: ``$SWIM_CONTROL``; ``$XDG_RUNTIME_DIR/swim/agent.sock``; ``/run/swim/agent.sock``.

Access (rules in agent/access.py): root, the agent's user and members of the control group
(default ``swim``) may connect. Each operation has a class, its ``access`` in ``OPS``:
*read* ops (``members``, ``info``, ``view``, ``watch`` with or without ``register``,
``probe``, ``monitor``) serve everyone admitted; *admin* ops (``leave``, ``force_leave``,
``join``, ``keys``, ``tags``) serve root, the agent's user and members of ``admin_group``.
An op whose row names no class is admin. A refused request gets an error reply (e.g.
``force_leave needs root, the agent's user (swim) or group 'swimadm'``) and the connection
stays open for the others.

Framing: every message is a 4-byte big-endian length followed by that many bytes of msgpack
(a map). Frames larger than ``MAX_FRAME_BYTES`` are refused by both sides.

Request: ``{"v": 1, "op": <str>, "args": <map>}``. Reply: ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": <str>}``. A streaming op (``monitor``) answers with one ``ok`` frame
and then one ``{"event": ...}`` frame per event until either side closes.

Operations and their results (the ``--json`` output of ``swimctl`` is exactly ``result``,
so this is also the stable JSON schema). A new operation: a row in ``OPS`` (its arguments),
its handler in agent/control_server.py ``HANDLERS``, and its line here:

- ``members`` args ``{status?: str}`` → list of member objects:
  ``{"name", "addr", "port", "status": alive|suspect|dead|left, "incarnation": int,
  "phi": float|null, "tags": {str: str}, "protocol": [pmin, pmax, pcur, dmin, dmax, dcur],
  "since_ms": int}`` (``since_ms``: milliseconds since the member last changed state).
- ``info`` → ``{"node", "addr", "port", "incarnation", "health_score", "members":
  {status: count}, "profile", "encrypted": bool, "tags": {str: str}, "uptime_ms": int,
  "stats": {...}, "version"}``; ``version`` is the agent's own installed version; ``stats``
  holds ``control_refused_connections`` and ``control_refused_requests`` (access refusals).
- ``join`` args ``{addrs: [str]}`` → ``{"joined": int, "errors": [str]}``.
- ``leave`` → ``{"left": bool}``; the agent then exits.
- ``force_leave`` args ``{node: str}`` → ``{"node": str, "status": str}``.
- ``tags`` args ``{set: {str: str}, delete: [str]}`` → ``{"tags": {str: str}}``.
- ``probe`` args ``{nodes: [str]}`` (1 to ``MAX_PROBE_NODES`` member names) →
  ``{"started": [str], "refused": {str: reason}}``: probe these members at once instead of
  at their round-robin turn, because something outside the protocol (a trainer's collective
  lost its connection to them) suggests they failed. Evidence, not a verdict: only the probe
  itself can make them suspect (rules in swim/probe.py). Repeated names count once.
  ``reason``: ``self``; ``unknown``; ``not_alive`` (suspect: its suspicion is running; dead
  or left); ``probing`` (a probe of it is in flight); ``rate_limited`` (probed urgently less
  than one probe interval ago); ``too_many`` (the agent's urgent probes in flight are at
  their bound, 4).
- ``keys`` args ``{action: list|install|use|remove, key?: base64 str}`` →
  ``{"keys": [base64], "primary": base64|null}``.
- ``monitor`` → event frames ``{"event": {"type": joined|updated|suspect|alive|dead|left|
  reaped|log, "node": str, "status": str, "incarnation": int, "at_ms": int,
  "message": str}}``.
- ``view`` args ``{job: str}`` → a job view (rules in ``agent.jobs``): ``{"job": str,
  "generation": int, "fingerprint": str, "members": [{"name", "addr", "port",
  "store_port": int, "registered_ms": int, "group": str, "status": alive|suspect,
  "ranks": int, "role": training|spare}]}``, members (nodes) oldest registration first;
  ``ranks`` is the node's number of local ranks; ``role`` is what the job's trainers made
  the node (``ROLES``): ``training`` (in the training group) or ``spare`` (registered,
  ready, waiting to take a failed node's place). A member without ``role`` (an agent from
  before spares) is ``training``. A role change is not a membership change: the
  fingerprint, the generation and ``registered_ms`` stay; watchers get the new view.
- ``jobs`` → ``{"jobs": [{"job": str, "generation": int, "fingerprint": str, "nodes": int,
  "ranks": int, "training": int, "spares": int, "hung": int, "local_ranks": int}],
  "omitted": int}``: every job a member's tag names (in any state) or a local rank
  registered here, by name; ``nodes``, ``generation`` and ``fingerprint`` are those of the
  job's ``view``; ``training`` and ``spares``: the view's nodes by ``role`` (their sum is
  ``nodes``); ``ranks``: the training nodes' ranks (the world the job trains at); ``hung``:
  alive or suspect nodes flagged hung (out of the view); ``local_ranks``: ranks registered
  on this agent; ``omitted``: jobs beyond ``agent.jobs.MAX_LISTED_JOBS`` (256), not listed.
- ``watch`` args ``{job: str, register?: {store_port?: int, heartbeat_pause_ms?: int,
  heartbeat_threshold?: float, first_heartbeat_estimate_ms?: int, local_rank?: int,
  local_world_size?: int, role?: training|spare}}`` → an ``ok`` frame ``{"node": <this
  agent's name>, "job": str}``, then a ``{"view": <view>}`` frame now and at every
  change. The client may send ``{"heartbeat": {"step": int}}``, ``{"group": str}``,
  ``{"role": training|spare}`` (local rank 0's group and role are the node's, gossiped in
  its job tag, so every agent's view shows them; ``check_role``; a role given at
  ``register`` holds from the node's first view), ``{"target": int}`` (the job's target
  number of training nodes, as its trainers know it: kept by this agent only, shown by
  ``jobs``; ``check_target``) and ``{"lost": [str]}`` (peers its
  collectives lost: the agent probes them at once) frames on the same connection; with
  ``register`` the connection is this local rank's registration (the node joins the view
  once all ``local_world_size`` ranks have registered) and closing it unregisters. A
  registration may also send ``{"pause": {"reason": str, "max_s": float}}`` (this rank
  stops stepping on purpose: not scored as hung for at most ``max_s``, ``check_pause``
  says what is valid), answered by ``{"pause": {"ok": true}}`` or ``{"pause": {"ok":
  false, "error": str}}``, and ``{"resume": true}`` when it steps again. A frame the
  agent refuses changes nothing and is counted (``refused_frames`` in ``jobs``).
- ``jobs`` entries also carry ``"paused": [{"local_rank": int, "reason": str,
  "left_ms": int}]`` (this agent's ranks in a pause) and ``"refused_frames": int`` (watch
  frames this agent refused from the job's ranks registered here now), ``"slow": {node:
  ratio}`` and ``"slow_flags": int`` (the job's nodes flagged slow now, as this agent's
  trainers last reported with a ``{"slow": {"nodes": {node: ratio}}}`` watch frame, and how
  many were newly flagged: agent/slow_jobs.py), and ``"target": int|null`` (the job's
  target number of training nodes, as this agent's local rank 0 last reported it; null
  where no trainer here said).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
HEADER = struct.Struct(">I")
Access = Literal["read", "admin"]


@dataclass(frozen=True, slots=True)
class Op:
    """One operation's arguments: a request naming others, or missing a required one, is
    refused with "bad arguments" before any handler runs. The values are checked by the
    operation's handler (agent/control_server.py ``HANDLERS``)."""

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    streaming: bool = False
    """Answers with one ``ok`` frame, then frames until either side closes."""
    access: Access = "admin"
    """Who may run it: ``read`` (the control group) or ``admin`` (root, the agent's user,
    ``admin_group``). Admin unless a row says otherwise, so a new op is never opened by
    mistake."""


OPS: dict[str, Op] = {
    "members": Op(optional=("status",), access="read"),
    "info": Op(access="read"),
    "join": Op(required=("addrs",), access="admin"),
    "leave": Op(access="admin"),
    "force_leave": Op(required=("node",), access="admin"),
    "tags": Op(optional=("set", "delete"), access="admin"),
    "probe": Op(required=("nodes",), access="read"),
    "keys": Op(optional=("action", "key"), access="admin"),
    "monitor": Op(streaming=True, access="read"),
    "view": Op(required=("job",), access="read"),
    "jobs": Op(access="read"),
    "watch": Op(optional=("job", "register"), streaming=True, access="read"),
}
"""Every control operation, its arguments and its access class (the schema above). A new
operation: a row here (naming its ``access``), its handler in agent/control_server.py
``HANDLERS``, its line in the docstring."""
STREAMING_OPS = tuple(name for name, op in OPS.items() if op.streaming)

MAX_PROBE_NODES = 64
"""Names in one ``probe`` request: a trainer reports the peers its collectives lost, which
is a few; the bound keeps one request's work in the node task small (the agent's urgent
probes in flight are bounded lower still, swim/probe.py ``MAX_URGENT_PROBES``)."""


@dataclass(frozen=True, slots=True)
class JobMember:
    """One member of a job view (the ``view``/``watch`` schema above); the agent builds
    them (agent/jobs.py), torchhook reads them (torchhook/client.py)."""

    name: str
    addr: str
    port: int
    store_port: int
    registered_ms: int
    group: str
    status: str
    ranks: int = 1
    """The node's local world size: its trainer processes in this job (global ranks follow
    join age, then local rank)."""
    role: str = "training"
    """``training`` or ``spare`` (``ROLES``): what the job's trainers made this node."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "addr": self.addr,
            "port": self.port,
            "store_port": self.store_port,
            "registered_ms": self.registered_ms,
            "group": self.group,
            "status": self.status,
            "ranks": self.ranks,
            "role": self.role,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobMember:
        return cls(
            str(d["name"]),
            str(d["addr"]),
            int(d["port"]),
            int(d["store_port"]),
            int(d["registered_ms"]),
            str(d["group"]),
            str(d["status"]),
            int(d.get("ranks", 1)),
            str(d.get("role", ROLE_TRAINING)),
        )


class ControlError(Exception):
    """The agent refused a request, or could not be reached; the message says why."""


ROLE_TRAINING = "training"
ROLE_SPARE = "spare"
ROLES = (ROLE_TRAINING, ROLE_SPARE)
"""A job member's roles: ``training`` (in the training group) or ``spare`` (registered and
ready, waiting to replace a failed node). The trainers decide; the agent carries it."""


MAX_TARGET_NODES = 65_536
"""A job's target number of training nodes: far above any cluster one gossip group holds
(memberlist clusters run to thousands), low enough to print and graph plainly."""


def check_target(target: object) -> int:
    """A valid target number of training nodes (``1..MAX_TARGET_NODES``), else
    ``ControlError`` naming the setting."""
    if isinstance(target, bool) or not isinstance(target, int):
        raise ControlError(f"target must be an int in 1..{MAX_TARGET_NODES}, got {target!r}"[:200])
    if not 1 <= target <= MAX_TARGET_NODES:
        raise ControlError(f"target must be an int in 1..{MAX_TARGET_NODES}, got {target!r}")
    return target


def check_role(role: object) -> str:
    """A valid role (the client checks before sending, the agent again on receipt), else
    ``ControlError`` naming the setting."""
    if not isinstance(role, str) or role not in ROLES:
        raise ControlError(f"role must be one of {', '.join(ROLES)}, got {role!r}"[:200])
    return role


MAX_PAUSE_S = 3600.0
"""Longest declared pause of a training rank: a sync checkpoint or an evaluation pass of a
large model takes minutes; an hour bounds how long a real hang inside a pause can hide."""
MAX_PAUSE_REASON_CHARS = 64
"""A pause's reason is a label for operators (``checkpoint``, ``eval``), not a log line."""


class PauseRefused(ControlError):
    """A pause that cannot be honoured (bad arguments, nested, or refused by the agent)."""


def check_pause(reason: object, max_s: object) -> tuple[str, float]:
    """``(reason, max_s)`` of a valid pause (the client checks before sending, the agent
    again on receipt), else ``PauseRefused`` naming the setting."""
    if (
        not isinstance(reason, str)
        or not 1 <= len(reason) <= MAX_PAUSE_REASON_CHARS
        or not reason.isprintable()
    ):
        raise PauseRefused(
            f"pause reason must be 1 to {MAX_PAUSE_REASON_CHARS} printable characters, "
            f"got {reason!r}"[:200]
        )
    if (
        isinstance(max_s, bool)
        or not isinstance(max_s, int | float)
        or not 0 < max_s <= MAX_PAUSE_S  # also refuses NaN
    ):
        raise PauseRefused(f"pause max_s must be in (0, {MAX_PAUSE_S:g}] seconds, got {max_s!r}")
    return reason, float(max_s)


def default_control_path() -> Path:
    explicit = os.environ.get("SWIM_CONTROL")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "swim" / "agent.sock"
    return Path("/run/swim/agent.sock")


def encode_frame(obj: Mapping[str, Any]) -> bytes:
    # names and tags come off the wire as UTF-8 with surrogateescape (a Go string may hold
    # any bytes); the same handler both ways carries them through losslessly
    body: bytes = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogateescape")
    if len(body) > MAX_FRAME_BYTES:
        raise ControlError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Incremental frame parser: feed bytes, take whole messages."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        frames: list[dict[str, Any]] = []
        while len(self._buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if length > self._max:
                raise ControlError(f"frame of {length} bytes exceeds {self._max}")
            if len(self._buf) < HEADER.size + length:
                break
            body = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            try:
                obj = msgpack.unpackb(
                    body, raw=False, strict_map_key=False, unicode_errors="surrogateescape"
                )
            except (ValueError, msgpack.UnpackException) as exc:
                raise ControlError(f"bad frame: {str(exc) or type(exc).__name__}") from exc
            if not isinstance(obj, dict):
                raise ControlError("a frame must hold a map")
            frames.append(obj)
        return frames


def make_request(op: str, **args: Any) -> dict[str, Any]:
    if op not in OPS:
        raise ControlError(f"unknown operation {op!r}; known: {', '.join(OPS)}")
    return {"v": PROTOCOL_VERSION, "op": op, "args": args}


def parse_request(frame: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Validate a request frame; raises ControlError with a message for the client."""
    if frame.get("v") != PROTOCOL_VERSION:
        raise ControlError(f"unsupported control protocol version {frame.get('v')!r}")
    op = frame.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ControlError(f"unknown operation {op!r}")
    args = frame.get("args", {})
    if not isinstance(args, dict):
        raise ControlError("args must be a map")
    spec = OPS[op]
    unknown = sorted(str(k) for k in args if k not in spec.required + spec.optional)
    missing = [name for name in spec.required if name not in args]
    if unknown or missing:
        problems = [f"unexpected argument {name!r}" for name in unknown]
        problems += [f"missing argument {name!r}" for name in missing]
        raise ControlError(f"bad arguments: {op} {'; '.join(problems)}")
    return op, args


def ok(result: Any) -> dict[str, Any]:
    return {"ok": True, "result": result}


def error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


class ControlClient:
    """Blocking client for scripts, ``swimctl`` and ``torchhook``."""

    def __init__(self, path: Path | str | None = None, timeout_s: float = 10.0) -> None:
        self.path = Path(path) if path is not None else default_control_path()
        self.timeout_s = timeout_s

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise unreachable(self.path, exc, "--control or SWIM_CONTROL") from exc
        return sock

    def request(self, op: str, **args: Any) -> Any:
        """Send one request and return its result, or raise ControlError."""
        with self._connect() as sock:
            send_request(sock, op, **args)
            return _result(_first(_frames(sock)))

    def stream(self, op: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Send a streaming request and yield its events until the agent closes."""
        sock = self._connect()
        sock.settimeout(None)
        try:
            send_request(sock, op, **args)
            frames = _frames(sock)
            _result(_first(frames))
            for frame in frames:
                event = frame.get("event")
                if isinstance(event, dict):
                    yield event
        finally:
            sock.close()


def unreachable(path: Path, exc: OSError, setting: str) -> ControlError:
    """The error for a failed connect: a permission problem says who has access."""
    if isinstance(exc, PermissionError):
        return ControlError(
            f"permission denied on the agent's socket {path}: only root, the agent's user "
            "and members of the socket's group may use it (`ls -l` shows the group; an "
            "operator adds users to it: docs/runbook.md, 'Granting training jobs access')"
        )
    return ControlError(
        f"cannot reach the agent at {path}: {exc.strerror or exc}. Is it running? "
        f"(set {setting} to its socket)"
    )


def send_request(sock: socket.socket, op: str, **args: Any) -> None:
    """Send one request frame. An agent that refused the connection may have closed it
    before the request went out; its reply is still there to read, so that is no error."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(encode_frame(make_request(op, **args)))


def receive(sock: socket.socket) -> bytes:
    """The next bytes from the agent, ``b""`` at the end. An agent that closed the
    connection with our frames unread (a refusal, after its reply) resets it: that is the
    end too, not an error."""
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def _frames(sock: socket.socket) -> Iterator[dict[str, Any]]:
    decoder = FrameDecoder()
    while True:
        try:
            data = receive(sock)
        except TimeoutError as exc:
            raise ControlError("the agent did not answer in time") from exc
        if not data:
            return
        yield from decoder.feed(data)


def _first(frames: Iterator[dict[str, Any]]) -> dict[str, Any]:
    frame = next(frames, None)
    if frame is None:
        raise ControlError("the agent closed the connection without answering")
    return frame


def _result(frame: Mapping[str, Any]) -> Any:
    if frame.get("ok") is True:
        return frame.get("result")
    raise ControlError(str(frame.get("error", "the agent refused the request")))
