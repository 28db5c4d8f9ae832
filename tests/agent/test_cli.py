"""swimctl as operators type it.

- ``--control``: accepted before the subcommand (group option, $SWIM_CONTROL) and after it
  (serf/consul style), the subcommand's value winning. These tests serve Unix control
  sockets that speak agent/control.py's framing with canned results and record which
  socket each request reached; the CLI runs in-process through click's runner.
- Everything else runs against three real agent processes on loopback (encrypted, tagged),
  reached through their real control sockets, the CLI in-process through click's runner;
  ``swimctl --version`` runs the installed console script. Covered: ``--version`` and
  ``version``, ``members`` filters as ``serf members`` (anchored regexes, a missing tag
  matching as '', bad regexes exit 2 without reaching the agent), ``info``'s sections and
  the agent's own version, ``jobs`` and ``view`` with real registrations (the torchhook
  client) and a hung node, and ``--json`` on every command that prints.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from agent import DISTRIBUTION
from agent.cli import main
from agent.cli_format import duration_ms, info_text, size_bytes
from agent.control import PROTOCOL_VERSION, FrameDecoder, encode_frame, ok, parse_request
from agent.demo import LocalAgent, wait_converged
from agent.procs import until
from agent.serf import PROTOCOL_VERSION_MAX as SERF_MAX
from agent.serf import PROTOCOL_VERSION_MIN as SERF_MIN
from swim import PROTOCOL_VERSION_MAX, PROTOCOL_VERSION_MIN
from torchhook.client import Membership

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
    "view": {"job": "j", "generation": 1, "fingerprint": "e3b0c44298fc1c14", "members": []},
    "jobs": {"jobs": [], "omitted": 0},
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
    (["view", "j"], "view"),
    (["jobs"], "jobs"),
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


# --- real agents ------------------------------------------------------------------------

KEY = base64.b64encode(bytes(range(16))).decode()
TAGS = {  # agent-2 has no rack: a --tag rack=... filter sees it as ''
    "agent-0": ["--tag", "role=gpu", "--tag", "rack=r1"],
    "agent-1": ["--tag", "role=gpu", "--tag", "rack=r2"],
    "agent-2": ["--tag", "role=cpu"],
}


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalAgent]]:
    workdir = tmp_path_factory.mktemp("cli")
    started: list[LocalAgent] = []
    try:
        for name, tags in TAGS.items():
            join = started[0].port if started else None
            started.append(LocalAgent(name, workdir, "local", join, [*tags, "--encrypt", KEY]))
        for a in started:
            a.wait_ready(20)
        wait_converged(started, 30)
        yield started
    finally:
        for a in started:
            a.stop(signal.SIGKILL)


def swimctl(agent: LocalAgent, *argv: str) -> Result:
    """``swimctl ARGV --control <agent's socket>``, in-process, stdout apart from stderr."""
    return CliRunner().invoke(main, [*argv, "--control", str(agent.control)])


def as_json(agent: LocalAgent, *argv: str) -> Any:
    result = swimctl(agent, *argv, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_version_flag_runs_the_installed_commands() -> None:
    for program in ("swimctl", "swim-agent"):
        script = Path(sys.executable).with_name(program)
        out = subprocess.run(
            [str(script), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [
            f"{program} {version(DISTRIBUTION)}",
            f"Gossip protocol (memberlist): {PROTOCOL_VERSION_MAX} (understands back to: "
            f"{PROTOCOL_VERSION_MIN})",
            f"Serf protocol: {SERF_MAX} (understands back to: {SERF_MIN})",
            f"Control API: {PROTOCOL_VERSION}",
        ]
    result = CliRunner().invoke(main, ["version", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "version": version(DISTRIBUTION),
        "distribution": DISTRIBUTION,
        "gossip_protocol": {"min": PROTOCOL_VERSION_MIN, "max": PROTOCOL_VERSION_MAX},
        "serf_protocol": {"min": SERF_MIN, "max": SERF_MAX},
        "control_protocol": PROTOCOL_VERSION,
    }


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], {0, 1, 2}),
        (["--tag", "role=gpu"], {0, 1}),
        (["--tag", "role=gpu", "--tag", "rack=r2"], {1}),  # every filter must match
        (["--tag", "role=gp"], set()),  # anchored: a whole match, not a search
        (["--tag", "rack=.*"], {0, 1, 2}),  # a missing tag matches as ''
        (["--tag", "rack=.+"], {0, 1}),
        (["--tag", "rack="], {2}),
        (["--tag", "rack=r1|r2"], {0, 1}),
        (["--name", "agent-[02]"], {0, 2}),
        (["--name", "agent"], set()),
        (["--name", "agent-0|agent-2"], {0, 2}),  # the alternation is anchored as a whole
        (["--name", "gent-0|agent-2"], {2}),
        (["--status", "alive"], {0, 1, 2}),  # a plain status: the agent filters
        (["--status", "suspect|dead"], set()),
        (["--status", "al.*", "--name", "agent-1", "--tag", "role=gpu"], {1}),
    ],
)
def test_members_filters_as_serf_members(
    agents: list[LocalAgent], argv: list[str], expected: set[int]
) -> None:
    shown = as_json(agents[0], "members", *argv)
    assert sorted(m["name"] for m in shown) == [f"agent-{i}" for i in sorted(expected)]


