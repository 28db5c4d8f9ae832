"""Sending packets and disseminating broadcasts: what leaves a node as datagrams.

Rules (hashicorp/memberlist @ 1b4c746 net.go ``sendMsg``/``rawSendMsgPacket``, state.go
``gossip``, queue.go; SWIM §4.1 "infection-style dissemination"):
- Every packet is filled with queued broadcasts up to ``udp_buffer_size``: member
  broadcasts first, then user broadcasts in what room is left. Unlike memberlist, the
  message's own compound entry and the CRC header are counted too, so a packet never
  exceeds ``udp_buffer_size``.
- A gossip round (every ``gossip_interval_ms``) sends pending broadcasts to
  ``gossip_nodes`` random members: alive or suspect, plus (memberlist) the recently dead,
  dead for less than ``gossip_to_the_dead_time_ms``; see ``Sender.gossip_targets`` for how
  the dead are drawn. A round with nothing queued draws no targets.
- Receivers that speak protocol ≥ 5 get a CRC32 header; a packet carries at most
  ``wire.MAX_COMPOUND_PARTS`` messages, more are split over several packets.
- Encryption settings come from the node's keyring; AES-GCM nonces come from the injected
  nonce source, never the protocol RNG. Randomness (target draws) comes only from the
  per-node ``Context``.
"""

from __future__ import annotations

from collections.abc import Callable

from swim import wire
from swim.context import Context
from swim.effects import Packet
from swim.member_state import MemberState
from swim.membership import Membership
from swim.messages import Address, NodeStateType, UserMsg
from swim.security import Keyring


