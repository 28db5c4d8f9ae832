"""``swim.Node``: the sans-IO SWIM + Lifeguard state machine speaking memberlist's protocol.

Rules (docs/design.md §1.3 and §4; h11/foca style):
- Inputs: ``handle_datagram``, ``handle_stream`` (a complete stream message someone sent
  us), ``handle_stream_response`` (the answer on a stream we opened), ``handle_timer``, and
  commands (``join``, ``leave``, ``set_meta``, ``probe_now``, user messages, keyring
  changes). Each takes ``now_ms`` and returns an ``Output`` (``probe_now`` also its
  outcome); nothing else leaves the node.
- ``bootstrap(snapshot)`` starts a node already joined to a shared ``MembershipSnapshot``
  (simulators): no events, no join traffic; it stores only what it changes (``swim.table``);
  push-pulls between such nodes share codec work (``swim.shared``), same bytes on the wire.
- Randomness only from the injected ``random.Random``; AES-GCM nonces from the injected
  nonce source (``secrets.token_bytes`` by default, never the protocol RNG).
- Hostile input never raises out of the node: dropped, counted by reason in
  ``stats.dropped``, membership unchanged. Misuse by the caller raises.
- Dissemination (memberlist net.go ``sendMsg``, state.go ``gossip``, queue.go): every packet
  is filled with queued broadcasts up to ``udp_buffer_size``; a gossip round every
  ``gossip_interval_ms`` sends pending broadcasts to ``gossip_nodes`` random members
  (alive, suspect, or dead for less than ``gossip_to_the_dead_time_ms``); a push-pull
  full-state exchange runs on join and every ``push_pull_scale_ms`` (memberlist util.go).
- The node is the facade: it owns the ``Context`` and routes every input to the helper
  that shares it; helpers call back only through ``probe.Transport`` (send, open_stream).

Modules: ``membership`` (SWIM §4.2: the ``PRECEDENCE`` table), ``suspicion`` (Lifeguard
timers), ``awareness`` (local health), ``member_state``, ``table`` (copy-on-write storage,
sampling, probe rounds), ``schedule`` (coordinated probe rounds), ``shared`` (push-pull
work shared by bootstrapped nodes), ``push_pull``, ``failed`` (serf's failed members),
``probe`` (the probe cycle), ``inbound`` (a datagram's messages to their owners),
``transport`` (packets out, gossip), ``streams``, ``timers``,
``wire`` (bytes), ``queue`` (piggyback), ``formulas``, ``context`` (shared per-node state).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Sequence
from typing import assert_never

from swim import wire
from swim.config import META_MAX_BYTES, Config
from swim.context import Context
from swim.effects import (
    Member,
    NodeStats,
    Output,
    StreamKind,
    Timer,
    UrgentProbeOutcome,
)
from swim.inbound import Inbound
from swim.member_state import MemberState
from swim.membership import LEAVE_NOTIFY, Membership
from swim.messages import Address, Dead, NodeStateType, UserMsg
from swim.probe import Prober
from swim.security import Keyring
from swim.streams import Streams
from swim.table import MembershipSnapshot, local_vsn
from swim.timers import (
    NODE_TIMERS,
    GossipTick,
    NodeTimer,
    ProbeDeadline,
    ProbeTcpGrace,
    ProbeTick,
    ProbeTimeout,
    PushPullTick,
    ReconnectTick,
    RelayTimeout,
    StreamExpire,
    SuspicionTimeout,
    SuspicionVerify,
)
from swim.transport import Sender
from swim.wire import DropReason, StreamMessage, WireError

__all__ = ["LEAVE_FANOUT", "Node"]

LEAVE_FANOUT = 1024
"""Live members told of our leave directly; the rest hear it by gossip."""


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
        vsn = local_vsn(self.config)
        local = MemberState(name, address, meta, 0, NodeStateType.ALIVE, now_ms, vsn)
        # a claimant waiting on a death verdict is told it directly (swim.claims)
        self._members = Membership(self._ctx, local, lambda dest, msg: self._sender.send(dest, msg))
        self._sender = Sender(self._ctx, self._members, keyring, nonce_source)
        self._prober = Prober(self._ctx, self._members, self)
        self._inbound = Inbound(self._ctx, self._members, self._prober)
        self._streams = Streams(self._ctx, self._members, self._sender, self._prober)
        self._leave_done = False
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
        return self._ctx.awareness.score

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
        ctx = self._ctx
        return len(ctx.broadcasts.pending) + len(ctx.user_broadcasts.pending)

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
        self._ctx.set_timer(ProbeTick, rng.randrange(c.probe_interval_ms))
        if c.gossip_interval_ms > 0 and c.gossip_nodes > 0:
            self._ctx.set_timer(GossipTick, rng.randrange(c.gossip_interval_ms))
        if c.push_pull_interval_ms > 0:
            self._streams.schedule_push_pull(rng.randrange(c.push_pull_interval_ms))
        if c.reconnect_interval_ms > 0:
            self._ctx.set_timer(ReconnectTick, rng.randrange(c.reconnect_interval_ms))
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
        self._streams.rescale_push_pull()
        return self._finish()

    def join(self, seeds: Sequence[Address], now_ms: int) -> Output:
        """Push-pull (join=True) with every seed; results arrive as ``join_results``."""
        self._ctx.begin(now_ms)
        for seed in seeds:
            if seed != self.address:
                self._streams.open_push_pull(seed, join=True)
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
                self._sender.send(peer.address, dead, peer)
            self._sender.gossip_round()
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

    def probe_now(self, name: str, now_ms: int) -> tuple[UrgentProbeOutcome, Output]:
        """Probe ``name`` now instead of at its round-robin turn: evidence from outside the
        protocol (a trainer lost its connection to it) makes the probe earlier, never the
        verdict; only the probe's own failure makes the member suspect. Refused (nothing
        sent, counted in ``stats.urgent_probes``) for ourselves, an unknown or not-alive
        member, one being probed, one probed urgently less than a probe interval ago, or
        with ``MAX_URGENT_PROBES`` in flight. Rules: ``swim.probe``."""
        self._ctx.begin(now_ms)
        outcome = self._prober.probe_now(name)
        return outcome, self._finish()

    def set_push_pull_state(self, state: bytes) -> None:
        """Application state sent after the member list in every push-pull (memberlist
        ``Delegate.LocalState``; Serf keeps its Lamport clocks there)."""
        self._streams.user_state = bytes(state)

    def gossip(self, now_ms: int) -> Output:
        """Run a gossip round now (e.g. to push out a message before leaving)."""
        self._ctx.begin(now_ms)
        self._sender.gossip_round()
        return self._finish()

    def set_meta(self, meta: bytes, now_ms: int) -> Output:
        """New node metadata (≤ 512 bytes), gossiped with a new incarnation."""
        _check_meta(meta)
        self._ctx.begin(now_ms)
        self._members.bump_local(meta)
        return self._finish()

    def set_clock_offset_ms(self, offset_ms: int) -> None:
        """Wall clock − ``now_ms``: members number probe rounds alike (coordinated_probes)."""
        self._prober.clock_offset_ms = int(offset_ms)

    def set_ack_payload(self, payload: bytes) -> None:
        """Bytes carried in every ack we send (memberlist ``PingDelegate.AckPayload``)."""
        self._prober.ack_payload = bytes(payload)

    def send_user(self, dest: Address, payload: bytes, now_ms: int) -> Output:
        """A best-effort user message in one packet (memberlist ``SendBestEffort``)."""
        self._ctx.begin(now_ms)
        message = wire.encode_message(UserMsg(payload))
        self._sender.emit(dest, [message], self._members.by_address(dest))
        return self._finish()

    def send_user_reliable(self, dest: Address, payload: bytes, now_ms: int) -> Output:
        """A user message over a stream (memberlist ``SendReliable``)."""
        if len(payload) > self.config.max_user_msg_bytes:
            raise ValueError(f"user message of {len(payload)} bytes exceeds the limit")
        self._ctx.begin(now_ms)
        deadline_ms = self._ctx.now_ms + self.config.tcp_timeout_ms
        message = wire.encode_user_stream(payload)
        self._streams.open(dest, message, StreamKind.USER, deadline_ms)
        return self._finish()

    def broadcast_user(self, payload: bytes, now_ms: int) -> Output:
        """Queue a user message to piggyback on gossip to everyone."""
        limit = self._sender.packet_room
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
            decoded = wire.decode_packet(data, self._sender.crypto)
        except WireError as exc:
            self._ctx.drop(exc.reason)
            return self._finish()
        for reason in decoded.drops:
            self._ctx.drop(reason)
        if not decoded.messages and not decoded.drops:
            self._ctx.drop(DropReason.EMPTY)  # e.g. a compound with no parts
        sender = self._inbound.dispatch(decoded.messages, source)
        if decoded.messages and sender is not None and sender.name != self.name:
            self._ctx.out.heard_from.append(sender.name)
        return self._finish()

    def handle_timer(self, timer: Timer, now_ms: int) -> Output:
        """A timer we asked for is due. One no longer live is ignored; a ``Timer`` that is
        not one of ours (``swim.timers.NodeTimer``) is a driver bug and raises TypeError."""
        self._ctx.begin(now_ms)
        if not isinstance(timer, GossipTick):  # an idle gossip tick is held back by design
            self._ctx.awareness.note_timer(timer.deadline_ms, now_ms)
        live = self._ctx.take_timer(timer)
        if live is not None:
            self._on_timer(live)
        elif not isinstance(timer, NODE_TIMERS):
            raise TypeError(f"not a timer of swim.Node: {timer!r}")
        return self._finish()

    def parse_stream(self, data: bytes) -> tuple[StreamMessage, int] | None:
        """One complete stream message from the front of ``data``, or None for "need more".

        Raises ``WireError`` as soon as the bytes cannot be a valid message; the driver
        then closes the stream and calls ``record_drop(error.reason)``.
        """
        return self._streams.parse(data)

    def stream_decoder(self) -> wire.StreamDecoder:
        """An incremental decoder for one incoming stream, with the crypto and limits
        ``parse_stream`` uses: feed it each chunk as it arrives (``StreamDecoder.feed``)."""
        config = self._ctx.config
        limits = wire.StreamLimits(
            config.max_stream_bytes, config.max_push_pull_nodes, config.max_user_msg_bytes
        )
        return wire.StreamDecoder(self._sender.crypto, limits)

    def handle_stream(self, source: Address, message: StreamMessage, now_ms: int) -> Output:
        """A message someone sent us on a stream; ``Output.reply`` is the answer, if any."""
        self._ctx.begin(now_ms)
        self._streams.handle(source, message)
        return self._finish()

    def handle_stream_response(
        self, stream_id: int, message: StreamMessage | None, now_ms: int, error: str = ""
    ) -> Output:
        """The reply on a stream we opened, or None with ``error`` if it failed."""
        self._ctx.begin(now_ms)
        self._streams.handle_response(stream_id, message, error)
        return self._finish()

    # --- timers -------------------------------------------------------------------------

    def _on_timer(self, timer: NodeTimer) -> None:
        """Exhaustive: mypy fails here when a kind of ``NodeTimer`` has no case."""
        prober = self._prober
        match timer:
            case ProbeTick():
                self._ctx.set_timer(ProbeTick, self.config.probe_interval_ms)
                prober.on_tick()
            case GossipTick():
                self._ctx.set_timer(GossipTick, self.config.gossip_interval_ms)
                self._sender.gossip_round()
            case ProbeTimeout(seq_no=seq_no):
                prober.on_probe_timeout(seq_no)
            case ProbeDeadline(seq_no=seq_no):
                prober.on_probe_deadline(seq_no)
            case RelayTimeout(seq_no=seq_no):
                prober.on_relay_timeout(seq_no)
            case SuspicionTimeout(name=name, state_change_ms=state_change_ms):
                # A last-chance ping first (its deadline is SuspicionVerify) where the config
                # asks for one (``Membership.needs_verify``); else the member is dead.
                if self._members.hold_if_starved(name, state_change_ms):
                    pass  # re-armed for Lifeguard's maximum (``starved_lag_ms``)
                elif self._members.needs_verify(name, state_change_ms):
                    prober.verify_suspect(name, state_change_ms)
                else:
                    self._members.on_suspicion_timeout(name, state_change_ms)
            case SuspicionVerify(name=name, state_change_ms=state_change_ms):
                self._members.on_suspicion_timeout(name, state_change_ms)
            case PushPullTick():
                self._streams.on_push_pull_tick()
            case ReconnectTick():
                self._ctx.set_timer(ReconnectTick, self.config.reconnect_interval_ms)
                self._streams.reconnect()
            case StreamExpire(stream_id=stream_id):
                self._streams.on_expire(stream_id)
            case ProbeTcpGrace(seq_no=seq_no):
                prober.on_tcp_grace(seq_no)
            case _:
                assert_never(timer)

    # --- sending (the ``probe.Transport`` protocol) -----------------------------------------

    def send(self, dest: Address, message: bytes, member: MemberState | None = None) -> None:
        """One message, with as many broadcasts piggybacked as fit (net.go ``sendMsg``)."""
        self._sender.send(dest, message, member)

    def send_parts(self, dest: Address, parts: list[bytes], member: MemberState | None) -> None:
        self._sender.emit(dest, parts, member)

    def open_stream(self, dest: Address, message: bytes, kind: StreamKind, deadline_ms: int) -> int:
        return self._streams.open(dest, message, kind, deadline_ms)

    def _finish(self) -> Output:
        finished = self._ctx.broadcasts.finished
        if finished:
            if LEAVE_NOTIFY in finished:
                self._leave_done = True
            finished.clear()
        return self._ctx.finish()


def _check_meta(meta: bytes) -> None:
    if len(meta) > META_MAX_BYTES:
        raise ValueError(f"node metadata is {len(meta)} bytes; the limit is {META_MAX_BYTES}")
