"""agent/procs.py against real child processes: the stopper's SIGTERM → SIGKILL → reap
path, by Popen, by pid and by process group, and the poller's result and timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import trio
import trio.testing

from agent.procs import free_port, stop, until, until_async

IGNORES_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _child(code: str, group: bool = False) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, process_group=0 if group else None
    )
    assert proc.stdout is not None
    if "ready" in code:
        assert proc.stdout.readline() == b"ready\n"  # its handler is in place
    return proc


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_child_that_ignores_sigterm_is_sigkilled_and_reaped() -> None:
    proc = _child(IGNORES_TERM)
    started = time.monotonic()
    stop(proc, timeout_s=0.3)
    assert proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 3
    assert not _exists(proc.pid)


def test_a_child_that_obeys_sigterm_exits_on_it() -> None:
    proc = _child("import time; time.sleep(60)")
    stop(proc, timeout_s=10)
    assert proc.returncode == -signal.SIGTERM


def test_a_stopped_child_acts_on_sigterm() -> None:
    proc = _child("import time; time.sleep(60)")
    os.kill(proc.pid, signal.SIGSTOP)
    stop(proc, timeout_s=10)
    assert proc.returncode == -signal.SIGTERM


def test_by_pid_a_child_is_reaped_and_a_dead_pid_is_fine() -> None:
    proc = _child(IGNORES_TERM)
    stop(proc.pid, timeout_s=0.3)
    assert not _exists(proc.pid)  # reaped by waitpid: no zombie left
    stop(proc.pid)  # gone already
    stop(proc)  # Popen of a process reaped by pid: nothing to do, no error
    done = _child("pass")
    done.wait()
    stop(done)


def test_a_whole_process_group() -> None:
    # the leader starts a grandchild in its group, which we never hold a Popen of
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    leader = _child(code, group=True)
    assert leader.stdout is not None
    grandchild = int(leader.stdout.readline())
    stop(leader, sig=signal.SIGKILL, group=True)
    assert leader.returncode == -signal.SIGKILL
    until(lambda: not _exists(grandchild), 5, "the grandchild gone")


def test_until_returns_the_seconds_it_took() -> None:
    calls = []

    def third_time() -> bool:
        calls.append(1)
        return len(calls) >= 3

    took = until(third_time, 5, "three calls", poll_s=0.01)
    assert len(calls) == 3
    assert 0.015 <= took < 2
    assert until(lambda: True, 0, "at once") < 0.5  # asked at least once


def test_until_raises_with_what_on_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"the moon: not within 0.1 s"):
        until(lambda: False, 0.1, "the moon", poll_s=0.02)


def test_until_ignores_only_the_named_exceptions() -> None:
    def flaky() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(TimeoutError, match=r"up: not within .*refused"):
        until(flaky, 0.1, "up", poll_s=0.02, ignore=(ConnectionError,))
    with pytest.raises(ConnectionError):
        until(flaky, 5, "up")


def test_free_port_never_repeats() -> None:
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20


@pytest.mark.trio
async def test_until_async_waits_in_virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    ready_at = trio.current_time() + 3.0
    took = await until_async(lambda: trio.current_time() >= ready_at, 10, "three seconds")
    assert 3.0 <= took < 3.0 + 0.1  # virtual seconds: the test itself takes milliseconds
    with pytest.raises(TimeoutError, match=r"never: not within 2 s; state: 42"):
        await until_async(lambda: False, 2, "never", describe=lambda: "state: 42")
