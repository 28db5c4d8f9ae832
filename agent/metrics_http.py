"""The agent's small HTTP server, on ``metrics_addr``: Prometheus metrics (agent/metrics.py)
at ``GET /metrics``, the status page (agent/status_page.py) at ``/``, and the page's JSON
endpoints ``/v1/members``, ``/v1/events``, ``/v1/jobs``, ``/v1/info`` and ``/healthz``
(agent/status.py, where their schemas are). ``HEAD`` too; nothing else.

Rules: read-only (any other method is 405; nothing served changes the agent, and no key
material is ever served). Bounded in connections (``MAX_CONNECTIONS``; more are closed at
once), in request size (``MAX_REQUEST_HEAD_BYTES``; a longer head is answered 431) and in
time (the whole exchange within ``CONNECTION_TIMEOUT_S``; a JSON endpoint waits at most
``agent.status.AGENT_WAIT_S`` for the agent, then answers 503), so a scraper or browser
that misbehaves costs one connection, never the agent. One request per connection
(``Connection: close``). The endpoints see the agent only through ``agent.api.AgentAPI``.
"""

from __future__ import annotations

import logging

import trio

from agent.api import AgentAPI
from agent.metrics import CONTENT_TYPE_LATEST, AgentMetrics
from agent.status import StatusEndpoints
from agent.status_page import CONTENT_SECURITY_POLICY, PAGE

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
    503: "Service Unavailable",
}
_JSON = "application/json"
_PAGE_HEADERS = (
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
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
        "X-Content-Type-Options: nosniff",
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


async def _route(metrics: AgentMetrics, status: StatusEndpoints | None, head: bytes) -> bytes:
    request_line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise _BadRequest(400)
    method, target = parts[0], parts[1]
    path, _, query = target.partition(b"?")
    if path not in (b"/", b"/metrics") and (status is None or path not in status.routes):
        return _response(404, b"not found; metrics are at /metrics, the status page at /\n")
    if method not in (b"GET", b"HEAD"):
        return _response(405, b"method not allowed\n", extra=(("Allow", "GET, HEAD"),))
    head_only = method == b"HEAD"
    if path == b"/":
        return _response(
            200, PAGE, "text/html; charset=utf-8", head_only=head_only, extra=_PAGE_HEADERS
        )
    if path == b"/metrics":
        try:
            body = metrics.render()
        except Exception:
            log.exception("metrics: rendering the metrics failed")
            return _response(500, b"rendering the metrics failed; see the agent log\n")
        return _response(200, body, CONTENT_TYPE_LATEST, head_only=head_only)
    assert status is not None  # the path is one of its routes
    try:
        reply = await status.answer(path, query)
    except Exception:
        log.exception("status: %s failed", path.decode("latin-1"))
        return _response(500, b'{"error":"internal error; see the agent log"}', _JSON)
    if reply is None:  # not reached: the routes were checked above
        return _response(404, b"not found\n")
    return _response(reply.status, reply.body, _JSON, head_only=head_only)


async def serve_metrics(
    metrics: AgentMetrics,
    host: str,
    port: int,
    *,
    agent: AgentAPI | None = None,
    timeout_s: float = CONNECTION_TIMEOUT_S,
    max_request_head_bytes: int = MAX_REQUEST_HEAD_BYTES,
    max_connections: int = MAX_CONNECTIONS,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` over HTTP/1.1 on ``host:port`` until cancelled, and with
    ``agent`` the status page's JSON endpoints (without one they are 404).

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
    status = None if agent is None else StatusEndpoints(agent)

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
                    response = await _route(metrics, status, head)
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

    log.info("metrics: serving http://%s:%d/metrics and the status page", host, bound_port)
    async with trio.open_nursery() as nursery:
        if status is not None:
            await nursery.start(status.run)
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(bound_port)
