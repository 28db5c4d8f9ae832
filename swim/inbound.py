"""What the messages of one incoming datagram do: each goes to the part of the node that
owns it.

Rules (hashicorp/memberlist @ 1b4c746 net.go ``handleCommand``):
- Pings, indirect pings, acks and nacks go to the prober (``swim.probe``); alive, suspect
  and dead messages to the membership (``swim.membership``); a suspect message that opened
  a suspicion, raised by someone else, may get a cross-check probe
  (``Config.suspicion_cross_checks``); a user message goes to ``Output.user_messages``.
  Any other type in a datagram is dropped and counted (UNEXPECTED_TYPE).
- Every message is counted by type (``NodeStats.messages_in``), in arrival order.
- The sender is the member at the datagram's source address *after* its messages were
  handled (an alive message may have just introduced it); the node reports it in
  ``Output.heard_from``. A datagram that is one ping takes a shortcut: answering a ping
  changes no member, so the sender is looked up once, before, and serves the ack too
  when the ack goes back to it (the commonest datagram in a healthy cluster).
"""

from __future__ import annotations

from swim.context import Context
from swim.effects import UserMessage
from swim.member_state import MemberState
from swim.membership import Membership
from swim.messages import (
    Ack,
    Address,
    Alive,
    Dead,
    IndirectPing,
    Message,
    Nack,
    Ping,
    Suspect,
    UserMsg,
)
from swim.probe import Prober
from swim.wire import MESSAGE_TYPE_NAMES, DropReason


class Inbound:
    """Routes one node's decoded datagram messages (see the module docstring)."""

    def __init__(self, ctx: Context, members: Membership, prober: Prober) -> None:
        self._ctx = ctx
        self._members = members
        self._prober = prober

    def dispatch(self, messages: tuple[Message, ...], source: Address) -> MemberState | None:
        """Handle ``messages`` in order; the member at ``source`` afterwards."""
        counts = self._ctx.stats.messages_in
        if len(messages) == 1 and type(messages[0]) is Ping:
            counts[MESSAGE_TYPE_NAMES[Ping]] += 1
            sender = self._members.by_address(source)
            self._prober.on_ping(messages[0], source, sender)
            return sender
        for message in messages:
            counts[MESSAGE_TYPE_NAMES[type(message)]] += 1
            self._one(message, source)
        return self._members.by_address(source)

    def _one(self, message: Message, source: Address) -> None:
        # the commonest first: acks (a lone ping does not come here), then broadcasts
        if isinstance(message, Ack):
            self._prober.on_ack(message, source)
        elif isinstance(message, Suspect):
            opened = self._members.apply_suspect(message)
            if opened and message.sender != self._members.local_name:
                self._prober.cross_check(message.node)
        elif isinstance(message, Alive):
            self._members.apply_alive(message)
        elif isinstance(message, Dead):
            self._members.apply_dead(message)
        elif isinstance(message, Ping):
            self._prober.on_ping(message, source, self._members.by_address(source))
        elif isinstance(message, IndirectPing):
            self._prober.on_indirect_ping(message, source)
        elif isinstance(message, Nack):
            self._prober.on_nack(message)
        elif isinstance(message, UserMsg):
            self._ctx.out.user_messages.append(UserMessage(source, message.payload))
        else:
            self._ctx.drop(DropReason.UNEXPECTED_TYPE)
