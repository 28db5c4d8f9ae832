"""The agent: the sans-IO ``swim.Node`` driven by real sockets and timers on trio.

Rules (DESIGN.md "The agent"):
- One task owns the Node (``_node_loop``). The UDP reader, the TCP server, stream tasks,
  the control API and signal handling only put inputs on its inbox channel and get answers
  back on one-shot channels. No locks: nothing else mutates the Node.
- The node loop also runs the timers: it waits on the inbox until the earliest timer
  deadline, then hands every due timer back to the Node.
- UDP and TCP share one port (memberlist convention). Incoming datagrams beyond the inbox
  bound are dropped and counted (memberlist's HandoffQueueDepth). Streams are bounded in
  number, in bytes (the Node's stream parser enforces ``max_stream_bytes``) and in time
  (``tcp_timeout_ms``), so a slow or hostile peer cannot hold resources.
- Every direct sign of life from a peer feeds the Phi accrual registry.
- Time is trio's clock in integer milliseconds, so tests can run on a MockClock.
"""

from __future__ import annotations

import base64
import contextlib
import heapq
import json
import logging
import math
import os
import random
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

import agent.systemd as systemd
from agent import serf
from agent.serf import queries as serf_queries
from agent.config import AgentConfig, AgentConfigError, parse_host_port
from agent.config import load as load_config
from agent.control import MAX_PROBE_NODES
from agent.control_server import ControlServer
from agent.departed import Departed
from agent.jobs import TAG_PREFIX, Generations, LocalJobs
from phi import PhiConfig, PhiRegistry, RegistryFullError
from swim import (
    Address,
    MemberEvent,
    Node,
    NodeStateType,
    Output,
    StreamRequest,
    Timer,
    UrgentProbeOutcome,
)
from swim.effects import EventKind, JoinResult, Member
from swim.node import LEAVE_FANOUT
from swim.security import KeyringError
from swim.wire import DropReason, StreamMessage, WireError

if TYPE_CHECKING:
    from agent.metrics import AgentMetrics

log = logging.getLogger("swim.agent")

INBOX_DEPTH = 4096
"""Inputs waiting for the node task; datagrams beyond it are dropped (memberlist: 1024)."""
MAX_INBOUND_STREAMS = 128
"""memberlist ``maxPushPullRequests``."""
MAX_OUTBOUND_STREAMS = 128
RECV_BYTES = 65_536
STALL_MS = 100
"""Timers overdue by more than this count as a stall (SIGSTOP, swapping, CPU starvation)
in ``Agent.stalls``. Stalled or not, due timers fire only after what has already arrived
is handled (``_catch_up``), so an ack or a refutation that beat its deadline counts even
when the loop runs late; Cassandra skips convictions after a local pause for the same
reason (research notes §4)."""
MAX_CATCH_UP = 4096
"""Datagrams read from the socket in one catch-up (the kernel buffer holds ~2 MiB)."""
MAX_INTENT_NAMES = 65_536
"""Serf intent clocks remembered (one per member name)."""
MAX_LEFT_MEMBERS = 65_536
"""LeftMembers names honoured from one push-pull state."""
MAX_META_BYTES = 512
"""memberlist MetaMaxSize."""
PHI_WINDOW = 200
"""Samples per peer: enough for a stable estimate, bounded memory (capacity × window × 8 B)."""


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


def now_ms() -> int:
    return int(trio.current_time() * 1000)