def test_members_text_output_is_filtered_too(agents: list[LocalAgent]) -> None:
    result = swimctl(agents[1], "members", "--tag", "role=cpu")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["Name", "Address", "Status", "Incarnation", "Phi", "Tags"]
    assert [line.split()[0] for line in lines[1:]] == ["agent-2"]
    assert lines[1].endswith("role=cpu")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tag", "rack=("], "--tag 'rack=(': not a valid regular expression (missing )"),
        (["--tag", "rack"], "--tag expects KEY=REGEX, got 'rack'"),
        (["--tag", "=x"], "--tag expects KEY=REGEX, got '=x'"),
        (["--name", "a[b"], "--name 'a[b': not a valid regular expression"),
        (["--status", "*"], "--status '*': not a valid regular expression"),
        (["--status", "alvie"], "--status 'alvie' matches none of alive, suspect, dead, left"),
    ],
)
def test_a_bad_filter_is_a_usage_error(tmp_path: Path, argv: list[str], message: str) -> None:
    # no agent at this path: exit status 2, not 1, shows the filter failed before any request
    argv = ["members", *argv, "--control", str(tmp_path / "no.sock")]
    result = CliRunner().invoke(main, argv, prog_name="swimctl")
    assert result.exit_code == 2, result.output
    assert "Usage: swimctl members" in result.stderr
    assert f"Error: {message}" in result.stderr
    assert result.stdout == ""


def test_info_text_in_sections_and_the_agents_version(agents: list[LocalAgent]) -> None:
    data = as_json(agents[0], "info")
    assert data["version"] == version(DISTRIBUTION)
    assert {"node", "addr", "port", "uptime_ms", "stats", "members", "tags"} <= set(data)
    result = swimctl(agents[0], "info")
    assert result.exit_code == 0, result.output
    text = result.stdout
    titles = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert titles == [
        "Agent",
        "Members",
        "Tags",
        "Traffic",
        "Probes",
        "Suspicion",
        "Agent loop",
        "Access",
    ]
    rows = {line.split("  ")[1].strip(): line for line in text.splitlines() if line[:2] == "  "}
    assert rows["node"].split() == ["node", "agent-0"]
    assert rows["version"].split() == ["version", version(DISTRIBUTION)]
    assert rows["encrypted"].split() == ["encrypted", "yes"]
    assert rows["address"].split()[1] == f"127.0.0.1:{agents[0].port}"
    # human units: bytes in B/KiB/..., the uptime as a duration, counts with separators
    assert re.fullmatch(r"bytes in +\d+(\.\d)? (B|KiB|MiB)", rows["bytes in"].strip())
    assert re.fullmatch(r"uptime +\d+( ms|\.\d s|m \d\ds)", rows["uptime"].strip())
    assert rows["alive"].split() == ["alive", "3"]
    # one label column for the whole output; numbers right-aligned within their section
    text_rows = ("node", "version", "profile", "encrypted", "role", "rack")
    assert len({rows[k].index(rows[k].split()[1]) for k in text_rows}) == 1
    section = text.split("\nTraffic\n")[1].split("\n\n")[0].splitlines()
    assert len(section) >= 5 and len({len(line) for line in section}) == 1, section


def test_info_text_shows_counter_maps_and_fields_it_does_not_know() -> None:
    info = {
        **RESULTS["info"],
        "uptime_ms": 3_725_000,
        "stats": {"packets_in": 1_234_567, "dropped": {"queue_full": 3, "bad_crc": 2}},
        "admin_group": "swim-admin",  # a field from a newer agent
    }
    info["stats"]["future_bytes"] = 2048
    lines = info_text(info).splitlines()
    assert "  uptime        1h 02m" in lines
    traffic = lines[lines.index("Traffic") + 1 : lines.index("Other") - 1]
    assert traffic == [  # a counter map: its total, then each key (the metric's label value)
        "  packets in    1,234,567",
        "  dropped               5",
        "    bad_crc             2",
        "    queue_full          3",
    ]
    assert lines[lines.index("Other") + 1 :] == [
        "  future bytes  2.0 KiB",
        "  admin group   swim-admin",
    ]


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0 ms"),
        (999, "999 ms"),
        (1000, "1.0 s"),
        (59_949, "59.9 s"),
        (61_000, "1m 01s"),
        (3_600_000, "1h 00m"),
        (90_061_000, "1d 01h"),
    ],
)
def test_durations_in_human_units(ms: int, text: str) -> None:
    assert duration_ms(ms) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 << 20, "5.0 MiB"),
        (3 << 30, "3.0 GiB"),
        (2 << 50, "2048.0 TiB"),
    ],
)
def test_sizes_in_human_units(n: int, text: str) -> None:
    assert size_bytes(n) == text


