"""The transport seam: how the agent moves bytes, and the bounds on its streams.

``Transport`` is the Protocol the driver (agent/driver.py) uses; two implementations:
``SocketTransport`` here (UDP and TCP sharing one port, memberlist's ``NetTransport``,
net_transport.go) and ``MemoryTransport`` in agent/memory_transport.py (many agents in one
trio run, on a MockClock, for tests).

Rules:
- Datagrams: ``send_datagram`` never blocks and never raises: a full buffer or an
  unreachable destination drops the packet, as UDP may. ``receive_datagram`` waits for one;
  ``receive_datagram_nowait`` is the non-blocking read the driver's catch-up after a stall
  uses (None: nothing waits; ``OSError``: one unreadable datagram, counted as read).
- Streams are bounded in number (``MAX_INBOUND_STREAMS``, ``MAX_OUTBOUND_STREAMS``; an
  inbound stream beyond the bound is closed at once and counted as a ``QUEUE_FULL`` drop),
  in bytes (the Node's stream decoder enforces ``max_stream_bytes`` per stream; all inbound
  streams together hold at most ``MAX_BUFFERED_STREAM_BYTES`` beyond ``FREE_STREAM_BYTES``
  each, and a stream that would pass it is cut as ``BUFFER_FULL``) and in time (an inbound
  stream gets ``tcp_timeout_ms`` from its accept, however the peer paces its bytes, and is
  cut as ``STREAM_TIMEOUT`` if its message is not whole by then; an outbound one gets its
  request's deadline), so a slow or hostile peer cannot hold resources. ``Streams``
  enforces all of it over any transport.
- Whatever a peer does on a stream (reset, garbage, silence) ends that stream only
  (``PEER_ERRORS``); it never reaches the rest of the agent.
- A stream carries one message each way: ``Streams.read_message`` feeds each chunk to the
  stream's own incremental decoder (``Node.stream_decoder``, ``swim.StreamDecoder``: work
  proportional to the bytes received) until it returns a whole message or raises
  ``WireError``. A feed costs time proportional to its chunk, and an inline chunk is fed in
  slices of ``FEED_SLICE_BYTES``, one stream's slice at a time with a schedule point before
  each, so a flood of streams never holds the trio thread for more than a slice between
  the control API's turns. The exception is the last feed of an encrypted or compressed
  stream, which decodes the whole frame at once
  (``ONE_SHOT_KINDS``): on a real transport (``threaded_decoding``) those streams are fed
  in a worker thread, at most ``DECODE_THREADS`` at once, so no stream's decoding holds the
  node task for more than a few ms: the trio thread waits at most one interpreter switch
  interval (5 ms) for the GIL. Only one thread touches a decoder at a time (its stream's
  task awaits each feed). On the memory transport all feeds run inline: a thread's work
  would let a MockClock jump.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from swim import Address, DropReason, MsgType, StreamMessage, StreamRequest, WireError

log = logging.getLogger("swim.agent")

MAX_INBOUND_STREAMS = 128
"""memberlist ``maxPushPullRequests``."""
MAX_OUTBOUND_STREAMS = 128
RECV_BYTES = 65_536
BIND_ATTEMPTS = 10
"""UDP ports tried for port 0 until one is free for TCP too (memberlist's limit): a port's
TCP side is taken by a connection's local port often enough to fail a busy test suite."""
FREE_STREAM_BYTES = 65_536
"""What an inbound stream may hold outside the shared budget: pings, acks and small user
messages never wait on it (128 streams x 64 KiB = 8 MiB at most)."""
MAX_BUFFERED_STREAM_BYTES = 32 * 1024 * 1024
"""Bytes all inbound streams together may hold beyond ``FREE_STREAM_BYTES`` each (at least
``max_stream_bytes``, see ``Streams``). Without it 128 streams of 20 MiB could hold 2.5 GiB;
32 MiB fits twice a push-pull from a 65,536-member cluster with ~200-byte states. Bytes
received count, not bytes buffered: a push-pull's decoded states are held too."""
DECODE_THREADS = 1
"""Worker threads decoding streams at once: one, so decoding competes with the trio thread
for the GIL from one thread only, and a flood of streams queues instead of starving it."""
FEED_SLICE_BYTES = 8192
"""The most a stream's inline feed decodes at once (~1 ms of push-pull states), and only
one stream feeds at a time: without it every stream with bytes waiting decoded up to a
whole ``RECV_BYTES`` chunk (~6 ms) in the same pass of trio's scheduler, and a control
request, which needs several passes (accept, read, the node task, reply), waited behind
all of them in each (p99 0.15-0.3 s under 24 trickled push-pull streams on a loaded box)."""
SMALL_CHUNK_BYTES = 16_384
SMALL_CHUNK_PAUSE_S = 0.01
"""After a chunk under ``SMALL_CHUNK_BYTES`` that did not complete the message, a stream
waits this long before reading again: a peer trickling bytes gets its stream woken at most
100 times a second (so 128 such streams cannot crowd the node task and the control API out
of trio's run queue), while a fast sender's full chunks are read back to back."""
ONE_SHOT_KINDS = frozenset((MsgType.ENCRYPT, MsgType.COMPRESS))
"""Streams whose last feed decodes a whole frame at once (decrypt or decompress, then
parse: up to ``max_stream_bytes``, and an LZW bomb inflates 64 KiB to megabytes): their
feeds run in a worker thread. Any other stream's feed costs time proportional to its chunk
(~1 ms per ``FEED_SLICE_BYTES`` slice of push-pull states) and runs inline, sparing
the thread hand-off on every chunk."""
PEER_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)
"""What a misbehaving peer or network can raise on a stream; handled per connection."""

