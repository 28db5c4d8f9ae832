"""Agent configuration: TOML file, then command-line overrides, validated with clear errors.

Precedence: built-in defaults < ``--config FILE.toml`` < command-line flags. Every error
names the setting and says what is wrong; nothing is silently ignored (an unknown key in
the file is an error, as a typo there would otherwise be a silent misconfiguration).

File format (see packaging/agent.toml for a commented example)::

    node = "gpu-07"                 # default: the host name
    bind = "0.0.0.0:7946"           # UDP and TCP on the same port (memberlist convention)
    advertise = "10.0.0.7:7946"     # the address peers use; default: bind, or a local IP
    advertise_interface = "ib0"     # or: advertise this interface's address (IPv4, else
                                    # IPv6), resolved at start; the port is bind's
    join = ["10.0.0.1:7946"]        # contacted once at start
    retry_join = ["10.0.0.1"]       # retried every retry_interval_ms until one works
    retry_interval_ms = 30000
    retry_max = 0                   # 0: forever
    profile = "lan"                 # lan | wan | local | fast
    encrypt = "base64 key"          # or keyring_file = "/etc/swim/keyring.json"
    encrypt_file = "/etc/swim/gossip.key"  # or the key read from a file (mode 0600)
    data_dir = "/var/lib/swim"      # key changes saved to <data_dir>/keyring.json, which
                                    # then wins over encrypt/encrypt_file at start
    encrypt_verify_incoming = true  # false: also accept plaintext (rollout only; Serf's name)
    encrypt_verify_outgoing = true  # false: send plaintext (rollout only; Serf's name)
    control = "/run/swim/agent.sock"
    control_group = "swim"          # may use the socket; default swim (else the agent's group)
    admin_group = "swimadm"         # may also leave/force_leave/join/keys/tags; default none
    metrics_addr = "127.0.0.1:9946" # off unless set
    job_early_drop = true           # jobs stop waiting for a crashed node early (default:
                                    # on with profile fast; agent/crash_evidence.py)
    job_stall_drop = true           # a stalled job stops waiting for a suspect node
                                    # (default: on with fast; agent/stall_evidence.py)
    log_level = "info"
    leave_timeout_ms = 5000
    leave_propagate_delay_ms = 300  # leave intent first, so Serf peers say "left"
    reconnect_timeout_ms = 86400000 # failed members stay listed this long (Serf: 24h)
    tombstone_timeout_ms = 86400000 # left members stay listed this long (Serf: 24h)
    event_handlers = ["member-failed=/usr/local/bin/drain", "/usr/local/bin/log-all"]
    event_handler_timeout_ms = 30000 # a handler run longer than this is killed
    [tags]
    rack = "a3"
    [protocol]                      # any swim.Config field, e.g.
    probe_interval_ms = 1000
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import grp
import ipaddress
import json
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.departed import DEFAULT_RECONNECT_TIMEOUT_MS, DEFAULT_TOMBSTONE_TIMEOUT_MS
from agent.handlers import HandlerConfigError, HandlerSpec, parse_handler
from swim import META_MAX_BYTES, PROFILES, Config, ConfigError, Keyring

DEFAULT_PORT = 7946
DEFAULT_HANDLER_TIMEOUT_MS = 30_000
"""An event handler's run time before it is killed (agent/handler_runner.py)."""
LOG_LEVELS = ("debug", "info", "warning", "error")
EARLY_DROP_PROFILES = ("fast",)
"""Profiles whose agents drop a crashed node from job views on strong evidence by default
(``job_early_drop``): measured there (docs/tuning.md); the others keep the membership's
verdict, as before."""


