"""Key material on disk: which keyring the agent starts with, where a key change is saved,
and a warning for every file holding a key that group or others can read.

Rules (Consul's ``data_dir`` behaviour, Serf's keyring file format):

- ``keyring_file`` set: that file is the keyring at start and is rewritten after every key
  change (``swimctl keys``, or a Serf ``keys`` query from another member).
- otherwise, with ``data_dir`` set, key changes are saved to ``<data_dir>/keyring.json``
  (``STATE_KEYRING``), and that file, when present, is the keyring at start: it takes
  precedence over ``encrypt``/``encrypt_file``, as Consul's saved keyring does over its
  ``encrypt``, so a rotated key survives a restart whatever the config file still says.
  Which source was used is logged (a warning when the configured key is not in the saved
  keyring: delete the saved file to start from the configured key).
- without either, a key change lives in memory only (until the agent stops).
- a keyring file is written atomically: a temporary file created mode 0600 in the same
  directory, written, flushed to disk, then renamed over the old one; a crash leaves the
  old file or the new one, never half of one, and the key is never in a file others can
  read, even for a moment.
- ``encrypt_file``, ``keyring_file``, the saved keyring, and a config file with an inline
  ``encrypt`` are checked at start: any of them with a permission bit for group or others
  (``st_mode & 0o077``) is logged as a warning and counted in ``info``'s
  ``stats.key_file_warnings``. The agent still starts: refusing would take a node out of
  the cluster for a permission an operator fixes with ``chmod 600``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path

from agent.config import AgentConfig, AgentConfigError, read_keyring_file
from swim import Keyring

log = logging.getLogger("swim.agent")

STATE_KEYRING = "keyring.json"
"""The saved keyring's name inside ``data_dir`` (Consul keeps ``serf/local.keyring``)."""


@dataclass(frozen=True, slots=True)
class StartKeys:
    """The keyring an agent starts with, where it came from, and where changes go."""

    keyring: Keyring | None
    source: str
    """For the log: ``encrypt``, ``encrypt_file PATH``, ``keyring_file PATH``, ``saved
    keyring PATH``, or ``""`` (no encryption)."""
    save_to: Path | None
    """The file rewritten after a key change; None: changes are not kept."""


def prepare_data_dir(config: AgentConfig) -> None:
    """Create ``data_dir`` (mode 0700) if missing; an error naming it if it is not a
    directory this user can write (found at start, not at the first key change)."""
    path = config.data_dir
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise AgentConfigError(f"data_dir {path}: not a directory")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise AgentConfigError(f"data_dir {path}: cannot create it: {exc.strerror}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise AgentConfigError(f"data_dir {path}: not writable by uid {os.geteuid()}")


def start_keys(config: AgentConfig) -> StartKeys:
    """The keyring to start with, by the rules above (``AgentConfigError`` naming the file
    or setting when one cannot be used); logs where it came from."""
    keys = _start_keys(config)
    if keys.keyring is not None:
        saved = f"; key changes are saved to {keys.save_to}" if keys.save_to else ""
        log.info("gossip keyring from %s (%d key(s))%s", keys.source, len(keys.keyring.keys), saved)
    return keys


def _start_keys(config: AgentConfig) -> StartKeys:
    if config.keyring_file is not None:
        path = config.keyring_file
        return StartKeys(config.keyring(), f"keyring_file {path}", path)
    saved = None if config.data_dir is None else config.data_dir / STATE_KEYRING
    if saved is not None and saved.exists():
        saved_ring = read_keyring_file(saved, "saved keyring")
        configured = _configured_source(config)
        if configured:
            key = config.keyring()
            if key is not None and key.primary_key not in saved_ring.keys:
                log.warning(
                    "%s is not in the saved keyring %s, which takes precedence: delete %s "
                    "to start from %s",
                    configured,
                    saved,
                    saved,
                    configured,
                )
        return StartKeys(saved_ring, f"saved keyring {saved}", saved)
    keyring = config.keyring()
    return StartKeys(keyring, _configured_source(config) if keyring else "", saved)


def _configured_source(config: AgentConfig) -> str:
    if config.encrypt_file is not None:
        return f"encrypt_file {config.encrypt_file}"
    return "encrypt" if config.encrypt is not None else ""


def exposure_warnings(config: AgentConfig, keys: StartKeys) -> list[str]:
    """One message per file holding a key that group or others may access; each is
    logged as a warning."""
    files: list[tuple[str, Path]] = []
    if config.encrypt_file is not None:
        files.append(("encrypt_file", config.encrypt_file))
    if keys.save_to is not None and keys.save_to.exists():
        files.append(("keyring_file" if config.keyring_file else "saved keyring", keys.save_to))
    if config.config_file is not None and _has_inline_key(config.config_file):
        files.append(("config file with an inline encrypt key", config.config_file))
    warnings = []
    for what, path in files:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError:
            continue  # unreadable files are reported where they are read
        if mode & 0o077:
            warnings.append(
                f"{what} {path} is mode {mode:04o}: group or others can read the gossip key; "
                f"chmod 600 it (owned by the agent's user)"
            )
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def _has_inline_key(path: Path) -> bool:
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError), path.open("rb") as fh:
        return "encrypt" in tomllib.load(fh)
    return False


def write_keyring(path: Path, keyring: Keyring) -> None:
    """The keyring file format serf reads: a JSON list of base64 keys, primary first;
    written atomically (see the module docstring), mode 0600 from its creation."""
    keys = [keyring.primary_key, *(k for k in keyring.keys if k != keyring.primary_key)]
    data = (json.dumps([base64.b64encode(k).decode() for k in keys]) + "\n").encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o600)  # O_CREAT's mode does not apply to an old file
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power cut
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
