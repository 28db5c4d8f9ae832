"""A deterministic in-memory network of real ``swim.Node`` objects on a virtual clock.

Rules: one event heap ordered by (time_ms, sequence), one seeded ``random.Random`` for the
network and one per node derived from it, so the same seed gives the same run. Packets
are the real encoded bytes; streams are parsed with the node's own ``parse_stream`` and
answered with ``handle_stream``, so every push-pull and TCP ping exercises the codec. No
trio, sockets, threads or wall-clock time.

Fault model kept small on purpose (the full simulator builds on it): per-packet latency
drawn uniformly from a range, independent packet loss, crash and restart, graceful leave,
and partitions as sets of blocked (source, destination) pairs.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from swim import Address, Config, MemberEvent, Node, NodeStateType, Output, Timer
from swim.wire import WireError

EventHook = Callable[[str, MemberEvent], None]


@dataclass(order=True, slots=True)
class _Event:
    at_ms: int
    seq: int
    action: Callable[[], None] = field(compare=False)


@dataclass(slots=True)
class NetworkStats:
    packets_sent: int = 0
    packets_delivered: int = 0
    packets_lost: int = 0
    bytes_sent: int = 0
    streams: int = 0


class Cluster:
    """N nodes named ``node-000``… on 10.0.x.y:7946, driven by virtual time."""

    def __init__(
        self,
        n: int,
        *,
        seed: int = 1,
        config: Config | None = None,
        latency_ms: tuple[int, int] = (1, 5),
        loss: float = 0.0,
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config if config is not None else Config.lan()
        self.latency_ms = latency_ms
        self.loss = loss
        self.now_ms = 0
        self.stats = NetworkStats()
        self.events: list[tuple[str, MemberEvent]] = []
        self.hooks: list[EventHook] = []
        self.nodes: dict[str, Node] = {}
        self.crashed: set[str] = set()
        self.blocked: set[tuple[str, str]] = set()
        self._addr_to_name: dict[Address, str] = {}
        self._heap: list[_Event] = []
        self._seq = 0
        self._incarnation_floor: dict[str, int] = {}
        for i in range(n):
            self.add_node(f"node-{i:03d}")

    # --- topology -------------------------------------------------------------------------

    def address_of(self, index: int) -> Address:
        return Address(f"10.0.{index // 250}.{index % 250 + 1}", 7946)

    def add_node(self, name: str, meta: bytes = b"") -> Node:
        address = self.address_of(len(self._addr_to_name))
        if name in self.nodes:
            address = self.nodes[name].address
        node = Node(
            name,
            address,
            rng=random.Random(self.rng.getrandbits(64)),
            now_ms=self.now_ms,
            config=self.config,
            meta=meta,
            nonce_source=self.rng.randbytes,
        )
        self.nodes[name] = node
        self._addr_to_name[address] = name
        self.crashed.discard(name)
        self._apply(name, node.start(self.now_ms))
        return node

    def join_all(self, seed_name: str | None = None) -> None:
        """Every node joins through the first node (or ``seed_name``)."""
        names = list(self.nodes)
        seed = self.nodes[seed_name or names[0]]
        for name in names:
            if name != seed.name:
                self._apply(name, self.nodes[name].join([seed.address], self.now_ms))

    def crash(self, name: str) -> None:
        """The process dies: no more packets in or out, its timers are never handled."""
        self.crashed.add(name)

    def restart(self, name: str, join_via: str) -> Node:
        """A new process with the same name and address, and a fresh incarnation."""
        node = self.add_node(name)
        self._apply(name, node.join([self.nodes[join_via].address], self.now_ms))
        return node

    def leave(self, name: str) -> None:
        self._apply(name, self.nodes[name].leave(self.now_ms))

    def partition(self, *groups: Iterable[str]) -> None:
        """Block all traffic between members of different groups."""
        sets = [set(g) for g in groups]
        for a_index, a in enumerate(sets):
            for b in sets[a_index + 1 :]:
                for x in sorted(a):
                    for y in sorted(b):
                        self.blocked.add((x, y))
                        self.blocked.add((y, x))

    def heal(self) -> None:
        self.blocked.clear()

    # --- the event loop -------------------------------------------------------------------

    def _schedule(self, at_ms: int, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, _Event(at_ms, self._seq, action))

    def run_until(self, t_ms: int) -> None:
        while self._heap and self._heap[0].at_ms <= t_ms:
            event = heapq.heappop(self._heap)
            self.now_ms = max(self.now_ms, event.at_ms)
            event.action()
        self.now_ms = max(self.now_ms, t_ms)

    def run_for(self, duration_ms: int) -> None:
        self.run_until(self.now_ms + duration_ms)

    def run_until_true(
        self, predicate: Callable[[], bool], limit_ms: int, step_ms: int = 50
    ) -> int:
        """Advance until ``predicate()`` holds; returns the time it first held, or -1."""
        end = self.now_ms + limit_ms
        while self.now_ms < end:
            if predicate():
                return self.now_ms
            self.run_until(min(self.now_ms + step_ms, end))
        return self.now_ms if predicate() else -1

    def _latency(self) -> int:
        low, high = self.latency_ms
        return self.rng.randint(low, high)

    def _reachable(self, src: str, dst: str | None) -> bool:
        return dst is not None and dst not in self.crashed and (src, dst) not in self.blocked

    def _apply(self, name: str, out: Output) -> None:
        node = self.nodes[name]
        for event in out.events:
            self.events.append((name, event))
            for hook in self.hooks:
                hook(name, event)
        for timer in out.timers:
            self._schedule(timer.deadline_ms, self._timer_action(name, node, timer))
        for packet in out.packets:
            self.stats.packets_sent += 1
            self.stats.bytes_sent += len(packet.data)
            dst = self._addr_to_name.get(packet.dest)
            if not self._reachable(name, dst) or self.rng.random() < self.loss:
                self.stats.packets_lost += 1
                continue
            assert dst is not None
            self._schedule(
                self.now_ms + self._latency(),
                self._deliver_action(dst, node.address, packet.data),
            )
        for request in out.streams:
            self.stats.streams += 1
            self._stream(
                name,
                node,
                request.stream_id,
                request.dest,
                request.data,
                request.deadline_ms,
                request.expect_reply,
            )

    def _timer_action(self, name: str, node: Node, timer: Timer) -> Callable[[], None]:
        def fire() -> None:
            if name in self.crashed or self.nodes.get(name) is not node:
                return
            self._apply(name, node.handle_timer(timer, self.now_ms))

        return fire

    def _deliver_action(self, dst: str, source: Address, data: bytes) -> Callable[[], None]:
        node = self.nodes[dst]

        def deliver() -> None:
            if dst in self.crashed or self.nodes.get(dst) is not node:
                return
            self.stats.packets_delivered += 1
            self._apply(dst, node.handle_datagram(source, data, self.now_ms))

        return deliver

    def _stream(
        self,
        name: str,
        node: Node,
        stream_id: int,
        dest: Address,
        data: bytes,
        deadline_ms: int,
        expect_reply: bool,
    ) -> None:
        dst = self._addr_to_name.get(dest)
        latency = self._latency()
        if not self._reachable(name, dst) or (name, dst) in self.blocked:
            fail_at = (
                deadline_ms
                if dst is not None and dst not in self.crashed
                else self.now_ms + latency
            )
            self._schedule(fail_at, self._stream_result(name, node, stream_id, None, "unreachable"))
            return
        assert dst is not None
        peer = self.nodes[dst]

        def serve() -> None:
            if dst in self.crashed or (dst, name) in self.blocked:
                self._schedule(
                    deadline_ms, self._stream_result(name, node, stream_id, None, "reset")
                )
                return
            try:
                parsed = peer.parse_stream(data)
            except WireError as exc:
                peer.record_drop(exc.reason)
                parsed = None
            if parsed is None:
                self._schedule(
                    self.now_ms + latency,
                    self._stream_result(name, node, stream_id, None, "bad request"),
                )
                return
            out = peer.handle_stream(node.address, parsed[0], self.now_ms)
            self._apply(dst, out)
            if not expect_reply:
                return
            reply: Any = None
            error = "no reply"
            if out.reply is not None:
                try:
                    got = node.parse_stream(out.reply)
                    reply = None if got is None else got[0]
                except WireError as exc:
                    error = str(exc)
            self._schedule(
                self.now_ms + latency, self._stream_result(name, node, stream_id, reply, error)
            )

        self._schedule(self.now_ms + latency, serve)

    def _stream_result(
        self, name: str, node: Node, stream_id: int, reply: Any, error: str
    ) -> Callable[[], None]:
        def done() -> None:
            if name in self.crashed or self.nodes.get(name) is not node:
                return
            self._apply(name, node.handle_stream_response(stream_id, reply, self.now_ms, error))

        return done

    # --- views ----------------------------------------------------------------------------

    def live(self) -> list[str]:
        return [n for n in self.nodes if n not in self.crashed and not self.nodes[n].leaving]

    def view(self, name: str) -> dict[str, NodeStateType]:
        return {m.name: m.state for m in self.nodes[name].members()}

    def state_of(self, observer: str, target: str) -> NodeStateType | None:
        member = self.nodes[observer].member(target)
        return None if member is None else member.state

    def all_see(
        self, target: str, states: Iterable[NodeStateType], observers: Iterable[str] | None = None
    ) -> bool:
        wanted = set(states)
        names = self.live() if observers is None else list(observers)
        return all(self.state_of(o, target) in wanted for o in names if o != target)

    def converged(self, names: Iterable[str] | None = None) -> bool:
        """Every given live node sees exactly the given set as alive."""
        group = sorted(self.live() if names is None else names)
        want = set(group)
        for name in group:
            alive = {m for m, s in self.view(name).items() if s == NodeStateType.ALIVE}
            if alive != want:
                return False
        return True
