"""An in-memory ``Transport`` (agent/transport.py): many agents in one trio run, no sockets,
so agent tests run on trio's ``MockClock`` in milliseconds of wall time.

``MemoryNetwork`` is the shared medium; ``network.attach(Address("10.0.0.1", 7946))`` gives
one agent its transport. What the network does, and the faults a test can inject:
- A datagram reaches its destination's queue at once, unless the destination is not
  attached (never started, closed, ``crash``-ed), the pair is cut (``partition``/``heal``),
  the sender's drop rate hits (``loss``, drawn from the network's injected random.Random),
  or the destination's queue is full (``DATAGRAM_QUEUE`` datagrams, like a socket buffer).
- A stream is a ``trio.testing.memory_stream_pair``: connecting to an address nobody is
  attached to is refused (``ConnectionRefusedError``, like a closed port); connecting
  across a partition hangs until the caller's deadline (like a lost SYN), or is refused
  across a rejecting one (``partition(..., reject=True)``: a firewall's REJECT).
- ``crash(address)`` detaches an agent at once, as a killed process's port goes away; the
  test cancels the agent's own tasks separately (its cancel scope), as the kernel would.
Addresses are whatever the test chooses; ``address_of(i)`` gives ``10.0.0.<i>:7946``.
"""

from __future__ import annotations

import errno
import random

import trio
import trio.testing

from agent.transport import StreamHandler
from swim import Address

DATAGRAM_QUEUE = 1024
"""Datagrams waiting per attached transport before more are dropped."""
PORT = 7946
"""memberlist's default port."""


def address_of(i: int) -> Address:
    return Address(f"10.0.0.{i}", PORT)


class MemoryNetwork:
    """The shared medium of ``MemoryTransport``s, with fault injection."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random(0)
        self._attached: dict[Address, MemoryTransport] = {}
        self._cut: set[frozenset[Address]] = set()
        self._rejecting: set[frozenset[Address]] = set()
        self._loss: dict[Address, float] = {}
        self.delivered = 0
        self.dropped = 0

    def attach(self, address: Address) -> MemoryTransport:
        if address in self._attached:
            raise OSError(errno.EADDRINUSE, f"{address} is in use")
        transport = MemoryTransport(self, address)
        self._attached[address] = transport
        return transport

    def detach(self, transport: MemoryTransport) -> None:
        if self._attached.get(transport.address) is transport:
            del self._attached[transport.address]

    def crash(self, address: Address) -> None:
        """The agent at ``address`` is gone: nothing reaches it, connections are refused."""
        transport = self._attached.pop(address, None)
        if transport is not None:
            transport.closed = True

    def partition(self, side: set[Address], other: set[Address], *, reject: bool = False) -> None:
        """Cut every pair across the two sides, both ways; ``reject``: connections across
        are refused at once instead of hanging."""
        for a in side:
            for b in other:
                self._cut.add(frozenset((a, b)))
                if reject:
                    self._rejecting.add(frozenset((a, b)))

    def heal(self) -> None:
        self._cut.clear()
        self._rejecting.clear()

    def loss(self, sender: Address, rate: float) -> None:
        """Drop this share of ``sender``'s datagrams (0 to 1)."""
        self._loss[sender] = rate

    def reachable(self, source: Address, dest: Address) -> bool:
        return frozenset((source, dest)) not in self._cut

    def _deliver(self, source: Address, dest: Address, data: bytes) -> None:
        target = self._attached.get(dest)
        rate = self._loss.get(source, 0.0)
        if (
            target is None
            or not self.reachable(source, dest)
            or (rate and self._rng.random() < rate)
        ):
            self.dropped += 1
            return
        try:
            target._datagrams_in.send_nowait((source, data))
            self.delivered += 1
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.dropped += 1

    async def _connect(self, source: Address, dest: Address) -> trio.abc.Stream:
        if frozenset((source, dest)) in self._rejecting:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        if not self.reachable(source, dest):
            await trio.sleep_forever()
        target = self._attached.get(dest)
        if target is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        ours, theirs = trio.testing.memory_stream_pair()
        try:
            target._streams_in.send_nowait((theirs, source))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused") from None
        return ours


class MemoryTransport:
    """One agent's end of a ``MemoryNetwork`` (implements agent.transport.Transport)."""

    threaded_decoding = False
    """Streams decode inline: a worker thread's work would let the MockClock jump."""

    def __init__(self, network: MemoryNetwork, address: Address) -> None:
        self._network = network
        self._address = address
        self._datagrams_in, self._datagrams = trio.open_memory_channel[tuple[Address, bytes]](
            DATAGRAM_QUEUE
        )
        self._streams_in, self._streams = trio.open_memory_channel[tuple[trio.abc.Stream, Address]](
            DATAGRAM_QUEUE
        )
        self.closed = False

    @property
    def address(self) -> Address:
        return self._address

    def send_datagram(self, dest: Address, data: bytes) -> None:
        if not self.closed:
            self._network._deliver(self._address, dest, data)

    async def receive_datagram(self) -> tuple[Address, bytes]:
        return await self._datagrams.receive()

    def receive_datagram_nowait(self) -> tuple[Address, bytes] | None:
        try:
            return self._datagrams.receive_nowait()
        except trio.WouldBlock:
            return None

    async def serve_streams(self, handler: StreamHandler) -> None:
        async with trio.open_nursery() as nursery:
            async for stream, source in self._streams:
                nursery.start_soon(handler, stream, source)

    async def open_stream(self, dest: Address) -> trio.abc.Stream:
        if self.closed:
            raise OSError(errno.EBADF, "transport closed")
        return await self._network._connect(self._address, dest)

    async def resolve(self, host: str, port: int) -> list[Address]:
        return [Address(host, port)]

    def close(self) -> None:
        self.closed = True
        self._network.detach(self)
