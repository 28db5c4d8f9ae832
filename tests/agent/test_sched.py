"""The agent's short scheduler slice (agent/sched.py), on this kernel and in a real agent
process. Skipped, with the reason, where the kernel does not take custom slices (before
Linux 6.12, not Linux, a seccomp filter): the agent then runs with the default."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from agent.demo import LocalAgent
from agent.sched import DEFAULT_SLICE_US, MAX_SLICE_US, request_slice, slice_us


def _unsupported() -> str | None:
    """Why this machine cannot take a custom slice (tried in a throwaway thread)."""
    why: list[str | None] = []
    thread = threading.Thread(target=lambda: why.append(request_slice(DEFAULT_SLICE_US)))
    thread.start()
    thread.join(timeout=5)
    return why[0] if why else "the probe thread did not finish"


def test_request_slice_sets_and_resets_the_calling_thread() -> None:
    reason = _unsupported()
    if reason is not None:
        pytest.skip(f"custom scheduler slices unavailable here: {reason}")
    seen: dict[str, int | str | None] = {}

    def work() -> None:
        default = slice_us()
        seen["set"] = request_slice(250)
        seen["after_set"] = slice_us()
        seen["reset"] = request_slice(0)
        seen["after_reset"] = slice_us()
        seen["default"] = default

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=5)
    assert seen["set"] is None and seen["after_set"] == 250
    assert seen["reset"] is None and seen["after_reset"] == seen["default"] != 250


def test_request_slice_refuses_out_of_range() -> None:
    for bad in (-1, 1, 99, MAX_SLICE_US + 1):
        with pytest.raises(ValueError, match="slice must be"):
            request_slice(bad)


def test_a_started_agent_runs_its_trio_thread_on_the_short_slice(tmp_path: Path) -> None:
    reason = _unsupported()
    if reason is not None:
        pytest.skip(f"custom scheduler slices unavailable here: {reason}")
    agent = LocalAgent("s1", tmp_path, "fast", None)
    try:
        agent.wait_ready(20)
        assert slice_us(agent.proc.pid) == DEFAULT_SLICE_US  # the main (trio) thread
    finally:
        agent.stop(signal.SIGKILL)
