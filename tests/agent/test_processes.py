"""Real agent processes on loopback: 16 agents join, detect a SIGKILL, and a restart with
the same name rejoins with a higher incarnation; swimctl commands, SIGTERM leave and SIGHUP
reload against live processes. Every process is stopped by pid at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo import LocalAgent, start_cluster, wait_converged
from agent.procs import stop, until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sixteen(tmp_path: Path) -> Iterator[list[LocalAgent]]:
    agents = start_cluster(16, tmp_path, "local")
    try:
        yield agents
    finally:
        for a in agents:
            a.stop(signal.SIGKILL)


def _status(agent: LocalAgent, name: str) -> str | None:
    m = agent.members().get(name)
    return None if m is None else str(m["status"])


@pytest.mark.slow
def test_sixteen_agents_join_detect_and_rejoin(sixteen: list[LocalAgent], tmp_path: Path) -> None:
    agents = sixteen
    took = wait_converged(agents, 60)
    assert took < 60
    victim, survivors = agents[5], [a for a in agents if a is not agents[5]]
    old_incarnation = survivors[0].members()[victim.name]["incarnation"]
    stop(victim.proc, sig=signal.SIGKILL)
    until(
        lambda: all(_status(a, victim.name) == "dead" for a in survivors),
        60,
        f"{victim.name} dead everywhere",
        poll_s=0.2,
    )
    # Restart with the same name and port: it must outbid its own death.
    reborn = LocalAgent(
        victim.name, tmp_path, "local", agents[0].port, ["--bind", f"127.0.0.1:{victim.port}"]
    )
    agents[5] = reborn
    reborn.wait_ready(20)
    wait_converged(agents, 60)
    assert survivors[0].members()[victim.name]["incarnation"] > old_incarnation


def _cli(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """``swimctl ARGS`` (python -m agent.cli) from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        check=False,
    )


def _swimctl(agent: LocalAgent, *args: str) -> subprocess.CompletedProcess[str]:
    return _cli("--control", str(agent.control), *args)


def test_swimctl_against_live_agents(tmp_path: Path) -> None:
    agents = start_cluster(3, tmp_path, "local", ["--tag", "role=trainer"])
    try:
        wait_converged(agents, 30)
        out = _swimctl(agents[0], "members")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split() == ["Name", "Address", "Status", "Incarnation", "Phi", "Tags"]
        assert len(lines) == 4 and all(
            "alive" in line and "role=trainer" in line for line in lines[1:]
        )
        data = json.loads(_swimctl(agents[0], "members", "--json").stdout)
        assert sorted(m["name"] for m in data) == ["agent-0", "agent-1", "agent-2"]
        assert set(data[0]) == {
            "name",
            "addr",
            "port",
            "status",
            "incarnation",
            "phi",
            "tags",
            "protocol",
            "since_ms",
        }
        assert _swimctl(agents[0], "members", "--status", "dead").stdout.count("\n") == 1
        info = json.loads(_swimctl(agents[1], "info", "--json").stdout)
        assert info["node"] == "agent-1" and info["members"]["alive"] == 3
        tags = _swimctl(agents[1], "tags", "--set", "zone=z1", "--delete", "role")
        assert tags.stdout.strip() == "zone=z1"
        until(lambda: agents[0].members()["agent-1"]["tags"] == {"zone": "z1"}, 10, "tag seen")
        bad = _swimctl(agents[1], "tags", "--set", "novalue")
        assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
        keys = _swimctl(agents[1], "keys", "--list")
        assert keys.returncode == 1 and "encryption is not enabled" in keys.stderr
        probed = _swimctl(agents[0], "probe", "agent-1", "--json")
        assert probed.returncode == 0, probed.stderr
        assert json.loads(probed.stdout) == {"started": ["agent-1"], "refused": {}}
        for _ in range(20):  # bounded: a round-robin probe of agent-2 may be in flight
            probed = _swimctl(agents[0], "probe", "agent-2", "ghost")
            if "agent-2: not probed (probing)" not in probed.stderr:
                break
        assert probed.returncode == 0 and probed.stdout.strip() == "agent-2: probing"
        assert "ghost: not probed (unknown)" in probed.stderr
        refused = _swimctl(agents[0], "probe", "ghost", "agent-0")
        assert refused.returncode == 1 and refused.stdout == ""
        assert "ghost: not probed (unknown)" in refused.stderr
        assert "agent-0: not probed (self)" in refused.stderr
        nobody = _cli("--control", str(tmp_path / "none.sock"), "members")
        assert nobody.returncode == 1 and "cannot reach the agent" in nobody.stderr
        # join is idempotent for known members; a dead address reports an error
        ok = _swimctl(agents[2], "join", f"127.0.0.1:{agents[0].port}")
        assert ok.returncode == 0 and "Successfully joined" in ok.stdout
        # leave through swimctl: the agent leaves and exits; peers see "left"
        left = _swimctl(agents[2], "leave")
        assert left.returncode == 0, left.stderr
        until(lambda: _status(agents[0], "agent-2") == "left", 5, "agent-2 left")
        assert agents[2].proc.wait(10) == 0
    finally:
        for a in agents:
            a.stop(signal.SIGKILL)


