"""The transport seam (agent/transport.py) on the memory network (agent/memory_transport.py):
what the network delivers and drops, and the bounds ``Streams`` keeps over any transport
(parse errors counted, deadlines, a refused or unreachable peer, a slow stream cut and
counted, the shared budget of buffered bytes), on a MockClock; and real sockets, where
streams decode in a worker thread."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from agent.memory_transport import MemoryNetwork, MemoryTransport, address_of
from agent.transport import FEED_SLICE_BYTES, FREE_STREAM_BYTES, SocketTransport, Streams
from swim import (
    Address,
    DropReason,
    NodeStateType,
    PushNodeState,
    PushPull,
    StreamDecoder,
    StreamKind,
    StreamLimits,
    StreamRequest,
    WireError,
    compress_message,
    encode_push_pull,
)

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


class _Lines:
    """A toy incremental decoder: one line; a line starting with "!" is garbage."""

    def __init__(self) -> None:
        self.buf = b""

    @property
    def received_bytes(self) -> int:
        return len(self.buf)

    def feed(self, data: bytes) -> object:
        self.buf += data
        if self.buf.startswith(b"!"):
            raise WireError(DropReason.MALFORMED, "garbage")
        if b"\n" not in self.buf:
            return None
        return self.buf.split(b"\n", 1)[0]


async def test_streams_request_reply_refusal_garbage_and_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    drops: list[DropReason] = []
    client = Streams(net.attach(A), tcp_timeout_ms=1000, decoder=_Lines, record_drop=drops.append)  # type: ignore[arg-type]
    server = Streams(net.attach(B), tcp_timeout_ms=1000, decoder=_Lines, record_drop=drops.append)  # type: ignore[arg-type]

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


@dataclass
class _Inbound:
    """A line-decoding ``Streams`` serving B on a memory network, recording what it
    delivers and drops; ``client`` is A's end of the network."""

    server: Streams
    client: MemoryTransport
    drops: list[DropReason] = field(default_factory=list)
    delivered: list[object] = field(default_factory=list)

    @classmethod
    def make(cls, tcp_timeout_ms: int, **limits: int) -> _Inbound:
        net = MemoryNetwork()
        drops: list[DropReason] = []
        server = Streams(
            net.attach(B),
            tcp_timeout_ms=tcp_timeout_ms,
            decoder=_Lines,  # type: ignore[arg-type]
            record_drop=drops.append,
            **limits,
        )
        return cls(server, net.attach(A), drops)

    async def deliver(self, source: Address, message: object) -> bytes | None:
        self.delivered.append(message)
        return None


async def test_a_slow_inbound_stream_is_cut_by_its_deadline_whatever_its_pacing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inbound = _Inbound.make(tcp_timeout_ms=1000)
    server, client, drops, delivered = (
        inbound.server,
        inbound.client,
        inbound.drops,
        inbound.delivered,
    )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve, inbound.deliver)
        await trio.sleep(0)
        stream = await client.open_stream(B)
        start = trio.current_time()
        cut_at = None
        try:
            for _ in range(50):  # a byte every 100 ms: 5 s if nobody cuts it
                await stream.send_all(b"x")
                await trio.sleep(0.1)
                if drops and cut_at is None:
                    cut_at = trio.current_time() - start
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        assert drops == [DropReason.STREAM_TIMEOUT]
        assert cut_at is not None and cut_at == pytest.approx(1.0, abs=0.15)
        # a quick stream still gets through, and its deadline never fires
        quick = await client.open_stream(B)
        await quick.send_all(b"hello\n")
        await trio.sleep(2)
        assert delivered == [b"hello"] and drops == [DropReason.STREAM_TIMEOUT]
        assert server.buffered_bytes == 0
        nursery.cancel_scope.cancel()


