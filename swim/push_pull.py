"""Our side of a push-pull full-state exchange: the table as the wire carries it, our
protocol versions, and which entries of a received state are worth merging.

Rules (hashicorp/memberlist @ 1b4c746 net.go ``sendLocalState``, state.go ``mergeState``,
``verifyProtocol``; docs/design.md §3.3):
- Our state is every member of the table in the table's order (base order, then added
  members), encoded exactly as ``wire.encode_push_pull`` of their ``PushNodeState``s. A
  node bootstrapped from a ``MembershipSnapshot`` splices its changed records into the
  snapshot's shared encoding, blanks the removed ones and appends the added ones: the
  same bytes, without re-encoding n records (``swim.shared``).
- Our version summary (``swim.compat``) costs O(changed members) when the base is uniform.
- Of a received state, only the entries that differ from the shared base, plus those of
  the members we changed, can change anything; merging only them (in their order) is the
  same as replaying every entry (``swim.shared.PushPullDiff``). The replay itself is
  ``Membership.merge``.
"""

from __future__ import annotations

from swim import wire
from swim.compat import Versions, VersionSummary, combine_bounds, summarize
from swim.messages import PushNodeState, PushPull
from swim.shared import PushPullDiff, SharedCodec, push_state
from swim.table import MemberTable

__all__ = ["OurSide", "push_states"]


def push_states(table: MemberTable) -> tuple[PushNodeState, ...]:
    return tuple(push_state(m) for m in table)


class OurSide:
    """Our side of every push-pull, over one node's member table."""

    def __init__(self, table: MemberTable) -> None:
        self._table = table

    @property
    def codec(self) -> SharedCodec | None:
        """Shared push-pull work, for a node bootstrapped from a snapshot."""
        return self._table.codec

    def encode(self, join: bool, user_state: bytes) -> bytes:
        """The whole table as one push-pull stream message (before compression/encryption)."""
        table, codec = self._table, self._table.codec
        if codec is None:
            return wire.encode_push_pull(PushPull(join, push_states(table), user_state))
        changes: dict[int, bytes] = {}
        for m in table.base_overrides():
            changes[codec.base_position(m.name)] = wire.encode_push_state(push_state(m))
        for name in table.gone_names():
            changes[codec.base_position(name)] = b""
        added = []
        for name in table.added_names():
            state = table.get(name)
            assert state is not None
            added.append(wire.encode_push_state(push_state(state)))
        return codec.push_pull_message(join, len(table), changes, added, user_state)

    def version_summary(self, codec: SharedCodec) -> VersionSummary:
        """Our side of ``verifyProtocol`` for a bootstrapped table."""
        table = self._table
        base, uniform = codec.base_versions()
        if not uniform:
            return summarize((Versions(m.name, m.state, m.vsn) for m in table), remote=False)
        own = summarize((Versions(m.name, m.state, m.vsn) for m in table.overrides()), remote=False)
        if table.untouched_base() == 0:
            return own
        currents = dict.fromkeys((*own.currents, *base.currents))
        return VersionSummary(combine_bounds(own.bounds, base.bounds), tuple(currents))

    def merge_picks(self, diff: PushPullDiff) -> list[int]:
        """Positions of the received entries to merge, in order."""
        picks = set(diff.differs)
        for name in self._table.changed_names():
            index = diff.index.get(name)
            if index is not None:
                picks.add(index)
        return sorted(picks)