def test_sigterm_leaves_and_sighup_reloads_tags(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('log_level = "info"\n[tags]\nrole = "a"\n')
    agents = start_cluster(2, tmp_path, "local", ["--config", str(config)])
    try:
        wait_converged(agents, 30)
        config.write_text('log_level = "debug"\n[tags]\nrole = "b"\n')
        os.kill(agents[1].proc.pid, signal.SIGHUP)
        until(lambda: agents[0].members()["agent-1"]["tags"] == {"role": "b"}, 10, "tag reloaded")
        config.write_text("this is not toml")
        os.kill(agents[1].proc.pid, signal.SIGHUP)  # a bad reload keeps running
        time.sleep(0.5)
        assert agents[1].proc.poll() is None
        start = time.monotonic()
        os.kill(agents[1].proc.pid, signal.SIGTERM)
        until(lambda: _status(agents[0], "agent-1") == "left", 5, "agent-1 left", poll_s=0.02)
        assert time.monotonic() - start < 1.0, "peers see a SIGTERM leave within one second"
        assert agents[1].proc.wait(10) == 0
        log = agents[1].log_path.read_text()
        assert "keeping the running configuration" in log
    finally:
        for a in agents:
            a.stop(signal.SIGKILL)


def test_bad_flags_exit_2_with_a_clear_message(tmp_path: Path) -> None:
    out = _cli("agent", "--bind", "nowhere:1")
    assert out.returncode == 2 and "bind: 'nowhere' is not an IP address" in out.stderr


def test_swimctl_demo_runs_and_cleans_up() -> None:
    out = _cli("demo", "--agents", "4", timeout_s=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(profile fast," in out.stdout  # the profile the README leads with
    assert "all 4 agents see each other alive" in out.stdout
    assert "every survivor declared agent-3 dead" in out.stdout
    assert "sees it left after" in out.stdout
    assert "stopped 4 agent processes" in out.stdout
    assert out.stdout.rstrip().endswith("./dev.sh demo --profile lan")


def test_systemd_notify_ready_watchdog_stopping(tmp_path: Path) -> None:
    import socket as socketlib

    path = tmp_path / "notify.sock"
    sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(20)
    agent = LocalAgent(
        "sd", tmp_path, "local", None, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"}
    )
    try:
        got: list[str] = []
        while not {"READY=1", "WATCHDOG=1"} <= set(got):
            got.append(sock.recv(4096).decode())
        assert got.index("READY=1") < got.index("WATCHDOG=1")
        os.kill(agent.proc.pid, signal.SIGTERM)
        while "STOPPING=1" not in got:
            got.append(sock.recv(4096).decode())
        assert agent.proc.wait(10) == 0
    finally:
        agent.stop(signal.SIGKILL)
        sock.close()
