"""The all-to-all heartbeat baseline: every member heartbeats every other member once per
interval and judges each one with a Phi accrual detector (Hayashibara et al. 2004, with
Akka's parameters and logistic approximation: ``phi.detector``).

This is the O(n²) design that SWIM §1–2 argues against (each member sends and receives
n−1 messages per interval), built so the simulator can run it on the same network and
fault model as ``swim.Node`` and the cost can be measured rather than asserted.

Rules:
- Same driver interface as ``swim.Node`` for what ``simulations.model.world.World`` and
  ``simulations.model.metrics`` use (``start``, ``bootstrap``, ``handle_timer``,
  ``handle_datagram``, ``member``/``members``/``num_members``, events as
  ``swim.MemberEvent``), so crashes, loss, latency and slow members are the world's own.
  It has no join protocol, streams or metadata: members come from the bootstrap
  snapshot (the simulator starts every run converged), and ``join``/``set_meta``/streams
  are refused with an error.
- Heartbeats are one-way (Cassandra-style gossip of a heartbeat counter, chitchat;
  Akka's request/response would double the count): at a per-node random phase, every
  ``heartbeat_interval_ms``, one datagram to every other member, including those held
  dead (Akka keeps heartbeating unreachable members so they can come back). The payload
  is our wire's ping (sequence number + sender name and address, ``swim.wire``), so
  bytes per message are like-for-like with a SWIM probe.
- A heartbeat from a member feeds its detector (``PhiAccrualDetector.heartbeat``).
- Every ``check_interval_ms`` (Akka ``unreachable-nodes-reaper-interval`` 1 s) each
  member not held dead whose phi is at or above the threshold is declared dead (Akka's
  "unreachable", which is what a membership consumer acts on), and a heartbeat from a
  member held dead makes it alive again: there is no suspicion stage and no
  dissemination, each member judges alone.
- Defaults are Akka cluster's failure detector (reference.conf; docs/design.md §6.2):
  1 s heartbeats, threshold 8, window 1000, min std 100 ms, acceptable pause 3 s, which
  convicts ≈ 4.52 s after the last heartbeat at steady 1 s beats.

Sources: SWIM §1 (all-to-all heartbeating, O(n²) load), docs/design.md §6 (phi formulas
and the Akka/Cassandra/chitchat defaults).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from phi import PhiAccrualDetector, PhiConfig
from swim import (
    Address,
    Config,
    EventKind,
    Member,
    MemberEvent,
    MembershipSnapshot,
    MsgType,
    Node,
    NodeStateType,
    Output,
    Packet,
    Ping,
    Timer,
    encode_message,
)

HEARTBEAT_TICK = "heartbeat"
CHECK_TICK = "check"


@dataclass(frozen=True, slots=True)
class HeartbeatTimer(Timer):
    """This baseline's timer: ``swim.Timer`` (deadline and id, all a driver needs) plus
    which tick it is (``HEARTBEAT_TICK`` or ``CHECK_TICK``)."""

    kind: str


@dataclass(frozen=True, slots=True)
class HeartbeatConfig:
    """All-to-all heartbeating with a Phi detector per peer; defaults are Akka cluster's."""

    heartbeat_interval_ms: int = 1000
    check_interval_ms: int = 1000
    phi: PhiConfig = field(default_factory=PhiConfig.akka_cluster)

    def __post_init__(self) -> None:
        if self.heartbeat_interval_ms < 1 or self.check_interval_ms < 1:
            raise ValueError("heartbeat_interval_ms and check_interval_ms must be >= 1")

    @classmethod
    def akka(cls) -> HeartbeatConfig:
        """akka.cluster.failure-detector (1 s beats, pause 3 s, threshold 8)."""
        return cls()

    @classmethod
    def fast(cls) -> HeartbeatConfig:
        """Tuned to detect in about the time of ``Config.fast()``: 250 ms beats and checks,
        acceptable pause 500 ms, min std 50 ms: convicts ≈ 1.01 s after the last beat."""
        return cls(
            heartbeat_interval_ms=250,
            check_interval_ms=250,
            phi=PhiConfig(
                min_std_deviation_ms=50,
                acceptable_heartbeat_pause_ms=500,
                first_heartbeat_estimate_ms=250,
            ),
        )

    def convict_after_ms(self) -> float:
        """Silence after the last beat that convicts at steady beats (the model)."""
        detector = PhiAccrualDetector(self.phi)
        for t in range(0, 20 * self.heartbeat_interval_ms + 1, self.heartbeat_interval_ms):
            detector.heartbeat(t)
        convict = detector.silence_to_convict_ms()
        assert convict is not None
        return convict


class _Peer:
    __slots__ = ("address", "dead", "detector", "name", "since_ms")

    def __init__(self, name: str, address: Address, config: PhiConfig, now_ms: int) -> None:
        self.name = name
        self.address = address
        self.detector = PhiAccrualDetector(config)
        self.dead = False
        self.since_ms = now_ms


