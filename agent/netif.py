"""A network interface's address, for ``advertise_interface``: what config management can
name on every node of a GPU cluster (``ib0``, ``bond0``) where each node's IP differs.

Rules:
- the interface must exist (``socket.if_nameindex``); else an error naming it and the
  interfaces there are.
- its IPv4 address (the ``SIOCGIFADDR`` ioctl, as ``ifconfig`` reads it: the interface's
  primary address) is advertised; without one, its first global IPv6 address
  (``/proc/net/if_inet6``, the kernel's table that ``ip -6 addr`` shows). Link-local IPv6
  (``fe80::/10``) is never chosen: peers could only reach it with a zone index, which
  memberlist's addresses cannot carry. Without either, an error naming the interface.
- resolved once, at start: an address that changes later needs a restart (as Consul's
  ``-bind`` with a go-sockaddr template).
Linux only (the ioctl and the proc file); elsewhere an error says so.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

from agent.config import AgentConfigError

__all__ = ["InterfaceError", "interface_address"]

SIOCGIFADDR = 0x8915
"""linux/sockios.h: get an interface's (primary) IPv4 address."""
IFNAMSIZ = 16
IF_INET6 = Path("/proc/net/if_inet6")
SCOPE_GLOBAL = 0x00
"""``if_inet6``'s scope column: 0x00 global, 0x20 link, 0x10 host, 0x40 site."""
IFA_F_DADFAILED = 0x08
"""``if_inet6``'s flags column (linux/if_addr.h): duplicate address detection failed."""


class InterfaceError(AgentConfigError):
    """The interface does not exist or has no address to advertise; the message names it."""


def interface_address(name: str) -> str:
    """The address to advertise for interface ``name``: IPv4 if it has one, else IPv6."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError as exc:
        raise InterfaceError(f"advertise_interface {name}: cannot list interfaces: {exc}") from exc
    if name not in names:
        raise InterfaceError(
            f"advertise_interface {name}: no such interface (there are: {', '.join(names)})"
        )
    v4 = _ipv4(name)
    if v4 is not None:
        return v4
    v6 = _ipv6(name)
    if v6 is not None:
        return v6
    raise InterfaceError(
        f"advertise_interface {name}: the interface has no IPv4 or global IPv6 address"
    )


def _ipv4(name: str) -> str | None:
    request = struct.pack("256s", name.encode()[: IFNAMSIZ - 1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
        except OSError:  # EADDRNOTAVAIL: no IPv4 address on it
            return None
    # struct ifreq: the name (16 bytes), then a sockaddr_in (family, port, address)
    return socket.inet_ntoa(reply[20:24])


def _ipv6(name: str) -> str | None:
    try:
        lines = IF_INET6.read_text().splitlines()
    except OSError:  # no IPv6 in this kernel
        return None
    for line in lines:
        fields = line.split()
        if len(fields) != 6 or fields[5] != name or int(fields[3], 16) != SCOPE_GLOBAL:
            continue
        if int(fields[4], 16) & IFA_F_DADFAILED:
            continue
        return str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return None