class Sender:
    """Packets out of one node, sharing the node's ``Context`` and member table."""

    def __init__(
        self,
        ctx: Context,
        members: Membership,
        keyring: Keyring | None,
        nonce_source: Callable[[int], bytes],
    ) -> None:
        self._ctx = ctx
        self._members = members
        self.keyring = keyring
        config = ctx.config
        self.crypto: wire.Crypto | None = (
            None
            if keyring is None
            else wire.Crypto(
                keyring,
                nonce_source,
                verify_incoming=config.gossip_verify_incoming,
                verify_outgoing=config.gossip_verify_outgoing,
            )
        )
        """Encryption settings of every packet and stream, or None. Built once: the config
        is frozen and the keyring changes in place (``Crypto`` refers to it)."""
        self.packet_room = config.udp_buffer_size - wire.packet_overhead(self.crypto)
        """What a packet leaves for its compound entries after encryption's overhead."""
        local_name = members.local_name
        # (one function per node, not one per gossip round: it is called per draw)
        self._not_live: Callable[[MemberState], bool] = lambda m: (
            m.name == local_name or m.state not in _LIVE
        )
        """Not a gossip target: ourselves, or dead or left."""
        self._compress = config.enable_compression
        self._compressor = self._compress_packet  # bound once, not once per packet

    def gossip_round(self) -> None:
        """state.go ``gossip``: pending broadcasts to a few random members."""
        ctx = self._ctx
        if not ctx.broadcasts.pending and not ctx.user_broadcasts.pending:
            return  # nothing to send: skip drawing targets (memberlist draws, then sends none)
        for peer in self.gossip_targets():
            crc = _wants_crc(peer)
            parts = self._take_broadcasts(self.packet_room - wire.CRC_OVERHEAD * crc)
            if not parts:
                return
            self._emit(peer.address, parts, crc)

    def gossip_targets(self) -> list[MemberState]:
        """Who gets this round's gossip.

        memberlist draws ``gossip_nodes`` from live *and* recently dead members together, so
        after a few failures most of a broadcast's few transmissions go to dead nodes and a
        live member can miss a death entirely (measured: 5.5% of deaths in an 8-node cluster
        with repeated kills reached the last survivor > 2 s late, up to 21 s). With
        ``gossip_to_dead_separately`` (default) the live targets are drawn from live members
        only, and one recently dead member is added with probability ≈ dead/n (one random
        draw), as chitchat does, so the dead can still refute.
        """
        config = self._ctx.config
        now = self._ctx.now_ms
        window = config.gossip_to_the_dead_time_ms
        members = self._members
        not_live = self._not_live

        def recently_dead(m: MemberState) -> bool:
            return m.state == NodeStateType.DEAD and now - m.state_change_ms <= window

        if not config.gossip_to_dead_separately:
            return members.random_members(
                config.gossip_nodes, lambda m: not_live(m) and not recently_dead(m)
            )
        targets = members.random_members(config.gossip_nodes, not_live)
        if not members.count(NodeStateType.DEAD):
            return targets  # nobody to gossip to the dead: skip the draw
        extra = members.random_members(1, _nobody)
        if extra and recently_dead(extra[0]):
            targets.append(extra[0])
        return targets

    def _take_broadcasts(self, limit: int) -> list[bytes]:
        """Member broadcasts first, then user broadcasts in what room is left (net.go)."""
        ctx = self._ctx
        broadcasts, user_broadcasts = ctx.broadcasts, ctx.user_broadcasts
        if not broadcasts.pending and not user_broadcasts.pending:
            return []  # the common case at steady state: nothing to piggyback
        n = len(self._members)
        overhead = wire.COMPOUND_OVERHEAD
        parts = broadcasts.take(overhead, limit, n)
        if not user_broadcasts.pending:
            return parts
        avail = limit - sum(len(p) + overhead for p in parts)
        if avail > overhead + wire.USER_MSG_OVERHEAD:
            user = user_broadcasts.take(overhead + wire.USER_MSG_OVERHEAD, avail, n)
            parts.extend(wire.encode_message(UserMsg(p)) for p in user)
        return parts

    def send(self, dest: Address, message: bytes, member: MemberState | None = None) -> None:
        """One message, with as many broadcasts piggybacked as fit (net.go ``sendMsg``)."""
        # Unlike memberlist (net.go sendMsg), also count the message's own compound entry
        # and the CRC header, so a packet never exceeds udp_buffer_size.
        crc = _wants_crc(member)
        ctx = self._ctx
        if ctx.broadcasts.pending or ctx.user_broadcasts.pending:
            room = (
                self.packet_room - wire.COMPOUND_OVERHEAD - len(message) - wire.CRC_OVERHEAD * crc
            )
            parts = [message, *self._take_broadcasts(room)]
        else:
            parts = [message]  # the common case at steady state: nothing to piggyback
        self._emit(dest, parts, crc)

    def emit(self, dest: Address, parts: list[bytes], member: MemberState | None) -> None:
        """``parts`` as they are, in as many packets as ``MAX_COMPOUND_PARTS`` needs."""
        self._emit(dest, parts, _wants_crc(member))

    def _compress_packet(self, data: bytes) -> bytes:
        """``wire.compress_message``, memoised by the snapshot's codec when there is one
        (looked up only for a packet big enough to compress)."""
        codec = self._members.push_pull.codec
        return wire.compress_message(data) if codec is None else codec.compress_packet(data)

    def _emit(self, dest: Address, parts: list[bytes], crc: bool) -> None:
        step = wire.MAX_COMPOUND_PARTS
        if len(parts) > step:  # rare: split, one packet per slice
            for i in range(0, len(parts), step):
                self._emit(dest, parts[i : i + step], crc)
            return
        ctx = self._ctx
        stats = ctx.stats
        data = wire.encode_packet(
            parts, compress=self._compress, crc=crc, crypto=self.crypto, compressor=self._compressor
        )
        ctx.out.packets.append(Packet(dest, data))
        stats.packets_out += 1
        stats.bytes_out += len(data)
        counts, names = stats.messages_out, wire.TYPE_NAMES
        for part in parts:
            counts[names[part[0]] if part else "empty"] += 1


_LIVE = (NodeStateType.ALIVE, NodeStateType.SUSPECT)


def _nobody(m: MemberState) -> bool:
    return False


def _wants_crc(member: MemberState | None) -> bool:
    """Receivers that speak protocol ≥ 5 get a CRC32 header (net.go rawSendMsgPacket)."""
    return member is not None and member.protocol_max >= 5
