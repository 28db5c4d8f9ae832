"""A trainer connecting to a stopped leader's store gives up in bounded time and keeps
heartbeating (the hung-trainer flake: a live trainer blocked in TCPStore's constructor
against a SIGSTOPped leader, stopped beating, and was flagged hung itself).

The connecting thread it abandons ends once the store's socket closes, and TCPStore then
logs the failed connect with a C++ stack trace. The test waits for that inside itself, so
pytest captures the trace (and shows it only if the test fails) instead of the thread
printing it on the terminal in the middle of a later test.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")

from torchhook.formation import STORE_CONNECT, Formation, Retry


def test_a_store_that_accepts_but_never_answers_is_given_up_while_beating() -> None:
    # listen() without accept(): the kernel completes the TCP handshake, nobody answers,
    # which is what a stopped process's listening socket does
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        beats: list[float] = []
        formation = Formation(
            lambda: pytest.fail("no view needed to connect"),
            local_rank=1,  # no directory of its own
            beat=lambda: beats.append(time.monotonic()),
            timeout_s=5,
            store_host="127.0.0.1",
            op_timeout=timedelta(seconds=5),
        )
        started = time.monotonic()
        with pytest.raises(Retry, match="no answer within"):
            formation.connect("127.0.0.1", port, "directory")
        took_s = time.monotonic() - started
        abandoned = [t for t in threading.enumerate() if t.name == "connect-directory"]
    assert took_s < STORE_CONNECT.total_seconds() + 1.0
    assert len(beats) >= 2  # the agent kept hearing from us
    # the listener is closed (the peer died): the abandoned connect ends, here
    for thread in abandoned:
        thread.join(10)
    assert abandoned and not any(t.is_alive() for t in abandoned)


PEER = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
sys.stdin.readline()
time.sleep(0.05)
"""
TRAINER = """
import subprocess, sys
from torchhook.stores import Retry, connect_store
peer = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
port = int(peer.stdout.readline())
try:
    connect_store("127.0.0.1", port, "directory")
except Retry:
    print("gave up", flush=True)
peer.stdin.write("exit\\n"); peer.stdin.flush()  # the peer's socket closes as this one exits
"""


def test_a_process_exits_cleanly_while_an_abandoned_connect_ends() -> None:
    # without the wait at exit, the abandoned thread's connect fails (the peer's socket
    # closed) while the interpreter finalizes, and the process aborts: 25 of 25 runs
    # aborted before the wait, 0 of 25 after (peer exit 0-0.2 s after giving up)
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", TRAINER, PEER], capture_output=True, text=True, timeout=60
    )
    assert "gave up" in done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_a_refused_connection_is_given_up_at_once() -> None:
    # a dead peer's port refuses: TCPStore's constructor would retry that until its
    # timeout (STORE_CONNECT), the plain connect before it ends the attempt at once
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(Retry, match="refused") as caught:
            connect_store_here("127.0.0.1", port)
    assert caught.value.unreachable


def connect_store_here(addr: str, port: int) -> None:
    from torchhook.stores import connect_store

    connect_store(addr, port, "directory")
