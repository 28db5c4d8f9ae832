"""The driver: the one task that owns the sans-IO ``swim.Node`` and executes its Outputs.

Rules:
- Only the node task (``Driver._node_loop``) touches the Node. The datagram reader, the
  stream server, stream tasks, the control API and signal handling only put inputs on its
  inbox channel and get answers back on one-shot channels; anything else that must change
  the Node runs as a function in the node task through ``Driver.command``. No locks.
  Two exceptions, both without await in between (so never seen half-done): stream tasks
  take a decoder from ``Node.stream_decoder`` (pure; the decoder is the stream's own, fed in
  a worker thread on real sockets, see agent/transport.py), and drops are counted with
  ``Node.record_drop`` where they happen (a full inbox, a bad stream).
- The node task also runs the timers: it waits on the inbox until the earliest timer
  deadline, then hands every due timer back to the Node. Before due timers fire it handles
  what has already arrived, queued or still in the transport (``_catch_up``), so an ack or
  a refutation that beat its deadline counts even when the loop runs late.
- The node task wakes up only for timers that can do something: a timer the Node has
  forgotten (``Output.cancelled_timers``, e.g. an acked probe's timeout) is dropped from the
  heap unhanded, and a gossip tick (``Output.gossip_timers``) that comes due while nothing
  is queued (``Node.broadcast_queue_depth == 0``), which would only ask for the next tick, is
  held back and handed over at its next multiple of ``gossip_interval_ms`` once something
  is queued. The Node sees the same inputs as if each idle tick had fired (they do nothing).
  The heap and these two rules are ``agent.timer_heap.TimerHeap``.
- Datagrams are read in batches: the reader task waits for the socket once, then takes
  whatever else is already there without waiting (``receive_datagram_nowait``); the node
  task handles everything queued in its inbox per wake-up.
- Datagrams beyond the inbox bound (``INBOX_DEPTH``) are dropped and counted as
  ``QUEUE_FULL`` (memberlist's HandoffQueueDepth); streams are bounded by agent.transport.
- Executing an Output (``apply``), in order: packets to the transport; timers onto the
  heap; stream requests into tasks; every direct sign of life (``heard_from``, probe
  results) into the Phi registry; refused probes to ``on_probe_refused``; member events to
  the log, the events fan-out, the
  Serf delegate and ``on_member_event`` (the event handlers, which only queue them); Serf
  user messages and push-pull states to the Serf delegate; notices to
  the log and the fan-out; join results to whoever waits in ``join_one``.
- Time is trio's clock in integer milliseconds (``now_ms``), so tests run on a MockClock.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from agent.config import parse_host_port
from agent.control import MAX_PROBE_NODES
from agent.events import Events
from agent.timer_heap import TimerHeap
from agent.transport import MAX_BUFFERED_STREAM_BYTES, Streams, Transport
from phi import PhiRegistry, RegistryFullError
from swim import (
    Address,
    DropReason,
    EventKind,
    JoinResult,
    MemberEvent,
    Node,
    Output,
    StreamMessage,
    StreamRequest,
    UrgentProbeOutcome,
)

log = logging.getLogger("swim.agent")

INBOX_DEPTH = 4096
"""Inputs waiting for the node task; datagrams beyond it are dropped (memberlist: 1024)."""
STALL_MS = 100
"""Timers overdue by more than this count as a stall (SIGSTOP, swapping, CPU starvation)
in ``Driver.stalls``. Stalled or not, due timers fire only after what has already arrived
is handled (``_catch_up``); Cassandra's failure detector skips convictions after a local
pause for the same reason (CASSANDRA-9183)."""
MAX_CATCH_UP = 4096
"""Datagrams read from the transport in one catch-up (the kernel buffer holds ~2 MiB)."""
JOIN_GRACE_MS = 1000
"""How long ``join_one`` waits past ``tcp_timeout_ms`` for the push-pull's result."""

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def now_ms() -> int:
    """trio's clock in whole milliseconds. The node loop sleeps until ``deadline_ms / 1000``
    and must then see ``now_ms() >= deadline_ms``; without the nanosecond of slack a
    deadline like 1005 reads back as 1004.9999999 ms and the loop spins (forever on a
    MockClock, whose time stands still while a task is runnable)."""
    return int(trio.current_time() * 1000 + _SLACK_MS)


_SLACK_MS = 1e-6


