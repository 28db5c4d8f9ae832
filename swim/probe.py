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
  (or +1 without nack-capable helpers), and suspect (``probes_refused``: TCP refused early).
- A helper relays the ack under the requester's sequence number, and sends a nack if no ack
  came within its own probe timeout. Relays in flight are bounded.

Urgent probes (``Node.probe_now``; ours, not memberlist's): outside evidence that a member
failed — a trainer's collective lost its connection to it, tens of ms after a crash, when
the round robin may reach it only n probe intervals later — moves that member's probe
earlier. It is evidence, not a verdict:
- An urgent probe is memberlist's ``probeNode`` cycle unchanged (the ping, the adaptive
  timeout, indirect pings with nacks, the TCP fallback, the health-scaled deadline, and the
  same conclusion: an answer −1 health and an RTT sample; a failure +missing nacks and
  suspect), started now and run beside the round-robin probe, which it never delays,
  replaces or reorders. So SWIM's safety is kept: a member becomes suspect only when it
  answered neither a direct ping, nor the helpers' pings, nor a TCP ping, and dead only
  after the Lifeguard suspicion window it can refute within; a wrong report costs one probe
  of a live member, which acks it. A hung member is probed the same way, urgent or not.
- Refused, with nothing sent and the refusal counted in ``stats.urgent_probes`` by reason
  (``UrgentProbeOutcome``), checked in this order: ourselves; an unknown member; a member
  that is not alive (a suspect's suspicion is already running, and the round robin pings it
  with the buddy accusation; dead or left has nothing to probe); a member whose probe is in
  flight (round-robin or urgent); one probed urgently less than one probe interval ago (a
  trainer stuck in an error loop cannot make its agent flood a member with pings); and any
  request while ``MAX_URGENT_PROBES`` are in flight.
- The round robin is not told about urgent probes: it may pick a member an urgent probe is
  already pinging, and both run to their own conclusion, as two members probing it would.
- An urgent probe concludes as soon as every path it tried has failed (its direct timeout
  passed, every helper it asked nacked, its TCP ping failed — a refused connection fails
  at once) instead of waiting out the probe interval for a late ack: the outside evidence
  already makes a failure likely, and a member suspected a little early keeps the whole
  suspicion window to refute. A helper that cannot nack (protocol < 4), or a TCP ping
  still open, keeps the probe waiting for its deadline as memberlist's does.
- O(1) work per request: a lookup, a scan of ``MAX_URGENT_PROBES`` probes, a trimmed history.

Faster detection (``Config`` switches, on in ``fast``): ``coordinated_probes``
takes the round-robin target from ``swim.schedule`` for round (now + wall-clock offset)
// interval; ``early_probe_conclusion`` ends round-robin probes like urgent ones; with
``suspicion_cross_checks`` a member that first hears an accusation probes the suspect at
once with probability checks / (n − 1) (``cross_check``: an urgent probe sharing
``MAX_URGENT_PROBES``, its ping carrying the buddy accusation); failing is our confirmation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from swim import formulas, wire
from swim.context import Context
from swim.effects import ProbeResult, StreamKind, UrgentProbeOutcome
from swim.member_state import MemberState
from swim.membership import Membership
from swim.messages import Ack, Address, IndirectPing, Nack, NodeStateType, Ping, Suspect
from swim.timers import ProbeDeadline, ProbeTcpGrace, ProbeTimeout, RelayTimeout, SuspicionVerify
from swim.wire import DropReason