async def test_inbound_streams_share_a_bounded_budget_of_buffered_bytes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inbound = _Inbound.make(tcp_timeout_ms=10_000, max_buffered_bytes=100_000)
    server, client, drops, delivered = (
        inbound.server,
        inbound.client,
        inbound.drops,
        inbound.delivered,
    )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve, inbound.deliver)
        await trio.sleep(0)
        big = FREE_STREAM_BYTES + 60_000  # each holds 60,000 bytes of the budget
        first, second = await client.open_stream(B), await client.open_stream(B)
        await first.send_all(b"a" * big)
        await trio.sleep(0.1)
        assert server.buffered_bytes == 60_000 and not drops
        await second.send_all(b"b" * big)
        await trio.sleep(0.1)
        assert drops == [DropReason.BUFFER_FULL]
        assert server.buffered_bytes == 60_000
        # small streams never wait on the budget
        small = await client.open_stream(B)
        await small.send_all(b"c" * 1000 + b"\n")
        await first.send_all(b"\n")
        await trio.sleep(0.1)
        assert sorted(map(len, delivered)) == [1000, big]  # type: ignore[arg-type]
        assert server.buffered_bytes == 0
        nursery.cancel_scope.cancel()


async def test_streams_with_bytes_waiting_decode_a_slice_at_a_time_taking_turns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three streams with 60,000 bytes each waiting: every feed is at most one slice, the
    streams take turns, and another task (the control API, the node task) runs between
    any two slices: a flood of streams holds the trio thread for a slice, not a chunk."""
    log: list[str] = []

    class Recording(_Lines):
        def feed(self, data: bytes) -> object:
            log.append(f"{len(data)} {(self.buf or data)[:1].decode()}")
            return super().feed(data)

    net = MemoryNetwork()
    server = Streams(net.attach(B), tcp_timeout_ms=10_000, decoder=Recording, record_drop=print)  # type: ignore[arg-type]
    client = net.attach(A)
    delivered: list[object] = []

    async def deliver(source: Address, message: object) -> None:
        delivered.append(message)

    async def ticker() -> None:
        while len(delivered) < 3:  # a busy task: the MockClock cannot jump while it runs
            log.append("tick")
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve, deliver)
        await trio.sleep(0)
        for letter in b"abc":
            stream = await client.open_stream(B)
            await stream.send_all(bytes([letter]) * 60_000 + b"\n")
        nursery.start_soon(ticker)
        await trio.sleep(1)  # the ticker ends before the clock can move
        nursery.cancel_scope.cancel()
    assert sorted(delivered) == [bytes([x]) * 60_000 for x in b"abc"]  # type: ignore[type-var]
    feeds = [entry.split() for entry in log if entry != "tick"]
    assert max(int(size) for size, _ in feeds) <= FEED_SLICE_BYTES
    # turns: once the last stream arrived, each waits for the others' slices
    streams = [s for _, s in feeds]
    turns = streams[streams.index("c") : streams.index("c") + 4]
    assert all(x != y for x, y in itertools.pairwise(turns)), streams
    run = longest = 0
    for entry in log[log.index("tick") :]:
        run = 0 if entry == "tick" else run + 1
        longest = max(longest, run)
    # trio may run a pass's tasks in either order: two slices can meet across passes
    assert longest <= 2, log


async def test_streams_on_real_sockets_decode_a_trickled_compressed_push_pull_in_a_thread() -> None:
    drops: list[DropReason] = []
    transport = await SocketTransport.bind("127.0.0.1", 0)
    assert transport.threaded_decoding
    server = Streams(
        transport,
        tcp_timeout_ms=10_000,
        decoder=lambda: StreamDecoder(None, StreamLimits()),
        record_drop=drops.append,
    )
    state = PushNodeState("n", bytes([10, 0, 0, 1]), 7946, b"m", 1, NodeStateType.ALIVE, b"")
    pp = PushPull(False, (state,) * 2000, b"user")
    data = compress_message(encode_push_pull(pp))  # compressed: fed in a worker thread
    got: list[object] = []

    async def deliver(source: Address, message: object) -> bytes | None:
        got.append(message)
        return b"ok"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve, deliver)
        stream = await trio.open_tcp_stream("127.0.0.1", transport.address.port)
        async with stream:
            for i in range(0, len(data), 97):
                await stream.send_all(data[i : i + 97])
            assert await stream.receive_some(10) == b"ok"
        garbage = await trio.open_tcp_stream("127.0.0.1", transport.address.port)
        async with garbage:
            await garbage.send_all(b"\xff\xff")
            assert await garbage.receive_some(10) == b""  # closed by the server
        nursery.cancel_scope.cancel()
    transport.close()
    assert got == [pp]
    assert drops == [DropReason.UNEXPECTED_TYPE]
