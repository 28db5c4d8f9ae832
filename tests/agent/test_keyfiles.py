"""Key material on disk (agent/keyfiles.py, ``encrypt_file`` in agent/config.py): a key read
from a file with errors naming it, one key source at a time, a warning for a key others can
read, the keyring written 0600 and atomically, and the saved keyring in ``data_dir`` taking
precedence at start. The last test rotates keys on real agent processes through the control
API, restarts one, and sees it come back (and rejoin) with the rotated keyring."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import stat
from pathlib import Path

import pytest

from agent.config import AgentConfigError, load
from agent.control import ControlError
from agent.demo import LocalAgent, wait_converged
from agent.keyfiles import (
    STATE_KEYRING,
    exposure_warnings,
    prepare_data_dir,
    start_keys,
    write_keyring,
)
from agent.procs import until
from swim import Keyring

RAW = bytes(range(16))
KEY = base64.b64encode(RAW).decode()
NEW_RAW = bytes(range(100, 132))
NEW = base64.b64encode(NEW_RAW).decode()


def _file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_encrypt_file_strips_whitespace(tmp_path: Path) -> None:
    key_file = _file(tmp_path / "gossip.key", f"\n  {KEY}  \n")
    keyring = load(None, {"encrypt_file": str(key_file)}).keyring()
    assert keyring is not None and keyring.keys == (RAW,)
    toml = _file(tmp_path / "agent.toml", f'encrypt_file = "{key_file}"\n')
    assert load(toml).encrypt_file == key_file


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file or directory"),
        ("", "must be a non-empty string"),
        ("not base64!", "the key is not valid base64"),
        (base64.b64encode(bytes(10)).decode(), "16, 24 or 32 bytes, got 10"),
        ("A" * 5000, "larger than 4096 bytes"),
        (b"\xff\xfe".decode("latin-1"), "not text"),
    ],
)
def test_encrypt_file_errors_name_the_file(
    tmp_path: Path, content: str | None, message: str
) -> None:
    key_file = tmp_path / "gossip.key"
    if content is not None:
        key_file.write_bytes(content.encode("latin-1"))
    with pytest.raises(AgentConfigError) as err:
        load(None, {"encrypt_file": str(key_file)}).keyring()
    assert f"encrypt_file {key_file}" in str(err.value) and message in str(err.value)


def test_one_key_source_at_a_time(tmp_path: Path) -> None:
    key_file = _file(tmp_path / "gossip.key", KEY)
    for other in ({"encrypt": KEY}, {"keyring_file": str(tmp_path / "ring.json")}):
        with pytest.raises(AgentConfigError, match="only one of encrypt, encrypt_file"):
            load(None, {"encrypt_file": str(key_file), **other})


def test_warnings_for_keys_others_can_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = _file(tmp_path / "gossip.key", KEY, 0o640)
    config = load(None, {"encrypt_file": str(key_file)})
    (warning,) = exposure_warnings(config, start_keys(config))
    assert f"encrypt_file {key_file} is mode 0640" in warning and "chmod 600" in warning
    assert warning in caplog.text
    key_file.chmod(0o600)
    assert exposure_warnings(config, start_keys(config)) == []

    inline = _file(tmp_path / "inline.toml", f'encrypt = "{KEY}"\n', 0o644)
    config = load(inline)
    (warning,) = exposure_warnings(config, start_keys(config))
    assert "config file with an inline encrypt key" in warning and "0644" in warning
    no_key = _file(tmp_path / "plain.toml", 'profile = "lan"\n', 0o644)
    config = load(no_key, {"encrypt": KEY})  # a flag's key is not in the file
    assert exposure_warnings(config, start_keys(config)) == []

    ring = _file(tmp_path / "ring.json", json.dumps([KEY]), 0o604)
    config = load(None, {"keyring_file": str(ring)})
    (warning,) = exposure_warnings(config, start_keys(config))
    assert f"keyring_file {ring} is mode 0604" in warning


def test_write_keyring_is_0600_atomic_and_primary_first(tmp_path: Path) -> None:
    path = tmp_path / "ring.json"
    _file(path, "old", 0o644)
    old_umask = os.umask(0)
    try:
        write_keyring(path, Keyring([RAW, NEW_RAW], primary=NEW_RAW))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == [NEW, KEY]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ring.json"]  # no temp file left


def test_saved_keyring_takes_precedence(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "swim.agent")
    data = tmp_path / "state" / "swim"
    key_file = _file(tmp_path / "gossip.key", KEY)
    config = load(None, {"encrypt_file": str(key_file), "data_dir": str(data)})
    prepare_data_dir(config)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    saved = data / STATE_KEYRING
    first = start_keys(config)  # nothing saved yet: the configured key, saved on a change
    assert first.keyring is not None and first.keyring.keys == (RAW,)
    assert first.source == f"encrypt_file {key_file}" and first.save_to == saved
    write_keyring(saved, Keyring([NEW_RAW]))
    caplog.clear()
    again = start_keys(config)
    assert again.keyring is not None and again.keyring.keys == (NEW_RAW,)
    assert again.source == f"saved keyring {saved}"
    assert f"gossip keyring from saved keyring {saved}" in caplog.text
    assert f"encrypt_file {key_file} is not in the saved keyring" in caplog.text

    # keyring_file set: that file is read and rewritten; data_dir's saved keyring is not used
    ring = _file(tmp_path / "ring.json", json.dumps([KEY]))
    config = load(None, {"keyring_file": str(ring), "data_dir": str(data)})
    keys = start_keys(config)
    assert keys.keyring is not None and keys.keyring.keys == (RAW,) and keys.save_to == ring
    # no encryption configured, nothing saved: nothing to keep
    empty = tmp_path / "empty"
    assert start_keys(load(None, {"data_dir": str(empty)})).keyring is None


def test_data_dir_that_cannot_be_used(tmp_path: Path) -> None:
    not_dir = _file(tmp_path / "file", "")
    with pytest.raises(AgentConfigError, match=f"data_dir {not_dir}: not a directory"):
        prepare_data_dir(load(None, {"data_dir": str(not_dir)}))
    with pytest.raises(AgentConfigError, match=r"data_dir .*: cannot create it"):
        prepare_data_dir(load(None, {"data_dir": str(not_dir / "below")}))


def test_rotation_survives_a_restart(tmp_path: Path) -> None:
    """Two real agents: a (encrypt_file + data_dir) and b (keyring_file). Rotate both to a
    new key through the control API (install, use, remove), restart a: it comes back with
    the rotated keyring from data_dir, not the old key still in its encrypt_file, and
    rejoins b, which only speaks the new key now."""
    key_file = _file(tmp_path / "gossip.key", KEY)
    ring = _file(tmp_path / "ring.json", json.dumps([KEY]))
    data = tmp_path / "data"
    a_args = ["--encrypt-file", str(key_file), "--data-dir", str(data)]
    a = LocalAgent("a", tmp_path, "local", None, a_args)
    agents = [a]
    try:
        a.wait_ready(20)
        b = LocalAgent("b", tmp_path, "local", a.port, ["--keyring-file", str(ring)])
        agents.append(b)
        b.wait_ready(20)
        wait_converged(agents, 30)
        for agent in agents:
            for action, key in (("install", NEW), ("use", NEW), ("remove", KEY)):
                agent.client.request("keys", action=action, key=key)
            assert agent.client.request("keys", action="list") == {"keys": [NEW], "primary": NEW}
        assert json.loads((data / STATE_KEYRING).read_text()) == [NEW]
        assert stat.S_IMODE((data / STATE_KEYRING).stat().st_mode) == 0o600
        assert json.loads(ring.read_text()) == [NEW]  # keyring_file: rewritten in place
        assert key_file.read_text() == KEY  # the configured key file is never written
        ring.unlink()
        ring.mkdir()  # a keyring file that cannot be replaced: the client is told
        with pytest.raises(ControlError, match=f"changed in memory but was not saved to {ring}"):
            b.client.request("keys", action="install", key=KEY)
        ring.rmdir()

        a.stop(signal.SIGTERM)
        until(lambda: b.members()["a"]["status"] == "left", 20, "a left, seen by b")
        a = LocalAgent("a", tmp_path, "local", b.port, [*a_args, "--bind", f"127.0.0.1:{a.port}"])
        agents[0] = a
        a.wait_ready(20)
        assert a.client.request("keys", action="list") == {"keys": [NEW], "primary": NEW}
        wait_converged(agents, 30)  # only possible with the new key: b has no other
        log = a.log_path.read_text()
        assert f"gossip keyring from saved keyring {data / STATE_KEYRING}" in log
        info = a.client.request("info")
        assert info["encrypted"] is True and info["stats"]["key_file_warnings"] == 0
    except (AssertionError, ControlError, TimeoutError) as exc:
        for agent in agents:
            exc.add_note(f"{agent.name} log:\n{agent.log_path.read_text()[-3000:]}")
        raise
    finally:
        for agent in agents:
            agent.stop(signal.SIGKILL)
