"""The stream side of a node: push-pull full-state exchange, TCP pings, reliable user
messages, and serf's reconnect to failed members.

Rules (hashicorp/memberlist @ 1b4c746 net.go ``handleConn``/``sendAndReceiveState``/
``readRemoteState``/``mergeRemoteState``, state.go ``pushPull``/``pushPullNode``, util.go
``pushPullScale``; serf ``reconnect``; SWIM §4 on how full-state exchange complements
gossip):
- A stream is opened as a value (``StreamRequest``); the driver hands back the single reply
  (``handle_stream_response``) or a failure. A stream that expects a reply is tracked until
  its deadline plus one probe timeout and then counts as failed; pending streams are
  bounded by ``MAX_PENDING_STREAMS`` (beyond it the open is dropped as ``QUEUE_FULL``).
- Push-pull runs with every seed on join and with one random alive member every
  ``pushPullScale(push_pull_interval_ms, n)``. A received push-pull is answered with our
  state, then merged; a state whose protocol versions clash with ours is not merged at all
  (``verify_protocol``) and is logged and counted as ``INVALID_VERSION``.
- Reconnect (serf): every ``reconnect_interval_ms``, with probability failed/alive, one
  random failed member gets a push-pull, so two halves of a healed partition merge.
- Application state (memberlist ``Delegate.LocalState``) travels after the member list in
  every push-pull we send; what others send is reported in ``Output.push_pull_states``.
- Between nodes bootstrapped from one snapshot, large stream payloads go through the shared
  codec (``swim.shared``): same bytes on the wire, the work is done once.
- Randomness comes only from the per-node ``Context``.
"""

from __future__ import annotations

from dataclasses import dataclass

from swim import formulas, wire
from swim.compat import Versions, verify_protocol, verify_summaries
from swim.context import Context
from swim.effects import JoinResult, StreamKind, StreamRequest, UserMessage
from swim.membership import Membership
from swim.messages import Ack, Address, ErrResp, NodeStateType, Ping, PushPull, UserMsg
from swim.probe import Prober
from swim.shared import MEMO_MIN_BYTES, SHARED_MIN_NODES
from swim.timers import PushPullTick, StreamExpire
from swim.transport import Sender
from swim.wire import DropReason, StreamMessage

MAX_PENDING_STREAMS = 1024


@dataclass(slots=True)
class _Stream:
    kind: StreamKind
    dest: Address
    join: bool
    timer_id: int
    reconnect: bool = False