StreamHandler = Callable[[trio.abc.Stream, Address], Awaitable[None]]
"""Serves one inbound stream from the given peer address."""


class Decoder(Protocol):
    """One stream's incremental decoder (``swim.StreamDecoder``)."""

    def feed(self, data: bytes) -> StreamMessage | None:
        """The message once whole, None for "need more", ``WireError`` for bytes that
        cannot become one."""
        ...

    @property
    def received_bytes(self) -> int:
        """Bytes fed so far."""
        ...


class Transport(Protocol):
    """Datagrams and streams between agents, on one address."""

    @property
    def address(self) -> Address:
        """Where peers reach this agent when the configuration advertises nothing else."""
        ...

    def send_datagram(self, dest: Address, data: bytes) -> None:
        """Send without blocking; a packet that cannot go now is dropped."""
        ...

    async def receive_datagram(self) -> tuple[Address, bytes]:
        """The next datagram and its source."""
        ...

    def receive_datagram_nowait(self) -> tuple[Address, bytes] | None:
        """A datagram that is already waiting, or None; ``OSError``: one unreadable."""
        ...

    async def serve_streams(self, handler: StreamHandler) -> None:
        """Accept inbound streams forever, each handled in its own task."""
        ...

    async def open_stream(self, dest: Address) -> trio.abc.Stream:
        """Connect to ``dest``; raises ``OSError`` when it cannot be reached."""
        ...

    async def resolve(self, host: str, port: int) -> list[Address]:
        """The addresses a ``host:port`` given to ``join`` names (``OSError`` if none)."""
        ...

    def close(self) -> None:
        """Release the address; later sends are dropped."""
        ...

    @property
    def threaded_decoding(self) -> bool:
        """Whether ``Streams`` decodes in worker threads: True on real time, False on a
        virtual clock (a MockClock would jump while a thread works)."""
        ...


