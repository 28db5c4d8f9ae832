"""Local processes on one host: a free port, one poller, one stopper.

Everything that runs real processes (``swimctl demo`` and ``demo --torch``, the process
tests, the network-namespace harness, the benchmarks, scripts/capture_serf_golden.py) waits
and tears down with these, so a wait and a teardown behave the same everywhere:

- ``free_port()``: a port free for UDP and TCP on 127.0.0.1, below the ephemeral range,
  never handed out twice by one process.
- ``until(predicate, timeout_s, what)``: poll every ``poll_s`` until ``predicate()`` is
  true; returns the seconds it took, or raises ``TimeoutError`` naming ``what``. A
  predicate that raises stops the wait (a process that exited is an error, not a "not
  yet"), unless the exception is one of ``ignore``. ``until_async`` is the same poller
  for trio tasks, on trio's clock, so agent tests on a MockClock wait in virtual time.
- ``stop(*targets, sig=SIGTERM, timeout_s=10)``: by pid, never by name. Send ``sig`` (and
  SIGCONT, so a SIGSTOPped process acts on it), wait up to ``timeout_s`` for every target to
  exit, SIGKILL the ones left and wait again (``KILL_WAIT_S``), reaping each: a ``Popen``
  (or another ``Proc``, such as a process forked by bench/forkserver.py) through its own
  ``poll`` (so its ``returncode`` is right), a pid that is our child through ``waitpid``,
  any other pid by polling until it is gone. With ``group=True`` each target
  leads a process group (``process_group=0`` or ``start_new_session=True``) and the whole
  group is signalled. A target that is already gone is fine; one that outlives SIGKILL
  raises ``TimeoutError``.

Rules: no process is found by name (``pkill -f``), only by the pid we started; every wait
is bounded; the wall clock used is ``time.monotonic``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

__all__ = ["KILL_WAIT_S", "POLL_S", "Proc", "free_port", "stop", "until", "until_async"]

POLL_S = 0.05  # how often ``until`` and ``stop`` look again
KILL_WAIT_S = 5.0  # how long a SIGKILLed process may take to be gone

_HANDED_OUT: set[int] = set()


class Proc(Protocol):
    """A started process as the helpers use it: ``subprocess.Popen`` has it all."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


Target = Proc | int


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1, outside the kernel's ephemeral range.

    A port drawn from the ephemeral range can be taken by any outgoing connection between
    this check and the agent's bind (serf's RPC listener lost such a race in a benchmark),
    so draw below it, and never hand the same port out twice in one process.
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, max(low, 10001))
        if port in _HANDED_OUT:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                tcp.bind(("127.0.0.1", port))
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port found")


def until(
    predicate: Callable[[], object],
    timeout_s: float,
    what: str,
    *,
    poll_s: float = POLL_S,
    ignore: tuple[type[Exception], ...] = (),
) -> float:
    """Poll ``predicate`` until it returns something true; the seconds that took.

    It is asked at least once, and once more at the deadline. An exception of a type in
    ``ignore`` counts as "not yet" (the last one is named in the timeout's message); any
    other propagates. Raises ``TimeoutError("<what>: not within <timeout_s> s")``.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except ignore as exc:
            last_error = exc
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(poll_s, left))
    detail = f" (last error: {last_error!r})" if last_error is not None else ""
    raise TimeoutError(f"{what}: not within {timeout_s:g} s{detail}")


async def until_async(
    predicate: Callable[[], object],
    timeout_s: float,
    what: str = "condition",
    *,
    poll_s: float = POLL_S,
    describe: Callable[[], str] | None = None,
) -> float:
    """``until`` for trio tasks, on trio's clock (a test's MockClock or the real one):
    the seconds until ``predicate`` returned something true, else ``TimeoutError`` naming
    ``what`` and, if given, ``describe()`` (the state to debug from, e.g. every view)."""
    import trio  # only async callers pay for it

    start = trio.current_time()
    with trio.move_on_after(timeout_s):
        while not predicate():
            await trio.sleep(poll_s)
        return trio.current_time() - start
    if predicate():  # once more at the deadline, as ``until`` does
        return trio.current_time() - start
    detail = f"; {describe()}" if describe is not None else ""
    raise TimeoutError(f"{what}: not within {timeout_s:g} s{detail}")


def _pid(target: Target) -> int:
    return target if isinstance(target, int) else target.pid


def _signal(target: Target, sig: int, group: bool) -> None:
    """``sig`` to the target (or its group); gone already is fine."""
    if not group and not isinstance(target, int) and target.returncode is not None:
        return  # reaped: its pid may belong to someone else now
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(_pid(target), sig)
        else:
            os.kill(_pid(target), sig)


def _gone(target: Target) -> bool:
    """Whether the target has exited, reaping it if it is our child."""
    if not isinstance(target, int):
        return target.poll() is not None
    try:
        pid, _ = os.waitpid(target, os.WNOHANG)
        return pid != 0
    except ChildProcessError:  # not our child (or reaped already): is the pid still there?
        try:
            state = Path(f"/proc/{target}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state in ("Z", "X")  # a zombie is dead; its parent reaps it


def _wait_all(targets: list[Target], timeout_s: float) -> list[Target]:
    """Wait up to ``timeout_s`` for the targets to exit; those still running."""
    deadline = time.monotonic() + timeout_s
    left = [t for t in targets if not _gone(t)]
    while left and time.monotonic() < deadline:
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        left = [t for t in left if not _gone(t)]
    return left


def stop(
    *targets: Target,
    sig: int = signal.SIGTERM,
    timeout_s: float = 10.0,
    group: bool = False,
) -> None:
    """Stop ``targets`` (``Popen`` objects or pids): ``sig``, wait, SIGKILL, reap.

    See the module docstring. ``sig=SIGKILL`` kills at once and only waits.
    """
    pending = list(targets)
    for target in pending:
        _signal(target, sig, group)
        if sig not in (signal.SIGKILL, signal.SIGCONT):
            _signal(target, signal.SIGCONT, group)  # a stopped process acts on sig now
    left = _wait_all(pending, timeout_s)
    if not left:
        return
    for target in left:
        _signal(target, signal.SIGKILL, group)
    still = _wait_all(left, KILL_WAIT_S)
    if still:
        pids = ", ".join(str(_pid(t)) for t in still)
        raise TimeoutError(f"pid {pids} still running {KILL_WAIT_S:g} s after SIGKILL")
