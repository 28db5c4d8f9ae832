"""A deterministic discrete-event world of real ``swim.Node`` state machines.

Rules:
- One event queue (``calendar``: same time ⇒ handled in schedule order) and a dispatch on
  the event's kind (packet, timer, stream served, stream result, scheduled call). No trio,
  sockets, threads or wall clock: the driver advances time with ``run_until``.
- One seeded ``random.Random``; the network, the scenario's fault choices and every node's
  RNG are derived from it in a fixed order, so the same seed gives the same run.
- Packets are the real encoded bytes a node emitted, routed by address through the
  ``Network`` (latency, loss, partitions). A stream connection costs three one-way delays
  (SYN, SYN-ACK, data) before the server sees it (lossy TCP: ``Network.stream_open``);
  the timing: ``world_streams``; what the ends read: ``streams``.
- Inputs that would do nothing are not handed to a node: an idle gossip tick comes back
  one interval later, a cancelled timer is dropped (``skip_idle_gossip``,
  ``skip_stale_timers``; the run is the same either way).
- A crashed node handles nothing (its in-flight timers are dropped, packets to it are
  lost); a restarted node is a new ``Node`` under the same name and address that joins
  through a live member. A leaving node stops one second after ``leave`` (serf
  ``LeavePropagateDelay``, https://github.com/hashicorp/serf/blob/master/serf/config.go).
  Slow members: ``faults``. The trace hash: ``trace``.

Design: docs/design.md §1 (the sans-IO core, timers as values), §5 (SWIM/memberlist facts).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from simulations.model.calendar import Calendar
from simulations.model.faults import DROP, NOW, SlowSpec, SlowState
from simulations.model.network import Latency, Network
from simulations.model.trace import Trace
from simulations.model.world_streams import WorldStreams
from simulations.model.world_types import (
    K_CALL,
    K_PACKET,
    K_SERVE,
    K_TIMER,
    LATE,
    InputChecker,
    Listener,
    Traffic,
)
from swim import (
    Address,
    Config,
    GossipTick,
    MemberEvent,
    MembershipSnapshot,
    Node,
    Output,
    SeedMember,
    UrgentProbeOutcome,
)

LEAVE_PROPAGATE_DELAY_MS = 1000


class World(WorldStreams):
    """N nodes named ``node-000…`` at 10.x.y.z:7946 on a virtual clock."""

    def __init__(
        self,
        n: int,
        *,
        seed: int,
        config: Config | None = None,
        latency: Latency | None = None,
        loss: float = 0.0,
        node_factory: Callable[..., Node] | None = None,
    ) -> None:
        self.seed = seed
        self._factory: Callable[..., Node] = Node if node_factory is None else node_factory
        """Builds each process: ``swim.Node`` (or a baseline protocol with its driver
        interface, ``simulations.experiments.heartbeat``), called with Node's arguments."""
        master = random.Random(seed)
        self.network = Network(random.Random(master.getrandbits(64)), latency, loss)
        self.rng = random.Random(master.getrandbits(64))
        """For the scenario's own choices (victims, churn)."""
        self._node_rngs = random.Random(master.getrandbits(64))
        self._nonces = random.Random(master.getrandbits(64))
        self.config = config if config is not None else Config.lan()
        self.now_ms = 0
        self.nodes: list[Node] = []
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.up: list[bool] = []
        self.leaving: list[bool] = []
        self.faulty: set[int] = set()
        """Members a scenario made unhealthy (slow, cut off): the Lifeguard paper's FP− counts
        only false positives observed at the others."""
        self.traffic = Traffic()
        self.listeners: list[Listener] = []
        self.taps: list[Callable[[int, int, bytes], None]] = []
        """Called with (source, destination, data) for each datagram sent to a node in
        ``tapped`` (before loss), e.g. ``Metrics`` timing the first probe of a crashed
        member. Empty ``tapped``: one falsy check per packet batch."""
        self.tapped: set[int] = set()
        self.checker: InputChecker | None = None
        self.skip_idle_gossip = True
        """Hold an idle gossip tick back instead of handing it to the node: while
        ``Node.broadcast_queue_depth`` is 0 the tick would only ask for the next one
        ``gossip_interval_ms`` later (``swim.Output.gossip_timers``), so the world hands the
        same tick back then. False: the node gets every tick (the same run, ``test_world``)."""
        self.skip_stale_timers = True
        """Drop a timer the node has cancelled (``swim.Output.cancelled_timers``, e.g. an
        acked probe's timeouts) instead of handing it back to be ignored."""
        self._cancelled: list[set[int]] = []
        """Per node: ids of its cancelled timers still in the calendar."""
        self._idle: list[bool] = []
        """Per node: its broadcast queues were empty after its last input (read right
        after ``_apply``, while the node is in the CPU's caches; every input and API call
        goes through ``_apply``, so it is still true when its next gossip tick is due, and
        the idle check does not touch the node then)."""
        self.events_processed = 0
        self.member_events = 0
        self.packets_lost = 0
        self.packets_unroutable = 0
        self.packets_to_down = 0
        self.packets_queue_dropped = 0
        self._addr_idx: dict[Address, int] = {}
        self._addresses: list[Address] = []
        self._slow: dict[int, SlowState] = {}
        self._calendar = Calendar()
        self._trace = Trace()
        self._width = max(3, len(str(max(n - 1, 0))))
        for _ in range(n):
            self.add_node()

    # --- topology -----------------------------------------------------------------------

    @staticmethod
    def address_of(idx: int) -> Address:
        ip = idx + 1
        return Address(f"10.{(ip >> 16) & 255}.{(ip >> 8) & 255}.{ip & 255}", 7946)

    def _new_node(self, idx: int, meta: bytes) -> Node:
        return self._factory(
            self.names[idx],
            self._addresses[idx],
            rng=random.Random(self._node_rngs.getrandbits(64)),
            now_ms=self.now_ms,
            config=self.config,
            meta=meta,
            nonce_source=self._nonces.randbytes,
        )

    def add_node(self, meta: bytes = b"") -> int:
        """A new, not yet started node; returns its number."""
        idx = len(self.nodes)
        name = f"node-{idx:0{self._width}d}"
        self.names.append(name)
        self.index[name] = idx
        self.up.append(False)
        self.leaving.append(False)
        self._cancelled.append(set())
        self._idle.append(False)
        self.traffic.grow()
        # One Address object per member, shared by its nodes, the snapshot and the routing
        # table: dict lookups by address then match on identity, without calling __eq__.
        address = self.address_of(idx)
        self._addresses.append(address)
        self._addr_idx[address] = idx
        self.nodes.append(self._new_node(idx, meta))
        return idx

    def start_all(self, *, bootstrap: bool = True) -> bool:
        """Start every node. With ``bootstrap`` they start knowing each other
        (``swim.MembershipSnapshot``); otherwise each joins through node 0. Returns True
        when bootstrapped."""
        if bootstrap:
            self._bootstrap()
            return True
        for idx, node in enumerate(self.nodes):
            self.up[idx] = True
            self._apply(idx, node, node.start(self.now_ms))
        seed = self.nodes[0].address
        for idx, node in enumerate(self.nodes):
            if idx:
                self._apply(idx, node, node.join([seed], self.now_ms))
        return False

    def _bootstrap(self) -> None:
        members = [SeedMember(self.names[i], node.address) for i, node in enumerate(self.nodes)]
        snapshot = MembershipSnapshot.build(members, self.now_ms)
        for idx, node in enumerate(self.nodes):
            self.up[idx] = True
            out = node.start(self.now_ms)
            out.extend(node.bootstrap(snapshot, self.now_ms))
            self._apply(idx, node, out)

    def live(self, idx: int) -> bool:
        return self.up[idx] and not self.leaving[idx]

    def live_indices(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if self.up[i] and not self.leaving[i]]

    def _notify(self, kind: str, idx: int) -> None:
        for listener in self.listeners:
            listener.on_lifecycle(kind, idx)

    # --- faults and commands ------------------------------------------------------------

    def at(self, t_ms: int, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t_ms`` (not before now)."""
        self._push(t_ms, K_CALL, -1, fn, args)

    def crash(self, idx: int) -> None:
        """The process dies: nothing in or out, its timers are never handled."""
        if self.up[idx]:
            self.up[idx] = False
            self._notify("crash", idx)

    def restart(self, idx: int, via: int | None = None) -> None:
        """A new process with the same name and address joins through a live member."""
        self.up[idx] = False
        node = self._new_node(idx, b"")
        self.nodes[idx] = node
        self.up[idx] = True
        self.leaving[idx] = False
        self._slow.pop(idx, None)  # a new process on a healthy machine
        self._cancelled[idx] = set()  # the new process numbers its timers from 1 again
        self.faulty.discard(idx)
        self._notify("restart", idx)
        self._apply(idx, node, node.start(self.now_ms))
        self._join(idx, via)

    def _join(self, idx: int, via: int | None) -> None:
        peer = via
        if via is None:  # a random live member
            peers = [i for i in self.live_indices() if i != idx]
            peer = peers[self.rng.randrange(len(peers))] if peers else None
        if peer is not None:
            node = self.nodes[idx]
            self._apply(idx, node, node.join([self.nodes[peer].address], self.now_ms))

    def join_new(self, meta: bytes = b"", via: int | None = None) -> int:
        """A brand-new member starts and joins through a live member."""
        idx = self.add_node(meta)
        self.up[idx] = True
        self._notify("join", idx)
        node = self.nodes[idx]
        self._apply(idx, node, node.start(self.now_ms))
        self._join(idx, via)
        return idx

    def leave(self, idx: int, stop_after_ms: int = LEAVE_PROPAGATE_DELAY_MS) -> None:
        """Graceful leave; the process exits ``stop_after_ms`` later."""
        if not self.up[idx] or self.leaving[idx]:
            return
        self.leaving[idx] = True
        self._notify("leave", idx)
        node = self.nodes[idx]
        self._apply(idx, node, node.leave(self.now_ms))
        self.at(self.now_ms + stop_after_ms, self._stop, idx, node)

    def _stop(self, idx: int, node: Node) -> None:
        if self.nodes[idx] is node and self.up[idx]:
            self.up[idx] = False
            self._notify("stopped", idx)

    def set_meta(self, idx: int, meta: bytes) -> None:
        node = self.nodes[idx]
        self._apply(idx, node, node.set_meta(meta, self.now_ms))

    def probe_now(self, idx: int, name: str) -> UrgentProbeOutcome | None:
        """Member ``idx`` probes ``name`` at once (``Node.probe_now``): what a trainer's
        report of a lost peer makes its agent do. None if ``idx`` is down."""
        if not self.up[idx]:
            return None
        node = self.nodes[idx]
        outcome, out = node.probe_now(name, self.now_ms)
        self._apply(idx, node, out)
        return outcome

    def set_slow(self, idx: int, spec: SlowSpec | None) -> None:
        """Make a member slow (or healthy again with None)."""
        if spec is None:
            self._slow.pop(idx, None)
            self.faulty.discard(idx)
        else:
            self._slow[idx] = SlowState(spec, self.now_ms)
            self.faulty.add(idx)

    def slow_dropped(self) -> int:
        """Datagrams dropped because a slow member's queue was full (all time)."""
        return self.packets_queue_dropped

    # --- the event loop -----------------------------------------------------------------

    def run_for(self, duration_ms: int) -> None:
        self.run_until(self.now_ms + duration_ms)

    def run_until_true(
        self, predicate: Callable[[], bool], limit_ms: int, step_ms: int = 50
    ) -> int:
        """Advance until ``predicate()`` holds; the time it first held, or -1."""
        end = self.now_ms + limit_ms
        while self.now_ms < end:
            if predicate():
                return self.now_ms
            self.run_until(min(self.now_ms + step_ms, end))
        return self.now_ms if predicate() else -1

    def run_until(self, t_end: int) -> None:
        calendar = self._calendar
        times = calendar.times
        buckets = calendar.buckets
        nodes = self.nodes
        up = self.up
        slow = self._slow
        apply = self._apply
        traffic = self.traffic
        pkts_in, bytes_in = traffic.pkts_in, traffic.bytes_in
        gossip_ms = self.config.gossip_interval_ms if self.skip_idle_gossip else -1
        cancelled = self._cancelled
        idle = self._idle
        processed = 0
        while times and times[0] <= t_end:
            t = times[0]
            self.now_ms = t
            bucket = buckets[t]
            i = 0
            # The bucket grows while we work through it (zero-delay events land in it).
            while i < len(bucket):
                event = bucket[i]
                kind, idx, a, b = event
                i += 1
                # The two common kinds first, with their checks inline; the rest below.
                if kind == K_TIMER:
                    if a is not nodes[idx] or not up[idx]:
                        continue  # a timer of a dead or replaced process
                    if slow and idx in slow and self._defer(t, kind, idx, a, b):
                        continue
                    if gossip_ms >= 0 and idle[idx] and b.__class__ is GossipTick:
                        # An idle gossip round: the node would only re-arm its tick at
                        # t + gossip_interval_ms. Hand the same tick back then instead.
                        # (Before the cancelled check: a node never cancels its gossip
                        # tick, and one it did would still be dropped once it is not idle.)
                        at = t + gossip_ms
                        later = buckets.get(at)
                        if later is None:
                            calendar.push(at, event)
                        else:
                            later.append(event)
                        continue
                    gone = cancelled[idx]
                    if gone and b.timer_id in gone:
                        gone.discard(b.timer_id)
                        continue  # the node would ignore it
                    apply(idx, a, a.handle_timer(b, t))
                elif kind == K_PACKET:
                    if not up[idx]:
                        self.packets_to_down += 1
                        continue
                    if slow and idx in slow and self._defer(t, kind, idx, a, b):
                        continue
                    node = nodes[idx]
                    pkts_in[idx] += 1
                    bytes_in[idx] += len(b)
                    apply(idx, node, node.handle_datagram(a, b, t))
                else:
                    self._dispatch_rare(t, kind, idx, a, b)
            processed += i
            calendar.done(t)
        self.events_processed += processed
        if t_end > self.now_ms:
            self.now_ms = t_end

    def _dispatch_rare(self, t: int, kind: int, idx: int, a: Any, b: Any) -> None:
        """Scheduled calls, streams, and slow nodes' queued inputs."""
        if kind == K_CALL:
            a(*b)
            return
        if not self.up[idx]:
            if kind == K_PACKET + LATE:
                self.packets_to_down += 1
            elif kind in (K_SERVE, K_SERVE + LATE):
                self._refuse(a, b)
            return
        if kind >= LATE:
            kind -= LATE
            st = self._slow.get(idx)
            if st is not None and kind != K_TIMER:
                st.queued -= 1
        elif self._slow and idx in self._slow and self._defer(t, kind, idx, a, b):
            return
        node = self.nodes[idx]
        if kind == K_PACKET:
            self.traffic.pkts_in[idx] += 1
            self.traffic.bytes_in[idx] += len(b)
            self._apply(idx, node, node.handle_datagram(a, b, t))
        elif kind == K_TIMER:
            if a is not node:
                return
            gone = self._cancelled[idx]
            if b.timer_id in gone:
                gone.discard(b.timer_id)
            else:
                self._apply(idx, node, node.handle_timer(b, t))
        elif kind == K_SERVE:
            self._serve(idx, node, a, b)
        elif a is node:
            self._apply(idx, node, self._stream_result(idx, node, b))

    def _defer(self, t: int, kind: int, idx: int, a: Any, b: Any) -> bool:
        """Queue an input of a slow node; False if it can be handled right now."""
        due = self._slow[idx].admit(t, timer=kind == K_TIMER, datagram=kind == K_PACKET)
        if due == NOW:
            return False
        if due == DROP:
            self.packets_queue_dropped += 1
        else:
            self._push(due, kind + LATE, idx, a, b)
        return True

    def _apply(self, idx: int, node: Node, out: Output) -> None:
        # (a node model without broadcast queues, e.g. the heartbeat baseline, is never idle)
        self._idle[idx] = not getattr(node, "broadcast_queue_depth", 1)
        if out.events:
            self._on_events(idx, out.events)
        if out.cancelled_timers and self.skip_stale_timers:
            self._cancelled[idx].update(out.cancelled_timers)
        buckets = self._calendar.buckets
        for timer in out.timers:
            at = timer.deadline_ms
            bucket = buckets.get(at)
            if bucket is None:
                self._push(at, K_TIMER, idx, node, timer)
            else:
                bucket.append((K_TIMER, idx, node, timer))
        if out.packets:
            t = self.now_ms
            net = self.network
            addr_idx = self._addr_idx
            traffic = self.traffic
            pkts_out, bytes_out = traffic.pkts_out, traffic.bytes_out
            src = node.address
            tapped = self.tapped
            for packet in out.packets:
                data = packet.data
                pkts_out[idx] += 1
                bytes_out[idx] += len(data)
                dst = addr_idx.get(packet.dest)
                if dst is None:
                    self.packets_unroutable += 1
                    continue
                if tapped and dst in tapped:
                    for tap in self.taps:
                        tap(idx, dst, data)
                d = net.delay(idx, dst)
                if d < 0:
                    self.packets_lost += 1
                    continue
                bucket = buckets.get(t + d)
                if bucket is None:
                    self._push(t + d, K_PACKET, dst, src, data)
                else:
                    bucket.append((K_PACKET, dst, src, data))
                if net.duplicate and net.rng.random() < net.duplicate:
                    self._push(t + net.latency.sample(net.rng), K_PACKET, dst, src, data)
        if self.checker is not None:
            self.checker.after_input(idx, node)
        for request in out.streams:
            self._open_stream(idx, node, request)

    def _on_events(self, idx: int, events: list[MemberEvent]) -> None:
        record = self._trace.record
        t = self.now_ms
        listeners = self.listeners
        for e in events:
            record(t, idx, e)
            self.member_events += 1
            for listener in listeners:
                listener.on_event(idx, e)

    def _push(self, t: int, kind: int, idx: int, a: Any, b: Any) -> None:
        """Schedule an event; never in the past. Same time ⇒ handled in schedule order."""
        self._calendar.push(t if t >= self.now_ms else self.now_ms, (kind, idx, a, b))

    # --- results ------------------------------------------------------------------------

    def trace_hash(self) -> str:
        """The run's fingerprint so far (``simulations.model.trace``)."""
        t = self.traffic
        sums = (sum(t.pkts_out), sum(t.bytes_out), sum(t.pkts_in), sum(t.streams_out))
        return self._trace.digest((self.now_ms, *sums, self.packets_lost, self.packets_to_down))

    def pending_events(self) -> int:
        return self._calendar.pending()


__all__ = ["InputChecker", "Listener", "SlowSpec", "Traffic", "World"]
