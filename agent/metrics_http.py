"""A minimal trio HTTP server for one agent's Prometheus metrics (agent/metrics.py builds
them): ``GET /metrics`` (and ``HEAD``), an index page at ``/``, nothing else.

Rules: bounded in connections (``MAX_CONNECTIONS``; more are closed at once), in request
size (``MAX_REQUEST_HEAD_BYTES``; a longer head is answered 431) and in time (the whole
exchange within ``CONNECTION_TIMEOUT_S``), so a scraper that misbehaves costs one
connection, never the agent. One request per connection (``Connection: close``).
"""

from __future__ import annotations

import logging

import trio

from agent.metrics import CONTENT_TYPE_LATEST, AgentMetrics

__all__ = [
    "CONNECTION_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_REQUEST_HEAD_BYTES",
    "serve_metrics",
]

log = logging.getLogger("agent.metrics")

MAX_REQUEST_HEAD_BYTES = 8 * 1024
"""Request line plus headers; a longer head is answered 431 and the connection closed."""
CONNECTION_TIMEOUT_S = 5.0
"""The whole exchange (read the request, write the response) must finish in this time, so a
slow-loris client — or one that never reads the response — cannot hold a connection."""
_MAX_DRAIN_BYTES = 64 * 1024
MAX_CONNECTIONS = 64
"""Concurrent connections; more are closed at once (Prometheus scrapes one at a time)."""

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}
_INDEX = (
    b"<!DOCTYPE html>\n<html><head><title>swim agent</title></head><body>\n"
    b'<h1>swim agent</h1>\n<p><a href="/metrics">Metrics</a></p>\n</body></html>\n'
)


class _BadRequest(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        "Connection: close",
        *(f"{k}: {v}" for k, v in extra),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return head if head_only else head + body


async def _read_head(stream: trio.abc.ReceiveStream, limit: int) -> bytes | None:
    """The request head (up to the blank line), None on EOF before it ends."""
    buf = bytearray()
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            end = buf.find(b"\n\n")
        if end >= 0:
            if end > limit:
                raise _BadRequest(431)
            return bytes(buf[:end])
        if len(buf) > limit:
            raise _BadRequest(431)
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        buf += chunk


async def _finish(stream: trio.SocketStream) -> None:
    """Half-close and drain what the client still sends until it closes: closing a socket
    with unread input makes the kernel send RST, which can destroy the response before the
    client reads it. The caller's deadline bounds this."""
    await stream.send_eof()
    drained = 0
    while drained <= _MAX_DRAIN_BYTES:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return
        drained += len(chunk)


def _route(metrics: AgentMetrics, head: bytes) -> bytes:
    request_line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise _BadRequest(400)
    method, target = parts[0], parts[1]
    path = target.split(b"?", 1)[0]
    if path not in (b"/", b"/metrics"):
        return _response(404, b"not found; metrics are at /metrics\n")
    if method not in (b"GET", b"HEAD"):
        return _response(405, b"method not allowed\n", extra=(("Allow", "GET, HEAD"),))
    head_only = method == b"HEAD"
    if path == b"/":
        return _response(200, _INDEX, "text/html; charset=utf-8", head_only=head_only)
    try:
        body = metrics.render()
    except Exception:
        log.exception("metrics: rendering the metrics failed")
        return _response(500, b"rendering the metrics failed; see the agent log\n")
    return _response(200, body, CONTENT_TYPE_LATEST, head_only=head_only)


async def serve_metrics(
    metrics: AgentMetrics,
    host: str,
    port: int,
    *,
    timeout_s: float = CONNECTION_TIMEOUT_S,
    max_request_head_bytes: int = MAX_REQUEST_HEAD_BYTES,
    max_connections: int = MAX_CONNECTIONS,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` over HTTP/1.1 on ``host:port`` until cancelled.

    One request per connection (``Connection: close``). ``task_status.started`` receives
    the bound port, so ``port=0`` works. When ``host`` resolves to several addresses and
    ``port`` is 0, only the first address is served (each would get a different port).
    A failure on one connection is logged and never stops the server.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len(listeners) > 1:
        for extra_listener in listeners[1:]:
            await extra_listener.aclose()
        listeners = listeners[:1]
    bound_port: int = listeners[0].socket.getsockname()[1]
    active = 0

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal active
        if active >= max_connections:
            await trio.aclose_forcefully(stream)
            return
        active += 1
        try:
            with trio.move_on_after(timeout_s) as scope:
                try:
                    head = await _read_head(stream, max_request_head_bytes)
                    if head is None:
                        return
                    response = _route(metrics, head)
                except _BadRequest as exc:
                    response = _response(exc.status, f"{_REASONS[exc.status]}\n".encode())
                await stream.send_all(response)
                await _finish(stream)
            if scope.cancelled_caught:
                log.debug("metrics: connection timed out after %.1f s", timeout_s)
        except Exception as exc:  # one connection's failure must not stop the server
            log.debug("metrics: connection failed: %r", exc)
        finally:
            active -= 1
            await trio.aclose_forcefully(stream)

    log.info("metrics: serving http://%s:%d/metrics", host, bound_port)
    task_status.started(bound_port)
    await trio.serve_listeners(handle, listeners)
