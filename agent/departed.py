"""Members that have gone: failed and left members kept visible after the core reaps them.

Serf keeps a failed member in its member list for ``ReconnectTimeout`` (24 h) and a left
one for ``TombstoneTimeout`` (24 h) (serf config.go; ``reap`` in serf.go), long after
memberlist dropped it from its node table (``GossipToTheDeadTime``, 15–30 s). Operators
rely on that: ``serf members`` answers "what died overnight?". So do two serf rules that
need the record:

- a leave intent that arrives after a member was declared failed still moves it to left
  (serf.go ``handleNodeLeaveIntent``, "EventMemberLeave (forced)"); and
- a push-pull ``LeftMembers`` entry does the same (delegate.go ``MergeRemoteState``).

This registry is the agent's version of that list. It is pure (no clock, no I/O) and
bounded: at most ``max_entries`` names, the oldest departure evicted first. A member that
comes back (a join under the same name) is forgotten here at once.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from swim import Member, NodeStateType

DAY_MS = 24 * 3600 * 1000
DEFAULT_RECONNECT_TIMEOUT_MS = DAY_MS
"""serf config.go ``ReconnectTimeout``: how long a failed member stays listed."""
DEFAULT_TOMBSTONE_TIMEOUT_MS = DAY_MS
"""serf config.go ``TombstoneTimeout``: how long a left member stays listed."""
DEFAULT_MAX_ENTRIES = 65_536


class Departed:
    """Failed (``DEAD``) and ``LEFT`` members no longer in the core's table."""

    def __init__(
        self,
        reconnect_timeout_ms: int = DEFAULT_RECONNECT_TIMEOUT_MS,
        tombstone_timeout_ms: int = DEFAULT_TOMBSTONE_TIMEOUT_MS,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        if reconnect_timeout_ms < 0 or tombstone_timeout_ms < 0:
            raise ValueError("reconnect and tombstone timeouts must be >= 0")
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.reconnect_timeout_ms = reconnect_timeout_ms
        self.tombstone_timeout_ms = tombstone_timeout_ms
        self.max_entries = max_entries
        # name -> (member, departed_at_ms); insertion order = departure order
        self._entries: OrderedDict[str, tuple[Member, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Member | None:
        entry = self._entries.get(name)
        return None if entry is None else entry[0]

    def record(self, member: Member, now_ms: int) -> list[str]:
        """Keep a reaped member (only ``DEAD`` or ``LEFT`` ones). Returns the names evicted
        to stay within ``max_entries``."""
        if member.state not in (NodeStateType.DEAD, NodeStateType.LEFT):
            return []
        self._entries.pop(member.name, None)
        self._entries[member.name] = (member, now_ms)
        evicted: list[str] = []
        while len(self._entries) > self.max_entries:
            name, _ = self._entries.popitem(last=False)
            evicted.append(name)
        return evicted

    def forget(self, name: str) -> bool:
        """The member is back (it joined again under the same name)."""
        return self._entries.pop(name, None) is not None

    def mark_left(self, name: str, now_ms: int) -> Member | None:
        """A late leave for a failed member: it left gracefully after all (serf's
        "EventMemberLeave (forced)"). Returns the updated member if it changed."""
        entry = self._entries.get(name)
        if entry is None or entry[0].state != NodeStateType.DEAD:
            return None
        left = dataclasses.replace(entry[0], state=NodeStateType.LEFT, state_change_ms=now_ms)
        self._entries[name] = (left, entry[1])
        return left

    def expire(self, now_ms: int) -> list[str]:
        """Drop failed members older than the reconnect timeout and left ones older than
        the tombstone timeout. Returns the names dropped."""
        gone = [
            name
            for name, (member, since_ms) in self._entries.items()
            if now_ms - since_ms >= self._timeout_ms(member)
        ]
        for name in gone:
            del self._entries[name]
        return gone

    def members(self) -> list[Member]:
        return [member for member, _ in self._entries.values()]

    def _timeout_ms(self, member: Member) -> int:
        if member.state == NodeStateType.LEFT:
            return self.tombstone_timeout_ms
        return self.reconnect_timeout_ms
