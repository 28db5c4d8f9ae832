"""The stores formation runs on: two small protocols and torch's TCPStore behind them.

``Store`` is the handful of operations ``torchhook.formation`` uses, ``Net`` where stores
come from (serve one here, connect to a peer's), ``Clock`` the time it waits on. torch's
``TCPStore`` satisfies ``Store`` (``TcpNet``); the formation tests use an in-memory one.
torch is imported on first use, so the protocol and its tests need none.

Connecting (``connect_store``) happens on a helper thread: TCPStore's constructor has no
deadline against a peer whose process is stopped (its kernel still accepts the
connection), and a trainer blocked there would stop heartbeating and be flagged hung
itself. After ``STORE_CONNECT`` it gives up (``Retry``) and the caller retries through the
view, which by then has dropped the stopped peer.

A refused connection is final, at once: the thread first opens a plain TCP connection
(closed unused; TCPStore's server takes a client that says nothing and leaves), and
``ECONNREFUSED`` (or any other error of that connect) ends the attempt there, because
TCPStore's own connect retries a refusal until its timeout. A store's port is listening
from before it is published (a directory before its registration, a formation store
before its offer) until its process ends, and Linux answers a SYN with a reset only when
nothing listens (a full backlog drops it silently, ``tcp_abort_on_overflow`` off), so a
refusal says the peer's process is gone. Measured: a spare reading the offer of a leader
that was SIGKILLed spent the whole ``STORE_CONNECT`` (0.5 s) in that retry, past its own
view's early drop of the leader, and was the last rank to reach the next formation.

One connection at a time per address. TCPStore looks up every connection's addresses in
reverse DNS (``getnameinfo`` without ``NI_NUMERICHOST``, to name them in its logs): the
client before it says anything, and the server on its single event-loop thread, once per
connection it accepts, which answers no other client meanwhile. Where a lookup's packet
is lost the resolver waits its timeout (glibc: 5 s, then tries again). Measured on a
2-core host whose resolver dropped 11 of 600 queries: one formation store stopped
answering for 30 s, because every follower gave up after ``STORE_CONNECT``, opened two
more connections (a lookup each) and left the earlier ones queued; six ranks queued
connections faster than the lookups drained them, and no rank of the job trained until
the leader abandoned the formation. So a call that finds a connection to the same
address still in flight (an earlier call gave up on it) waits for that one and takes its
store, instead of opening another; a store that arrives with nobody waiting is kept
``PENDING_KEEP_S`` for the next call.

A thread given up on is ``abandon``ed: it keeps running until its store call returns, and
at interpreter exit the process waits for such threads for at most ``EXIT_WAIT_S``. A
daemon thread still inside TCPStore's C++ code when the interpreter finalizes is torn
down mid-call, and the process aborts (``terminate called without an active exception``)
instead of exiting with its status.
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

STORE_CONNECT = timedelta(seconds=0.5)
"""Connecting to a formation store or a directory: a peer that accepts nothing (power
lost, unreachable) or never answers (stopped) is given up after this, and a gloo error can
start a formation on a view that still lists a dead leader; a short attempt, retried
through the view, costs at most this after the verdict (a refused one costs nothing:
module docstring)."""
JOIN_SLICE_S = 0.005
"""The caller beats at this pace while the helper thread connects."""
EXIT_WAIT_S = 2.0
"""At exit, the longest wait for abandoned store threads, all together: each one's own
call is bounded (``STORE_CONNECT``, a read's timeout), so they end well within this; a
call stuck past it is torn down, as before."""

PENDING_KEEP_S = 5.0
"""A connection that completed after its caller gave up waits this long for the next call
to the same address: the caller retries within a second or two; a store older than this
may belong to a process that has gone since, and is closed instead."""
MAX_PENDING = 64
"""Connections in flight or waiting for a caller, remembered by address: one per peer a
process connects to at once (its leader's directory and formation store, a spare's
candidates); past this many the oldest is forgotten (its thread still ends by itself)."""

_pending: dict[tuple[str, int], _Attempt] = {}
"""Connections by (address, port) that a caller gave up on and no caller has taken since
(``connect_store``): still connecting, or connected and not yet handed on; guarded by
``_pending_lock``."""
_pending_lock = threading.Lock()
_abandoned: list[threading.Thread] = []
"""Store threads a caller stopped waiting for (``abandon``); appended under the GIL."""


def abandon(thread: threading.Thread) -> None:
    """Stop waiting for ``thread`` here; the process waits for it at exit (``EXIT_WAIT_S``)."""
    _abandoned[:] = [t for t in _abandoned if t.is_alive() and t is not thread]
    _abandoned.append(thread)


@atexit.register
def _drain_abandoned() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_abandoned):
        thread.join(max(0.0, deadline - time.monotonic()))


class Retry(Exception):
    """A formation attempt that must start over with the latest view. ``unreachable``: the
    leader could not be reached (dead, or stopped), so trying again before the view
    changes would only spin."""

    def __init__(self, why: str, *, unreachable: bool = False) -> None:
        super().__init__(why)
        self.unreachable = unreachable


class Refused(Retry):
    """The peer's port refused the connection: nothing listens there, its process is gone
    (module docstring). Always ``unreachable``."""

    def __init__(self, why: str) -> None:
        super().__init__(why, unreachable=True)


class Store(Protocol):
    """The store operations formation uses (torch's ``TCPStore`` has them all)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def delete_key(self, key: str) -> bool: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def set_timeout(self, timeout: timedelta) -> None: ...
    @property
    def port(self) -> int: ...


S_co = TypeVar("S_co", bound=Store, covariant=True)


class Net(Protocol[S_co]):
    """Where stores come from: ``serve`` one on this host, ``connect`` to a peer's."""

    def serve(self, host: str, timeout: timedelta) -> S_co: ...
    def connect(self, addr: str, port: int, what: str, beat: Callable[[], None]) -> S_co: ...
    def timed_out(self, exc: BaseException) -> bool:
        """Whether a store error is a wait that ran out (else the store failed)."""
        ...


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class TcpNet:
    """torch's TCPStore (imported on first use: the protocol itself needs no torch)."""

    def serve(self, host: str, timeout: timedelta) -> TCPStore:
        from torch._C._distributed_c10d import TCPStore

        return TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)

    def connect(self, addr: str, port: int, what: str, beat: Callable[[], None]) -> TCPStore:
        return connect_store(addr, port, what, beat=beat)

    def timed_out(self, exc: BaseException) -> bool:
        import torch.distributed as dist

        # a wait or get that ran out: "wait timeout after 50ms" (the connection stays usable)
        return isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower()


def connect_store(
    addr: str, port: int, what: str, *, beat: Callable[[], None] = lambda: None
) -> TCPStore:
    """A TCPStore client, built on a helper thread while this one keeps beating (module docstring):
    gives up with ``Retry(unreachable=True)`` at once on a refused connection (the peer's
    process is gone), after ``STORE_CONNECT`` on a peer that never answers (stopped, power
    lost). The abandoned thread ends when the peer resumes or dies; until it does, a later
    call for the same ``addr:port`` waits for that thread instead of opening another
    connection, and takes its store if it connects (module docstring). The client's timeout
    for later operations is the caller's to set (``set_timeout``)."""
    key = (addr, port)
    with _pending_lock:
        # taken out while this caller waits: a concurrent caller (another thread of this
        # process) makes its own, so threads never share a client
        attempt = _pending.pop(key, None)
    if attempt is None or not attempt.usable(time.monotonic()):
        attempt = _Attempt(addr, port, what)
    deadline = time.monotonic() + STORE_CONNECT.total_seconds()
    while attempt.thread.is_alive() and time.monotonic() < deadline:
        attempt.thread.join(JOIN_SLICE_S)
        beat()
    if not attempt.result:
        with _pending_lock:
            _keep_pending(key, attempt)  # the next call waits for it
        abandon(attempt.thread)
        raise Retry(f"{what} at {addr}:{port}: no answer within {STORE_CONNECT}", unreachable=True)
    got = attempt.result[0]
    if isinstance(got, ConnectionRefusedError):
        raise Refused(f"{what} at {addr}:{port}: {got}")
    if isinstance(got, BaseException):
        raise Retry(f"{what} at {addr}:{port}: {got}", unreachable=True)
    store: TCPStore = got
    return store


class _Attempt:
    """One connection to a store on a thread of its own: its outcome (a ``TCPStore`` or the
    error) once it ends, and when it ended (``time.monotonic``)."""

    def __init__(self, addr: str, port: int, what: str) -> None:
        self.result: list[Any] = []
        self.ended_at: float | None = None
        self.thread = threading.Thread(
            target=self._connect, args=(addr, port), name=f"connect-{what}", daemon=True
        )
        self.thread.start()

    def _connect(self, addr: str, port: int) -> None:
        from torch._C._distributed_c10d import TCPStore

        try:
            _answers(addr, port)  # a refusal ends here, not after STORE_CONNECT
            self.result.append(TCPStore(addr, port, is_master=False, timeout=STORE_CONNECT))
        except (RuntimeError, OSError) as exc:
            self.result.append(exc)
        self.ended_at = time.monotonic()

    def usable(self, now: float) -> bool:
        """Still connecting, or connected at most ``PENDING_KEEP_S`` ago (an older store
        may belong to a process that has gone since; an error is not handed on: the next
        call tries again)."""
        if self.ended_at is None:
            return True
        connected = bool(self.result) and not isinstance(self.result[0], BaseException)
        return connected and now - self.ended_at <= PENDING_KEEP_S


def _keep_pending(key: tuple[str, int], attempt: _Attempt) -> None:
    """Remember ``attempt`` for ``key`` (``_pending_lock`` held), past at most
    ``MAX_PENDING`` others: attempts that ended too long ago go first, then the oldest."""
    now = time.monotonic()
    for old in [k for k, a in _pending.items() if not a.usable(now)]:
        del _pending[old]
    while len(_pending) >= MAX_PENDING:
        del _pending[next(iter(_pending))]
    _pending[key] = attempt


def _answers(addr: str, port: int) -> None:
    """Open and close one plain TCP connection to ``addr:port``; ``OSError`` if it fails
    (``ConnectionRefusedError``: nothing listens there any more; module docstring)."""
    with socket.create_connection((addr, port), timeout=STORE_CONNECT.total_seconds()):
        pass
