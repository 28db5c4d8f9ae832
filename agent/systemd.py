"""systemd readiness and watchdog notifications (``sd_notify(3)``), without libsystemd.

The protocol is one datagram of newline-separated ``KEY=value`` assignments sent to the
AF_UNIX socket named by ``$NOTIFY_SOCKET``: ``READY=1`` once the agent serves,
``STATUS=...`` free text for ``systemctl status``, ``WATCHDOG=1`` at least every
``watchdog_interval_s()`` seconds, ``RELOADING=1`` / ``STOPPING=1`` around reload and
shutdown. Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "watchdog_interval_s"]


def _socket_address(value: str) -> str | None:
    if value.startswith("@"):
        # Linux abstract namespace: the leading '@' stands for a NUL byte.
        return "\0" + value[1:] if len(value) > 1 else None
    if value.startswith("/"):
        return value
    return None  # relative paths and other transports (vsock:...) are not supported


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``, ``"STATUS=joined 12 members"``, ``"WATCHDOG=1"``,
    ``"STOPPING=1"``; several assignments may be joined with ``"\\n"``) to systemd.

    Returns True when the datagram was sent; False when ``$NOTIFY_SOCKET`` is unset or
    unusable or the send failed. Never raises for a send error: the caller logs it.

    The socket is non-blocking so that a full notification queue can never stall the
    agent's event loop; a lost ``WATCHDOG=1`` is repeated at the next interval.
    """
    value = os.environ.get("NOTIFY_SOCKET")
    if not value or not state:
        return False
    address = _socket_address(value)
    if address is None:
        return False
    try:
        data = state.encode("utf-8")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sent = sock.sendto(data, address)
    except (OSError, UnicodeError, ValueError):
        return False
    return sent == len(data)


def watchdog_interval_s() -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``$WATCHDOG_USEC`` (the period systemd
    recommends, ``sd_watchdog_enabled(3)``), in seconds.

    None when the watchdog is not enabled for this process: ``$WATCHDOG_USEC`` unset, not a
    positive decimal integer, or ``$WATCHDOG_PID`` set to another process's pid.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if usec is None or not _is_decimal(usec):
        return None
    period = int(usec)
    if period <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None and (not _is_decimal(pid) or int(pid) != os.getpid()):
        return None
    return period / 2 / 1_000_000


def _is_decimal(text: str) -> bool:
    # Stricter than int(): no sign, spaces, underscores or non-ASCII digits (safe_atou64).
    return text.isascii() and text.isdigit()