class Delegate(Protocol):
    """What the driver hands up to the Serf layer (agent/serf_runtime.py); called in the
    node task, so it may call ``Driver.apply``."""

    def on_event(self, event: MemberEvent) -> None: ...

    def on_user_message(self, payload: bytes) -> None: ...

    def on_push_pull_state(self, state: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class _Datagram:
    source: Address
    data: bytes


@dataclass(frozen=True, slots=True)
class _StreamIn:
    source: Address
    message: StreamMessage
    reply: trio.MemorySendChannel[bytes | None]


@dataclass(frozen=True, slots=True)
class _StreamResult:
    stream_id: int
    message: StreamMessage | None
    error: str


@dataclass(frozen=True, slots=True)
class _Command:
    run: Callable[[int], Any]
    reply: trio.MemorySendChannel[tuple[bool, Any]]


_Input = _Datagram | _StreamIn | _StreamResult | _Command


class Driver:
    """Owns one Node: ``await nursery.start(driver.run)``, then ``command``/``join_one``."""

    def __init__(
        self,
        node: Node,
        transport: Transport,
        *,
        phi: PhiRegistry,
        events: Events,
        tcp_timeout_ms: int,
    ) -> None:
        self.node = node
        self.transport = transport
        self.phi = phi
        self.events = events
        self.delegate: Delegate | None = None
        self.on_probe_rtt_ms: Callable[[int], None] | None = None
        """Called with every direct probe's round-trip time (the metrics histogram)."""
        self.probe_rtt_ms: dict[str, int] = {}
        """The last direct probe's round trip per member (the status page); bounded by the
        member table: a member's entry goes when it is reaped or leaves."""
        self.on_member_event: Callable[[MemberEvent], None] | None = None
        """Called with every member event (the event handlers; must not block)."""
        self.on_probe_refused: Callable[[str], None] | None = None
        """Called with every member our probe failed to reach with its TCP ping refused
        (``Output.probes_refused``), before the member events of that input
        (agent/crash_evidence.py; must not block)."""
        self.stalls = 0
        """Times the node loop found its timers overdue by more than ``STALL_MS``."""
        self.stall_datagrams = 0
        """Datagrams read by the catch-up after a stall, before the overdue timers fired."""
        self._tcp_timeout_ms = tcp_timeout_ms
        self._send_in, self._inbox = trio.open_memory_channel[_Input](INBOX_DEPTH)
        self._timers = TimerHeap(node.config.gossip_interval_ms)
        self._join_waiters: dict[Address, trio.MemorySendChannel[JoinResult]] = {}
        self._nursery: trio.Nursery | None = None
        self._streams = Streams(
            transport,
            tcp_timeout_ms=tcp_timeout_ms,
            decoder=node.stream_decoder,
            record_drop=node.record_drop,
            max_buffered_bytes=max(MAX_BUFFERED_STREAM_BYTES, node.config.max_stream_bytes + 5),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The node task, the datagram reader and the stream server, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._node_loop)
            nursery.start_soon(self._read_datagrams)
            nursery.start_soon(self._streams.serve, self._deliver_stream)
            task_status.started()

    def stats(self) -> dict[str, Any]:
        """The Node's counters and the driver's stall counts (``info``'s ``stats``)."""
        node = self.node
        st = node.stats
        return {
            "packets_in": st.packets_in,
            "packets_out": st.packets_out,
            "bytes_in": st.bytes_in,
            "bytes_out": st.bytes_out,
            "probes_sent": st.probes_sent,
            "probes_failed": st.probes_failed,
            "indirect_probes_sent": st.indirect_probes_sent,
            "nacks_received": st.nacks_received,
            "tcp_fallback_probes": st.tcp_fallback_probes,
            "tcp_fallback_rescues": st.tcp_fallback_rescues,
            "suspicions_raised": st.suspicions_raised,
            "suspicion_verifications": st.suspicion_verifications,
            "suspicions_held_starved": st.suspicions_held_starved,
            "cross_check_probes": st.cross_check_probes,
            "cross_check_probes_failed": st.cross_check_probes_failed,
            "refutations": st.refutations,
            "deaths_declared": st.deaths_declared,
            "address_conflicts": st.address_conflicts,
            "urgent_probes": dict(st.urgent_probes),
            "urgent_probes_failed": st.urgent_probes_failed,
            "dropped": dict(st.dropped),
            "broadcast_queue": node.broadcast_queue_depth,
            "stalls": self.stalls,
            "stall_datagrams": self.stall_datagrams,
        }

    # --- inputs from other tasks ----------------------------------------------------------

    async def command(self, run: Callable[[int], Any]) -> Any:
        """Run ``run(now_ms)`` in the node task and return its result (or raise its error)."""
        send, receive = trio.open_memory_channel[tuple[bool, Any]](1)
        await self._send_in.send(_Command(run, send))
        ok, value = await receive.receive()
        if not ok:
            raise value
        return value

    async def join(self, addresses: list[str]) -> dict[str, Any]:
        """Push-pull with each ``host:port`` (names resolved by the transport), one after
        another; ``{"joined": successes, "errors": [why each other failed]}``."""
        joined = 0
        errors: list[str] = []
        for text in addresses:
            try:
                hp = parse_host_port(text, "join")
                targets = await self.transport.resolve(hp.host, hp.port)
            except (ValueError, OSError) as exc:
                errors.append(f"{text}: {exc}")
                continue
            for target in targets:
                result = await self.join_one(target)
                if result.ok:
                    joined += 1
                else:
                    errors.append(f"{target}: {result.detail}")
        return {"joined": joined, "errors": errors}

    async def join_one(self, target: Address) -> JoinResult:
        """Push-pull with one address; its result, or "timed out"."""
        if target == self.node.address:
            return JoinResult(target, False, "that is this agent's own address")
        send, receive = trio.open_memory_channel[JoinResult](1)
        self._join_waiters[target] = send
        await self.command(lambda t: self.apply(self.node.join([target], t)))
        with trio.move_on_after((self._tcp_timeout_ms + JOIN_GRACE_MS) / 1000):
            return await receive.receive()
        self._join_waiters.pop(target, None)
        return JoinResult(target, False, "timed out")

    async def probe_now(self, names: Sequence[str]) -> dict[str, Any]:
        """Probe these members at once instead of at their round-robin turn: a trainer's
        collectives lost them, which is evidence, not a verdict (``Node.probe_now``; only
        the probe can make them suspect). Runs in the node task. Repeated names count once;
        more than ``MAX_PROBE_NODES`` names, or a name that is not a string, raise
        ``ValueError``. Returns ``{"started": [name], "refused": {name: reason}}``, reasons
        as ``swim.UrgentProbeOutcome`` values (schema: the ``probe`` op, agent/control.py).
        """
        if len(names) > MAX_PROBE_NODES:
            raise ValueError(f"probe takes at most {MAX_PROBE_NODES} names, got {len(names)}")
        if not all(isinstance(name, str) for name in names):
            raise ValueError("probe takes member names (strings)")
        wanted = list(dict.fromkeys(names))

        def run(now: int) -> dict[str, Any]:
            started: list[str] = []
            refused: dict[str, str] = {}
            for name in wanted:
                outcome, out = self.node.probe_now(name, now)
                self.apply(out)
                if outcome is UrgentProbeOutcome.STARTED:
                    started.append(name)
                else:
                    refused[name] = outcome.value
            return {"started": started, "refused": refused}

        result: dict[str, Any] = await self.command(run)
        if result["started"]:
            log.info("probing %s at once (reported lost)", ", ".join(result["started"]))
        if result["refused"]:
            log.debug("not probing at once: %s", result["refused"])
        return result

    async def _read_datagrams(self) -> None:
        """Wait for a datagram, then take what else already waits without waiting again."""
        transport = self.transport
        while True:
            self._queue_datagram(*await transport.receive_datagram())
            for _ in range(MAX_CATCH_UP - 1):
                try:
                    got = transport.receive_datagram_nowait()
                except OSError:  # one unreadable datagram (ICMP); the next may be fine
                    continue
                if got is None:
                    break
                self._queue_datagram(*got)

    def _queue_datagram(self, source: Address, data: bytes) -> None:
        try:
            self._send_in.send_nowait(_Datagram(source, data))
        except trio.WouldBlock:
            self.node.record_drop(DropReason.QUEUE_FULL)

    async def _deliver_stream(self, source: Address, message: StreamMessage) -> bytes | None:
        send, receive = trio.open_memory_channel[bytes | None](1)
        await self._send_in.send(_StreamIn(source, message, send))
        return await receive.receive()

    async def _request_stream(self, request: StreamRequest) -> None:
        message, error = await self._streams.request(request)
        if request.expect_reply:
            await self._send_in.send(_StreamResult(request.stream_id, message, error))

    # --- the node task --------------------------------------------------------------------

    async def _node_loop(self) -> None:
        timers = self._timers
        inbox = self._inbox
        node = self.node
        while True:
            timers.settle(node.broadcast_queue_depth, now_ms)
            next_ms = timers.next_deadline_ms()
            with trio.move_on_at(math.inf if next_ms is None else next_ms / 1000):
                item = await inbox.receive()
                self._handle(item)
                self._drain_inbox()
            timers.settle(node.broadcast_queue_depth, now_ms)
            next_ms = timers.next_deadline_ms()
            if next_ms is not None and next_ms <= now_ms():
                self._catch_up(next_ms)
            self._fire_due_timers()

    def _drain_inbox(self) -> None:
        """Handle what is queued in the inbox, without waiting."""
        receive = self._inbox.receive_nowait
        for _ in range(INBOX_DEPTH):
            try:
                item = receive()
            except trio.WouldBlock:
                break
            self._handle(item)

    def _catch_up(self, deadline_ms: int) -> None:
        """Before due timers: handle what is queued and what waits in the transport."""
        late_ms = now_ms() - deadline_ms
        self._drain_inbox()
        read = 0
        while read < MAX_CATCH_UP:
            try:
                got = self.transport.receive_datagram_nowait()
            except OSError:  # e.g. ICMP port unreachable surfacing on Linux
                read += 1
                continue
            if got is None:
                break
            read += 1
            self._handle(_Datagram(*got))
        if late_ms > STALL_MS:
            self.stalls += 1
            self.stall_datagrams += read
            log.debug("stalled: timers %d ms late; read %d datagrams before them", late_ms, read)

    def _fire_due_timers(self) -> None:
        now = now_ms()
        node = self.node
        for timer in self._timers.due(now, lambda: node.broadcast_queue_depth):
            self.apply(node.handle_timer(timer, now))

    def _handle(self, item: _Input) -> None:
        node = self.node
        now = now_ms()
        if isinstance(item, _Datagram):
            self.apply(node.handle_datagram(item.source, item.data, now))
        elif isinstance(item, _StreamIn):
            out = node.handle_stream(item.source, item.message, now)
            reply, out.reply = out.reply, None
            self.apply(out)
            with contextlib.suppress(
                trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                item.reply.send_nowait(reply)
        elif isinstance(item, _StreamResult):
            self.apply(node.handle_stream_response(item.stream_id, item.message, now, item.error))
        else:
            try:
                result: tuple[bool, Any] = (True, item.run(now))
            except Exception as exc:  # a command's failure goes back to its caller
                result = (False, exc)
            with contextlib.suppress(
                trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                item.reply.send_nowait(result)

    def apply(self, out: Output) -> Output:
        """Execute an Output (in the node task): send, schedule, spawn streams, publish."""
        for packet in out.packets:
            self.transport.send_datagram(packet.dest, packet.data)
        self._timers.add(out)
        if self._nursery is not None:
            for request in out.streams:
                self._nursery.start_soon(self._request_stream, request)
        now = now_ms()
        for name in out.heard_from:
            self._heard(name, now)
        for result in out.probe_results:
            self._heard(result.node, now)
            if result.via == "direct":
                self.probe_rtt_ms[result.node] = result.rtt_ms
                if self.on_probe_rtt_ms is not None:
                    self.on_probe_rtt_ms(result.rtt_ms)
        if self.on_probe_refused is not None:
            for name in out.probes_refused:
                self.on_probe_refused(name)
        for event in out.events:
            self.emit(event)
        delegate = self.delegate
        for message in out.user_messages:
            if delegate is not None:
                delegate.on_user_message(message.payload)
        for state in out.push_pull_states:
            if delegate is not None:
                delegate.on_push_pull_state(state)
        for notice in out.notices:
            log.log(_LEVELS.get(notice.level, logging.INFO), "%s", notice.message)
            self.events.publish(
                {
                    "type": "log",
                    "level": notice.level,
                    "kind": notice.kind,
                    "message": notice.message,
                    "at_ms": now,
                }
            )
        for joined in out.join_results:
            waiter = self._join_waiters.pop(joined.address, None)
            if waiter is not None:
                waiter.send_nowait(joined)
        return out

    def emit(self, event: MemberEvent) -> None:
        """A member event (the Node's, or the Serf layer's "left after all"): log it, drop
        the member's Phi history when it is gone, tell the Serf layer, publish it."""
        m = event.member
        bad = event.kind in (EventKind.SUSPECT, EventKind.DEAD)
        log.log(
            logging.WARNING if bad else logging.INFO,
            "member %s %s (incarnation %d, %s)",
            m.name,
            event.kind.value,
            m.incarnation,
            m.address,
        )
        self.events.notify_changed()
        if event.kind in (EventKind.REAPED, EventKind.LEFT):
            self.probe_rtt_ms.pop(m.name, None)
            if m.name in self.phi:
                self.phi.remove(m.name)
        if self.delegate is not None:
            self.delegate.on_event(event)
        if self.on_member_event is not None:
            self.on_member_event(event)
        self.events.publish(
            {
                "type": event.kind.value,
                "node": m.name,
                "status": m.state.name.lower(),
                "incarnation": m.incarnation,
                "addr": m.address.host,
                "port": m.address.port,
                "at_ms": event.at_ms,
                "message": "",
            }
        )

    def _heard(self, name: str, now: int) -> None:
        # registry full: that peer is simply not scored (the registry is bounded)
        with contextlib.suppress(RegistryFullError):
            self.phi.heartbeat(name, now)
