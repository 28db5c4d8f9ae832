"""``advertise_interface`` (agent/netif.py): a real interface's address. ``lo`` on this host,
and, in a fresh network namespace, veth interfaces with an IPv4 address, with only a global
IPv6 address (plus the link-local one the kernel adds), and with none; then a real agent
started there with ``--advertise-interface`` advertises that interface's address. The
namespace (and every interface in it) is deleted at the end, the agent stopped by pid."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import AgentConfigError, load
from agent.control import ControlClient, ControlError
from agent.netif import InterfaceError, interface_address
from agent.procs import stop, until

ROOT = Path(__file__).resolve().parents[2]


def test_loopback_and_an_unknown_interface() -> None:
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(InterfaceError, match=r"advertise_interface nope9: no such .*\blo\b"):
        interface_address("nope9")


@pytest.mark.parametrize("name", ["", "a/b", "eth0:1", "has space", "x" * 16, ".."])
def test_names_linux_refuses(name: str) -> None:
    with pytest.raises(AgentConfigError, match="advertise_interface"):
        load(None, {"advertise_interface": name or " "})


def test_not_with_advertise() -> None:
    with pytest.raises(AgentConfigError, match="either advertise or advertise_interface"):
        load(None, {"advertise_interface": "lo", "advertise": "10.0.0.1:7946"})
    assert load(None, {"advertise_interface": "ib0"}).advertise_interface == "ib0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def netns() -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    name = f"swimtest-if-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"'ip netns add' is not permitted here: {made.stderr.strip()}")
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "link", "add", "v4", "type", "veth", "peer", "name", "v6")
        _ip("-n", name, "link", "add", "bare", "type", "veth", "peer", "name", "bare2")
        _ip("-n", name, "addr", "add", "10.98.76.5/24", "dev", "v4")
        _ip("-n", name, "-6", "addr", "add", "fd00:5a:1::7/64", "dev", "v6", "nodad")
        for dev in ("v4", "v6"):
            _ip("-n", name, "link", "set", dev, "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False, timeout=20)


PROBE = """
import json, sys
from agent.netif import InterfaceError, interface_address
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = interface_address(name)
    except InterfaceError as exc:
        out[name] = f"error: {exc}"
print(json.dumps(out))
"""


def test_interfaces_in_a_namespace_and_an_agent_advertising_one(netns: str, tmp_path: Path) -> None:
    found = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", PROBE, "v4", "v6", "bare"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=True,
    )
    assert json.loads(found.stdout) == {
        "v4": "10.98.76.5",
        "v6": "fd00:5a:1::7",  # not its fe80:: link-local address
        "bare": "error: advertise_interface bare: the interface has no IPv4 or global IPv6 address",
    }

    control = tmp_path / "agent.sock"
    log = (tmp_path / "agent.log").open("wb")
    args = [sys.executable, "-m", "agent.cli", "--control", str(control), "agent"]
    args += ["--node", "ib-node", "--bind", "0.0.0.0:7946", "--advertise-interface", "v4"]
    agent = subprocess.Popen(
        ["ip", "netns", "exec", netns, *args, "--profile", "local"],  # ip netns exec execs
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        client = ControlClient(control, timeout_s=5)

        def info() -> dict[str, object] | None:
            if agent.poll() is not None:
                raise RuntimeError(f"agent exited: {(tmp_path / 'agent.log').read_text()}")
            try:
                result: dict[str, object] = client.request("info")
            except ControlError:
                return None
            return result

        until(info, 20, "the agent's control socket")
        got = info()
        assert got is not None and (got["addr"], got["port"]) == ("10.98.76.5", 7946)
        members = client.request("members")
        assert [(m["addr"], m["port"]) for m in members] == [("10.98.76.5", 7946)]
    finally:
        stop(agent, sig=signal.SIGKILL)
        log.close()
