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
- ``report_lost(names)`` tells the agent that this process's collectives lost these peers
  (evidence: the agent probes them at once, only its detector decides).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.control import (
    ControlError,
    FrameDecoder,
    JobMember,
    default_control_path,
    encode_frame,
    receive,
    send_request,
    unreachable,
)

__all__ = [
    "JobMember",
    "Listener",
    "Membership",
    "MembershipClosed",
    "View",
    "fetch_view",
    "local_place",
]
Listener = Callable[["View"], None]


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
        self._view: View | None = None
        self._closed: str | None = None
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
        reason = "closed"
        try:
            while True:
                self._accept(self._next_frame())
        except (OSError, ControlError, ValueError, KeyError) as exc:
            reason = str(exc) or type(exc).__name__
        with self._cond:
            if self._closed is None:
                self._closed = reason
            self._cond.notify_all()

    # --- public API -------------------------------------------------------------------

    @property
    def view(self) -> View:
        with self._cond:
            assert self._view is not None  # the constructor waited for the first one
            return self._view

    @property
    def closed(self) -> str | None:
        """Why the watch ended, or None while it is live."""
        with self._cond:
            return self._closed

    def add_listener(self, listener: Listener) -> None:
        with self._cond:
            self._listeners.append(listener)

    def wait(self, predicate: Callable[[View], bool], timeout_s: float) -> View:
        """Block until the latest view satisfies ``predicate``; TimeoutError otherwise."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._closed is not None or (self._view is not None and predicate(self._view))
                ),
                timeout_s,
            )
            if self._closed is not None:
                raise MembershipClosed(f"watch of {self.job!r} ended: {self._closed}")
            if not ok or self._view is None:
                raise TimeoutError(f"no view of {self.job!r} matched within {timeout_s} s")
            return self._view

    def heartbeat(self, step: int) -> None:
        self._send({"heartbeat": {"step": step}})

    def set_group(self, group: str) -> None:
        self._send({"group": group})

    def report_lost(self, names: list[str]) -> None:
        """This process's collectives lost these peers: ask the agent to probe them now."""
        self._send({"lost": list(names)})

    def _send(self, frame: Mapping[str, Any]) -> None:
        data = encode_frame(frame)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise MembershipClosed(f"watch of {self.job!r}: {exc}") from None

    def close(self) -> None:
        """Unregister (the agent removes the job tag when the socket closes)."""
        with self._cond:
            if self._closed is None:
                self._closed = "closed by the client"
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
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
