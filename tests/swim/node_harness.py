"""Helpers for the swim.Node unit tests: nodes on fixed addresses, the timers they asked
for, packets crafted and decoded with ``swim.wire``. Public API only; time is explicit.
"""

from __future__ import annotations

import random
from typing import TypeVar

from simulations.experiments.variants import BEFORE_DETECTION_SWITCHES
from swim import Address, Config, Member, Node, Output, Packet, Timer, wire
from swim.messages import Ack, Alive, Message, Ping
from swim.security import Keyring
from swim.timers import GossipTick, ProbeTick

PORT = 7946
FAST_WITHOUT_DETECTION_SWITCHES: dict[str, object] = dict(BEFORE_DETECTION_SWITCHES)
"""Overrides that turn ``Config.fast()`` back into the fast profile before its
faster-detection switches (the frontier's ``fast/before-switches``), for tests about what
those switches would blur (RTT sampling order, the Lifeguard window, urgent probes against the
plain round robin)."""
T = TypeVar("T")
TimerT = TypeVar("TimerT", bound=Timer)


def addr(index: int) -> Address:
    return Address(f"10.0.0.{index}", PORT)


def vsn(pmax: int = 5) -> bytes:
    """A memberlist version vector (pmin, pmax, pcur, dmin, dmax, dcur); the delegate
    versions are our defaults so that push-pull version checks pass."""
    c = Config.lan()
    return bytes(
        [
            1,
            pmax,
            min(2, pmax),
            c.delegate_protocol_min,
            c.delegate_protocol_max,
            c.delegate_protocol_version,
        ]
    )


def alive(
    name: str, index: int, incarnation: int = 1, *, pmax: int = 5, meta: bytes = b""
) -> Alive:
    a = addr(index)
    return Alive(incarnation, name, a.ip_bytes, a.port, meta, vsn(pmax))


def packet(*messages: Message) -> bytes:
    """One plain datagram holding ``messages`` (compound when more than one)."""
    parts = [wire.encode_message(m) for m in messages]
    return wire.encode_packet(parts, compress=False, crc=False, crypto=None)


def decode(data: bytes, keyring: Keyring | None = None) -> list[Message]:
    crypto = None if keyring is None else wire.Crypto(keyring, random.Random(0).randbytes)
    decoded = wire.decode_packet(data, crypto)
    assert decoded.drops == ()
    return list(decoded.messages)


def to(out: Output, dest: Address) -> list[Packet]:
    return [p for p in out.packets if p.dest == dest]


def of_type(messages: list[Message], cls: type[T]) -> list[T]:
    return [m for m in messages if isinstance(m, cls)]


class Peer:
    """A Node under test plus every timer it has asked for (latest last)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.timers: list[Timer] = []

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def address(self) -> Address:
        return self.node.address

    def member(self, name: str) -> Member:
        m = self.node.member(name)
        assert m is not None, f"{self.name} does not know {name}"
        return m

    def take(self, out: Output) -> Output:
        self.timers.extend(out.timers)
        return out

    def timer(self, kind: type[TimerT]) -> TimerT:
        """The most recently requested timer of ``kind`` (a ``swim.timers`` class)."""
        for t in reversed(self.timers):
            if isinstance(t, kind):
                return t
        raise AssertionError(f"{self.name} asked for no {kind.__name__} timer")

    def fire(self, kind: type[Timer], now_ms: int | None = None) -> Output:
        """Hand back the latest timer of ``kind`` (at its deadline unless ``now_ms``)."""
        t = self.timer(kind)
        self.timers.remove(t)
        return self.take(self.node.handle_timer(t, t.deadline_ms if now_ms is None else now_ms))

    def receive(self, source: Address, *messages: Message, now_ms: int) -> Output:
        return self.take(self.node.handle_datagram(source, packet(*messages), now_ms))

    def deliver(self, source: Address, data: bytes, now_ms: int) -> Output:
        return self.take(self.node.handle_datagram(source, data, now_ms))

    def learn(self, *alives: Alive, now_ms: int = 0) -> None:
        """Tell the node about members with alive messages from nobody in particular."""
        out = self.receive(addr(250), *alives, now_ms=now_ms)
        assert not out.notices, out.notices

    def drain(self, now_ms: int) -> None:
        """Gossip until nothing is queued, so the next packet carries no piggyback."""
        for _ in range(100):
            if self.node.broadcast_queue_depth == 0:
                return
            self.fire(GossipTick, now_ms)
        raise AssertionError("broadcast queue did not drain")

    def probe(self, target: str, now_ms: int) -> tuple[Output, Ping]:
        """Fire probe ticks until the ping goes to ``target``; other probes are acked."""
        for _ in range(3 * self.node.num_members() + 3):
            out = self.fire(ProbeTick, now_ms)
            pings = [(p, m) for p in out.packets for m in decode(p.data) if isinstance(m, Ping)]
            if not pings:
                continue
            assert len(pings) == 1
            pkt, ping = pings[0]
            if ping.node == target:
                return out, ping
            self.receive(pkt.dest, Ack(ping.seq_no), now_ms=now_ms)
        raise AssertionError(f"{self.name} never probed {target}")


def make_peer(
    name: str,
    index: int,
    *,
    config: Config | None = None,
    seed: int | None = None,
    meta: bytes = b"",
    keyring: Keyring | None = None,
    now_ms: int = 0,
) -> Peer:
    """A started node named ``name`` at 10.0.0.<index>:7946 with a seeded RNG."""
    node = Node(
        name,
        addr(index),
        rng=random.Random(index if seed is None else seed),
        now_ms=now_ms,
        config=config,
        meta=meta,
        keyring=keyring,
        nonce_source=random.Random(1000 + index).randbytes,
    )
    peer = Peer(node)
    peer.take(node.start(now_ms))
    return peer


def alive_of(peer: Peer) -> Alive:
    """The alive message a peer would gossip about itself."""
    me = peer.node.member(peer.name)
    assert me is not None
    return Alive(
        me.incarnation, me.name, me.address.ip_bytes, me.address.port, me.meta, bytes(me.vsn)
    )


def mesh(*peers: Peer, now_ms: int = 0) -> None:
    """Everyone knows everyone (alive), with no packets exchanged."""
    for p in peers:
        p.learn(*(alive_of(q) for q in peers if q is not p), now_ms=now_ms)