class AgentConfigError(ValueError):
    """A setting that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(text: str, what: str, default_port: int | None = DEFAULT_PORT) -> HostPort:
    """``HOST:PORT``, ``[v6]:PORT`` or (with a default port) ``HOST``."""
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise AgentConfigError(f"{what}: {text!r} is missing the closing ']'")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise AgentConfigError(f"{what}: {text!r} is not [HOST]:PORT")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    if not host:
        raise AgentConfigError(f"{what}: {text!r} has no host")
    if not port_text:
        if default_port is None:
            raise AgentConfigError(f"{what}: {text!r} needs a port (HOST:PORT)")
        return HostPort(host, default_port)
    try:
        port = int(port_text)
    except ValueError:
        raise AgentConfigError(f"{what}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise AgentConfigError(f"{what}: port {port} is out of range 0..65535")
    return HostPort(host, port)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node: str = field(default_factory=socket.gethostname)
    bind: HostPort = HostPort("0.0.0.0", DEFAULT_PORT)
    advertise: HostPort | None = None
    join: tuple[str, ...] = ()
    retry_join: tuple[str, ...] = ()
    retry_interval_ms: int = 30_000
    retry_max: int = 0
    profile: str = "lan"
    tags: Mapping[str, str] = field(default_factory=dict)
    encrypt: str | None = None
    keyring_file: Path | None = None
    encrypt_file: Path | None = None
    data_dir: Path | None = None
    advertise_interface: str | None = None
    encrypt_verify_incoming: bool = True
    encrypt_verify_outgoing: bool = True
    control: Path | None = None
    control_group: str | None = None
    """The control socket's group (agent/access.py); None: ``swim``, else the agent's own."""
    admin_group: str | None = None
    """Members may also run the admin ops (agent/access.py); None: only root and the agent."""
    metrics_addr: HostPort | None = None
    log_level: str = "info"
    leave_timeout_ms: int = 5_000
    leave_propagate_delay_ms: int = 300
    reconnect_timeout_ms: int = DEFAULT_RECONNECT_TIMEOUT_MS
    tombstone_timeout_ms: int = DEFAULT_TOMBSTONE_TIMEOUT_MS
    protocol: Mapping[str, Any] = field(default_factory=dict)
    config_file: Path | None = None
    phi_capacity: int = 4096
    event_handlers: tuple[HandlerSpec, ...] = ()
    """``[filter=]COMMAND`` as Serf's ``-event-handler`` (agent/handlers.py), in order."""
    event_handler_timeout_ms: int = DEFAULT_HANDLER_TIMEOUT_MS
    job_early_drop: bool | None = None
    """A job stops waiting for a suspect node on strong crash evidence (a local trainer
    lost it and our own probe failed: agent/crash_evidence.py); None: on with ``fast``."""

    job_stall_drop: bool | None = None
    """A job stalled on this node stops waiting for a suspect member
    (agent/stall_evidence.py); None: on with ``fast``."""

    def stall_drop(self) -> bool:
        """``job_stall_drop``, or the profile's choice when unset (``EARLY_DROP_PROFILES``)."""
        return self._profile_default(self.job_stall_drop)

    def early_drop(self) -> bool:
        """``job_early_drop``, or the profile's choice when unset (``EARLY_DROP_PROFILES``)."""
        return self._profile_default(self.job_early_drop)

    def _profile_default(self, setting: bool | None) -> bool:
        return self.profile in EARLY_DROP_PROFILES if setting is None else setting

    def swim_config(self) -> Config:
        """The protocol configuration: the profile's preset with ``[protocol]`` overrides."""
        verify = {
            "gossip_verify_incoming": self.encrypt_verify_incoming,
            "gossip_verify_outgoing": self.encrypt_verify_outgoing,
        }
        try:
            return Config.profile(self.profile, **{**verify, **self.protocol})
        except ConfigError as exc:
            raise AgentConfigError(f"[protocol]: {exc}") from exc

    def keyring(self) -> Keyring | None:
        """The keyring from ``encrypt``, ``encrypt_file`` (one base64 key; surrounding
        whitespace is ignored) or ``keyring_file`` (a JSON list of base64 keys, primary
        first, as Serf's keyring file). A keyring saved in ``data_dir`` takes precedence
        over the first two at start: agent/keyfiles.py decides that."""
        if self.encrypt_file is not None:
            where = f"encrypt_file {self.encrypt_file}"
            text = read_key_material(self.encrypt_file, where, MAX_KEY_FILE_BYTES)
            return Keyring.from_base64([_key(text, where)])
        if self.keyring_file is not None:
            return read_keyring_file(self.keyring_file, "keyring_file")
        if self.encrypt is not None:
            try:
                return Keyring.from_base64([self.encrypt])
            except ValueError as exc:
                raise AgentConfigError(f"encrypt: {exc}") from exc
        return None


MAX_KEY_FILE_BYTES = 4096
"""An ``encrypt_file`` holds one key of 24 to 44 base64 characters; a larger file is not a
key file (a log or a certificate named by mistake) and is refused, not read whole."""
MAX_KEYRING_FILE_BYTES = 65536
"""A keyring file: over a thousand keys, where a rotation keeps two or three."""


def read_key_material(path: Path, where: str, limit: int) -> str:
    """The text of a key or keyring file, at most ``limit`` bytes; errors name ``where``."""
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise AgentConfigError(f"{where}: {exc.strerror}") from exc
    if len(data) > limit:
        raise AgentConfigError(f"{where}: larger than {limit} bytes, not a key file")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise AgentConfigError(f"{where}: not text") from None


