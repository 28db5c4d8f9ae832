"""One member's record as a node keeps it: ``MemberState``, mutable, owned by one table.

Rules: a record in a shared ``MembershipSnapshot`` is never written; a node copies it first
(``swim.table``). ``snapshot()`` is the immutable public view (``swim.Member``). This module
depends on nothing but the message and effect types, so the table (``swim.table``) and the
shared push-pull work (``swim.shared``) both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from swim.effects import Member
from swim.messages import Address, Alive, NodeStateType


@dataclass(slots=True)
class MemberState:
    name: str
    address: Address
    meta: bytes
    incarnation: int
    state: NodeStateType
    state_change_ms: int
    vsn: tuple[int, ...] = ()

    @property
    def protocol_max(self) -> int:
        return self.vsn[1] if len(self.vsn) >= 6 else 0

    def dead_or_left(self) -> bool:
        return self.state >= NodeStateType.DEAD

    def copy(self) -> MemberState:
        return MemberState(
            self.name,
            self.address,
            self.meta,
            self.incarnation,
            self.state,
            self.state_change_ms,
            self.vsn,
        )

    def alive(self) -> Alive:
        """The alive message that says what this record says."""
        vsn = bytes(self.vsn)
        return Alive(
            self.incarnation, self.name, self.address.ip_bytes, self.address.port, self.meta, vsn
        )

    def snapshot(self) -> Member:
        return Member(
            self.name,
            self.address,
            self.meta,
            self.incarnation,
            self.state,
            self.state_change_ms,
            self.vsn,
        )