class Streams:
    """The streams of one node, sharing the node's ``Context``, member table and sender."""

    def __init__(
        self,
        ctx: Context,
        members: Membership,
        sender: Sender,
        prober: Prober,
    ) -> None:
        self._ctx = ctx
        self._members = members
        self._sender = sender
        self._prober = prober
        self._streams: dict[int, _Stream] = {}
        self._next_stream_id = 0
        self.user_state = b""
        self._push_pull_timer: int | None = None

    # --- inputs -------------------------------------------------------------------------

    def parse(self, data: bytes) -> tuple[StreamMessage, int] | None:
        """One complete stream message from the front of ``data``, or None for "need more"
        (raises ``WireError``; see ``Node.parse_stream``)."""
        config = self._ctx.config
        limits = wire.StreamLimits(
            config.max_stream_bytes,
            config.max_push_pull_nodes,
            config.max_user_msg_bytes,
        )
        codec = self._members.push_pull.codec
        if (
            codec is not None
            and self._sender.keyring is None
            and type(data) is bytes
            and len(data) >= MEMO_MIN_BYTES
        ):
            return codec.parse(data, limits)
        return wire.parse_stream(data, self._sender.crypto, limits)

    def handle(self, source: Address, message: StreamMessage) -> None:
        """A message someone sent us on a stream; the answer goes to ``Output.reply``."""
        ctx = self._ctx
        out = ctx.out
        if isinstance(message, Ping):
            if message.node and message.node != self._members.local_name:
                ctx.drop(DropReason.WRONG_NODE)
            else:
                ack = wire.encode_message(Ack(message.seq_no))
                out.reply = self._stream_bytes(ack)
        elif isinstance(message, PushPull):
            ctx.stats.push_pulls += 1
            local = self._members.push_pull.encode(message.join, self.user_state)
            out.reply = self._stream_bytes(local)
            self._merge(message, source)
        elif isinstance(message, UserMsg):
            out.user_messages.append(UserMessage(source, message.payload))
        else:
            ctx.drop(DropReason.UNEXPECTED_TYPE)

    def handle_response(self, stream_id: int, message: StreamMessage | None, error: str) -> None:
        """The reply on a stream we opened, or None with ``error`` if it failed."""
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._ctx.cancel_timer(stream.timer_id)
            if message is None:
                self._ctx.stats.streams_failed += 1
            self._stream_done(stream_id, stream, message, error)

    def _stream_done(
        self, stream_id: int, stream: _Stream, message: StreamMessage | None, error: str
    ) -> None:
        ctx = self._ctx
        if stream.kind == StreamKind.PING:
            self._prober.on_tcp_result(stream_id, message if isinstance(message, Ack) else None)
            return
        if stream.kind != StreamKind.PUSH_PULL:
            return
        if isinstance(message, PushPull) and not self._merge(message, stream.dest):
            error = "incompatible protocol versions"
        elif isinstance(message, PushPull):
            ctx.stats.push_pulls += 1
            if stream.reconnect:
                ctx.notice("info", "reconnected", f"reconnected to {stream.dest}")
            elif stream.join:
                self._join_result(stream.dest, True, f"pushed/pulled {len(message.nodes)} states")
            return
        if isinstance(message, ErrResp):
            error = f"remote error: {message.error}"
        elif message is not None and not isinstance(message, PushPull):
            error = f"unexpected reply {type(message).__name__}"
        if stream.reconnect:
            ctx.notice("debug", "reconnect_failed", f"reconnect {stream.dest}: {error}")
            return
        ctx.notice("error", "push_pull_failed", f"push/pull with {stream.dest}: {error}")
        if stream.join:
            self._join_result(stream.dest, False, error or "failed")

    def _merge(self, remote: PushPull, source: Address) -> bool:
        """Merge a pushed state unless its protocol versions clash (memberlist
        ``mergeRemoteState``): then nothing is merged and the reason is logged."""
        members = self._members
        codec = members.push_pull.codec
        # below SHARED_MIN_NODES the plain merge is as fast (same result, see swim.shared)
        if codec is not None and len(remote.nodes) >= SHARED_MIN_NODES:
            diff = codec.diff(remote)
            problem = verify_summaries(members.push_pull.version_summary(codec), diff.versions)
        else:
            diff = None
            problem = verify_protocol(
                (Versions(m.name, m.state, m.vsn) for m in members.states()),
                (Versions(r.name, r.state, r.vsn) for r in remote.nodes),
            )
        if problem:
            self._ctx.drop(DropReason.INVALID_VERSION)
            self._ctx.notice("error", "push_pull_rejected", f"push/pull from {source}: {problem}")
            return False
        if diff is not None:
            members.merge_diff(remote.nodes, diff)
        else:
            members.merge(remote.nodes)
        if remote.user_state:
            self._ctx.out.push_pull_states.append(remote.user_state)
        return True

    def _join_result(self, address: Address, ok: bool, detail: str) -> None:
        level = "info" if ok else "error"
        self._ctx.notice(level, "join_ok" if ok else "join_failed", f"join {address}: {detail}")
        self._ctx.out.join_results.append(JoinResult(address, ok, detail))

    # --- timers -------------------------------------------------------------------------

    def schedule_push_pull(self, delay_ms: int) -> None:
        """Arm the first periodic push-pull (``Node.start``)."""
        self._push_pull_timer = self._ctx.set_timer(PushPullTick, delay_ms)

    def rescale_push_pull(self) -> None:
        """Re-draw the next periodic push-pull over the interval scaled to the group size
        (``Node.bootstrap``); nothing if push-pull is off or was never armed."""
        ctx = self._ctx
        interval_ms = ctx.config.push_pull_interval_ms
        if interval_ms > 0 and self._push_pull_timer is not None:
            ctx.cancel_timer(self._push_pull_timer)
            scaled_ms = formulas.push_pull_scale_ms(interval_ms, len(self._members))
            self._push_pull_timer = ctx.set_timer(PushPullTick, ctx.rng.randrange(scaled_ms))

    def on_push_pull_tick(self) -> None:
        members = self._members
        interval = formulas.push_pull_scale_ms(self._ctx.config.push_pull_interval_ms, len(members))
        self._push_pull_timer = self._ctx.set_timer(PushPullTick, interval)
        local_name = members.local_name
        peers = members.random_members(
            1, lambda m: m.name == local_name or m.state != NodeStateType.ALIVE
        )
        if peers:
            self.open_push_pull(peers[0].address, join=False)

    def reconnect(self) -> None:
        """serf ``reconnect``: with probability failed/alive, push-pull with one failed member.

        This is what merges two halves of a healed partition: each side declared the other
        dead, and only a new exchange of full state lets the accused refute.
        """
        members = self._members
        members.failed.expire()
        if members.leaving:
            return
        address = members.failed.pick(self._ctx.rng, members.count(NodeStateType.ALIVE))
        if address is None:
            return
        stream_id = self.open_push_pull(address, join=True)
        if stream_id in self._streams:
            self._streams[stream_id].reconnect = True

    def on_expire(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._ctx.stats.streams_failed += 1
            self._stream_done(stream_id, stream, None, "no answer before the deadline")

    # --- outputs ------------------------------------------------------------------------

    def open(self, dest: Address, message: bytes, kind: StreamKind, deadline_ms: int) -> int:
        """Ask the driver to open a stream; its id, or -1 if too many are pending."""
        ctx = self._ctx
        if len(self._streams) >= MAX_PENDING_STREAMS:
            ctx.drop(DropReason.QUEUE_FULL)
            return -1
        self._next_stream_id += 1
        stream_id = self._next_stream_id
        expect_reply = kind != StreamKind.USER
        if expect_reply:
            grace_ms = deadline_ms - ctx.now_ms + ctx.config.probe_timeout_ms
            timer_id = ctx.set_timer(StreamExpire, grace_ms, stream_id)
            self._streams[stream_id] = _Stream(kind, dest, False, timer_id)
        ctx.stats.streams_opened += 1
        data = self._stream_bytes(message)
        ctx.out.streams.append(
            StreamRequest(stream_id, dest, data, deadline_ms, kind, expect_reply)
        )
        return stream_id

    def open_push_pull(self, dest: Address, join: bool) -> int:
        local = self._members.push_pull.encode(join, self.user_state)
        deadline_ms = self._ctx.now_ms + self._ctx.config.tcp_timeout_ms
        stream_id = self.open(dest, local, StreamKind.PUSH_PULL, deadline_ms)
        if stream_id in self._streams:
            self._streams[stream_id].join = join
        return stream_id

    def _stream_bytes(self, message: bytes) -> bytes:
        config = self._ctx.config
        codec = self._members.push_pull.codec
        if (
            codec is not None
            and self._sender.keyring is None
            and config.enable_compression
            and len(message) >= MEMO_MIN_BYTES
        ):
            return codec.compress(message)
        return wire.encode_stream(
            message, compress=config.enable_compression, crypto=self._sender.crypto
        )
