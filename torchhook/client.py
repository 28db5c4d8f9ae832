"""The training side of a job's membership: numbered views pushed by the local agent.

No torch and no trio here: a blocking Unix-socket client (``agent.control`` framing) and
one reader thread per ``Membership``. Rules (the agent side is ``agent/watch.py``):

- one ``watch`` connection per process; with ``register=True`` that connection *is* this
  local rank's registration for the job (closing it, or the process dying, unregisters);
  a node with ``local_world_size`` ranks (torchrun's ``LOCAL_WORLD_SIZE``, one process per
  GPU) joins views once all of its local ranks have registered, and leaves them when any
  of them unregisters or hangs (agent/jobs.py says why the whole node);
- every ``View`` is complete: its members (nodes), oldest registration first, the same
  order on every node that sees the same member set, and a ``fingerprint`` of that set;
  ``generation`` numbers the views this process saw (local, monotonic); global ranks
  follow the member order, then the local rank (``View.ranks_of``);
- listeners run on the reader thread and must not block (they set flags, fail futures);
- ``heartbeat(step)`` once per training step lets the agent flag a hung worker;
- ``report_slow(nodes)`` tells the agent which nodes of the job are flagged slow now;
- ``set_role(role)`` tells the agent whether this node trains or waits as a spare
  (``"training"``/``"spare"``, on a change; an agent that does not know the frame refuses
  it, which changes nothing); ``set_target(nodes)`` tells it the job's target size;
- ``report_lost(names)`` tells the agent that this process's collectives lost these peers
  (evidence: the agent probes them at once, only its detector decides);
- ``paused(reason, max_s)`` (a context manager) tells the agent that this rank stops
  stepping on purpose (a sync checkpoint, an evaluation pass): its hang detector spares the
  rank for at most ``max_s`` seconds (``agent.control.MAX_PAUSE_S``) and scores it afresh
  afterwards; the agent confirms the pause before the body runs (``PAUSE_REPLY_S``).

The reader thread never dies silently. Whatever ends it other than ``close()`` (the agent
closing the connection or dying, a frame that does not decode, a listener that raises) is
recorded once as a ``MembershipLost`` carrying the cause; from then on ``view``, ``wait``,
``heartbeat`` and the other sends raise it, each listener's ``on_closed`` is called with
it (so ``verdicts.GroupWatch`` fails the collectives in flight instead of leaving them to
the group timeout), and the connection is closed, which unregisters this rank: a trainer
that can no longer see verdicts must not stay in other ranks' views.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.control import (
    ControlError,
    FrameDecoder,
    JobMember,
    PauseRefused,
    check_pause,
    default_control_path,
    encode_frame,
    receive,
    send_request,
    unreachable,
)

__all__ = [
    "ClosedListener",
    "JobMember",
    "Listener",
    "Membership",
    "MembershipClosed",
    "MembershipLost",
    "PauseRefused",
    "View",
    "fetch_view",
    "local_place",
]
Listener = Callable[["View"], None]
ClosedListener = Callable[["MembershipLost"], None]
log = logging.getLogger("torchhook.client")

ROLES = ("training", "spare")
"""A node's role in a job (``torchhook.roster``): it trains, or waits as a spare."""
PAUSE_REPLY_S = 10.0
"""How long ``paused`` waits for the agent to confirm a pause before the body runs: the
agent answers from its event loop within milliseconds; beyond this it is stuck, and a
pause it never recorded would let the body look like a hang."""


@dataclass(frozen=True, slots=True)
class View:
    job: str
    generation: int
    fingerprint: str
    members: tuple[JobMember, ...]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> View:
        members = tuple(JobMember.from_dict(m) for m in d["members"])
        return cls(str(d["job"]), int(d["generation"]), str(d["fingerprint"]), members)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def member(self, name: str) -> JobMember | None:
        return next((m for m in self.members if m.name == name), None)

    @property
    def world_size(self) -> int:
        """Every local rank of every member."""
        return sum(m.ranks for m in self.members)

    def ranks_of(self, name: str) -> range:
        """``name``'s global ranks in this view: after every older member's ranks."""
        first = 0
        for m in self.members:
            if m.name == name:
                return range(first, first + m.ranks)
            first += m.ranks
        raise KeyError(f"{name!r} is not in view {self.generation} of {self.job!r}")


