"""swimctl's --control: accepted before the subcommand (group option, $SWIM_CONTROL) and
after it (serf/consul style), the subcommand's value winning.

Each test serves real Unix control sockets that speak agent/control.py's framing and record
which socket each request reached; the CLI runs in-process through click's runner.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.control import FrameDecoder, encode_frame, ok, parse_request

RESULTS: dict[str, Any] = {
    "members": [],
    "info": {
        "node": "n1",
        "addr": "127.0.0.1",
        "port": 7946,
        "incarnation": 1,
        "health_score": 0,
        "profile": "lan",
        "encrypted": False,
        "version": "0",
        "members": {"alive": 1},
        "tags": {},
        "stats": {},
    },
    "join": {"joined": 1, "errors": []},
    "leave": {"left": True},
    "force_leave": {"node": "n2", "status": "left"},
    "tags": {"tags": {}},
    "probe": {"started": ["n2"], "refused": {}},
    "keys": {"keys": [], "primary": None},
}


class ControlSocket:
    """A Unix socket answering every request with ``RESULTS[op]``; records the ops."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ops: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                decoder = FrameDecoder()
                frames: list[dict[str, Any]] = []
                while not frames:
                    data = conn.recv(65536)
                    if not data:
                        break
                    frames = decoder.feed(data)
                if frames:
                    op, _args = parse_request(frames[0])
                    self.ops.append(op)
                    conn.sendall(encode_frame(ok(RESULTS[op])))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[tuple[ControlSocket, ControlSocket]]:
    a, b = ControlSocket(tmp_path / "a.sock"), ControlSocket(tmp_path / "b.sock")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


COMMANDS: list[tuple[list[str], str]] = [
    (["members"], "members"),
    (["info"], "info"),
    (["join", "10.0.0.2:7946"], "join"),
    (["leave"], "leave"),
    (["force-leave", "n2"], "force_leave"),
    (["tags", "--set", "a=b"], "tags"),
    (["probe", "n2"], "probe"),
    (["keys", "--list"], "keys"),
]


@pytest.mark.parametrize(("argv", "op"), COMMANDS, ids=[c[1] for c in COMMANDS])
def test_control_after_the_subcommand(
    sockets: tuple[ControlSocket, ControlSocket], argv: list[str], op: str
) -> None:
    a, b = sockets
    result = CliRunner().invoke(main, [*argv, "--control", str(b.path)], env={"SWIM_CONTROL": ""})
    assert result.exit_code == 0, result.output
    assert (a.ops, b.ops) == ([], [op])


@pytest.mark.parametrize(
    ("before", "env", "after", "reached"),
    [
        ("a", None, None, "a"),  # group option, as before
        (None, "a", None, "a"),  # $SWIM_CONTROL
        ("a", None, "b", "b"),  # the subcommand's wins over the group's
        (None, "a", "b", "b"),  # ... and over the environment
        ("b", "a", None, "b"),  # the group's wins over the environment
    ],
)
def test_which_control_socket_wins(
    sockets: tuple[ControlSocket, ControlSocket],
    before: str | None,
    env: str | None,
    after: str | None,
    reached: str,
) -> None:
    by_name = dict(zip("ab", sockets, strict=True))
    argv = ["--control", str(by_name[before].path)] if before else []
    argv.append("members")
    if after:
        argv += ["--control", str(by_name[after].path)]
    environ = {"SWIM_CONTROL": str(by_name[env].path) if env else ""}
    result = CliRunner().invoke(main, argv, env=environ)
    assert result.exit_code == 0, result.output
    assert {name: s.ops for name, s in by_name.items()} == {
        name: (["members"] if name == reached else []) for name in by_name
    }


def test_an_unreachable_socket_after_the_subcommand_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["members", "--control", str(tmp_path / "nobody.sock")])
    assert result.exit_code == 1
    assert "cannot reach the agent at" in result.output
    assert "nobody.sock" in result.output