class Streams:
    """The stream side of the agent over any ``Transport``: bounds, deadlines, parsing."""

    def __init__(
        self,
        transport: Transport,
        *,
        tcp_timeout_ms: int,
        decoder: Callable[[], Decoder],
        record_drop: Callable[[DropReason], None],
        max_buffered_bytes: int = MAX_BUFFERED_STREAM_BYTES,
    ) -> None:
        self._transport = transport
        self._tcp_timeout_ms = tcp_timeout_ms
        self._new_decoder = decoder
        self._record_drop = record_drop
        self._in_limiter = trio.CapacityLimiter(MAX_INBOUND_STREAMS)
        self._out_limiter = trio.CapacityLimiter(MAX_OUTBOUND_STREAMS)
        self._decode_limiter = trio.CapacityLimiter(DECODE_THREADS)
        self._feed_lock = trio.Lock()
        self._threaded = transport.threaded_decoding
        self._max_buffered = max_buffered_bytes
        self._buffered = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes inbound streams hold now against ``max_buffered_bytes``."""
        return self._buffered

    async def serve(
        self, deliver: Callable[[Address, StreamMessage], Awaitable[bytes | None]]
    ) -> None:
        """Serve inbound streams: read one message, ``deliver`` it, write back its reply."""

        async def handle(stream: trio.abc.Stream, source: Address) -> None:
            if self._in_limiter.available_tokens == 0:
                self._record_drop(DropReason.QUEUE_FULL)
                await stream.aclose()
                return
            async with self._in_limiter, stream:
                reading = True
                try:
                    with trio.move_on_after(self._tcp_timeout_ms / 1000) as scope:
                        message = await self.read_message(stream, budget=True)
                        reading = False
                        if message is None:
                            return
                        reply = await deliver(source, message)
                        if reply:
                            await stream.send_all(reply)
                    if scope.cancelled_caught and reading:
                        self._record_drop(DropReason.STREAM_TIMEOUT)
                        log.debug("inbound stream from %s cut by its deadline", source)
                except PEER_ERRORS as exc:
                    log.debug("inbound stream ended: %s", exc)

        await self._transport.serve_streams(handle)

    async def read_message(
        self, stream: trio.abc.Stream, *, budget: bool = False
    ) -> StreamMessage | None:
        """One message, or None (garbage is counted as a drop; a closed stream is not).

        With ``budget`` (inbound streams) the bytes received beyond ``FREE_STREAM_BYTES``
        are charged to the shared budget until the message is read; a chunk that would
        pass it ends the stream as ``BUFFER_FULL``."""
        decoder = self._new_decoder()
        charged = 0
        threaded = False
        try:
            while True:
                try:
                    chunk = bytes(await stream.receive_some(RECV_BYTES))  # bytes: no copy
                except (trio.BrokenResourceError, OSError):
                    return None
                if not chunk:
                    if decoder.received_bytes:
                        self._record_drop(DropReason.MALFORMED)
                    return None
                if not decoder.received_bytes:
                    threaded = self._threaded and chunk[0] in ONE_SHOT_KINDS
                if budget:
                    want = max(0, decoder.received_bytes + len(chunk) - FREE_STREAM_BYTES)
                    if want > charged:
                        if self._buffered + want - charged > self._max_buffered:
                            self._record_drop(DropReason.BUFFER_FULL)
                            log.debug("dropping a stream: %d bytes buffered", self._buffered)
                            return None
                        self._buffered += want - charged
                        charged = want
                try:
                    if threaded:
                        message = await trio.to_thread.run_sync(
                            decoder.feed, chunk, limiter=self._decode_limiter
                        )
                    else:
                        message = await self._feed_inline(decoder, chunk)
                except WireError as exc:
                    self._record_drop(exc.reason)
                    log.debug("dropping a stream: %s", exc)
                    return None
                if message is not None:
                    return message
                if len(chunk) < SMALL_CHUNK_BYTES:
                    await trio.sleep(SMALL_CHUNK_PAUSE_S)  # let a trickle gather in the kernel
        finally:
            self._buffered -= charged

    async def _feed_inline(self, decoder: Decoder, chunk: bytes) -> StreamMessage | None:
        """Feed ``chunk`` in slices of ``FEED_SLICE_BYTES``, one stream's slice at a time
        (``_feed_lock``, first come first served), with a schedule point before each: the
        trio thread never decodes for more than a slice before the node task and the
        control API get their turn, however many streams have bytes waiting."""
        for start in range(0, len(chunk), FEED_SLICE_BYTES):
            async with self._feed_lock:
                message = decoder.feed(chunk[start : start + FEED_SLICE_BYTES])
            if message is not None:
                return message  # bytes after a whole message are ignored, as before
        return None

    async def request(self, request: StreamRequest) -> tuple[StreamMessage | None, str]:
        """Open a stream, send the request, read the reply if one is expected; by the
        request's deadline. Returns ``(reply, error)``; error "" when all went well."""
        error = ""
        message: StreamMessage | None = None
        async with self._out_limiter:
            with trio.move_on_at(request.deadline_ms / 1000) as scope:
                try:
                    stream = await self._transport.open_stream(request.dest)
                    async with stream:
                        await stream.send_all(request.data)
                        if request.expect_reply:
                            message = await self.read_message(stream)
                            if message is None:
                                error = "no valid reply"
                except PEER_ERRORS as exc:
                    error = f"{getattr(exc, 'strerror', None) or exc}"
            if scope.cancelled_caught:
                error = "timed out"
        return message, error


