"""Work shared by the nodes bootstrapped from one ``MembershipSnapshot``: push-pull codec
memos and the facts about a push-pull that let a node merge it in O(what differs).

Rules:
- Only pure functions are memoised: LZW compression of a stream message and of a
  packet's compound (before its CRC and encryption), parsing of a plain (unencrypted)
  stream, and that parse's refusal (``WireError``). A hit returns exactly what the call
  would have returned (a refusal: a new ``WireError`` with the same reason and detail);
  results are immutable (bytes, frozen dataclasses) and safe to share. The stream memos
  are small LRUs and only take payloads of ``MEMO_MIN_BYTES`` or more: in a simulated
  cluster many nodes send byte-identical full-state push-pulls, and a pure-Python LZW
  pass over a 10,000-member state takes about a second. Packets are memoised whatever
  their size (a larger LRU, ``_PACKET_MEMO_ENTRIES``): nodes relay the same broadcasts, so
  the same compound recurs (10,000 nodes × 12 s: 93% of 188,000 compressions were repeats
  within the last 256), and a pure-Python LZW pass over one costs ~35 µs.
- Base records never change, so their encoded push-pull node states are cached by name.
- A node's own push-pull message is the base's encoding with its changes spliced in;
  it is memoised by those changes (``push_pull_message``), so nodes that changed the same
  members alike share one bytes object, whose hash the stream memos then compute once.
- ``PushPullDiff``: which entries of a received push-pull are not a base record verbatim
  (and every entry of a name that appears twice), the position of every name, and the
  sender's version summary. A node whose table is that base plus its own changes merges
  only those entries and the entries of members it changed: for every other entry, the
  remote state equals the base record equals ours, and memberlist's ``aliveNode`` ignores
  an alive message whose incarnation is not newer from the same address; the skipped
  calls are no-ops, so the result is the same as replaying every entry.
- No stream memo is used with encryption (every stream has a fresh nonce) or for small
  clusters (below ``SHARED_MIN_NODES`` the plain path is as fast).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from swim import wire
from swim.compat import Versions, VersionSummary, summarize
from swim.member_state import MemberState
from swim.messages import NodeStateType, PushNodeState, PushPull

MEMO_MIN_BYTES = 1024
"""Smallest stream payload worth memoising (hashing it must be cheaper than the work).
A 300-member push-pull compresses to ≈ 2.5 KB, and decompressing that in pure Python
costs ~1 ms against ~2 µs to hash it: with 4 KiB here, a 300-node world took 77.6 µs of
CPU per node-second, with 1 KiB 41.9 (same run otherwise)."""
SHARED_MIN_NODES = 256
"""Push-pulls with fewer node states take the plain merge path."""
_MEMO_ENTRIES = 8
_PACKET_MEMO_ENTRIES = 512

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Lru(Generic[K, V]):
    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def get_or_compute(self, key: K, compute: Callable[[K], V]) -> V:
        """The remembered value of ``key``, else ``compute(key)``, remembered."""
        value = self.get(key)
        if value is None:
            value = compute(key)
            self.put(key, value)
        return value


@dataclass(frozen=True, slots=True)
class _Refused:
    """A stream that ``wire.parse_stream`` refused (``SharedCodec.parse``)."""

    reason: wire.DropReason
    detail: str


@dataclass(frozen=True, slots=True)
class PushPullDiff:
    differs: tuple[int, ...]
    """Indexes of entries that must be replayed whatever our table holds."""
    index: Mapping[str, int]
    """Where each name is (for names that appear once)."""
    versions: VersionSummary
    """The sender's side of ``verifyProtocol``."""


def push_state(m: MemberState) -> PushNodeState:
    return PushNodeState(
        m.name,
        m.address.ip_bytes,
        m.address.port,
        m.meta,
        m.incarnation,
        m.state,
        bytes(m.vsn),
    )


