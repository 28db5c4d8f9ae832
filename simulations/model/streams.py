"""Stream (TCP) traffic in the simulated world: what the two ends read off the bytes.

Rules:
- A stream carries the real bytes a node emitted (push-pull, TCP fallback ping). The
  server reads the request with its own ``Node.parse_stream`` and answers with
  ``handle_stream``; the client reads the reply with its own ``parse_stream`` and hands it
  to ``handle_stream_response``, as the agent's stream reader does.
- A malformed request is a drop the server counts (``record_drop``), and the client sees
  "bad request"; a malformed reply is the client's error text, a truncated one "truncated
  reply". Timing (three one-way delays before the server sees a connection, refusal by a
  dead server, timeouts) is the world's (``simulations.model.world``).
"""

from __future__ import annotations

from swim import Node, StreamMessage, WireError


def read_request(server: Node, data: bytes) -> StreamMessage | None:
    """The request ``server`` reads from ``data``; None if it cannot (the drop counted)."""
    try:
        parsed = server.parse_stream(data)
    except WireError as exc:
        server.record_drop(exc.reason)
        return None
    return None if parsed is None else parsed[0]


def read_reply(client: Node, reply: bytes | None, error: str) -> tuple[StreamMessage | None, str]:
    """The reply ``client`` reads (None without one) and the error text it is handed."""
    if reply is None:
        return None, error
    try:
        got = client.parse_stream(reply)
    except WireError as exc:
        return None, str(exc)
    if got is None:
        return None, "truncated reply"
    return got[0], error


__all__ = ["read_reply", "read_request"]
