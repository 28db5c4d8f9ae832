"""Agent configuration: TOML + flags, precedence, and clear errors for bad input."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from agent.config import AgentConfigError, HostPort, load, parse_host_port, parse_tag_args

KEY = base64.b64encode(bytes(range(16))).decode()


def test_defaults() -> None:
    c = load()
    assert c.bind == HostPort("0.0.0.0", 7946)
    assert c.profile == "lan" and c.swim_config().probe_interval_ms == 1000
    assert c.keyring() is None and c.metrics_addr is None


def test_toml_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        'node = "gpu-07"\nbind = "127.0.0.1:8000"\njoin = ["10.0.0.1", "10.0.0.2:9000"]\n'
        'profile = "local"\nlog_level = "DEBUG"\n'
        '[tags]\nrack = "a3"\nzone = "z1"\n[protocol]\nprobe_interval_ms = 700\n'
    )
    c = load(f, {"node": "override", "tags": {"zone": "z2"}, "join": ()})
    assert c.node == "override"
    assert c.bind == HostPort("127.0.0.1", 8000)
    assert c.join == ("10.0.0.1", "10.0.0.2:9000")
    assert dict(c.tags) == {"rack": "a3", "zone": "z2"}
    assert c.log_level == "debug"
    assert c.swim_config().probe_interval_ms == 700
    assert c.swim_config().probe_timeout_ms == 200  # the local profile underneath


def test_fast_profile_with_protocol_overrides(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('profile = "fast"\n[protocol]\nprobe_timeout_max_ms = 100\n')
    c = load(f).swim_config()
    assert c.adaptive_probe_timeout and c.derived_suspicion
    assert (c.probe_interval_ms, c.probe_timeout_max_ms) == (250, 100)
    f.write_text('profile = "fast"\n[protocol]\nprobe_timeout_max_ms = 300\n')
    with pytest.raises(AgentConfigError, match="probe_timeout_max_ms"):
        load(f).swim_config()


@pytest.mark.parametrize(
    ("profile", "setting", "early"),
    [("fast", None, True), ("lan", None, False), ("fast", False, False), ("lan", True, True)],
)
def test_job_early_drop_follows_the_profile_unless_set(
    profile: str, setting: bool | None, early: bool
) -> None:
    assert load(None, {"profile": profile, "job_early_drop": setting}).early_drop() is early


def test_job_early_drop_must_be_a_bool(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('job_early_drop = "yes"\n')
    with pytest.raises(AgentConfigError, match="job_early_drop must be true or false"):
        load(f)


def test_packaged_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "packaging" / "agent.toml"
    c = load(example)
    assert c.swim_config() is not None
    assert c.encrypt is None and c.data_dir == Path("/var/lib/swim")


def test_packaged_fast_example_config() -> None:
    """packaging/agent-fast.toml: the GPU cluster example loads as it says."""
    c = load(Path(__file__).resolve().parents[2] / "packaging" / "agent-fast.toml")
    assert c.profile == "fast" and c.swim_config().adaptive_probe_timeout
    assert c.advertise is None and c.advertise_interface == "ib0"
    assert c.encrypt is None and c.encrypt_file == Path("/etc/swim/gossip.key")
    assert c.data_dir == Path("/var/lib/swim") and c.control == Path("/run/swim/agent.sock")
    assert c.metrics_addr is not None and c.metrics_addr.host == "127.0.0.1"
    assert "rack" in c.tags and c.retry_join


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('nodename = "x"\n', "unknown setting(s) nodename"),
        ('bind = "localhost:7946"\n', "not an IP address"),
        ('bind = "1.2.3.4:99999"\n', "out of range"),
        ('advertise = "0.0.0.0:7946"\n', "cannot be advertised"),
        ('profile = "fast-ish"\n', "profile must be one of"),
        ("retry_interval_ms = -1\n", "non-negative integer"),
        ('join = "10.0.0.1:x"\n', "is not a number"),
        ('encrypt = "not base64!"\n', "not valid base64"),
        (f'encrypt = "{base64.b64encode(b"short").decode()}"\n', "16, 24 or 32 bytes"),
        ("[protocol]\nprobe_timeout_ms = 5000\n", "[protocol]: probe_timeout_ms"),
        ("[protocol]\nprobe_intervl_ms = 5\n", "unknown field(s) probe_intervl_ms"),
        ("[tags]\nrack = 3\n", "keys and values must be strings"),
        ('metrics_addr = "127.0.0.1"\n', "needs a port"),
        ("this is = not toml", "not valid TOML"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path: Path, toml: str, message: str) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(toml)
    with pytest.raises(AgentConfigError) as err:
        load(f).keyring()
    assert message in str(err.value)


def test_missing_file_and_both_key_sources(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match="cannot read config file"):
        load(tmp_path / "nope.toml")
    ring = tmp_path / "keyring.json"
    ring.write_text(json.dumps([KEY]))
    with pytest.raises(
        AgentConfigError,
        match="only one of encrypt, encrypt_file and keyring_file, not encrypt and keyring_file",
    ):
        load(None, {"encrypt": KEY, "keyring_file": str(ring)})


def test_keyring_file(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    other = base64.b64encode(bytes(32)).decode()
    ring.write_text(json.dumps([KEY, other]))
    keyring = load(None, {"keyring_file": str(ring)}).keyring()
    assert keyring is not None and keyring.primary_key == bytes(range(16))
    assert len(keyring.keys) == 2
    ring.write_text('{"not": "a list"}')
    with pytest.raises(AgentConfigError, match="JSON list of base64 keys"):
        load(None, {"keyring_file": str(ring)}).keyring()


def test_tags_too_big_for_memberlist_meta() -> None:
    with pytest.raises(AgentConfigError, match="512 bytes"):
        load(None, {"tags": {"k": "v" * 600}})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.2.3.4:80", HostPort("1.2.3.4", 80)),
        ("1.2.3.4", HostPort("1.2.3.4", 7946)),
        ("[::1]:9", HostPort("::1", 9)),
        ("host.example", HostPort("host.example", 7946)),
    ],
)
def test_parse_host_port(text: str, expected: HostPort) -> None:
    assert parse_host_port(text, "x") == expected


def test_tag_args() -> None:
    assert parse_tag_args(["a=1", "b=x=y", "c="]) == {"a": "1", "b": "x=y", "c": ""}
    with pytest.raises(AgentConfigError, match="KEY=VALUE"):
        parse_tag_args(["novalue"])