class Agent:
    """A running member. ``await Agent(config).run()`` until it leaves or is cancelled."""

    def __init__(self, config: AgentConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        self.swim_config = config.swim_config()
        self.keyring = config.keyring()
        self._rng = rng if rng is not None else random.Random()
        self.node: Node | None = None
        self.tags: dict[str, str] = dict(config.tags)
        self.clock = serf.LamportClock()
        self.query_clock = serf.LamportClock()
        self._queries_seen = serf_queries.QuerySeen()
        self.phi = PhiRegistry(
            PhiConfig(
                max_sample_size=PHI_WINDOW,
                acceptable_heartbeat_pause_ms=0,
                first_heartbeat_estimate_ms=self.swim_config.probe_interval_ms,
            ),
            config.phi_capacity,
        )
        self.metrics: AgentMetrics | None = None  # only with --metrics-addr
        self.bound_port = 0
        self.ready = trio.Event()
        self.stopped = trio.Event()
        self._send_in, self._inbox = trio.open_memory_channel[_Input](INBOX_DEPTH)
        self._timers: list[tuple[int, int, Timer]] = []
        self._udp: socket.socket | None = None
        self.stalls = 0
        """Times the node loop found its timers overdue by more than ``STALL_MS``."""
        self.stall_datagrams = 0
        """Datagrams read by the catch-up after a stall, before the overdue timers fired."""
        self._nursery: trio.Nursery | None = None
        self._subscribers: list[trio.MemorySendChannel[dict[str, Any]]] = []
        self._out_limiter = trio.CapacityLimiter(MAX_OUTBOUND_STREAMS)
        self._in_limiter = trio.CapacityLimiter(MAX_INBOUND_STREAMS)
        self._join_waiters: dict[Address, trio.MemorySendChannel[JoinResult]] = {}
        self.started_ms = 0
        self.shutdown_requested = trio.Event()
        self._leaving = False
        self._status_ltimes: dict[str, int] = {}
        self.departed = Departed(config.reconnect_timeout_ms, config.tombstone_timeout_ms)
        self.generations = Generations()
        self.local_jobs = LocalJobs()
        """This node's training-process registrations (agent/watch.py serves them)."""
        self.job_tag_lock = trio.Lock()
        """Held while a job tag is recomputed and published (agent/watch.py)."""
        self._changed = trio.Event()

    # --- lifecycle ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, join, serve until ``shutdown_requested``; then leave gracefully."""
        cfg = self.config
        raw = socket.socket(_family(cfg.bind.host), socket.SOCK_DGRAM)
        try:
            raw.bind((cfg.bind.host, cfg.bind.port))
        except OSError:
            raw.close()
            raise
        _grow_receive_buffer(raw)
        raw.setblocking(False)
        self.bound_port = raw.getsockname()[1]
        udp = trio.socket.from_stdlib_socket(raw)
        listeners = await trio.open_tcp_listeners(self.bound_port, host=cfg.bind.host)
        self._udp = raw
        advertise = self._advertise_address()
        self.node = Node(
            cfg.node,
            advertise,
            rng=self._rng,
            now_ms=now_ms(),
            config=self.swim_config,
            meta=serf.encode_tags(self.tags),
            keyring=self.keyring,
        )
        self.started_ms = now_ms()
        log.info(
            "agent %s listening on %s (udp+tcp), advertising %s, profile %s%s",
            cfg.node,
            f"{cfg.bind.host}:{self.bound_port}",
            advertise,
            cfg.profile,
            ", encrypted" if self.keyring else "",
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._node_loop)
                nursery.start_soon(self._udp_reader, udp)
                nursery.start_soon(self._serve_tcp, listeners)
                control = ControlServer(self)
                await nursery.start(control.serve)
                if cfg.metrics_addr is not None:
                    # prometheus_client costs ~10 MB resident: load it only when asked for
                    from agent.metrics import AgentMetrics, serve_metrics

                    self.metrics = AgentMetrics(self.node, self.phi_values)
                    await nursery.start(
                        serve_metrics, self.metrics, cfg.metrics_addr.host, cfg.metrics_addr.port
                    )
                await self.command(lambda t: self._apply(self._node().start(t)))
                self._send_join_intent()
                if cfg.join:
                    result = await self.join(list(cfg.join))
                    if not result["joined"]:
                        log.warning("could not join any of %s: %s", cfg.join, result["errors"])
                if cfg.retry_join:
                    nursery.start_soon(self._retry_join)
                nursery.start_soon(self._watchdog)
                self.ready.set()
                systemd.notify("READY=1")
                task_status.started()
                await self.shutdown_requested.wait()
                await self.leave_cluster()
                nursery.cancel_scope.cancel()
        finally:
            systemd.notify("STOPPING=1")
            udp.close()
            for subscriber in self._subscribers:
                subscriber.close()
            self.stopped.set()
            log.info("agent %s stopped", cfg.node)

    def _advertise_address(self) -> Address:
        cfg = self.config
        if cfg.advertise is not None:
            return Address(cfg.advertise.host, cfg.advertise.port)
        host = cfg.bind.host
        if host in ("0.0.0.0", "::"):
            host = _default_ip(host)
        return Address(host, self.bound_port)

    def _node(self) -> Node:
        assert self.node is not None, "the agent is not running"
        return self.node

    async def leave_cluster(self) -> None:
        """Serf's leave: a leave intent first (so Serf peers say "left", not "failed"),
        then memberlist's dead-from-self, then wait until it has been gossiped out."""
        node = self._node()
        if self._leaving:
            return
        self._leaving = True
        await self.command(lambda t: self._send_leave_intent(node.name, direct=True))
        # Serf peers must see the intent before memberlist's dead, or they call it failed
        # (serf.go handleNodeLeave); Serf waits LeavePropagateDelay, we wait less.
        await trio.sleep(self.config.leave_propagate_delay_ms / 1000)
        await self.command(lambda t: self._apply(node.leave(t)))
        with trio.move_on_after(self.config.leave_timeout_ms / 1000):
            while not node.leave_done:
                await trio.sleep(0.05)
        log.info("left the cluster%s", "" if node.leave_done else " (leave not confirmed)")

    def request_shutdown(self) -> None:
        self.shutdown_requested.set()

    async def reload(self) -> None:
        """SIGHUP: re-read the config file; apply tags and log level (others need a restart)."""
        if self.config.config_file is None:
            log.info("SIGHUP: no config file to reload")
            return
        try:
            fresh = load_config(self.config.config_file)
        except AgentConfigError as exc:
            log.error("SIGHUP: keeping the running configuration: %s", exc)
            return
        logging.getLogger("swim").setLevel(fresh.log_level.upper())
        # job registrations are runtime state, not configuration: a reload keeps them
        wanted = dict(fresh.tags) | {k: v for k, v in self.tags.items() if k.startswith(TAG_PREFIX)}
        if wanted != self.tags:
            await self.set_tags(wanted)
        log.info("SIGHUP: reloaded tags and log level (%s)", fresh.log_level)

    async def set_tags(self, tags: dict[str, str]) -> dict[str, str]:
        return await self.update_tags(tags, (), replace=True)

    async def update_tags(
        self, set_: Mapping[str, str], delete: Iterable[str], *, replace: bool = False
    ) -> dict[str, str]:
        """Change tags atomically in the node task (concurrent callers cannot lose updates)."""
        node = self._node()
        gone = list(delete)

        def run(now: int) -> dict[str, str]:
            tags = dict(set_) if replace else {**self.tags, **set_}
            for key in gone:
                tags.pop(key, None)
            meta = serf.encode_tags(tags)
            if len(meta) > MAX_META_BYTES:
                raise ValueError(f"tags would take {len(meta)} bytes; the limit is 512")
            if tags != self.tags:
                self._apply(node.set_meta(meta, now))
                self.tags = tags
                self.notify_changed()
            return tags

        result: dict[str, str] = await self.command(run)
        return result

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
        node = self._node()

        def run(now: int) -> dict[str, Any]:
            started: list[str] = []
            refused: dict[str, str] = {}
            for name in wanted:
                outcome, out = node.probe_now(name, now)
                self._apply(out)
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

    def notify_changed(self) -> None:
        """Wake everyone in ``wait_changed``: membership or local tags changed."""
        self._changed.set()
        self._changed = trio.Event()

    @property
    def changed(self) -> trio.Event:
        """Set at the next change; take it *before* reading state, then wait on it."""
        return self._changed

    # --- the node task --------------------------------------------------------------------

    async def command(self, run: Callable[[int], Any]) -> Any:
        """Run ``run(now_ms)`` in the node task and return its result (or raise its error)."""
        send, receive = trio.open_memory_channel[tuple[bool, Any]](1)
        await self._send_in.send(_Command(run, send))
        ok, value = await receive.receive()
        if not ok:
            raise value
        return value

    async def _node_loop(self) -> None:
        while True:
            deadline = self._timers[0][0] / 1000 if self._timers else math.inf
            with trio.move_on_at(deadline):
                item = await self._inbox.receive()
                self._handle(item)
            if self._timers and self._timers[0][0] <= now_ms():
                self._catch_up()
            self._fire_due_timers()

    def _catch_up(self) -> None:
        """Before due timers: handle what is queued and what waits in the socket."""
        late_ms = now_ms() - self._timers[0][0]
        for _ in range(INBOX_DEPTH):
            try:
                self._handle(self._inbox.receive_nowait())
            except trio.WouldBlock:
                break
        read = 0
        udp = self._udp
        while udp is not None and read < MAX_CATCH_UP:
            try:
                data, addr = udp.recvfrom(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # e.g. ICMP port unreachable surfacing on Linux
                read += 1
                continue
            read += 1
            self._handle(_Datagram(Address(addr[0], addr[1]), data))
        if late_ms > STALL_MS:
            self.stalls += 1
            self.stall_datagrams += read
            log.debug("stalled: timers %d ms late; read %d datagrams before them", late_ms, read)

    def _fire_due_timers(self) -> None:
        node = self._node()
        now = now_ms()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            self._apply(node.handle_timer(timer, now))

    def _handle(self, item: _Input) -> None:
        node = self._node()
        now = now_ms()
        if isinstance(item, _Datagram):
            self._apply(node.handle_datagram(item.source, item.data, now))
        elif isinstance(item, _StreamIn):
            out = node.handle_stream(item.source, item.message, now)
            reply, out.reply = out.reply, None
            self._apply(out)
            with contextlib.suppress(
                trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                item.reply.send_nowait(reply)
        elif isinstance(item, _StreamResult):
            self._apply(node.handle_stream_response(item.stream_id, item.message, now, item.error))
        else:
            try:
                result: tuple[bool, Any] = (True, item.run(now))
            except Exception as exc:  # a command's failure goes back to its caller
                result = (False, exc)
            with contextlib.suppress(
                trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                item.reply.send_nowait(result)

    def _apply(self, out: Output) -> Output:
        """Execute an Output: send, schedule, spawn streams, publish events and logs."""
        udp = self._udp
        for packet in out.packets:
            if udp is not None:
                try:
                    # Non-blocking: a full socket buffer drops the packet, as UDP may.
                    udp.sendto(packet.data, (packet.dest.host, packet.dest.port))
                except OSError as exc:
                    log.debug("send to %s failed: %s", packet.dest, exc)
        for timer in out.timers:
            heapq.heappush(self._timers, (timer.deadline_ms, timer.timer_id, timer))
        if self._nursery is not None:
            for request in out.streams:
                self._nursery.start_soon(self._open_stream, request)
        now = now_ms()
        for name in out.heard_from:
            self._heard(name, now)
        for result in out.probe_results:
            self._heard(result.node, now)
            if self.metrics is not None and result.via == "direct":
                self.metrics.observe_probe_rtt_ms(result.rtt_ms)
        for event in out.events:
            self._on_event(event)
        for message in out.user_messages:
            self._on_user_message(message.payload)
        for state in out.push_pull_states:
            self._on_push_pull_state(state)
        for notice in out.notices:
            log.log(_LEVELS.get(notice.level, logging.INFO), "%s", notice.message)
            self._publish(
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

    # --- phi, events, serf messages -----------------------------------------------------

    def _heard(self, name: str, now: int) -> None:
        # registry full: that peer is simply not scored (the registry is bounded)
        with contextlib.suppress(RegistryFullError):
            self.phi.heartbeat(name, now)

    def phi_values(self) -> dict[str, float]:
        return self.phi.phi_all(now_ms())

    def _on_event(self, event: MemberEvent) -> None:
        m = event.member
        bad = event.kind in (EventKind.SUSPECT, EventKind.DEAD)
        level = logging.WARNING if bad else logging.INFO
        log.log(
            level,
            "member %s %s (incarnation %d, %s)",
            m.name,
            event.kind.value,
            m.incarnation,
            m.address,
        )
        self.notify_changed()
        if event.kind in (EventKind.REAPED, EventKind.LEFT) and m.name in self.phi:
            self.phi.remove(m.name)
        if event.kind == EventKind.REAPED:
            # Serf keeps failed and left members listed (and their intent clocks) long
            # after memberlist reaps them; so do we, bounded (agent/departed.py).
            self._forget_intents(self.departed.record(m, event.at_ms))
            self._forget_intents(self.departed.expire(event.at_ms))
            if m.name not in self.departed:
                self._status_ltimes.pop(m.name, None)
        elif event.kind == EventKind.JOINED:
            self.departed.forget(m.name)
        self._publish(
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

    def _on_user_message(self, payload: bytes) -> None:
        """Serf messages from Serf peers (and from our agents), as serf.go handles them:
        witness Lamport times; re-gossip join/leave intents that are news (Serf relies on
        every member passing intents on); answer a stale leave about us with a join intent;
        and honour a leave intent for a failed member (Serf's force-leave)."""
        try:
            _, message = serf.decode_serf_message(payload)
        except ValueError:
            return
        ltime = getattr(message, "ltime", None)
        if isinstance(message, serf.Query):
            self._on_query(message, payload)
            return
        if isinstance(ltime, int) and not isinstance(message, serf.QueryResponse):
            self.clock.witness(ltime)
        if isinstance(message, serf.JoinIntent | serf.LeaveIntent):
            if self._intent_is_news(message.node, message.ltime):
                self._broadcast_serf(payload)
            else:
                return
        if isinstance(message, serf.LeaveIntent):
            self._on_leave_intent(message.node)
        elif isinstance(message, serf.UserEvent):
            self._publish(
                {
                    "type": "user_event",
                    "node": "",
                    "name": message.name,
                    "payload": message.payload,
                    "at_ms": now_ms(),
                    "message": "",
                }
            )

    def _on_query(self, query: serf.Query, payload: bytes) -> None:
        """A Serf query (rules in agent/serf_queries.py): pass news on, ack when asked,
        answer the key-management queries so ``serf keys`` rotates our keyring too."""
        self.query_clock.witness(query.ltime)
        if not self._queries_seen.is_news(query.ltime, query.id):
            return
        if not query.no_broadcast:
            self._broadcast_serf(payload)
        node = self._node()
        if not serf_queries.for_us(query.filters, node.name, self.tags):
            return
        try:
            dest = Address(*serf_queries.response_address(query))
        except ValueError:
            return
        now = now_ms()
        if query.ack:
            ack = serf_queries.response(query, node.name, b"", ack=True)
            self._apply(node.send_user(dest, ack, now))
        name = query.name.removeprefix(serf.INTERNAL_QUERY_PREFIX)
        if query.name.startswith(serf.INTERNAL_QUERY_PREFIX) and name in serf_queries.KEY_QUERIES:
            answer = serf_queries.response(query, node.name, self._key_query(name, query.payload))
            self._apply(node.send_user(dest, answer, now))

    def _key_query(self, name: str, payload: bytes) -> bytes:
        """internal_query.go ``handleInstallKey`` and friends, on our keyring."""
        node = self._node()
        keyring = node.keyring
        if keyring is None:
            empty = "Keyring is empty" if name == "list-keys" else "No keyring to modify"
            return serf_queries.key_response(False, f"{empty} (encryption not enabled)", [], None)
        if name == "list-keys":
            return serf_queries.key_response(True, "", list(keyring.keys), keyring.primary_key)
        change = {"install-key": node.install_key, "use-key": node.use_key}
        try:
            key = serf_queries.key_request(payload)
            change.get(name, node.remove_key)(key)
            self.persist_keyring()
        except (ValueError, KeyringError, OSError) as exc:
            log.warning("serf %s query failed: %s", name, exc)
            return serf_queries.key_response(False, str(exc), [], None)
        log.info("serf %s query: done", name)
        return serf_queries.key_response(True, "", [], None)

    def persist_keyring(self) -> None:
        """Write the keyring back to ``keyring_file`` (primary first), as serf does after a
        key change, atomically; without a keyring file there is nothing to keep."""
        path = self.config.keyring_file
        keyring = self._node().keyring
        if path is None or keyring is None:
            return
        keys = [keyring.primary_key, *(k for k in keyring.keys if k != keyring.primary_key)]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps([base64.b64encode(k).decode() for k in keys]) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    def _on_leave_intent(self, name: str) -> None:
        """A leave intent that is news (serf.go ``handleNodeLeaveIntent``)."""
        node = self._node()
        if name == node.name:
            if not self._leaving:
                # A stale leave about us (e.g. from before a restart): serf peers would keep
                # us "leaving"; a newer join intent refutes it.
                self._send_join_intent()
            return
        member = node.member(name)
        if member is not None:
            if member.state in (NodeStateType.DEAD, NodeStateType.SUSPECT):
                self._apply(node.force_leave(name, now_ms()))
            return
        self._departed_left(name, now_ms())

    def _departed_left(self, name: str, now: int) -> None:
        """A member the core already reaped as failed left after all: a late leave intent or
        a force-leave turns "failed" into "left" (serf's "EventMemberLeave (forced)")."""
        left = self.departed.mark_left(name, now)
        if left is not None:
            self._on_event(MemberEvent(EventKind.LEFT, left, now))

    def _forget_intents(self, names: list[str]) -> None:
        for name in names:
            self._status_ltimes.pop(name, None)

    def all_members(self) -> list[Member]:
        """The core's table plus departed members it has already reaped (as serf lists
        failed and left members until their reconnect/tombstone timeout)."""
        node = self._node()
        self._forget_intents(self.departed.expire(now_ms()))
        live = node.members()
        known = {m.name for m in live}
        return live + [m for m in self.departed.members() if m.name not in known]

    def force_leave(self, name: str, now: int) -> Member | None:
        """Serf ``force-leave``: a failed member is marked left (and gossiped as such).
        Raises ``ValueError`` for an unknown or live member."""
        node = self._node()
        if node.member(name) is None and name in self.departed:
            self._departed_left(name, now)
            return self.departed.get(name)
        self._apply(node.force_leave(name, now))
        return node.member(name)

    def _intent_is_news(self, name: str, ltime: int) -> bool:
        """serf.go: an intent matters only if newer than the last one seen for that node.
        Bounded: one entry per name, dropped when the member is forgotten (reaped and,
        if failed or left, its departed record expired or evicted)."""
        if ltime <= self._status_ltimes.get(name, -1):
            return False
        if name not in self._status_ltimes and len(self._status_ltimes) >= MAX_INTENT_NAMES:
            return False
        self._status_ltimes[name] = ltime
        return True

    def _on_push_pull_state(self, state: bytes) -> None:
        """Serf's push-pull state: witness its clock (serf delegate.go MergeRemoteState)."""
        try:
            decoded = serf.decode_push_pull_state(state)
        except ValueError:
            return
        ltime = decoded.get("ltime")
        if isinstance(ltime, int) and ltime > 0:
            self.clock.witness(ltime - 1)
        # delegate.go MergeRemoteState: each LeftMembers name is a leave intent one past
        # its join LTime, so a leave we missed in gossip still arrives within a push-pull.
        status_ltimes = decoded.get("status_ltimes", {})
        for name in decoded.get("left_members", [])[:MAX_LEFT_MEMBERS]:
            if self._intent_is_news(name, status_ltimes.get(name, 0) + 1):
                self._on_leave_intent(name)

    def _send_join_intent(self) -> None:
        # serf.go: intents carry the current Lamport time, then the clock moves on.
        intent = serf.JoinIntent(self.clock.time(), self.config.node)
        self.clock.increment()
        self._broadcast_serf(serf.encode_join_intent(intent))

    def _send_leave_intent(self, name: str, *, direct: bool = False) -> None:
        intent = serf.LeaveIntent(self.clock.time(), name)
        self.clock.increment()
        self._status_ltimes[name] = intent.ltime
        payload = serf.encode_leave_intent(intent)
        self._broadcast_serf(payload)
        if direct:
            # Serf peers call a departure "left" only if the intent came first; tell every
            # live member directly rather than hope gossip gets there in time.
            node = self._node()
            now = now_ms()
            alive = [
                m for m in node.members() if m.state == NodeStateType.ALIVE and m.name != node.name
            ]
            for member in alive[:LEAVE_FANOUT]:
                self._apply(node.send_user(member.address, payload, now))

    def _broadcast_serf(self, payload: bytes) -> None:
        node = self._node()
        self._apply(node.broadcast_user(payload, now_ms()))

    def subscribe(self, depth: int = 256) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        send, receive = trio.open_memory_channel[dict[str, Any]](depth)
        self._subscribers.append(send)
        return receive

    def _publish(self, event: dict[str, Any]) -> None:
        keep = []
        for subscriber in self._subscribers:
            try:
                subscriber.send_nowait(event)
                keep.append(subscriber)
            except trio.WouldBlock:
                subscriber.close()  # a subscriber that cannot keep up is cut off, bounded
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self._subscribers = keep

    # --- sockets --------------------------------------------------------------------------

    async def _udp_reader(self, udp: trio.socket.SocketType) -> None:
        while True:
            try:
                data, addr = await udp.recvfrom(RECV_BYTES)
            except OSError as exc:  # e.g. ICMP port unreachable surfacing on Linux
                log.debug("udp receive error: %s", exc)
                continue
            try:
                self._send_in.send_nowait(_Datagram(Address(addr[0], addr[1]), data))
            except trio.WouldBlock:
                if self.node is not None:
                    self.node.record_drop(DropReason.QUEUE_FULL)

    async def _serve_tcp(self, listeners: list[trio.SocketListener]) -> None:
        await trio.serve_listeners(self._handle_conn, listeners)

    async def _handle_conn(self, stream: trio.SocketStream) -> None:
        """One inbound stream. Whatever a peer does here (reset, garbage, silence) ends
        this connection only; it never reaches the rest of the agent."""
        node = self._node()
        if self._in_limiter.available_tokens == 0:
            node.record_drop(DropReason.QUEUE_FULL)
            await stream.aclose()
            return
        async with self._in_limiter, stream:
            try:
                await self._serve_conn(stream)
            except _PEER_ERRORS as exc:
                log.debug("inbound stream ended: %s", exc)

    async def _serve_conn(self, stream: trio.SocketStream) -> None:
        peer = stream.socket.getpeername()
        source = Address(peer[0], peer[1])
        with trio.move_on_after(self.swim_config.tcp_timeout_ms / 1000):
            message = await self._read_message(stream)
            if message is None:
                return
            send, receive = trio.open_memory_channel[bytes | None](1)
            await self._send_in.send(_StreamIn(source, message, send))
            reply = await receive.receive()
            if reply:
                await stream.send_all(reply)

    async def _read_message(self, stream: trio.SocketStream) -> StreamMessage | None:
        node = self._node()
        buf = b""
        while True:
            try:
                parsed = node.parse_stream(buf)
            except WireError as exc:
                node.record_drop(exc.reason)
                log.debug("dropping a stream: %s", exc)
                return None
            if parsed is not None:
                return parsed[0]
            try:
                chunk = await stream.receive_some(RECV_BYTES)
            except (trio.BrokenResourceError, OSError):
                return None
            if not chunk:
                if buf:
                    node.record_drop(DropReason.MALFORMED)
                return None
            buf += chunk

    async def _open_stream(self, request: StreamRequest) -> None:
        error = ""
        message: StreamMessage | None = None
        async with self._out_limiter:
            with trio.move_on_at(request.deadline_ms / 1000) as scope:
                try:
                    stream = await trio.open_tcp_stream(request.dest.host, request.dest.port)
                    async with stream:
                        await stream.send_all(request.data)
                        if request.expect_reply:
                            message = await self._read_message(stream)
                            if message is None:
                                error = "no valid reply"
                except _PEER_ERRORS as exc:
                    error = f"{getattr(exc, 'strerror', None) or exc}"
            if scope.cancelled_caught:
                error = "timed out"
        if request.expect_reply:
            await self._send_in.send(_StreamResult(request.stream_id, message, error))

    # --- joining --------------------------------------------------------------------------

    async def join(self, addresses: list[str]) -> dict[str, Any]:
        """Push-pull with each address (resolving names); counts the successes."""
        joined = 0
        errors: list[str] = []
        for text in addresses:
            try:
                hp = parse_host_port(text, "join")
                infos = await trio.socket.getaddrinfo(hp.host, hp.port, type=socket.SOCK_STREAM)
            except (ValueError, OSError) as exc:
                errors.append(f"{text}: {exc}")
                continue
            targets = sorted({Address(str(i[4][0]), hp.port) for i in infos}, key=str)
            for target in targets:
                result = await self._join_one(target)
                if result.ok:
                    joined += 1
                else:
                    errors.append(f"{target}: {result.detail}")
        return {"joined": joined, "errors": errors}

    async def _join_one(self, target: Address) -> JoinResult:
        if target == self._node().address:
            return JoinResult(target, False, "that is this agent's own address")
        send, receive = trio.open_memory_channel[JoinResult](1)
        self._join_waiters[target] = send
        await self.command(lambda t: self._apply(self._node().join([target], t)))
        with trio.move_on_after(self.swim_config.tcp_timeout_ms / 1000 + 1):
            return await receive.receive()
        self._join_waiters.pop(target, None)
        return JoinResult(target, False, "timed out")

    async def _retry_join(self) -> None:
        attempt = 0
        while self.config.retry_max == 0 or attempt < self.config.retry_max:
            attempt += 1
            result = await self.join(list(self.config.retry_join))
            if result["joined"]:
                log.info("retry-join: joined %d address(es)", result["joined"])
                return
            log.warning("retry-join attempt %d failed: %s", attempt, "; ".join(result["errors"]))
            await trio.sleep(self.config.retry_interval_ms / 1000)
        log.error("retry-join: giving up after %d attempts", attempt)

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval_s()
        if interval is None:
            return
        while True:
            # The ping only goes out if the node task is responsive.
            await self.command(lambda t: None)
            systemd.notify("WATCHDOG=1")
            await trio.sleep(interval)


_PEER_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)
"""What a misbehaving peer or network can raise on a stream; handled per connection."""

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


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


async def run_agent(
    config: AgentConfig,
    install_signals: bool = True,
    on_ready: Callable[[Agent], Awaitable[None]] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (graceful leave) or a leave request; SIGHUP reloads."""
    agent = Agent(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.run)
        if on_ready is not None:
            await on_ready(agent)
        if install_signals:
            nursery.start_soon(_signals, agent)
        await agent.stopped.wait()
        nursery.cancel_scope.cancel()
    return 0


async def _signals(agent: Agent) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                await agent.reload()
            else:
                log.info("received %s: leaving the cluster", signal.Signals(signum).name)
                agent.request_shutdown()
