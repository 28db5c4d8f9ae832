"""A member whose name and tags are not UTF-8 is served, never fatal.

memberlist and Serf carry names and tags as Go strings, which may hold any bytes; the wire
decodes them with ``surrogateescape`` (swim/wire/fields.py) so they round-trip. The control
API once could not encode such a name: one hostile datagram, then ``swimctl members``, and
the agent process exited (seen in CI under the hostile blast, tests/agent/test_hostile_blast.py).
Here a real agent process gets one such alive over real UDP; ``members``, ``info`` and the
``swimctl`` CLI must answer, and the agent must keep running.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from agent import serf
from agent.demo import LocalAgent
from agent.procs import until
from swim import Alive, encode_message

NAME = "bad-\udcff\udcfe"  # the bytes 0xff 0xfe, which are not UTF-8
TAGS = {"role": "x-\udce9", "\udcc3": "v"}
LOOPBACK = bytes([127, 0, 0, 1])


def test_a_member_named_with_bytes_that_are_not_utf8_is_served(tmp_path: Path) -> None:
    target = LocalAgent("target", tmp_path, "lan", None)
    try:
        target.wait_ready(20)
        meta = serf.encode_tags(TAGS)
        alive = Alive(1, NAME, LOOPBACK, 9, meta, bytes([1, 5, 2, 2, 5, 4]))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.sendto(encode_message(alive), ("127.0.0.1", target.port))
        until(lambda: NAME in target.members(), 10, "the member is listed")
        member = target.members()[NAME]
        assert member["tags"] == TAGS
        assert target.client.request("info")["members"]["alive"] + 0 >= 1
        cli = [sys.executable, "-m", "agent.cli", "--control", str(target.control), "members"]
        out = subprocess.run(
            cli,
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        # the table shows the name's own bytes, as ls shows a file name that is not UTF-8
        assert b"bad-\xff\xfe " in out.stdout
        as_json = subprocess.run(
            [*cli, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert as_json.returncode == 0, as_json.stderr
        names = {m["name"] for m in json.loads(as_json.stdout)}
        assert NAME in names
        assert target.proc.poll() is None, target.log_path.read_text()[-2000:]
    finally:
        target.stop()