class SharedCodec:
    """Memos for one snapshot's nodes (see the module docstring)."""

    def __init__(self, base: Mapping[str, MemberState]) -> None:
        self._base = base
        self._parts: list[bytes] | None = None
        self._position: dict[str, int] = {name: i for i, name in enumerate(base)}
        self._compressed: _Lru[bytes, bytes] = _Lru(_MEMO_ENTRIES)
        self._packets: _Lru[bytes, bytes] = _Lru(_PACKET_MEMO_ENTRIES)
        self._parsed: _Lru[
            tuple[bytes, wire.StreamLimits], tuple[wire.StreamMessage, int] | _Refused
        ]
        self._parsed = _Lru(_MEMO_ENTRIES)
        self._diffs: _Lru[int, tuple[PushPull, PushPullDiff]] = _Lru(_MEMO_ENTRIES)
        self._messages: _Lru[
            tuple[bool, int, tuple[tuple[int, bytes], ...], tuple[bytes, ...], bytes], bytes
        ] = _Lru(_MEMO_ENTRIES)
        self._base_versions: tuple[VersionSummary, bool] | None = None

    def _base_parts(self) -> list[bytes]:
        """The encoded push-pull state of every base record, in base order (read only)."""
        if self._parts is None:
            self._parts = [wire.encode_push_state(push_state(m)) for m in self._base.values()]
        return self._parts

    def base_position(self, name: str) -> int:
        return self._position[name]

    def push_pull_message(
        self,
        join: bool,
        count: int,
        changes: Mapping[int, bytes],
        added: Sequence[bytes],
        user_state: bytes,
    ) -> bytes:
        """``wire.encode_push_pull_parts(join, count, parts, user_state)`` where ``parts``
        is the base's encoding with ``changes`` (position → part, b"" for a removed member)
        applied and ``added`` appended, memoised by what differs from the base. Nodes
        that changed the same members the same way send the same message, and hand the
        same bytes object on: its hash (for ``compress``) is then computed once, not once
        per push-pull (0.12 ms at 10,000 members)."""
        parts = self._base_parts()
        differs = tuple(sorted((i, p) for i, p in changes.items() if p != parts[i]))
        key = (join, count, differs, tuple(added), user_state)
        message = self._messages.get(key)
        if message is None:
            full = list(parts)
            for i, part in differs:
                full[i] = part
            full.extend(added)
            message = wire.encode_push_pull_parts(join, count, full, user_state)
            self._messages.put(key, message)
        return message

    def compress(self, message: bytes) -> bytes:
        """``wire.compress_message(message)``, memoised."""
        return self._compressed.get_or_compute(message, wire.compress_message)

    def compress_packet(self, data: bytes) -> bytes:
        """``wire.compress_message(data)`` for a packet's compound, memoised."""
        return self._packets.get_or_compute(data, wire.compress_message)

    def parse(
        self, data: bytes, limits: wire.StreamLimits
    ) -> tuple[wire.StreamMessage, int] | None:
        """``wire.parse_stream(data, None, limits)``, memoised when complete or refused.

        A refusal is remembered as its reason and detail and raised again as a new
        ``WireError`` with both: a push-pull over ``limits.max_nodes`` (every one in a
        cluster of more than 65,536 members) is only found out after decompressing it
        whole, ~0.2 s per 100,000 members."""
        key = (data, limits)
        parsed = self._parsed.get(key)
        if parsed is None:
            try:
                parsed = wire.parse_stream(data, None, limits)
            except wire.WireError as exc:
                self._parsed.put(key, _Refused(exc.reason, exc.detail))
                raise
            if parsed is not None:
                self._parsed.put(key, parsed)
        if isinstance(parsed, _Refused):
            raise wire.WireError(parsed.reason, parsed.detail)
        return parsed

    def diff(self, pp: PushPull) -> PushPullDiff:
        """What in ``pp`` differs from the base (memoised per push-pull object)."""
        hit = self._diffs.get(id(pp))
        if hit is not None and hit[0] is pp:
            return hit[1]
        found = self._compute_diff(pp)
        self._diffs.put(id(pp), (pp, found))
        return found

    def _compute_diff(self, pp: PushPull) -> PushPullDiff:
        differs: list[int] = []
        index: dict[str, int] = {}
        twice: set[str] = set()
        for i, r in enumerate(pp.nodes):
            if r.name in index:
                twice.add(r.name)
            index[r.name] = i
            if not self._is_base_record(r):
                differs.append(i)
        if twice:
            differs.extend(i for i, r in enumerate(pp.nodes) if r.name in twice)
            for name in twice:
                del index[name]
        versions = summarize((Versions(r.name, r.state, r.vsn) for r in pp.nodes), remote=True)
        return PushPullDiff(tuple(sorted(set(differs))), index, versions)

    def _is_base_record(self, r: PushNodeState) -> bool:
        b = self._base.get(r.name)
        return (
            b is not None
            and r.state == NodeStateType.ALIVE
            and r.incarnation == b.incarnation
            and r.port == b.address.port
            and r.addr == b.address.ip_bytes
            and r.meta == b.meta
            and r.vsn == bytes(b.vsn)
        )

    def base_versions(self) -> tuple[VersionSummary, bool]:
        """The base's version summary, and whether every base record has the same vsn
        (then any non-empty part of the base has this same summary)."""
        if self._base_versions is None:
            states = self._base.values()
            summary = summarize((Versions(m.name, m.state, m.vsn) for m in states), remote=False)
            uniform = len({m.vsn for m in states}) <= 1
            self._base_versions = (summary, uniform)
        return self._base_versions
