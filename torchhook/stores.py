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

_abandoned: list[threading.Thread] = []
"""Store threads a caller stopped waiting for (``abandon``); appended under the GIL."""


def abandon(thread: threading.Thread) -> None:
    """Stop waiting for ``thread`` here; the process waits for it at exit (``EXIT_WAIT_S``)."""
    _abandoned[:] = [t for t in _abandoned if t.is_alive()]
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
    lost). The abandoned thread ends when the peer resumes or dies. The client's timeout for later
    operations is the caller's to set (``set_timeout``)."""
    from torch._C._distributed_c10d import TCPStore

    result: list[Any] = []

    def connect() -> None:
        try:
            _answers(addr, port)  # a refusal ends here, not after STORE_CONNECT
            result.append(TCPStore(addr, port, is_master=False, timeout=STORE_CONNECT))
        except (RuntimeError, OSError) as exc:
            result.append(exc)

    thread = threading.Thread(target=connect, name=f"connect-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + STORE_CONNECT.total_seconds()
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(JOIN_SLICE_S)
        beat()
    if not result:
        abandon(thread)
        raise Retry(f"{what} at {addr}:{port}: no answer within {STORE_CONNECT}", unreachable=True)
    if isinstance(result[0], ConnectionRefusedError):
        raise Refused(f"{what} at {addr}:{port}: {result[0]}")
    if isinstance(result[0], BaseException):
        raise Retry(f"{what} at {addr}:{port}: {result[0]}", unreachable=True)
    store: TCPStore = result[0]
    return store


def _answers(addr: str, port: int) -> None:
    """Open and close one plain TCP connection to ``addr:port``; ``OSError`` if it fails
    (``ConnectionRefusedError``: nothing listens there any more; module docstring)."""
    with socket.create_connection((addr, port), timeout=STORE_CONNECT.total_seconds()):
        pass