class SocketTransport:
    """UDP and TCP on one port (memberlist convention). Open with ``SocketTransport.bind``."""

    threaded_decoding = True

    def __init__(
        self, udp: socket.socket, listeners: list[trio.SocketListener], address: Address
    ) -> None:
        self._raw = udp
        self._udp = trio.socket.from_stdlib_socket(udp)
        self._listeners = listeners
        self._address = address

    @classmethod
    async def bind(cls, host: str, port: int) -> SocketTransport:
        """Bind UDP then TCP on ``host:port``. Port 0: any port free for both; a port free
        for UDP may be taken for TCP (a connection's local port, another listener), so up
        to ``BIND_ATTEMPTS`` UDP ports are tried, each kept bound until the end so that
        the next pick is another port (memberlist's ``newMemberlist`` retries a bind to port
        0 ten times on "address already in use")."""
        attempts = BIND_ATTEMPTS if port == 0 else 1
        tried: list[socket.socket] = []
        try:
            for attempt in range(1, attempts + 1):
                raw = socket.socket(_family(host), socket.SOCK_DGRAM)
                try:
                    raw.bind((host, port))
                except OSError:
                    raw.close()
                    raise
                bound_port = raw.getsockname()[1]
                try:
                    listeners = await trio.open_tcp_listeners(bound_port, host=host)
                except OSError as exc:
                    tried.append(raw)
                    if exc.errno == errno.EADDRINUSE and attempt < attempts:
                        continue
                    raise
                _grow_receive_buffer(raw)
                raw.setblocking(False)
                if host in ("0.0.0.0", "::"):
                    host = _default_ip(host)
                return cls(raw, listeners, Address(host, bound_port))
            raise AssertionError("unreachable: the last attempt returns or raises")
        finally:
            for unused in tried:
                unused.close()

    @property
    def address(self) -> Address:
        return self._address

    def send_datagram(self, dest: Address, data: bytes) -> None:
        try:
            # Non-blocking: a full socket buffer drops the packet, as UDP may.
            self._raw.sendto(data, (dest.host, dest.port))
        except OSError as exc:
            log.debug("send to %s failed: %s", dest, exc)

    async def receive_datagram(self) -> tuple[Address, bytes]:
        # One wait for readability, then the plain non-blocking read: trio's own recvfrom
        # adds two schedule points per datagram, which cost more than the read itself.
        raw = self._raw
        while True:
            await trio.lowlevel.wait_readable(raw)
            try:
                data, addr = raw.recvfrom(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:  # e.g. ICMP port unreachable surfacing on Linux
                log.debug("udp receive error: %s", exc)
                continue
            return Address(addr[0], addr[1]), data

    def receive_datagram_nowait(self) -> tuple[Address, bytes] | None:
        try:
            data, addr = self._raw.recvfrom(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return None
        return Address(addr[0], addr[1]), data

    async def serve_streams(self, handler: StreamHandler) -> None:
        async def accept(stream: trio.SocketStream) -> None:
            try:
                peer = stream.socket.getpeername()
            except OSError:
                await stream.aclose()
                return
            await handler(stream, Address(peer[0], peer[1]))

        await trio.serve_listeners(accept, self._listeners)

    async def open_stream(self, dest: Address) -> trio.abc.Stream:
        return await trio.open_tcp_stream(dest.host, dest.port)

    async def resolve(self, host: str, port: int) -> list[Address]:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({Address(str(i[4][0]), port) for i in infos}, key=str)

    def close(self) -> None:
        self._udp.close()
        for listener in self._listeners:  # the TCP side of the port too
            listener.socket.close()


def _grow_receive_buffer(sock: socket.socket) -> None:
    """memberlist net_transport.go ``setUDPRecvBuf``: ask for 2 MiB, halving until the
    kernel accepts, so bursts of gossip are not dropped before we can count them."""
    size = 2 * 1024 * 1024
    while size >= 64 * 1024:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
            return
        except OSError:
            size //= 2


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _default_ip(wildcard: str) -> str:
    """The local address the default route would use (no packet is sent)."""
    family = socket.AF_INET6 if wildcard == "::" else socket.AF_INET
    probe = ("2001:db8::1", 9) if family == socket.AF_INET6 else ("192.0.2.1", 9)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(probe)
            return str(s.getsockname()[0])
        except OSError:
            return "::1" if family == socket.AF_INET6 else "127.0.0.1"
