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
from typing import Any

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


def _accepted(listener: socket.socket) -> int:
    """Connections waiting in ``listener``'s backlog (each accepted and closed)."""
    listener.settimeout(0.2)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return count
        conn.close()
        count += 1


def test_a_retry_waits_for_the_connection_in_flight_instead_of_opening_more() -> None:
    # TCPStore's server looks up each connection's address in reverse DNS on its one
    # thread (module docstring of torchhook/stores.py): a retry that opened new
    # connections while the earlier ones were still queued kept a stalled server stalled
    from torchhook.stores import connect_store

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # no accept(): nobody answers, as while the server stalls
        port = listener.getsockname()[1]
        for _ in range(3):
            with pytest.raises(Retry, match="no answer within"):
                connect_store("127.0.0.1", port, "formation store")
        attempts = [t for t in threading.enumerate() if t.name == "connect-formation store"]
        # one attempt: its plain connection (closed at once) and TCPStore's own
        assert _accepted(listener) == 2
    for thread in attempts:  # the listener closed: the attempt ends, here (module docstring)
        thread.join(10)
    assert len(attempts) == 1 and not attempts[0].is_alive()


SERVER = """
import sys
from datetime import timedelta
from torch._C._distributed_c10d import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                 timeout=timedelta(seconds=30))
store.set("ready", "yes")
print(store.port, flush=True)
sys.stdin.readline()
"""


def test_a_connection_that_completes_late_is_handed_to_the_next_call() -> None:
    import os
    import signal
    import subprocess
    import sys

    from torchhook.stores import connect_store

    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        port = int(server.stdout.readline())
        os.kill(server.pid, signal.SIGSTOP)  # its kernel still accepts; it answers nothing
        with pytest.raises(Retry, match="no answer within"):
            connect_store("127.0.0.1", port, "formation store")
        os.kill(server.pid, signal.SIGCONT)
        # two threads of this process at once: one takes the late connection, the other
        # gets one of its own (threads never share a client)
        stores: list[Any] = []
        callers = [
            threading.Thread(
                target=lambda: stores.append(connect_store("127.0.0.1", port, "formation store"))
            )
            for _ in range(2)
        ]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(30)
        assert len(stores) == 2 and stores[0] is not stores[1]
        for store in stores:
            store.set_timeout(timedelta(seconds=5))
            assert store.get("ready") == b"yes"
        stores.clear()
        server.stdin.write("exit\n")
        server.stdin.flush()
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
            server.kill()
            server.wait(10)