def read_keyring_file(path: Path, what: str) -> Keyring:
    """A keyring file (Serf's format: a JSON list of base64 keys, primary first)."""
    where = f"{what} {path}"
    text = read_key_material(path, where, MAX_KEYRING_FILE_BYTES)
    try:
        keys = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AgentConfigError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise AgentConfigError(f"{where}: expected a JSON list of base64 keys")
    try:
        return Keyring.from_base64(keys)
    except ValueError as exc:
        raise AgentConfigError(f"{where}: {exc}") from exc


_FILE_KEYS = {f.name for f in dataclasses.fields(AgentConfig)} - {"config_file"}


def load(
    config_file: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> AgentConfig:
    """Defaults, then the TOML file, then ``overrides`` (CLI flags; None values skipped)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_read_toml(config_file))
    for key, value in (overrides or {}).items():
        if value is None or value == () or value == {}:
            continue
        if key == "tags" and "tags" in values:
            values["tags"] = {**values["tags"], **value}
        elif key == "event_handlers" and isinstance(values.get(key), list):
            values[key] = [*values[key], *value]  # as Serf: the flags' handlers come after
        else:
            values[key] = value
    return build(values, config_file)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise AgentConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise AgentConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise AgentConfigError(
            f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_FILE_KEYS))}"
        )
    return data


def build(values: Mapping[str, Any], config_file: Path | None = None) -> AgentConfig:
    """Validate raw values (from TOML or flags) into an AgentConfig."""
    v = dict(values)
    kwargs: dict[str, Any] = {"config_file": config_file}
    if "node" in v:
        kwargs["node"] = _text(v["node"], "node")
    if "bind" in v:
        kwargs["bind"] = _bind(_text(v["bind"], "bind"))
    if "advertise" in v:
        kwargs["advertise"] = _ip_host_port(_text(v["advertise"], "advertise"), "advertise")
    if "advertise_interface" in v:
        kwargs["advertise_interface"] = _interface(v["advertise_interface"])
    for key in ("join", "retry_join"):
        if key in v:
            kwargs[key] = tuple(_addresses(v[key], key))
    for key in (
        "retry_interval_ms",
        "retry_max",
        "leave_timeout_ms",
        "leave_propagate_delay_ms",
        "reconnect_timeout_ms",
        "tombstone_timeout_ms",
        "phi_capacity",
        "event_handler_timeout_ms",
    ):
        if key in v:
            kwargs[key] = _int(v[key], key)
    if "event_handlers" in v:
        kwargs["event_handlers"] = _handlers(v["event_handlers"])
    if "profile" in v:
        kwargs["profile"] = _choice(v["profile"], "profile", PROFILES)
    if "log_level" in v:
        kwargs["log_level"] = _choice(str(v["log_level"]).lower(), "log_level", LOG_LEVELS)
    if "tags" in v:
        kwargs["tags"] = _tags(v["tags"])
    if "encrypt" in v:
        kwargs["encrypt"] = _key(v["encrypt"])
    bools = ("encrypt_verify_incoming", "encrypt_verify_outgoing")
    for key in (*bools, "job_early_drop", "job_stall_drop"):
        if key in v:
            if not isinstance(v[key], bool):
                raise AgentConfigError(f"{key} must be true or false, got {v[key]!r}")
            kwargs[key] = v[key]
    for key in ("keyring_file", "control", "encrypt_file", "data_dir"):
        if key in v:  # a str from TOML, a Path from a click.Path flag
            value = str(v[key]) if isinstance(v[key], Path) else v[key]
            kwargs[key] = Path(_text(value, key))
    for key in ("control_group", "admin_group"):
        if key in v:
            kwargs[key] = _text(v[key], key)
            group_id(kwargs[key], key)
    if "metrics_addr" in v:
        kwargs["metrics_addr"] = parse_host_port(
            _text(v["metrics_addr"], "metrics_addr"), "metrics_addr", None
        )
    if "protocol" in v:
        if not isinstance(v["protocol"], Mapping):
            raise AgentConfigError("[protocol] must be a table of swim.Config fields")
        kwargs["protocol"] = _protocol(v["protocol"])
    config = AgentConfig(**kwargs)
    _check(config)
    return config


def _check(c: AgentConfig) -> None:
    keys = [k for k in ("encrypt", "encrypt_file", "keyring_file") if getattr(c, k) is not None]
    if len(keys) > 1:
        raise AgentConfigError(
            f"set only one of encrypt, encrypt_file and keyring_file, not {' and '.join(keys)}"
        )
    if c.advertise is not None and c.advertise_interface is not None:
        raise AgentConfigError(
            "set either advertise or advertise_interface, not both "
            "(with advertise_interface the port is bind's)"
        )
    if c.retry_interval_ms <= 0:
        raise AgentConfigError("retry_interval_ms must be > 0")
    if c.phi_capacity < 1:
        raise AgentConfigError("phi_capacity must be >= 1")
    if c.event_handler_timeout_ms < 1:
        raise AgentConfigError("event_handler_timeout_ms must be >= 1")
    for key in ("reconnect_timeout_ms", "tombstone_timeout_ms"):
        if getattr(c, key) < 0:
            raise AgentConfigError(f"{key} must be >= 0")
    c.swim_config()  # validates [protocol] against the profile
    from agent.serf import encode_tags

    if len(encode_tags(c.tags)) > META_MAX_BYTES:
        raise AgentConfigError(f"tags take more than {META_MAX_BYTES} bytes once encoded")


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise AgentConfigError(f"{what} must be a non-empty string, got {value!r}")
    return value.strip()


def group_id(name: str, what: str) -> int:
    """The gid of group ``name``; an error naming the setting ``what`` if there is none."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise AgentConfigError(
            f"{what}: there is no group {name!r} on this machine (create it, e.g. with "
            "packaging/swim-sysusers.conf or groupadd, or name another group)"
        ) from None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AgentConfigError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _choice(value: Any, what: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise AgentConfigError(f"{what} must be one of {', '.join(options)}, got {value!r}")
    return str(value)


def _bind(text: str) -> HostPort:
    hp = parse_host_port(text, "bind")
    try:
        ipaddress.ip_address(hp.host)
    except ValueError:
        raise AgentConfigError(f"bind: {hp.host!r} is not an IP address") from None
    return hp


def _ip_host_port(text: str, what: str) -> HostPort:
    hp = parse_host_port(text, what)
    try:
        ip = ipaddress.ip_address(hp.host)
    except ValueError:
        raise AgentConfigError(f"{what}: {hp.host!r} is not an IP address") from None
    if ip.is_unspecified:
        raise AgentConfigError(f"{what}: {hp.host} cannot be advertised; give a reachable IP")
    if hp.port == 0:
        raise AgentConfigError(f"{what}: port 0 cannot be advertised")
    return hp


def _addresses(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise AgentConfigError(f"{what} must be a list of HOST[:PORT] strings")
    out = []
    for item in value:
        parse_host_port(_text(item, what), what)  # validates the form
        out.append(item.strip())
    return out


def _tags(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise AgentConfigError("tags must be a table of string keys and values")
    tags: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or not isinstance(item, str):
            raise AgentConfigError(f"tag {key!r}: keys and values must be strings")
        tags[key] = item
    return tags


def parse_tag_args(items: tuple[str, ...] | list[str], what: str = "--tag") -> dict[str, str]:
    """``k=v`` items from the command line."""
    tags: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AgentConfigError(f"{what} {item!r}: expected KEY=VALUE")
        tags[key] = value
    return tags


def _key(value: Any, what: str = "encrypt") -> str:
    text = _text(value, what)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise AgentConfigError(f"{what}: the key is not valid base64") from None
    if len(raw) not in (16, 24, 32):
        raise AgentConfigError(f"{what}: the key must decode to 16, 24 or 32 bytes, got {len(raw)}")
    return text


def _handlers(value: Any) -> tuple[HandlerSpec, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(h, str) for h in value):
        raise AgentConfigError('event_handlers must be a list of "[filter=]COMMAND" strings')
    try:
        return tuple(parse_handler(h) for h in value)
    except HandlerConfigError as exc:
        raise AgentConfigError(str(exc)) from None


def _interface(value: Any) -> str:
    """A network interface name as Linux accepts one (``dev_valid_name``): under 16 bytes
    (IFNAMSIZ), no '/', ':' or white space, not '.' or '..'."""
    name = _text(value, "advertise_interface")
    if (
        len(name.encode()) > 15
        or name in (".", "..")
        or any(ch in "/:" or ch.isspace() for ch in name)
    ):
        raise AgentConfigError(f"advertise_interface: {name!r} is not an interface name")
    return name


def _protocol(value: Mapping[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise AgentConfigError(
            f"[protocol]: unknown field(s) {', '.join(unknown)} (see swim/config.py)"
        )
    return dict(value)
