"""The transport seam (agent/transport.py) on the memory network (agent/memory_transport.py):
what the network delivers and drops, and the bounds ``Streams`` keeps over any transport
(parse errors counted, deadlines, a refused or unreachable peer), on a MockClock."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from agent.memory_transport import MemoryNetwork, address_of
from agent.transport import Streams
from swim import Address, DropReason, StreamKind, StreamRequest, WireError

pytestmark = pytest.mark.trio
A, B, C = address_of(1), address_of(2), address_of(3)


async def test_datagrams_reach_attached_reachable_members_only() -> None:
    net = MemoryNetwork(random.Random(1))
    a, b = net.attach(A), net.attach(B)
    a.send_datagram(B, b"hello")
    assert b.receive_datagram_nowait() == (A, b"hello")
    assert b.receive_datagram_nowait() is None
    a.send_datagram(C, b"nobody")  # not attached
    net.partition({A}, {B})
    a.send_datagram(B, b"cut")
    net.heal()
    net.loss(A, 1.0)
    a.send_datagram(B, b"lost")
    assert b.receive_datagram_nowait() is None
    assert (net.delivered, net.dropped) == (1, 3)
    net.loss(A, 0.0)
    net.crash(B)
    a.send_datagram(B, b"crashed")
    assert net.dropped == 4
    with pytest.raises(OSError):
        net.attach(A)  # in use


def _parse(data: bytes) -> tuple[object, int] | None:
    """A toy stream format: one line; a line starting with "!" is garbage."""
    if data.startswith(b"!"):
        raise WireError(DropReason.MALFORMED, "garbage")
    if b"\n" not in data:
        return None
    line = data.split(b"\n", 1)[0]
    return line, len(line) + 1


async def test_streams_request_reply_refusal_garbage_and_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    drops: list[DropReason] = []
    client = Streams(net.attach(A), tcp_timeout_ms=1000, parse=_parse, record_drop=drops.append)  # type: ignore[arg-type]
    server = Streams(net.attach(B), tcp_timeout_ms=1000, parse=_parse, record_drop=drops.append)  # type: ignore[arg-type]

    async def deliver(source: Address, message: object) -> bytes | None:
        assert source == A
        return b"re: " + message + b"\n" if isinstance(message, bytes) else None

    def request(dest: Address, data: bytes, deadline_s: float) -> StreamRequest:
        deadline_ms = int(trio.current_time() * 1000) + int(deadline_s * 1000)
        return StreamRequest(1, dest, data, deadline_ms, StreamKind.PUSH_PULL)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve, deliver)
        await trio.sleep(0)
        reply: tuple[object, str] = await client.request(request(B, b"ping\n", 1))
        assert reply == (b"re: ping", "")
        got, error = await client.request(request(C, b"ping\n", 1))
        assert got is None and "refused" in error
        assert await client.request(request(B, b"!bad\n", 1)) == (None, "no valid reply")
        assert drops == [DropReason.MALFORMED]
        net.partition({A}, {B})
        start = trio.current_time()
        assert await client.request(request(B, b"ping\n", 2)) == (None, "timed out")
        assert trio.current_time() - start == pytest.approx(2, abs=0.01)
        nursery.cancel_scope.cancel()