class HeartbeatNode:
    """One member of the all-to-all heartbeat baseline (see the module rules)."""

    def __init__(
        self,
        name: str,
        address: Address,
        *,
        rng: random.Random,
        now_ms: int,
        config: HeartbeatConfig,
    ) -> None:
        self.name = name
        self.address = address
        self.config = config
        self._rng = rng
        self._peers: list[_Peer] = []
        self._by_addr: dict[Address, _Peer] = {}
        self._by_name: dict[str, _Peer] = {}
        self._seq = 0
        self._timer_id = 0
        self._pause_ms = config.phi.acceptable_heartbeat_pause_ms
        self._threshold = config.phi.threshold
        self.drops = 0

    # --- commands ----------------------------------------------------------------------

    def start(self, now_ms: int) -> Output:
        """Arm the heartbeat and check ticks, each at a random phase."""
        out = Output()
        c = self.config
        beat_ms = now_ms + self._rng.randrange(c.heartbeat_interval_ms)
        check_ms = now_ms + self._rng.randrange(c.check_interval_ms)
        out.timers += [self._timer(beat_ms, HEARTBEAT_TICK), self._timer(check_ms, CHECK_TICK)]
        return out

    def bootstrap(self, snapshot: MembershipSnapshot, now_ms: int) -> Output:
        """Every other member of the snapshot becomes a peer (alive, no heartbeat yet)."""
        for name in snapshot.names:
            member = snapshot.get(name)
            if name == self.name or member is None or name in self._by_name:
                continue
            peer = _Peer(name, member.address, self.config.phi, now_ms)
            self._peers.append(peer)
            self._by_addr[member.address] = peer
            self._by_name[name] = peer
        return Output()

    def join(self, seeds: Sequence[Address], now_ms: int) -> Output:
        raise NotImplementedError("the heartbeat baseline has no join protocol: bootstrap it")

    def leave(self, now_ms: int) -> Output:
        raise NotImplementedError("the heartbeat baseline has no graceful leave")

    def set_meta(self, meta: bytes, now_ms: int) -> Output:
        raise NotImplementedError("the heartbeat baseline carries no metadata")

    def parse_stream(self, data: bytes) -> None:
        """No streams: every connection is answered with 'bad request'."""
        return None

    def record_drop(self, reason: object) -> None:
        self.drops += 1

    # --- inputs ------------------------------------------------------------------------

    def handle_timer(self, timer: Timer, now_ms: int) -> Output:
        if not isinstance(timer, HeartbeatTimer):
            raise TypeError(f"not a timer of HeartbeatNode: {timer!r}")
        if timer.kind == HEARTBEAT_TICK:
            out, next_ms = self._beat(now_ms), now_ms + self.config.heartbeat_interval_ms
        else:
            out, next_ms = self._check(now_ms), now_ms + self.config.check_interval_ms
        out.timers.append(self._timer(next_ms, timer.kind))
        return out

    def handle_datagram(self, source: Address, data: bytes, now_ms: int) -> Output:
        out = Output()
        peer = self._by_addr.get(source)
        if peer is None or not data or data[0] != MsgType.PING:
            self.drops += 1
            return out
        peer.detector.heartbeat(now_ms)
        if peer.dead:
            peer.dead = False
            peer.since_ms = now_ms
            out.events.append(MemberEvent(EventKind.ALIVE, self._member(peer), now_ms))
        return out

    # --- queries -----------------------------------------------------------------------

    def member(self, name: str) -> Member | None:
        peer = self._by_name.get(name)
        return None if peer is None else self._member(peer)

    def members(self) -> list[Member]:
        return sorted((self._member(p) for p in self._peers), key=lambda m: m.name)

    def num_members(self) -> int:
        return len(self._peers) + 1

    def detector(self, name: str) -> PhiAccrualDetector:
        """The Phi detector judging ``name`` (read it; feeding it is this node's job)."""
        return self._by_name[name].detector

    # --- internals ---------------------------------------------------------------------

    def _timer(self, deadline_ms: int, kind: str) -> HeartbeatTimer:
        self._timer_id += 1
        return HeartbeatTimer(deadline_ms, self._timer_id, kind)

    def _beat(self, now_ms: int) -> Output:
        self._seq += 1
        ping = Ping(self._seq, "", self.address.ip_bytes, self.address.port, self.name)
        data = encode_message(ping)
        out = Output()
        out.packets = [Packet(p.address, data) for p in self._peers]
        return out

    def _check(self, now_ms: int) -> Output:
        out = Output()
        pause_ms, threshold = self._pause_ms, self._threshold
        for peer in self._peers:
            if peer.dead:
                continue
            last_ms = peer.detector.last_heartbeat_ms
            # phi reaches the threshold only past mean + pause: skip the cheap cases.
            if last_ms is None or now_ms - last_ms <= pause_ms:
                continue
            if peer.detector.phi(now_ms) >= threshold:
                peer.dead = True
                peer.since_ms = now_ms
                out.events.append(MemberEvent(EventKind.DEAD, self._member(peer), now_ms))
        return out

    def _member(self, peer: _Peer) -> Member:
        state = NodeStateType.DEAD if peer.dead else NodeStateType.ALIVE
        return Member(peer.name, peer.address, b"", 1, state, peer.since_ms, ())


NodeFactory = Callable[..., Node]


def factory(config: HeartbeatConfig) -> NodeFactory:
    """A ``World`` node factory building heartbeat nodes. They stand in for ``swim.Node``
    where the world and the metrics drive them (the subset in the module rules); the
    cast is that stand-in, and ``World`` never calls more than that subset."""

    def make(name: str, address: Address, *, rng: random.Random, now_ms: int, **_: Any) -> Node:
        return cast(Node, HeartbeatNode(name, address, rng=rng, now_ms=now_ms, config=config))

    return make


WORLD_CONFIG = Config.lan()
"""The ``World`` and ``Metrics`` read a ``swim.Config`` (load per probe period, restart
grace); heartbeat worlds get lan's, whose 1 s period equals the Akka heartbeat interval."""

__all__ = ["WORLD_CONFIG", "HeartbeatConfig", "HeartbeatNode", "factory"]
