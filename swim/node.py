"""``swim.Node``: the sans-IO SWIM + Lifeguard state machine speaking memberlist's protocol.

Rules (DESIGN.md; h11/foca style):
- Inputs: ``handle_datagram``, ``handle_stream`` (a complete stream message someone sent
  us), ``handle_stream_response`` (the answer on a stream we opened), ``handle_timer``, and
  commands (``join``, ``leave``, ``set_meta``, user messages, keyring changes). Each takes
  ``now_ms`` and returns an ``Output``; nothing else leaves the node.
- ``bootstrap(snapshot)`` starts a node already joined to a shared ``MembershipSnapshot``
  (simulators): no events, no join traffic; the node stores only what it changes later
  (``swim.table``), and push-pulls between such nodes share their codec work
  (``swim.shared``) without changing a byte on the wire.
- Randomness comes only from the injected ``random.Random``; AES-GCM nonces come from the
  injected nonce source (``secrets.token_bytes`` by default, never the protocol RNG).
- Malformed or hostile input never raises out of the node: it is dropped, counted by reason
  in ``stats.dropped``, and leaves membership unchanged. Misuse by the caller raises.
- Dissemination (memberlist net.go ``sendMsg``, state.go ``gossip``, queue.go): every packet
  is filled with queued broadcasts up to ``udp_buffer_size``; a gossip round every
  ``gossip_interval_ms`` sends pending broadcasts to ``gossip_nodes`` random members
  (alive, suspect, or dead for less than ``gossip_to_the_dead_time_ms``); a push-pull
  full-state exchange runs on join and every ``push_pull_scale_ms`` (memberlist util.go).

Module map: ``membership`` (§4.2 transitions), ``table`` (copy-on-write member storage,
sampling, probe rounds), ``shared`` (push-pull work shared across bootstrapped nodes),
``probe`` (the probe cycle), ``wire`` (bytes), ``queue`` (piggyback queue), ``formulas``
(every derived number).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from swim import formulas, wire
from swim.compat import Versions, verify_protocol, verify_summaries
from swim.config import META_MAX_BYTES, Config
from swim.context import Context
from swim.effects import (
    JoinResult,
    Member,
    NodeStats,
    Output,
    Packet,
    StreamKind,
    StreamRequest,
    Timer,
    UserMessage,
)
from swim.membership import LEAVE_NOTIFY, SUSPICION_TIMER, Membership, MemberState
from swim.messages import (
    Ack,
    Address,
    Alive,
    Dead,
    ErrResp,
    IndirectPing,
    Message,
    Nack,
    NodeStateType,
    Ping,
    PushPull,
    Suspect,
    UserMsg,
)
from swim.probe import (
    PROBE_DEADLINE,
    PROBE_TCP_GRACE,
    PROBE_TIMEOUT,
    RELAY_TIMEOUT,
    Prober,
)
from swim.security import Keyring
from swim.shared import MEMO_MIN_BYTES, SHARED_MIN_NODES
from swim.table import MembershipSnapshot, local_vsn
from swim.wire import DropReason, StreamMessage, WireError

PROBE_TICK = "probe_tick"
GOSSIP_TICK = "gossip_tick"
PUSH_PULL_TICK = "push_pull_tick"
RECONNECT_TICK = "reconnect_tick"
STREAM_EXPIRE = "stream_expire"
MAX_PENDING_STREAMS = 1024
LEAVE_FANOUT = 1024
"""Live members told of our leave directly; the rest hear it by gossip."""


@dataclass(slots=True)
class _Stream:
    kind: StreamKind
    dest: Address
    join: bool
    timer_id: int
    reconnect: bool = False


class Node:
    """One member of a SWIM group. See the module docstring for the contract."""

    def __init__(
        self,
        name: str,
        address: Address,
        *,
        rng: random.Random,
        now_ms: int,
        config: Config | None = None,
        meta: bytes = b"",
        keyring: Keyring | None = None,
        nonce_source: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        if not name:
            raise ValueError("a node needs a non-empty name")
        _check_meta(meta)
        Address.from_ip_bytes(address.ip_bytes, address.port)  # validates the IP
        self.config = config if config is not None else Config.lan()
        self._ctx = Context(self.config, rng, now_ms)
        self._keyring = keyring
        self._nonce_source = nonce_source
        vsn = local_vsn(self.config)
        local = MemberState(name, address, meta, 0, NodeStateType.ALIVE, now_ms, vsn)
        self._members = Membership(self._ctx, local)
        self._prober = Prober(self._ctx, self._members, self)
        self._streams: dict[int, _Stream] = {}
        self._next_stream_id = 0
        self._leave_done = False
        self._user_state = b""
        self._push_pull_timer: int | None = None
        self._members.bump_local()
        self._ctx.out = Output()

    # --- read-only views ----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._members.local_name

    @property
    def address(self) -> Address:
        return self._members.local.address

    @property
    def incarnation(self) -> int:
        return self._members.local.incarnation

    @property
    def health_score(self) -> int:
        return self._members.health_score

    @property
    def stats(self) -> NodeStats:
        return self._ctx.stats

    @property
    def leaving(self) -> bool:
        return self._members.leaving

    @property
    def leave_done(self) -> bool:
        """True once our leave message has been gossiped out (or nobody is left to tell)."""
        return self._leave_done

    @property
    def broadcast_queue_depth(self) -> int:
        return len(self._ctx.broadcasts) + len(self._ctx.user_broadcasts)

    @property
    def live_timers(self) -> int:
        return self._ctx.live_timers

    @property
    def keyring(self) -> Keyring | None:
        return self._keyring

    def members(self) -> list[Member]:
        """Every member we know, ourselves included, sorted by name."""
        return sorted((m.snapshot() for m in self._members.states()), key=lambda m: m.name)

    def member(self, name: str) -> Member | None:
        state = self._members.get(name)
        return None if state is None else state.snapshot()

    def num_members(self) -> int:
        """Members in the table (alive, suspect, and not yet reaped dead/left)."""
        return len(self._members)

    def suspicion_deadline_ms(self, name: str) -> int | None:
        return self._members.suspicion_deadline_ms(name)

    # --- commands -----------------------------------------------------------------------

    def start(self, now_ms: int) -> Output:
        """Arm the periodic timers, each with a random stagger (state.go ``schedule``)."""
        self._ctx.begin(now_ms)
        c = self.config
        rng = self._ctx.rng
        self._ctx.set_timer(PROBE_TICK, rng.randrange(c.probe_interval_ms))
        if c.gossip_interval_ms > 0 and c.gossip_nodes > 0:
            self._ctx.set_timer(GOSSIP_TICK, rng.randrange(c.gossip_interval_ms))
        if c.push_pull_interval_ms > 0:
            self._push_pull_timer = self._ctx.set_timer(
                PUSH_PULL_TICK, rng.randrange(c.push_pull_interval_ms)
            )
        if c.reconnect_interval_ms > 0:
            self._ctx.set_timer(RECONNECT_TICK, rng.randrange(c.reconnect_interval_ms))
        return self._finish()

    def bootstrap(self, snapshot: MembershipSnapshot, now_ms: int) -> Output:
        """Start already joined: every member of ``snapshot`` other than us becomes an alive
        member, without push-pulls. Call it right after ``start()`` (raises otherwise).

        No per-member events are emitted (the caller built the snapshot, so it knows who is
        in it); later changes are reported as usual. The snapshot is shared, not copied:
        this node stores only the members whose state it changes later, so N nodes
        bootstrapped from one snapshot cost O(n) memory in all, not O(n²). Our own entry in
        the snapshot, if any, is replaced by what we are.

        The next periodic push-pull is re-drawn uniformly over the interval scaled to the
        new group size (``pushPullScale``). memberlist's ``pushPullTrigger`` staggers a
        fresh node's first push-pull over the unscaled interval and then ticks every
        scaled interval; a bootstrapped node stands for a member of a cluster that has
        been running a while, whose ticks are uniformly spread over the scaled interval.
        (Otherwise all n nodes of a bootstrapped cluster would push-pull their full state
        within the first 30 s.)
        """
        self._ctx.begin(now_ms)
        self._members.bootstrap(snapshot)
        interval_ms = self.config.push_pull_interval_ms
        if interval_ms > 0 and self._push_pull_timer is not None:
            self._ctx.cancel_timer(self._push_pull_timer)
            scaled_ms = formulas.push_pull_scale_ms(interval_ms, len(self._members))
            self._push_pull_timer = self._ctx.set_timer(
                PUSH_PULL_TICK, self._ctx.rng.randrange(scaled_ms)
            )
        return self._finish()

    def join(self, seeds: Sequence[Address], now_ms: int) -> Output:
        """Push-pull (join=True) with every seed; results arrive as ``join_results``."""
        self._ctx.begin(now_ms)
        for seed in seeds:
            if seed != self.address:
                self._open_push_pull(seed, join=True)
        return self._finish()

    def leave(self, now_ms: int) -> Output:
        """Broadcast that we leave and tell every live member at once; watch ``leave_done``.

        memberlist only queues the message for gossip, so a leave can be missed when the few
        gossip targets are themselves dead and the process exits; we also send it directly
        to up to ``LEAVE_FANOUT`` random live members (one packet each, once).
        """
        self._ctx.begin(now_ms)
        if not self._members.leaving:
            self._members.leave()
            if not self._members.any_alive_peer():
                self._leave_done = True
            me = self._members.local
            dead = wire.encode_message(Dead(me.incarnation, me.name, me.name))
            peers = self._members.random_members(
                LEAVE_FANOUT, lambda m: m.name == me.name or m.state != NodeStateType.ALIVE
            )
            for peer in peers:
                self.send(peer.address, dead, peer)
            self._gossip_round()
        return self._finish()

    def force_leave(self, name: str, now_ms: int) -> Output:
        """Declare a failed member gone for good (Serf ``force-leave``): it is gossiped as
        having left, so it is reaped instead of waited for. Refused for a live member."""
        member = self._members.get(name)
        if member is None:
            raise ValueError(f"no member named {name!r}")
        if name == self.name:
            raise ValueError("use leave() to leave; force-leave is for other, failed members")
        if member.state == NodeStateType.ALIVE:
            raise ValueError(f"{name} is alive; force-leave only removes failed members")
        self._ctx.begin(now_ms)
        if member.state != NodeStateType.LEFT:
            self._members.force_left(name)
        return self._finish()

    def set_push_pull_state(self, state: bytes) -> None:
        """Application state sent after the member list in every push-pull (memberlist
        ``Delegate.LocalState``; Serf keeps its Lamport clocks there)."""
        self._user_state = bytes(state)

    def gossip(self, now_ms: int) -> Output:
        """Run a gossip round now (e.g. to push out a message before leaving)."""
        self._ctx.begin(now_ms)
        self._gossip_round()
        return self._finish()

    def set_meta(self, meta: bytes, now_ms: int) -> Output:
        """New node metadata (≤ 512 bytes), gossiped with a new incarnation."""
        _check_meta(meta)
        self._ctx.begin(now_ms)
        self._members.bump_local(meta)
        return self._finish()

    def set_ack_payload(self, payload: bytes) -> None:
        """Bytes carried in every ack we send (memberlist ``PingDelegate.AckPayload``)."""
        self._prober.ack_payload = bytes(payload)

    def send_user(self, dest: Address, payload: bytes, now_ms: int) -> Output:
        """A best-effort user message in one packet (memberlist ``SendBestEffort``)."""
        self._ctx.begin(now_ms)
        self._emit(dest, [wire.encode_message(UserMsg(payload))], self._members.by_address(dest))
        return self._finish()

    def send_user_reliable(self, dest: Address, payload: bytes, now_ms: int) -> Output:
        """A user message over a stream (memberlist ``SendReliable``)."""
        if len(payload) > self.config.max_user_msg_bytes:
            raise ValueError(f"user message of {len(payload)} bytes exceeds the limit")
        self._ctx.begin(now_ms)
        deadline_ms = self._ctx.now_ms + self.config.tcp_timeout_ms
        self.open_stream(dest, wire.encode_user_stream(payload), StreamKind.USER, deadline_ms)
        return self._finish()

    def broadcast_user(self, payload: bytes, now_ms: int) -> Output:
        """Queue a user message to piggyback on gossip to everyone."""
        limit = self.config.udp_buffer_size - wire.packet_overhead(self._crypto())
        if len(payload) + wire.USER_MSG_OVERHEAD + wire.COMPOUND_OVERHEAD > limit:
            raise ValueError(f"a broadcast user message must fit one packet ({limit} bytes)")
        self._ctx.begin(now_ms)
        self._ctx.user_broadcasts.queue(payload)
        return self._finish()

    def install_key(self, key: bytes) -> None:
        self._require_keyring().install(key)

    def use_key(self, key: bytes) -> None:
        self._require_keyring().use(key)

    def remove_key(self, key: bytes) -> None:
        self._require_keyring().remove(key)

    def _require_keyring(self) -> Keyring:
        if self._keyring is None:
            raise ValueError("encryption is not enabled on this node")
        return self._keyring

    def record_drop(self, reason: DropReason) -> None:
        """Count input the driver dropped before it reached the node (e.g. a bad stream)."""
        self._ctx.drop(reason)

    # --- inputs -------------------------------------------------------------------------

    def handle_datagram(self, source: Address, data: bytes, now_ms: int) -> Output:
        self._ctx.begin(now_ms)
        stats = self._ctx.stats
        stats.packets_in += 1
        stats.bytes_in += len(data)
        try:
            decoded = wire.decode_packet(data, self._crypto())
        except WireError as exc:
            self._ctx.drop(exc.reason)
            return self._finish()
        for reason in decoded.drops:
            self._ctx.drop(reason)
        if not decoded.messages and not decoded.drops:
            self._ctx.drop(DropReason.EMPTY)  # e.g. a compound with no parts
        for message in decoded.messages:
            stats.messages_in[wire.message_type_name(message)] += 1
            self._dispatch(message, source)
        sender = self._members.by_address(source)
        if decoded.messages and sender is not None and sender.name != self.name:
            self._ctx.out.heard_from.append(sender.name)
        return self._finish()

    def _dispatch(self, message: Message, source: Address) -> None:
        if isinstance(message, Ping):
            self._prober.on_ping(message, source)
        elif isinstance(message, IndirectPing):
            self._prober.on_indirect_ping(message, source)
        elif isinstance(message, Ack):
            self._prober.on_ack(message, source)
        elif isinstance(message, Nack):
            self._prober.on_nack(message)
        elif isinstance(message, Alive):
            self._members.apply_alive(message)
        elif isinstance(message, Suspect):
            self._members.apply_suspect(message)
        elif isinstance(message, Dead):
            self._members.apply_dead(message)
        elif isinstance(message, UserMsg):
            self._ctx.out.user_messages.append(UserMessage(source, message.payload))
        else:
            self._ctx.drop(DropReason.UNEXPECTED_TYPE)

    def handle_timer(self, timer: Timer, now_ms: int) -> Output:
        self._ctx.begin(now_ms)
        entry = self._ctx.take_timer(timer)
        if entry is not None:
            self._on_timer(*entry)
        return self._finish()

    def parse_stream(self, data: bytes) -> tuple[StreamMessage, int] | None:
        """One complete stream message from the front of ``data``, or None for "need more".

        Raises ``WireError`` as soon as the bytes cannot be a valid message; the driver
        then closes the stream and calls ``record_drop(error.reason)``.
        """
        limits = wire.StreamLimits(
            self.config.max_stream_bytes,
            self.config.max_push_pull_nodes,
            self.config.max_user_msg_bytes,
        )
        codec = self._members.codec
        if (
            codec is not None
            and self._keyring is None
            and type(data) is bytes
            and len(data) >= MEMO_MIN_BYTES
        ):
            return codec.parse(data, limits)
        return wire.parse_stream(data, self._crypto(), limits)

    def handle_stream(self, source: Address, message: StreamMessage, now_ms: int) -> Output:
        """A message someone sent us on a stream; ``Output.reply`` is the answer, if any."""
        self._ctx.begin(now_ms)
        out = self._ctx.out
        if isinstance(message, Ping):
            if message.node and message.node != self.name:
                self._ctx.drop(DropReason.WRONG_NODE)
            else:
                ack = wire.encode_message(Ack(message.seq_no))
                out.reply = self._stream_bytes(ack)
        elif isinstance(message, PushPull):
            self._ctx.stats.push_pulls += 1
            local = self._members.encode_push_pull(message.join, self._user_state)
            out.reply = self._stream_bytes(local)
            self._merge(message, source)
        elif isinstance(message, UserMsg):
            out.user_messages.append(UserMessage(source, message.payload))
        else:
            self._ctx.drop(DropReason.UNEXPECTED_TYPE)
        return self._finish()

    def handle_stream_response(
        self, stream_id: int, message: StreamMessage | None, now_ms: int, error: str = ""
    ) -> Output:
        """The reply on a stream we opened, or None with ``error`` if it failed."""
        self._ctx.begin(now_ms)
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._ctx.cancel_timer(stream.timer_id)
            if message is None:
                self._ctx.stats.streams_failed += 1
            self._stream_done(stream_id, stream, message, error)
        return self._finish()

    def _stream_done(
        self, stream_id: int, stream: _Stream, message: StreamMessage | None, error: str
    ) -> None:
        if stream.kind == StreamKind.PING:
            self._prober.on_tcp_result(stream_id, message if isinstance(message, Ack) else None)
            return
        if stream.kind != StreamKind.PUSH_PULL:
            return
        if isinstance(message, PushPull) and not self._merge(message, stream.dest):
            error = "incompatible protocol versions"
        elif isinstance(message, PushPull):
            self._ctx.stats.push_pulls += 1
            if stream.reconnect:
                self._ctx.notice("info", "reconnected", f"reconnected to {stream.dest}")
            elif stream.join:
                self._join_result(stream.dest, True, f"pushed/pulled {len(message.nodes)} states")
            return
        if isinstance(message, ErrResp):
            error = f"remote error: {message.error}"
        elif message is not None and not isinstance(message, PushPull):
            error = f"unexpected reply {type(message).__name__}"
        if stream.reconnect:
            self._ctx.notice("debug", "reconnect_failed", f"reconnect {stream.dest}: {error}")
            return
        self._ctx.notice("error", "push_pull_failed", f"push/pull with {stream.dest}: {error}")
        if stream.join:
            self._join_result(stream.dest, False, error or "failed")

    def _merge(self, remote: PushPull, source: Address) -> bool:
        """Merge a pushed state unless its protocol versions clash (memberlist
        ``mergeRemoteState``): then nothing is merged and the reason is logged."""
        codec = self._members.codec
        if codec is not None and len(remote.nodes) >= SHARED_MIN_NODES:
            diff = codec.diff(remote)
            problem = verify_summaries(self._members.version_summary(codec), diff.versions)
        else:
            diff = None
            problem = verify_protocol(
                (Versions(m.name, m.state, m.vsn) for m in self._members.states()),
                (Versions(r.name, r.state, r.vsn) for r in remote.nodes),
            )
        if problem:
            self._ctx.drop(DropReason.INVALID_VERSION)
            self._ctx.notice("error", "push_pull_rejected", f"push/pull from {source}: {problem}")
            return False
        if diff is not None:
            self._members.merge_diff(remote.nodes, diff)
        else:
            self._members.merge(remote.nodes)
        if remote.user_state:
            self._ctx.out.push_pull_states.append(remote.user_state)
        return True

    def _join_result(self, address: Address, ok: bool, detail: str) -> None:
        level = "info" if ok else "error"
        self._ctx.notice(level, "join_ok" if ok else "join_failed", f"join {address}: {detail}")
        self._ctx.out.join_results.append(JoinResult(address, ok, detail))

    # --- timers -------------------------------------------------------------------------

    def _on_timer(self, kind: str, data: object) -> None:
        prober = self._prober
        if kind == PROBE_TICK:
            self._ctx.set_timer(PROBE_TICK, self.config.probe_interval_ms)
            prober.on_tick()
        elif kind == GOSSIP_TICK:
            self._ctx.set_timer(GOSSIP_TICK, self.config.gossip_interval_ms)
            self._gossip_round()
        elif kind == PUSH_PULL_TICK:
            self._on_push_pull_tick()
        elif kind == RECONNECT_TICK:
            self._ctx.set_timer(RECONNECT_TICK, self.config.reconnect_interval_ms)
            self._reconnect()
        elif kind == SUSPICION_TIMER:
            name, state_change_ms = cast(tuple[str, int], data)
            self._members.on_suspicion_timeout(name, state_change_ms)
        elif kind == STREAM_EXPIRE:
            self._on_stream_expire(cast(int, data))
        elif kind == PROBE_TIMEOUT:
            prober.on_probe_timeout(cast(int, data))
        elif kind == PROBE_DEADLINE:
            prober.on_probe_deadline(cast(int, data))
        elif kind == PROBE_TCP_GRACE:
            prober.on_tcp_grace(cast(int, data))
        elif kind == RELAY_TIMEOUT:
            prober.on_relay_timeout(cast(int, data))

    def _on_push_pull_tick(self) -> None:
        interval = formulas.push_pull_scale_ms(
            self.config.push_pull_interval_ms, len(self._members)
        )
        self._push_pull_timer = self._ctx.set_timer(PUSH_PULL_TICK, interval)
        peers = self._members.random_members(
            1, lambda m: m.name == self.name or m.state != NodeStateType.ALIVE
        )
        if peers:
            self._open_push_pull(peers[0].address, join=False)

    def _reconnect(self) -> None:
        """serf ``reconnect``: with probability failed/alive, push-pull with one failed member.

        This is what merges two halves of a healed partition: each side declared the other
        dead, and only a new exchange of full state lets the accused refute.
        """
        members = self._members
        members.expire_failed()
        if not members.failed or members.leaving:
            return
        alive = max(members.count(NodeStateType.ALIVE), 1)
        rng = self._ctx.rng
        if rng.random() > len(members.failed) / alive:
            return
        names = list(members.failed)
        address, _ = members.failed[names[rng.randrange(len(names))]]
        stream_id = self._open_push_pull(address, join=True)
        if stream_id in self._streams:
            self._streams[stream_id].reconnect = True

    def _on_stream_expire(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._ctx.stats.streams_failed += 1
            self._stream_done(stream_id, stream, None, "no answer before the deadline")

    # --- dissemination ------------------------------------------------------------------

    def _gossip_round(self) -> None:
        """state.go ``gossip``: pending broadcasts to a few random members."""
        if not len(self._ctx.broadcasts) and not len(self._ctx.user_broadcasts):
            return  # nothing to send: skip drawing targets (memberlist draws, then sends none)
        limit = self.config.udp_buffer_size - wire.packet_overhead(self._crypto())
        for peer in self._gossip_targets():
            parts = self._take_broadcasts(limit - _crc_overhead(peer))
            if not parts:
                return
            self._emit(peer.address, parts, peer)

    def _gossip_targets(self) -> list[MemberState]:
        """Who gets this round's gossip.

        memberlist draws ``gossip_nodes`` from live *and* recently dead members together, so
        after a few failures most of a broadcast's few transmissions go to dead nodes and a
        live member can miss a death entirely (measured: 5.5% of deaths in an 8-node cluster
        with repeated kills reached the last survivor > 2 s late, up to 21 s). With
        ``gossip_to_dead_separately`` (default) the live targets are drawn from live members
        only, and one recently dead member is added with probability ≈ dead/n (one random
        draw), as chitchat does, so the dead can still refute.
        """
        now = self._ctx.now_ms
        window = self.config.gossip_to_the_dead_time_ms
        members = self._members

        def recently_dead(m: MemberState) -> bool:
            return m.state == NodeStateType.DEAD and now - m.state_change_ms <= window

        def live(m: MemberState) -> bool:
            return m.name != self.name and m.state in (NodeStateType.ALIVE, NodeStateType.SUSPECT)

        if not self.config.gossip_to_dead_separately:
            return members.random_members(
                self.config.gossip_nodes, lambda m: not (live(m) or recently_dead(m))
            )
        targets = members.random_members(self.config.gossip_nodes, lambda m: not live(m))
        if not members.count(NodeStateType.DEAD):
            return targets  # nobody to gossip to the dead: skip the draw
        extra = members.random_members(1, lambda m: False)
        if extra and recently_dead(extra[0]):
            targets.append(extra[0])
        return targets

    def _take_broadcasts(self, limit: int) -> list[bytes]:
        """Member broadcasts first, then user broadcasts in what room is left (net.go)."""
        n = len(self._members)
        overhead = wire.COMPOUND_OVERHEAD
        parts = self._ctx.broadcasts.take(overhead, limit, n)
        used = sum(len(p) + overhead for p in parts)
        avail = limit - used
        if avail > overhead + wire.USER_MSG_OVERHEAD and len(self._ctx.user_broadcasts):
            user = self._ctx.user_broadcasts.take(overhead + wire.USER_MSG_OVERHEAD, avail, n)
            parts.extend(wire.encode_message(UserMsg(p)) for p in user)
        return parts

    def send(self, dest: Address, message: bytes, member: MemberState | None = None) -> None:
        """One message, with as many broadcasts piggybacked as fit (net.go ``sendMsg``)."""
        # Unlike memberlist (net.go sendMsg), also count the message's own compound entry
        # and the CRC header, so a packet never exceeds udp_buffer_size.
        limit = (
            self.config.udp_buffer_size
            - len(message)
            - wire.COMPOUND_OVERHEAD
            - wire.packet_overhead(self._crypto())
            - _crc_overhead(member)
        )
        self._emit(dest, [message, *self._take_broadcasts(limit)], member)

    def send_parts(self, dest: Address, parts: list[bytes], member: MemberState | None) -> None:
        self._emit(dest, parts, member)

    def _emit(self, dest: Address, parts: list[bytes], member: MemberState | None) -> None:
        crc = _crc_overhead(member) > 0
        crypto = self._crypto()
        stats = self._ctx.stats
        for start in range(0, len(parts), wire.MAX_COMPOUND_PARTS):
            chunk = parts[start : start + wire.MAX_COMPOUND_PARTS]
            data = wire.encode_packet(
                chunk, compress=self.config.enable_compression, crc=crc, crypto=crypto
            )
            self._ctx.out.packets.append(Packet(dest, data))
            stats.packets_out += 1
            stats.bytes_out += len(data)
            for part in chunk:
                stats.messages_out[_type_name(part)] += 1

    def open_stream(self, dest: Address, message: bytes, kind: StreamKind, deadline_ms: int) -> int:
        if len(self._streams) >= MAX_PENDING_STREAMS:
            self._ctx.drop(DropReason.QUEUE_FULL)
            return -1
        self._next_stream_id += 1
        stream_id = self._next_stream_id
        expect_reply = kind != StreamKind.USER
        if expect_reply:
            grace_ms = deadline_ms - self._ctx.now_ms + self.config.probe_timeout_ms
            timer_id = self._ctx.set_timer(STREAM_EXPIRE, grace_ms, stream_id)
            self._streams[stream_id] = _Stream(kind, dest, False, timer_id)
        self._ctx.stats.streams_opened += 1
        data = self._stream_bytes(message)
        self._ctx.out.streams.append(
            StreamRequest(stream_id, dest, data, deadline_ms, kind, expect_reply)
        )
        return stream_id

    def _open_push_pull(self, dest: Address, join: bool) -> int:
        local = self._members.encode_push_pull(join, self._user_state)
        deadline_ms = self._ctx.now_ms + self.config.tcp_timeout_ms
        stream_id = self.open_stream(dest, local, StreamKind.PUSH_PULL, deadline_ms)
        if stream_id in self._streams:
            self._streams[stream_id].join = join
        return stream_id

    def _stream_bytes(self, message: bytes) -> bytes:
        codec = self._members.codec
        if (
            codec is not None
            and self._keyring is None
            and self.config.enable_compression
            and len(message) >= MEMO_MIN_BYTES
        ):
            return codec.compress(message)
        return wire.encode_stream(
            message, compress=self.config.enable_compression, crypto=self._crypto()
        )

    def _crypto(self) -> wire.Crypto | None:
        if self._keyring is None:
            return None
        return wire.Crypto(self._keyring, self._nonce_source)

    def _finish(self) -> Output:
        finished = self._ctx.broadcasts.finished
        if finished:
            if LEAVE_NOTIFY in finished:
                self._leave_done = True
            finished.clear()
        return self._ctx.finish()


def _crc_overhead(member: MemberState | None) -> int:
    """Receivers that speak protocol ≥ 5 get a CRC32 header (net.go rawSendMsgPacket)."""
    return wire.CRC_OVERHEAD if member is not None and member.protocol_max >= 5 else 0


def _type_name(part: bytes) -> str:
    return wire.type_name(part[0]) if part else "empty"


def _check_meta(meta: bytes) -> None:
    if len(meta) > META_MAX_BYTES:
        raise ValueError(f"node metadata is {len(meta)} bytes; the limit is {META_MAX_BYTES}")
