"""agent.systemd (sd_notify over a real AF_UNIX datagram socket, watchdog parsing) and the
packaged unit file (``systemd-analyze verify`` plus the settings the agent relies on)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import load
from agent.keyfiles import STATE_KEYRING
from agent.systemd import notify, watchdog_interval_s

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
UNIT = PACKAGING / "swim-agent.service"
SYSUSERS = UNIT.with_name("swim-sysusers.conf")


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify"
    if len(str(path)) >= 100:  # sun_path holds 108 bytes
        pytest.skip(f"tmp_path too long for an AF_UNIX socket path: {path}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield sock, str(path)


def test_notify_sends_one_datagram(
    receiver: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("READY=1") is True
    assert sock.recv(4096) == b"READY=1"
    assert notify("STATUS=joined 12 members — ok\nWATCHDOG=1") is True
    assert sock.recv(4096) == "STATUS=joined 12 members — ok\nWATCHDOG=1".encode()
    assert notify("STOPPING=1") is True
    assert sock.recv(4096) == b"STOPPING=1"


def test_notify_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"swim-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("WATCHDOG=1") is True
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_notify_without_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify("READY=1") is False


@pytest.mark.parametrize("value", ["relative/path", "@", "vsock:2:1234"])
def test_notify_unsupported_address(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert notify("READY=1") is False


def test_notify_send_error_is_false_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path))  # a directory, not a socket
    assert notify("READY=1") is False


def test_notify_empty_state(
    receiver: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", receiver[1])
    assert notify("") is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("10000000", None, 5.0),  # WatchdogSec=10s in the unit
        ("1000000", "self", 0.5),
        ("3", None, 1.5e-6),
        (None, None, None),
        ("", None, None),
        ("0", None, None),
        ("-5", None, None),
        ("+5", None, None),
        (" 5", None, None),
        ("1_000", None, None),
        ("garbage", None, None),
        ("1.5", None, None),
        ("١٢", None, None),  # non-ASCII digits
        ("10000000", "1", None),  # another process's watchdog
        ("10000000", "other", None),
        ("10000000", "garbage", None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    if usec is None:
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    else:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is None:
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
    else:
        own = os.getpid()
        value = {"self": str(own), "other": str(own + 1)}.get(pid, pid)
        monkeypatch.setenv("WATCHDOG_PID", value)
    result = watchdog_interval_s()
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)


# --- the unit file ----------------------------------------------------------------------------


def _settings(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, val = line.partition("=")
        current.setdefault(key.strip(), []).append(val.strip())
    return sections


def test_unit_settings() -> None:
    units = _settings(UNIT.read_text())
    service = {k: v[-1] for k, v in units["Service"].items()}
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/opt/swim/bin/swim-agent --config /etc/swim/agent.toml",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "WatchdogSec": "10s",
        "Restart": "on-failure",
        "RestartSec": "2s",
        "TimeoutStopSec": "15s",
        "KillSignal": "SIGTERM",
        "RuntimeDirectory": "swim",
        "RuntimeDirectoryMode": "0750",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
        "LimitNOFILE": "65536",
        "MemoryMax": "256M",
        "StateDirectory": "swim",
        "StateDirectoryMode": "0700",
        "CPUWeight": "1000",
        "Nice": "-5",
    }
    for key, val in expected.items():
        assert service.get(key) == val, key
    # the access model (agent/access.py): a static user and group that other users can be
    # made members of, and a runtime directory that group may pass to reach the socket
    assert "DynamicUser" not in service
    assert (service.get("User"), service.get("Group")) == ("swim", "swim")
    assert service.get("RemoveIPC") == "yes"  # what DynamicUser= implied
    mode = int(service["RuntimeDirectoryMode"], 8)
    assert mode & 0o010 and not mode & 0o007, "group may pass /run/swim, others may not"
    assert units["Unit"]["After"] == ["network-online.target"]
    assert units["Unit"]["Wants"] == ["network-online.target"]
    assert units["Install"]["WantedBy"] == ["multi-user.target"]


WRITABLE_BASES = {
    "RuntimeDirectory": "/run",
    "StateDirectory": "/var/lib",
    "CacheDirectory": "/var/cache",
    "LogsDirectory": "/var/log",
}
"""systemd.exec(5): these directories stay writable under ProtectSystem=strict."""


@pytest.mark.parametrize("example", ["agent.toml", "agent-fast.toml"])
def test_the_unit_lets_the_agent_write_where_its_config_says(example: str) -> None:
    """Under ProtectSystem=strict only the unit's own directories (and ReadWritePaths) are
    writable: the example configs' data_dir (where key changes are saved) and control
    socket must lie inside them, or key rotation fails only once it is tried."""
    service = _settings(UNIT.read_text())["Service"]
    assert service["ProtectSystem"] == ["strict"]
    writable = [
        Path(base) / name
        for key, base in WRITABLE_BASES.items()
        for value in service.get(key, [])
        for name in value.split()
    ]
    writable += [Path(p.lstrip("-+")) for v in service.get("ReadWritePaths", []) for p in v.split()]
    config = load(PACKAGING / example)
    assert config.data_dir == Path("/var/lib/swim")
    written = [config.data_dir / STATE_KEYRING, config.control]
    if config.keyring_file is not None:
        written.append(config.keyring_file)
    for path in written:
        assert path is not None and any(path.is_relative_to(w) for w in writable), (
            f"{example}: the agent writes {path}, read-only under the unit (writable: "
            f"{', '.join(map(str, writable))})"
        )


def _verify(unit: Path) -> tuple[int, str]:
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (Debian package 'systemd')")
    # First make sure systemd-analyze works here at all (containers without systemd as PID 1
    # can still run it offline; some sandboxes cannot).
    probe = tmp_path / "swim-probe.service"
    probe.write_text(f"[Service]\nType=oneshot\nExecStart={sys.executable} -c pass\n")
    rc, output = _verify(probe)
    if rc != 0 or output.strip():
        pytest.skip(f"systemd-analyze verify cannot run here: rc={rc} {output.strip()[:500]}")

    # verify complains when ExecStart's binary does not exist: point it at one that does.
    text = UNIT.read_text()
    text, count = re.subn(
        r"^ExecStart=/opt/swim/bin/swim-agent ", f"ExecStart={sys.executable} ", text, flags=re.M
    )
    assert count == 1
    unit = tmp_path / "swim-agent.service"
    unit.write_text(text)
    rc, output = _verify(unit)
    problems = [line for line in output.splitlines() if "swim-agent.service" in line]
    assert problems == [], output
    assert rc == 0, output


def test_verify_catches_mistakes(tmp_path: Path) -> None:
    """The verify test above is meaningful: a typo in the unit is reported."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (Debian package 'systemd')")
    unit = tmp_path / "swim-agent.service"
    unit.write_text(
        UNIT.read_text().replace("/opt/swim/bin/swim-agent ", f"{sys.executable} ")
        + "[Service]\nProtectSytem=strict\n"
    )
    _, output = _verify(unit)
    if "ProtectSytem" not in output:
        pytest.skip(f"systemd-analyze verify reports nothing here: {output.strip()[:500]}")
    assert "swim-agent.service" in output


def test_sysusers_creates_the_units_user_and_group(tmp_path: Path) -> None:
    """packaging/swim-sysusers.conf, applied by the real systemd-sysusers to an empty root,
    creates the user and group the unit runs as: a system account without a login."""
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers not installed (Debian package 'systemd')")
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    service = {k: v[-1] for k, v in _settings(UNIT.read_text())["Service"].items()}
    users, groups = _entries(tmp_path / "etc/passwd"), _entries(tmp_path / "etc/group")
    user, group = users[service["User"]], groups[service["Group"]]
    assert user[3] == group[2], "the user's primary group is the unit's group"
    assert int(user[2]) < 1000, "a system uid"
    assert user[6] == "/usr/sbin/nologin"


def _entries(path: Path) -> dict[str, list[str]]:
    """An /etc/passwd or /etc/group file: its colon-separated fields by name."""
    return {f[0]: f for f in (line.split(":") for line in path.read_text().splitlines()) if f[0]}