MAX_URGENT_PROBES = 4
"""Urgent probes in flight at once. A crash costs a survivor's collectives one peer (one
member per host) or a few (a switch, a rack), so 4 covers a real report; the bound caps the
extra traffic of a burst of reports at 4 × (1 ping + ``indirect_checks`` requests + 1 TCP
ping) per probe interval, beside the round robin's one probe. Refused reports are not lost
members: the round robin still reaches them."""


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
    tcp_refused: bool = False  # failed before the deadline: refused or reset, not unanswered
    deadline_passed: bool = False
    urgent: bool = False
    cross_check: bool = False
    helpers: int = 0
    """Helpers asked for an indirect ping (0 until the direct timeout passed)."""
    asked: bool = False
    """The direct timeout passed and the other paths were tried."""


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
        self._urgent: dict[int, _Probe] = {}
        self._urgent_started: OrderedDict[str, int] = OrderedDict()
        """When each member was last probed urgently, oldest first; entries older than one
        probe interval are trimmed as new ones come, so it holds only the rate-limited."""
        self._relays: dict[int, _Relay] = {}
        self.ack_payload = b""
        self.clock_offset_ms = 0
        """Wall clock − node clock, to number probe rounds alike (``coordinated_probes``)."""
        self._last_round = -1

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
        ctx = self._ctx
        # Never the same round twice (a late tick after a stall): no target twice in a row.
        round_no = (ctx.now_ms + self.clock_offset_ms) // ctx.config.probe_interval_ms
        self._last_round = round_no = max(round_no, self._last_round + 1)
        target = self._members.next_probe_target(round_no)
        if target is None:
            return
        self._probe = self._send_probe(target)

    def _send_probe(
        self, target: MemberState, urgent: bool = False, cross_check: bool = False
    ) -> _Probe:
        """The ping and the two timers of state.go ``probeNode``."""
        ctx = self._ctx
        seq_no = self.next_seq_no()
        interval_ms = ctx.awareness.scale_ms(ctx.config.probe_interval_ms)
        ping = wire.encode_message(self._self_ping(seq_no, target.name))
        if target.state != NodeStateType.ALIVE and ctx.config.lifeguard_buddy:
            accusation = Suspect(target.incarnation, target.name, self._members.local_name)
            self._transport.send_parts(
                target.address, [ping, wire.encode_message(accusation)], target
            )
        else:
            self._transport.send(target.address, ping, target)
        ctx.stats.probes_sent += 1
        timeout_ms = ctx.rtt.probe_timeout_ms(target.name, ctx.awareness.score)
        timers = [
            ctx.set_timer(ProbeTimeout, timeout_ms, seq_no),
            ctx.set_timer(ProbeDeadline, interval_ms, seq_no),
        ]
        return _Probe(
            seq_no,
            target.name,
            target.address,
            ctx.now_ms,
            ctx.now_ms + interval_ms,
            timers,
            urgent=urgent,
            cross_check=cross_check,
        )

    def probe_now(self, name: str) -> UrgentProbeOutcome:
        """Start an urgent probe of ``name`` now, or say why not (rules: module docstring)."""
        outcome = self._check_urgent(name)
        self._ctx.stats.urgent_probes[outcome.value] += 1
        if outcome is not UrgentProbeOutcome.STARTED:
            return outcome
        now = self._ctx.now_ms
        window_ms = self._ctx.config.probe_interval_ms
        started = self._urgent_started
        while started and now - next(iter(started.values())) >= window_ms:
            started.popitem(last=False)
        started.pop(name, None)
        started[name] = now
        target = self._members.get(name)
        assert target is not None  # checked above
        probe = self._send_probe(target, urgent=True)
        self._urgent[probe.seq_no] = probe
        return outcome

    def cross_check(self, name: str) -> None:
        """``name`` was just accused: probe it now with probability checks / (n − 1)."""
        ctx = self._ctx
        wanted = ctx.config.suspicion_cross_checks
        target = self._members.get(name)
        others = len(self._members) - 1
        if not wanted or target is None or name == self._members.local_name or others < 1:
            return
        busy = len(self._urgent) >= MAX_URGENT_PROBES or self._in_flight(name)
        if target.state != NodeStateType.SUSPECT or busy:
            return
        if wanted < others and ctx.rng.random() * others >= wanted:
            return
        probe = self._send_probe(target, urgent=True, cross_check=True)
        self._urgent[probe.seq_no] = probe
        ctx.stats.cross_check_probes += 1

    def _check_urgent(self, name: str) -> UrgentProbeOutcome:
        if name == self._members.local_name:
            return UrgentProbeOutcome.SELF
        target = self._members.get(name)
        if target is None:
            return UrgentProbeOutcome.UNKNOWN
        if target.state != NodeStateType.ALIVE:
            return UrgentProbeOutcome.NOT_ALIVE
        if self._in_flight(name):
            return UrgentProbeOutcome.PROBING
        last_ms = self._urgent_started.get(name)
        if last_ms is not None and self._ctx.now_ms - last_ms < self._ctx.config.probe_interval_ms:
            return UrgentProbeOutcome.RATE_LIMITED
        if len(self._urgent) >= MAX_URGENT_PROBES:
            return UrgentProbeOutcome.TOO_MANY
        return UrgentProbeOutcome.STARTED

    def _in_flight(self, name: str) -> bool:
        """A probe of ``name`` is running: the round robin's or an urgent one."""
        return self.probing == name or any(p.target == name for p in self._urgent.values())

    def _find(self, seq_no: int) -> _Probe | None:
        """The probe in flight, round-robin or urgent, with this sequence number."""
        probe = self._probe
        if probe is not None and probe.seq_no == seq_no:
            return probe
        return self._urgent.get(seq_no) if self._urgent else None

    def on_probe_timeout(self, seq_no: int) -> None:
        """No direct ack in time: ask helpers, and try TCP (state.go HANDLE_REMOTE_FAILURE)."""
        probe = self._find(seq_no)
        if probe is None:
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
            probe.helpers += 1
        if not ctx.config.disable_tcp_pings and target.protocol_max >= 3:
            ping = wire.encode_message(self._self_ping(seq_no, target.name))
            probe.tcp_stream = self._transport.open_stream(
                target.address, ping, StreamKind.PING, probe.deadline_ms
            )
            ctx.stats.tcp_fallback_probes += 1
        probe.asked = True
        self._conclude_if_every_path_failed(probe)

    def on_probe_deadline(self, seq_no: int) -> None:
        probe = self._find(seq_no)
        if probe is None:
            return
        probe.deadline_passed = True
        if probe.tcp_stream is not None and not probe.tcp_ok:
            # The TCP attempt shares this deadline; give the driver a moment to report it.
            probe.timer_ids.append(
                self._ctx.set_timer(ProbeTcpGrace, self._ctx.config.probe_timeout_ms, seq_no)
            )
            return
        self._conclude(probe)

    def on_tcp_grace(self, seq_no: int) -> None:
        probe = self._find(seq_no)
        if probe is not None:
            self._conclude(probe)

    def on_tcp_result(self, stream_id: int, ack: Ack | None) -> None:
        probe = self._probe
        if probe is None or probe.tcp_stream != stream_id:
            probe = next((p for p in self._urgent.values() if p.tcp_stream == stream_id), None)
        if probe is None:
            return
        probe.tcp_stream = None
        probe.tcp_ok = ack is not None and ack.seq_no == probe.seq_no
        probe.tcp_refused = ack is None and self._ctx.now_ms < probe.deadline_ms
        if probe.deadline_passed:
            self._conclude(probe)
        else:
            self._conclude_if_every_path_failed(probe)

    def _conclude_if_every_path_failed(self, probe: _Probe) -> None:
        """An urgent probe ends as soon as every path it tried has failed: the direct
        timeout passed, every helper nacked (all of them nack-capable), and the TCP ping,
        if one was opened, failed. A round-robin probe waits out its deadline instead,
        unless ``early_probe_conclusion``."""
        early = probe.urgent or self._ctx.config.early_probe_conclusion
        if not early or not probe.asked or probe.tcp_ok or probe.tcp_stream is not None:
            return
        if probe.expected_nacks == probe.helpers == probe.nacks:
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
        if probe.cross_check:
            ctx.stats.cross_check_probes_failed += 1
        elif probe.urgent:
            ctx.stats.urgent_probes_failed += 1
        delta = formulas.probe_failure_awareness_delta(
            probe.expected_nacks if ctx.config.lifeguard_nacks else 0, probe.nacks
        )
        # Suspect, then end the probe: the next one, which a tick may start, sees the suspicion
        target = self._members.get(probe.target)
        # a probe of an address its name has since left (swim.claims) says nothing of it now
        if target and not target.dead_or_left() and target.address == probe.target_address:
            if probe.cross_check:
                kind, how = "cross_check_failed", " (cross-check of an accusation)"
            elif probe.urgent:
                kind, how = "urgent_probe_failed", " (urgent probe)"
            else:
                kind, how = "probe_failed", ""
            how += f"; our timers {ctx.awareness.lag_ms} ms late, health {ctx.awareness.score}"
            ctx.notice("info", kind, f"suspect {probe.target} has failed, no acks received{how}")
            self._members.apply_suspect(
                Suspect(target.incarnation, target.name, self._members.local_name)
            )
            if probe.tcp_refused:  # for the agent's crash evidence
                ctx.out.probes_refused.append(target.name)
        self._end(probe, delta)

    def _end(self, probe: _Probe, health_delta: int) -> None:
        for timer_id in probe.timer_ids:
            self._ctx.cancel_timer(timer_id)
        self._ctx.awareness.apply_delta(health_delta)
        if probe.urgent:
            del self._urgent[probe.seq_no]
            return
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
        for _ in range(ctx.config.suspicion_verify_copies):
            self._transport.send_parts(target.address, [accusation, ping], target)
        ctx.stats.suspicion_verifications += 1
        grace_ms = ctx.rtt.probe_timeout_ms(name, ctx.awareness.score)
        ctx.set_timer(SuspicionVerify, grace_ms, name, state_change_ms)

    # --- answering ----------------------------------------------------------------------

    def on_ping(self, ping: Ping, source: Address, sender: MemberState | None) -> None:
        """net.go ``handlePing``: ack to the advertised source, else to the sender (the
        member at ``source``, looked up by the caller)."""
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
        if reply_to != source:
            sender = self._members.by_address(reply_to)
        self._transport.send(reply_to, ack, sender)

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
        timeout_ms = ctx.rtt.probe_timeout_ms(req.node, ctx.awareness.score)
        timer_id = ctx.set_timer(RelayTimeout, timeout_ms, seq_no)
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
        probe = self._find(ack.seq_no)
        if probe is None:
            return
        via = "direct" if source == probe.target_address else "indirect"
        rtt_ms = self._ctx.now_ms - probe.sent_ms
        if via == "direct":
            self._ctx.rtt.sample(probe.target, rtt_ms)
        self._ctx.out.probe_results.append(ProbeResult(probe.target, rtt_ms, ack.payload, via))
        self._end(probe, -1)

    def on_nack(self, nack: Nack) -> None:
        probe = self._find(nack.seq_no)
        if probe is not None:
            probe.nacks += 1
            self._ctx.stats.nacks_received += 1
            self._conclude_if_every_path_failed(probe)

    @property
    def probing(self) -> str | None:
        """The round-robin probe's target, if one is in flight."""
        return None if self._probe is None else self._probe.target