def test_jobs_and_view_with_real_registrations(agents: list[LocalAgent]) -> None:
    a0, a1, a2 = agents
    trainers: list[Membership] = []
    try:
        for r in range(2):
            trainers.append(
                Membership(
                    "train", control=a0.control, local_rank=r, local_world_size=2, store_port=29500
                )
            )
        trainers.append(Membership("train", control=a1.control))
        # agent-2's trainer heartbeats once, then stops: its node is flagged hung, out of view
        stuck = Membership(
            "train",
            control=a2.control,
            heartbeat_pause_ms=0,
            heartbeat_threshold=1.0,
            first_heartbeat_estimate_ms=100,
        )
        trainers.append(stuck)
        stuck.heartbeat(1)

        def summary() -> dict[str, Any]:
            listed: list[dict[str, Any]] = a0.client.request("jobs")["jobs"]
            return {j["job"]: j for j in listed}.get("train", {})

        until(lambda: summary().get("hung") == 1 and summary()["nodes"] == 2, 20, "views")
        listed = as_json(a0, "jobs")
        assert listed["omitted"] == 0
        (train,) = listed["jobs"]
        shown = as_json(a0, "view", "train")
        assert train == {
            "job": "train",
            "generation": shown["generation"],
            "fingerprint": shown["fingerprint"],
            "nodes": 2,
            "ranks": 3,
            "training": 2,
            "spares": 0,
            "target": None,
            "hung": 1,
            "local_ranks": 2,
            "paused": [],
            "refused_frames": 0,
            "slow": {},
            "slow_flags": 0,
        }
        assert [(m["name"], m["ranks"], m["store_port"]) for m in shown["members"]] == [
            ("agent-0", 2, 29500),
            ("agent-1", 1, 0),
        ]
        assert as_json(a2, "jobs")["jobs"][0]["local_ranks"] == 1
        text = swimctl(a0, "jobs").stdout.splitlines()
        assert text[0].split() == [
            *("Job", "Generation", "Training", "Spares", "Ranks", "Hung", "Local", "ranks"),
            *("Paused", "Slow", "Fingerprint"),
        ]
        generation, fp = str(train["generation"]), train["fingerprint"]
        assert text[1].split() == ["train", generation, "2", "0", "3", "1", "2", "-", "-", fp]
        text = swimctl(a0, "view", "train").stdout.splitlines()
        assert text[0] == (
            f"Job train: generation {shown['generation']}, fingerprint {shown['fingerprint']}, "
            "2 training node(s), 3 rank(s), 0 spare(s)"
        )
        assert [line.split()[:7] for line in text[2:]] == [
            ["agent-0", f"127.0.0.1:{a0.port}", "alive", "training", "2", "0-1", "29500"],
            ["agent-1", f"127.0.0.1:{a1.port}", "alive", "training", "1", "2", "-"],
        ]
        bad = swimctl(a0, "view", "no such job")
        assert bad.exit_code == 1 and "job must match" in bad.stderr
    finally:
        for t in trainers:
            t.close()


def test_json_on_every_command_that_prints(agents: list[LocalAgent]) -> None:
    # the module's last test on ``agents``: it kills agent-2 and makes agent-1 leave
    a0, a1, a2 = agents
    assert as_json(a1, "tags", "--set", "zone=z1") == {
        "tags": {"role": "gpu", "rack": "r2", "zone": "z1"}
    }
    assert as_json(a1, "keys", "--list") == {"keys": [KEY], "primary": KEY}
    assert as_json(a1, "join", f"127.0.0.1:{a0.port}") == {"joined": 1, "errors": []}
    assert as_json(a0, "probe", "agent-1") == {"started": ["agent-1"], "refused": {}}
    # force-leave needs a failed member: SIGKILL agent-2, wait until agent-0 declares it dead
    a2.stop(signal.SIGKILL)
    until(lambda: a0.members()["agent-2"]["status"] == "dead", 30, "agent-2 dead")
    assert as_json(a0, "force-leave", "agent-2") == {"node": "agent-2", "status": "left"}
    assert as_json(a1, "leave") == {"left": True}
    assert a1.proc.wait(10) == 0
