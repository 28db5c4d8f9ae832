"""Binding port 0 (any free port) where the port the kernel picks for UDP is taken for
TCP: the transport tries another (agent/transport.py ``SocketTransport.bind``).

The collision is rare on a host (28,000 ephemeral ports) but real: a full test run once
failed with ``Address already in use`` at the TCP listener of an agent bound to port 0.
Here it is made certain in a network namespace of the test's own (``unshare --net``: it
ends with the process) whose ephemeral range holds two ports, the first listening for
TCP: every UDP pick of the first port must be followed by a pick of the second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from agent.transport import BIND_ATTEMPTS

BINDS = 10

CHILD = f"""
import socket, subprocess, sys
import trio
from agent.transport import SocketTransport

subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
    f.write("40000 40001")
taken = socket.socket()
taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
taken.bind(("127.0.0.1", 40000))
taken.listen()

async def main() -> None:
    for _ in range({BINDS}):
        transport = await SocketTransport.bind("127.0.0.1", 0)
        print(transport.address.port, flush=True)
        transport.close()

trio.run(main)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of its own needs root")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare is not installed")
def test_port_zero_skips_a_port_whose_tcp_side_is_taken() -> None:
    assert BIND_ATTEMPTS >= 2
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # each bind found the one port free for both, however often UDP picked the other
    assert done.stdout.split() == ["40001"] * BINDS