class MembershipClosed(ControlError):
    """The connection to the agent is gone: no more views will arrive."""


class MembershipLost(MembershipClosed):
    """The watch failed without ``close()``: the agent closed the connection or died, a
    frame did not decode, or a listener raised. ``cause`` is that exception."""

    def __init__(self, job: str, cause: BaseException) -> None:
        self.job = job
        self.cause = cause
        reason = str(cause) or type(cause).__name__
        super().__init__(f"the watch of job {job!r} failed: {reason}")


def fetch_view(job: str, control: Path | str | None = None, timeout_s: float = 10.0) -> View:
    """One view, without registering (for tools and tests)."""
    from agent.control import ControlClient

    return View.from_dict(ControlClient(control, timeout_s).request("view", job=job))


class Membership:
    """Watches ``job`` through the local agent; optionally registers this process in it."""

    def __init__(
        self,
        job: str,
        *,
        control: Path | str | None = None,
        register: bool = True,
        store_port: int = 0,
        heartbeat_pause_ms: int = 30_000,
        heartbeat_threshold: float = 8.0,
        first_heartbeat_estimate_ms: int = 1000,
        connect_timeout_s: float = 10.0,
        local_rank: int | None = None,
        local_world_size: int | None = None,
    ) -> None:
        """``local_rank``/``local_world_size`` default to torchrun's ``LOCAL_RANK`` and
        ``LOCAL_WORLD_SIZE``, else 0 and 1 (one process per node)."""
        self.job = job
        self.local_rank, self.local_world_size = local_place(local_rank, local_world_size)
        self.path = Path(control) if control is not None else default_control_path()
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._closed_listeners: list[ClosedListener] = []
        self._view: View | None = None
        self._closed: str | None = None
        self._lost: MembershipLost | None = None
        self._pausing = False
        self._pause_reply: dict[str, Any] | None = None
        args: dict[str, Any] = {"job": job}
        if register:
            args["register"] = {
                "store_port": store_port,
                "heartbeat_pause_ms": heartbeat_pause_ms,
                "heartbeat_threshold": heartbeat_threshold,
                "first_heartbeat_estimate_ms": first_heartbeat_estimate_ms,
                "local_rank": self.local_rank,
                "local_world_size": self.local_world_size,
            }
        self._sock = _connect(self.path, connect_timeout_s)
        self._decoder = FrameDecoder()
        self._pending: list[dict[str, Any]] = []
        try:
            send_request(self._sock, "watch", **args)
            first = self._next_frame()
            if first.get("ok") is not True:
                raise ControlError(str(first.get("error", "the agent refused the watch")))
            self.node: str = str(first["result"]["node"])
            self._accept(self._next_frame())
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._read, name=f"swim-watch-{job}", daemon=True)
        self._thread.start()

    # --- reading ----------------------------------------------------------------------

    def _next_frame(self) -> dict[str, Any]:
        while not self._pending:
            data = receive(self._sock)
            if not data:
                raise MembershipClosed(f"the agent at {self.path} closed the watch")
            self._pending = self._decoder.feed(data)
        return self._pending.pop(0)

    def _accept(self, frame: Mapping[str, Any]) -> None:
        reply = frame.get("pause")
        if isinstance(reply, dict):
            with self._cond:
                self._pause_reply = reply
                self._cond.notify_all()
        raw = frame.get("view")
        if not isinstance(raw, dict):
            return
        fresh = View.from_dict(raw)
        with self._cond:
            self._view = fresh
            listeners = list(self._listeners)
            self._cond.notify_all()
        for listener in listeners:
            listener(fresh)

    def _read(self) -> None:
        try:
            while True:
                self._accept(self._next_frame())
        # the reader must not end silently: whatever stops it (a lost connection, a bad
        # frame, a listener's bug) is recorded and surfaced; nothing is retried
        except Exception as exc:
            self._fail(exc)

    def _fail(self, cause: BaseException) -> None:
        """Record the first failure, close the connection, tell the listeners, wake the
        waiters. After ``close()`` the end of the connection is expected: nothing is
        recorded. ``_lost`` is set first (sends and ``view`` raise from here), ``_closed``
        last: a trainer woken in ``wait`` finds the listeners told (a GroupWatch has failed
        the collectives in flight)."""
        with self._cond:
            if self._closed is not None or self._lost is not None:
                return
            lost = self._lost = MembershipLost(self.job, cause)
            closed_listeners = list(self._closed_listeners)
        log.error("%s", lost)
        self._shut()
        for listener in closed_listeners:
            self._tell(listener, lost)
        with self._cond:
            if self._closed is None:
                self._closed = str(lost)
            self._cond.notify_all()

    @staticmethod
    def _tell(listener: ClosedListener, lost: MembershipLost) -> None:
        try:
            listener(lost)
        except Exception:  # one listener's bug must not hide the others
            log.exception("a listener failed on the end of the watch")

    # --- public API -------------------------------------------------------------------

    @property
    def view(self) -> View:
        """The latest view; ``MembershipLost`` once the watch failed."""
        with self._cond:
            if self._lost is not None:
                raise self._lost
            assert self._view is not None  # the constructor waited for the first one
            return self._view

    @property
    def closed(self) -> str | None:
        """Why the watch ended, or None while it is live."""
        with self._cond:
            return self._closed

    @property
    def lost(self) -> MembershipLost | None:
        """The failure that ended the watch, or None (live, or ended by ``close()``)."""
        with self._cond:
            return self._lost

    def add_listener(self, listener: Listener, on_closed: ClosedListener | None = None) -> None:
        """``listener(view)`` on every view, on the reader thread (it must not block; one
        that raises ends the watch). ``on_closed(error)`` once if the watch fails (at once
        if it already has)."""
        with self._cond:
            self._listeners.append(listener)
            lost = self._lost
            if on_closed is not None and lost is None:
                self._closed_listeners.append(on_closed)
        if on_closed is not None and lost is not None:
            self._tell(on_closed, lost)

    def wait(self, predicate: Callable[[View], bool], timeout_s: float) -> View:
        """Block until the latest view satisfies ``predicate``; TimeoutError otherwise,
        ``MembershipLost`` if the watch fails, ``MembershipClosed`` after ``close()``."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._closed is not None or (self._view is not None and predicate(self._view))
                ),
                timeout_s,
            )
            if self._lost is not None:
                raise self._lost
            if self._closed is not None:
                raise MembershipClosed(f"watch of {self.job!r} ended: {self._closed}")
            if not ok or self._view is None:
                raise TimeoutError(f"no view of {self.job!r} matched within {timeout_s} s")
            return self._view

    def heartbeat(self, step: int) -> None:
        self._send({"heartbeat": {"step": step}})

    def set_group(self, group: str) -> None:
        self._send({"group": group})

    def set_role(self, role: str) -> None:
        """This node's role in the job now: ``"training"`` or ``"spare"`` (local rank 0
        sends it when the role changes; the agent shows it in the job's view)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self._send({"role": role})

    def set_target(self, nodes: int) -> None:
        """The job's target size in nodes (``Settings.target_nodes``), for the agent's
        ``jobs`` listing; local rank 0 sends it once."""
        self._send({"target": int(nodes)})

    def report_lost(self, names: list[str]) -> None:
        """This process's collectives lost these peers: ask the agent to probe them now."""
        self._send({"lost": list(names)})

    def report_slow(self, nodes: Mapping[str, float]) -> None:
        """The job's nodes flagged slow now (name -> step time over the job's median; empty:
        none), on a change (``torchhook.slowness``): the agent's metric, ``job-slow`` event
        and status page. Each node's local rank 0 sends it; every node reaches the same
        verdict."""
        self._send({"slow": {"nodes": {str(n): float(r) for n, r in nodes.items()}}})

    @contextlib.contextmanager
    def paused(self, reason: str, max_s: float) -> Iterator[None]:
        """This rank stops stepping on purpose for at most ``max_s`` seconds (a sync
        checkpoint, an evaluation pass): the agent does not flag it hung meanwhile, and
        scores its heartbeats afresh once the block ends or ``max_s`` passes (a block that
        overruns is caught as a hang then). ``reason`` (at most
        ``agent.control.MAX_PAUSE_REASON_CHARS`` printable characters) is shown to
        operators. ``PauseRefused`` for bad arguments, a nested pause or the agent's
        refusal; ``MembershipClosed``/``MembershipLost`` when the agent is gone."""
        reason, max_s = check_pause(reason, max_s)
        with self._cond:
            if self._pausing:
                raise PauseRefused(f"job {self.job!r}: this rank is paused already")
            self._pausing = True
            self._pause_reply = None
        try:
            self._send({"pause": {"reason": reason, "max_s": max_s}})
            self._await_pause_reply()
            body_failed = True
            try:
                yield
                body_failed = False
            finally:
                try:
                    self._send({"resume": True})
                except MembershipClosed:
                    if not body_failed:
                        raise  # the body's own exception matters more than the link
        finally:
            with self._cond:
                self._pausing = False

    def _await_pause_reply(self) -> None:
        with self._cond:
            self._cond.wait_for(
                lambda: self._pause_reply is not None or self._closed is not None, PAUSE_REPLY_S
            )
            if self._lost is not None:
                raise self._lost
            if self._closed is not None:
                raise MembershipClosed(f"watch of {self.job!r} ended: {self._closed}")
            reply = self._pause_reply
        if reply is None:
            # it may still record the pause late: take it back rather than leave a rank
            # unscored that believes it is not paused
            with contextlib.suppress(MembershipClosed):
                self._send({"resume": True})
            raise PauseRefused(f"the agent did not confirm the pause within {PAUSE_REPLY_S} s")
        if reply.get("ok") is not True:
            raise PauseRefused(str(reply.get("error", "the agent refused the pause")))

    def _send(self, frame: Mapping[str, Any]) -> None:
        data = encode_frame(frame)
        with self._cond:
            if self._lost is not None:
                raise self._lost
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                with self._cond:
                    lost = self._lost
                if lost is not None:
                    raise lost from None
                raise MembershipClosed(f"watch of {self.job!r}: {exc}") from None

    def close(self) -> None:
        """Unregister (the agent removes the job tag when the socket closes)."""
        with self._cond:
            if self._closed is None:
                self._closed = "closed by the client"
            self._cond.notify_all()
        self._shut()

    def _shut(self) -> None:
        """Shut down first (wakes a blocked send or receive, the agent sees the end), then
        close under the send lock, so a concurrent send never writes to a reused fd."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._send_lock:
            self._sock.close()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connect(path: Path, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise unreachable(path, exc, "control= or SWIM_CONTROL") from exc
    return sock


def local_place(local_rank: int | None, local_world_size: int | None) -> tuple[int, int]:
    """(local rank, local world size): as given, else torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``, else 0 and 1 (one process per node)."""
    return (
        _env_int("LOCAL_RANK", 0) if local_rank is None else local_rank,
        _env_int("LOCAL_WORLD_SIZE", 1) if local_world_size is None else local_world_size,
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ControlError(f"{name} must be an integer, got {value!r}") from None
