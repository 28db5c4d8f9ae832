"""The failure-detection cycle: direct ping, indirect ping with nacks, TCP fallback, and the
helper side of indirect pings.

Rules (SWIM §4; hashicorp/memberlist @ 1b4c746 state.go ``probe``/``probeNode``, net.go
``handlePing``/``handleIndirectPing``/``handleAck``/``handleNack``; Lifeguard arXiv
1707.00788 §IV-A):
- One probe at a time, every probe interval, to the next member in round-robin order. A
  tick that arrives while a probe is running is remembered and runs when it ends (a Go
  ticker buffers one tick).
- The probe waits ``probe_timeout_ms`` for a direct ack (never scaled; with
  ``adaptive_probe_timeout``, the target's Phi-adaptive timeout from swim/rtt.py, scaled
  by local health; direct acks, also late ones, are RTT samples), then asks
  ``indirect_checks`` random alive members to ping the target (asking for a nack from those
  that speak protocol ≥ 4) and, for targets that speak ≥ 3, opens a TCP ping; the whole
  probe ends at the health-scaled probe interval.
- Buddy system: a target that is not alive gets the suspicion together with the ping.
- Outcome → local health: an answer (direct, indirect or TCP) −1; a failure +missing nacks
  (or +1 without nack-capable helpers) and the target becomes suspect.
- A helper relays the ack under the requester's sequence number, and sends a nack if no ack
  came within its own probe timeout. Relays in flight are bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from swim import formulas, wire
from swim.context import Context
from swim.effects import ProbeResult, StreamKind
from swim.membership import Membership, MemberState
from swim.messages import Ack, Address, IndirectPing, Nack, NodeStateType, Ping, Suspect
from swim.wire import DropReason

PROBE_TIMEOUT = "probe_timeout"
PROBE_DEADLINE = "probe_deadline"
PROBE_TCP_GRACE = "probe_tcp_grace"
RELAY_TIMEOUT = "relay_timeout"
SUSPICION_VERIFY = "suspicion_verify"
VERIFY_COPIES = 2
"""Copies of the last-chance accusation + ping (``verify_suspect``): at 10% loss one round
trip fails 19% of the time, two independent ones 3.6%."""


class Transport(Protocol):
    """What the prober needs from its node: sending packets and opening streams."""

    def send(self, dest: Address, message: bytes, member: MemberState | None = None) -> None: ...

    def send_parts(self, dest: Address, parts: list[bytes], member: MemberState | None) -> None: ...

    def open_stream(
        self, dest: Address, message: bytes, kind: StreamKind, deadline_ms: int
    ) -> int: ...


@dataclass(slots=True)
class _Probe:
    seq_no: int
    target: str
    target_address: Address
    sent_ms: int
    deadline_ms: int
    timer_ids: list[int]
    expected_nacks: int = 0
    nacks: int = 0
    tcp_stream: int | None = None
    tcp_ok: bool = False
    deadline_passed: bool = False


@dataclass(slots=True)
class _Relay:
    requester_seq: int
    reply_to: Address
    want_nack: bool
    timer_id: int
    target: str
    sent_ms: int


class Prober:
    def __init__(self, ctx: Context, members: Membership, transport: Transport) -> None:
        self._ctx = ctx
        self._members = members
        self._transport = transport
        self._seq_no = 0
        self._probe: _Probe | None = None
        self._tick_pending = False
        self._relays: dict[int, _Relay] = {}
        self.ack_payload = b""

    def next_seq_no(self) -> int:
        self._seq_no = (self._seq_no + 1) & 0xFFFF_FFFF
        return self._seq_no

    def _self_ping(self, seq_no: int, target: str) -> Ping:
        me = self._members.local
        return Ping(seq_no, target, me.address.ip_bytes, me.address.port, me.name)

    # --- the probe cycle ----------------------------------------------------------------

    def on_tick(self) -> None:
        if self._probe is not None:
            self._tick_pending = True
            return
        self._start_probe()

    def _start_probe(self) -> None:
        self._tick_pending = False
        target = self._members.next_probe_target()
        if target is None:
            return
        ctx = self._ctx
        seq_no = self.next_seq_no()
        interval_ms = self._members.scale_ms(ctx.config.probe_interval_ms)
        ping = wire.encode_message(self._self_ping(seq_no, target.name))
        if target.state != NodeStateType.ALIVE and ctx.config.lifeguard_buddy:
            accusation = Suspect(target.incarnation, target.name, self._members.local_name)
            self._transport.send_parts(
                target.address, [ping, wire.encode_message(accusation)], target
            )
        else:
            self._transport.send(target.address, ping, target)
        ctx.stats.probes_sent += 1
        timers = [
            ctx.set_timer(
                PROBE_TIMEOUT,
                ctx.rtt.probe_timeout_ms(target.name, self._members.health_score),
                seq_no,
            ),
            ctx.set_timer(PROBE_DEADLINE, interval_ms, seq_no),
        ]
        self._probe = _Probe(
            seq_no, target.name, target.address, ctx.now_ms, ctx.now_ms + interval_ms, timers
        )

    def on_probe_timeout(self, seq_no: int) -> None:
        """No direct ack in time: ask helpers, and try TCP (state.go HANDLE_REMOTE_FAILURE)."""
        probe = self._probe
        if probe is None or probe.seq_no != seq_no:
            return
        ctx = self._ctx
        target = self._members.get(probe.target)
        if target is None:
            return
        me = self._members.local
        helpers = self._members.random_members(
            ctx.config.indirect_checks,
            lambda m: m.name in (me.name, probe.target) or m.state != NodeStateType.ALIVE,
        )
        for peer in helpers:
            want_nack = ctx.config.lifeguard_nacks and peer.protocol_max >= 4
            probe.expected_nacks += int(want_nack)
            request = IndirectPing(
                seq_no,
                target.address.ip_bytes,
                target.address.port,
                target.name,
                want_nack,
                me.address.ip_bytes,
                me.address.port,
                me.name,
            )
            self._transport.send(peer.address, wire.encode_message(request), peer)
            ctx.stats.indirect_probes_sent += 1
        if not ctx.config.disable_tcp_pings and target.protocol_max >= 3:
            ping = wire.encode_message(self._self_ping(seq_no, target.name))
            probe.tcp_stream = self._transport.open_stream(
                target.address, ping, StreamKind.PING, probe.deadline_ms
            )
            ctx.stats.tcp_fallback_probes += 1

    def on_probe_deadline(self, seq_no: int) -> None:
        probe = self._probe
        if probe is None or probe.seq_no != seq_no:
            return
        probe.deadline_passed = True
        if probe.tcp_stream is not None and not probe.tcp_ok:
            # The TCP attempt shares this deadline; give the driver a moment to report it.
            probe.timer_ids.append(
                self._ctx.set_timer(PROBE_TCP_GRACE, self._ctx.config.probe_timeout_ms, seq_no)
            )
            return
        self._conclude(probe)

    def on_tcp_grace(self, seq_no: int) -> None:
        probe = self._probe
        if probe is not None and probe.seq_no == seq_no:
            self._conclude(probe)

    def on_tcp_result(self, stream_id: int, ack: Ack | None) -> None:
        probe = self._probe
        if probe is None or probe.tcp_stream != stream_id:
            return
        probe.tcp_stream = None
        probe.tcp_ok = ack is not None and ack.seq_no == probe.seq_no
        if probe.deadline_passed:
            self._conclude(probe)

    def _conclude(self, probe: _Probe) -> None:
        ctx = self._ctx
        if probe.tcp_ok:
            ctx.stats.tcp_fallback_rescues += 1
            ctx.notice(
                "warning",
                "udp_probe_failed_tcp_ok",
                f"was able to connect to {probe.target} over TCP but UDP probes failed, "
                "network may be misconfigured",
            )
            ctx.out.probe_results.append(
                ProbeResult(probe.target, ctx.now_ms - probe.sent_ms, b"", "tcp")
            )
            self._end(probe, -1)
            return
        ctx.stats.probes_failed += 1
        delta = formulas.probe_failure_awareness_delta(
            probe.expected_nacks if ctx.config.lifeguard_nacks else 0, probe.nacks
        )
        # Suspect first, then end the probe: a tick that arrived meanwhile starts the next
        # probe, which must see the suspicion (memberlist runs it after probeNode returns).
        target = self._members.get(probe.target)
        if target is not None and not target.dead_or_left():
            ctx.notice(
                "info", "probe_failed", f"suspect {probe.target} has failed, no acks received"
            )
            self._members.apply_suspect(
                Suspect(target.incarnation, target.name, self._members.local_name)
            )
        self._end(probe, delta)

    def _end(self, probe: _Probe, health_delta: int) -> None:
        for timer_id in probe.timer_ids:
            self._ctx.cancel_timer(timer_id)
        self._members.apply_health_delta(health_delta)
        self._probe = None
        if self._tick_pending:
            self._start_probe()

    def verify_suspect(self, name: str, state_change_ms: int) -> None:
        """Last chance for an unconfirmed suspect (``verify_unconfirmed_suspicion``).

        The accusation goes first in the packet so that a live member queues its refutation
        before it builds the ack, which then carries it back (acks piggyback broadcasts).
        """
        ctx = self._ctx
        target = self._members.get(name)
        if target is None:
            return
        me = self._members.local
        seq_no = self.next_seq_no()
        accusation = wire.encode_message(Suspect(target.incarnation, name, me.name))
        ping = wire.encode_message(self._self_ping(seq_no, name))
        for _ in range(VERIFY_COPIES):
            self._transport.send_parts(target.address, [accusation, ping], target)
        ctx.stats.suspicion_verifications += 1
        grace_ms = ctx.rtt.probe_timeout_ms(name, self._members.health_score)
        ctx.set_timer(SUSPICION_VERIFY, grace_ms, (name, state_change_ms))

    # --- answering ----------------------------------------------------------------------

    def on_ping(self, ping: Ping, source: Address) -> None:
        """net.go ``handlePing``: ack to the advertised source, else to the sender."""
        if ping.node and ping.node != self._members.local_name:
            self._ctx.drop(DropReason.WRONG_NODE)
            return
        reply_to = source
        if ping.source_addr and ping.source_port:
            try:
                reply_to = Address.from_ip_bytes(ping.source_addr, ping.source_port)
            except ValueError:
                self._ctx.drop(DropReason.MALFORMED)
                return
        ack = wire.encode_message(Ack(ping.seq_no, self.ack_payload))
        self._transport.send(reply_to, ack, self._members.by_address(reply_to))

    def on_indirect_ping(self, req: IndirectPing, source: Address) -> None:
        """net.go ``handleIndirectPing``: ping the target for the requester."""
        ctx = self._ctx
        if len(self._relays) >= ctx.config.max_pending_relays:
            ctx.drop(DropReason.QUEUE_FULL)
            return
        try:
            target = Address.from_ip_bytes(req.target, req.port or self._members.local.address.port)
            reply_to = source
            if req.source_addr and req.source_port:
                reply_to = Address.from_ip_bytes(req.source_addr, req.source_port)
        except ValueError:
            ctx.drop(DropReason.MALFORMED)
            return
        seq_no = self.next_seq_no()
        me = self._members.local
        ping = Ping(seq_no, req.node, me.address.ip_bytes, me.address.port, me.name)
        timeout_ms = ctx.rtt.probe_timeout_ms(req.node, self._members.health_score)
        timer_id = ctx.set_timer(RELAY_TIMEOUT, timeout_ms, seq_no)
        self._relays[seq_no] = _Relay(
            req.seq_no, reply_to, req.nack, timer_id, req.node, ctx.now_ms
        )
        self._transport.send(target, wire.encode_message(ping), self._members.get(req.node))

    def on_relay_timeout(self, seq_no: int) -> None:
        relay = self._relays.pop(seq_no, None)
        if relay is not None and relay.want_nack:
            nack = wire.encode_message(Nack(relay.requester_seq))
            self._transport.send(relay.reply_to, nack, self._members.by_address(relay.reply_to))

    def on_ack(self, ack: Ack, source: Address) -> None:
        relay = self._relays.pop(ack.seq_no, None)
        if relay is not None:
            self._ctx.cancel_timer(relay.timer_id)
            self._ctx.rtt.sample(relay.target, self._ctx.now_ms - relay.sent_ms)
            reply = wire.encode_message(Ack(relay.requester_seq))
            self._transport.send(relay.reply_to, reply, self._members.by_address(relay.reply_to))
            return
        probe = self._probe
        if probe is None or probe.seq_no != ack.seq_no:
            return
        via = "direct" if source == probe.target_address else "indirect"
        rtt_ms = self._ctx.now_ms - probe.sent_ms
        if via == "direct":
            self._ctx.rtt.sample(probe.target, rtt_ms)
        self._ctx.out.probe_results.append(ProbeResult(probe.target, rtt_ms, ack.payload, via))
        self._end(probe, -1)

    def on_nack(self, nack: Nack) -> None:
        probe = self._probe
        if probe is not None and probe.seq_no == nack.seq_no:
            probe.nacks += 1
            self._ctx.stats.nacks_received += 1

    @property
    def probing(self) -> str | None:
        return None if self._probe is None else self._probe.target
