"""bench/restart_sched.py: how a restarted victim starts in the mixed-fault benchmark, set
back to normal on a real process, and its restart windows split by the way each started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from agent.procs import stop, until
from bench import restart_sched

THREADS = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


def test_parse_and_wrap() -> None:
    assert restart_sched.parse("idle") == ("idle",)
    assert restart_sched.parse("nice, idle") == ("nice", "idle")
    assert restart_sched.parse("fork,idle") == ("fork", "idle")
    for bad in ("", "fast", "idle,other"):
        with pytest.raises(ValueError, match="--restart-sched"):
            restart_sched.parse(bad)
    assert restart_sched.wrap("idle", 19) == ("chrt", "--idle", "0")
    assert restart_sched.wrap("fork", 19) == ("chrt", "--idle", "0"), "the fork server reads it"
    assert restart_sched.wrap("nice", 19) == ("nice", "-n", "19")
    assert restart_sched.wrap("nice", 0) == ()


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_restore_sets_every_thread_of_the_group_back_to_normal() -> None:
    proc = subprocess.Popen(
        ["chrt", "--idle", "0", "nice", "-n", "5", sys.executable, "-c", THREADS],
        stdout=subprocess.PIPE,
        process_group=0,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        until(lambda: len(_threads(proc.pid)) == 2, 10, "two threads")
        tids = _threads(proc.pid)
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        assert restart_sched.restore(proc.pid) == 2
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {0}
        assert restart_sched.restore(proc.pid + 10_000_000) == 0, "no such group"
    finally:
        stop(proc, sig=signal.SIGKILL, group=True)


def test_split_gives_each_window_to_the_restart_before_it() -> None:
    windows = [(10.5, 4.0, 40, 5.0), (70.2, 4.5, 41, 2.0), (130.9, 4.0, 50, 1.0)]
    restarts = [(10.0, "nice"), (70.0, "idle"), (130.0, "nice")]
    by = restart_sched.split(windows, restarts, 0.1)
    assert by["nice"]["restarts"] == 2 and by["nice"]["lost_steps"] == pytest.approx(6.0)
    assert by["nice"]["lost_s"] == pytest.approx(0.6)
    assert by["idle"] == {"restarts": 1, "lost_steps": 2.0, "lost_s": pytest.approx(0.2)}
    assert restart_sched.split(windows, [(200.0, "idle")], 0.1) == {}, "no restart before"


def test_a_restart_window_begins_when_its_agent_was_started() -> None:
    from bench.mixed_restarts import from_restarts

    spans = [(10.6, 15.0), (70.9, 75.0), (200.0, 204.0)]
    got = from_restarts(spans, [10.0, 70.0, 71.0, 100.0])
    assert got == [(10.0, 15.0), (70.0, 75.0), (200.0, 204.0)], "none within 30 s: as logged"
