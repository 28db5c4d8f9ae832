"""The agent's CPU-cgroup check (agent/cpu_cgroup.py) on real processes in a real cgroup,
and the daemon's start-up warning. The cgroup tests need root and a writable CPU cgroup
(v1 ``cpu`` or v2 with the ``cpu`` controller); they skip, saying so, elsewhere. Every
process is stopped by pid and the cgroup removed."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cpu_cgroup import cpu_cgroup
from agent.demo import LocalAgent
from agent.procs import stop, until

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")


def _cgroup_root() -> Path | None:
    if (V1 / "cpu.shares").exists() and os.access(V1, os.W_OK):
        return V1
    controllers = V2 / "cgroup.controllers"
    with contextlib.suppress(OSError):
        if "cpu" in controllers.read_text().split() and os.access(V2, os.W_OK):
            return V2
    return None


@pytest.fixture
def fresh_cgroup() -> Iterator[Path]:
    root = _cgroup_root()
    if root is None:
        pytest.skip("needs root and a writable CPU cgroup (v1 cpu, or v2 with cpu)")
    path = root / f"swimtest-cpucg-{secrets.token_hex(3)}"
    path.mkdir()
    try:
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)

        def removed() -> bool:
            path.rmdir()
            return True

        until(removed, 5, f"rmdir {path}", poll_s=0.1, ignore=(OSError,))


def test_counts_other_processes_but_not_the_own_children(fresh_cgroup: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # a shell that starts a child of its own once it is in the cgroup: the child is
        # not "another process"
        sh = subprocess.Popen(["sh", "-c", "read go; sleep 60 & wait"], stdin=subprocess.PIPE)
        procs.append(sh)
        (fresh_cgroup / "cgroup.procs").write_text(str(sh.pid))
        assert sh.stdin is not None
        sh.stdin.write(b"go\n")
        sh.stdin.flush()
        listed = fresh_cgroup / "cgroup.procs"
        until(lambda: len(listed.read_text().split()) == 2, 5, "the shell's child started")
        alone = cpu_cgroup(sh.pid)
        assert alone is not None and alone.others == 0
        assert alone.path.endswith(fresh_cgroup.name)
        procs.append(subprocess.Popen(["sleep", "60"]))
        (fresh_cgroup / "cgroup.procs").write_text(str(procs[1].pid))
        shared = cpu_cgroup(sh.pid)
        assert shared is not None and shared.others == 1
    finally:
        stop(*procs, sig=signal.SIGKILL)
        for pid in (fresh_cgroup / "cgroup.procs").read_text().split():  # the shell's sleep
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_unreadable_says_nothing(tmp_path: Path) -> None:
    assert cpu_cgroup(os.getpid(), root=tmp_path) is None
    assert cpu_cgroup(2**22 + 7) is None  # no such process


def test_a_fast_daemon_in_a_shared_cgroup_warns_at_start(tmp_path: Path) -> None:
    mine = cpu_cgroup(os.getpid())
    if mine is None or mine.others == 0:
        pytest.skip("this test process has a CPU cgroup of its own: nothing to share")
    agent = LocalAgent("w1", tmp_path, "fast", None)
    try:
        agent.wait_ready(20)
        assert "shares its CPU cgroup" in agent.log_path.read_text()
    finally:
        agent.stop(signal.SIGKILL)
