"""Protocol messages as frozen dataclasses, one per memberlist message type.

Rules: messages are immutable values with Python names and types; only ``swim.wire``
turns them into bytes and back (memberlist's Go field names live there). Integer fields
keep memberlist's ranges (uint32 sequence numbers and incarnations, uint16 ports) and
``swim.wire`` rejects anything outside them. Addresses travel as raw IP bytes (4 for IPv4,
16 for IPv6), as Go's ``net.IP`` does.

Source: hashicorp/memberlist @ 1b4c746 net.go (``ping``, ``indirectPingReq``, ``ackResp``,
``nackResp``, ``errResp``, ``suspect``, ``alive``, ``dead``, ``pushPullHeader``,
``pushNodeState``, ``userMsgHeader``) and the ``messageType`` constants, which are part of
the protocol and only ever appended to.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from swim.frozen import fast_init


class MsgType(IntEnum):
    """net.go ``messageType``: the first byte of every packet and stream."""

    PING = 0
    INDIRECT_PING = 1
    ACK = 2
    SUSPECT = 3
    ALIVE = 4
    DEAD = 5
    PUSH_PULL = 6
    COMPOUND = 7
    USER = 8
    COMPRESS = 9
    ENCRYPT = 10
    NACK = 11
    HAS_CRC = 12
    ERR = 13
    HAS_LABEL = 244


class NodeStateType(IntEnum):
    """state.go ``NodeStateType`` as carried in push-pull node states."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


class Address(NamedTuple):
    """A UDP/TCP endpoint: an IP address in text form and a port.

    A named tuple, not a dataclass: it is the key of the per-datagram lookups (the member
    table's address index, a simulator's routing table), and a tuple's hash and equality
    run in C, about 4x faster than a dataclass's generated Python methods."""

    host: str
    port: int

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @property
    def ip_bytes(self) -> bytes:
        """The address as Go's ``net.IP`` bytes (4 bytes for IPv4)."""
        return ip_to_bytes(self.host)

    @classmethod
    def from_ip_bytes(cls, ip: bytes, port: int) -> Address:
        return address_from_ip(ip, port)


_IP_CACHE = 1 << 16
"""Addresses remembered by the two converters: parsing an IP per packet is costly, and a
cluster has few distinct addresses (these are pure functions; the cache only saves time)."""


@functools.lru_cache(maxsize=_IP_CACHE)
def ip_to_bytes(host: str) -> bytes:
    ip = ipaddress.ip_address(host)
    return ip.packed


@functools.lru_cache(maxsize=_IP_CACHE)
def address_from_ip(ip: bytes, port: int) -> Address:
    """``Address(ip_from_bytes(ip), port)``: one per ping's advertised source, and a named
    tuple's ``__new__`` is a Python function."""
    return Address(ip_from_bytes(ip), port)


@functools.lru_cache(maxsize=_IP_CACHE)
def ip_from_bytes(ip: bytes) -> str:
    """Text form of a ``net.IP``; 16-byte IPv4-mapped addresses come back as IPv4."""
    if len(ip) == 4:
        return str(ipaddress.IPv4Address(ip))
    if len(ip) == 16:
        v6 = ipaddress.IPv6Address(ip)
        mapped = v6.ipv4_mapped
        return str(mapped) if mapped is not None else str(v6)
    raise ValueError(f"an IP address has 4 or 16 bytes, got {len(ip)}")


@dataclass(frozen=True, slots=True)
class Ping:
    """Direct probe. ``node`` names the intended target so a restarted process with another
    name does not answer for it; the source fields let the target reply directly."""

    seq_no: int
    node: str
    source_addr: bytes = b""
    source_port: int = 0
    source_node: str = ""


@dataclass(frozen=True, slots=True)
class IndirectPing:
    """Ask a helper to ping ``node`` at ``target:port`` and relay the ack (SWIM ping-req)."""

    seq_no: int
    target: bytes
    port: int
    node: str
    nack: bool = False
    source_addr: bytes = b""
    source_port: int = 0
    source_node: str = ""


@dataclass(frozen=True, slots=True)
class Ack:
    seq_no: int
    payload: bytes = b""


@dataclass(frozen=True, slots=True)
class Nack:
    """A helper's answer that it could not reach the target in time (Lifeguard §IV-A)."""

    seq_no: int


@dataclass(frozen=True, slots=True)
class ErrResp:
    error: str


@dataclass(frozen=True, slots=True)
class Suspect:
    incarnation: int
    node: str
    sender: str
    """Who suspects (memberlist's ``From``)."""


@dataclass(frozen=True, slots=True)
class Alive:
    incarnation: int
    node: str
    addr: bytes
    port: int
    meta: bytes = b""
    vsn: bytes = b""
    """Protocol versions: pmin, pmax, pcur, dmin, dmax, dcur (Go ``[]uint8``)."""


@dataclass(frozen=True, slots=True)
class Dead:
    incarnation: int
    node: str
    sender: str
    """Who declares it (memberlist's ``From``); equal to ``node`` means it left."""


@dataclass(frozen=True, slots=True)
class UserMsg:
    """Opaque application payload (memberlist delegate messages; Serf's events live here)."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class PushNodeState:
    name: str
    addr: bytes
    port: int
    meta: bytes
    incarnation: int
    state: NodeStateType
    vsn: bytes


@dataclass(frozen=True, slots=True)
class PushPull:
    """Full state exchange over a stream: the sender's whole member table."""

    join: bool
    nodes: tuple[PushNodeState, ...]
    user_state: bytes = b""


Message = Ping | IndirectPing | Ack | Nack | ErrResp | Suspect | Alive | Dead | UserMsg
"""Messages that travel in UDP packets (push-pull only travels on streams)."""


# made on every input: the faster, same-signature __init__ (swim.frozen)
for _cls in (
    Ping,
    IndirectPing,
    Ack,
    Nack,
    ErrResp,
    Suspect,
    Alive,
    Dead,
    UserMsg,
    PushNodeState,
    PushPull,
):
    fast_init(_cls)
