"""The member table's storage: a shared, immutable base plus this node's own differences.

Rules:
- ``MembershipSnapshot`` is an immutable member list built once and shared by any number
  of nodes (a simulator bootstraps thousands of nodes from one). Its ``MemberState``
  records are never mutated: a node that changes a member first copies it into its own
  overrides (copy-on-write, ``MemberTable.mutable``); lookups fall back to the base.
- A node's memory is O(members it changed or added), not O(n). Removing a base member
  leaves a tombstone; an address index of overrides shadows the base index.
- Everything per tick is O(1) or O(k) expected: counts by state are maintained counters;
  random members come from rejection sampling over an indexable name space (base names,
  then added names) with a bounded number of tries and an exact O(n) fallback, so the
  result is uniform over the eligible members either way.
- Probe rounds (SWIM §4.3, randomized round-robin) are drawn incrementally: each probe
  picks uniformly among the members not yet drawn this round, which is a uniformly
  shuffled order generated one step at a time. A member added mid-round lands at a
  uniformly random position among the members still to come. When the rejection sampler
  runs out of luck near the end of a round, the rest of the round is materialised and
  shuffled once (O(n) once per round, O(1) amortised per probe).
- Iteration order is deterministic: base order, then added members in insertion order;
  sets of names are only ever used for membership tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from swim.config import PROTOCOL_VERSION_MAX, PROTOCOL_VERSION_MIN, Config
from swim.effects import Member
from swim.member_state import MemberState
from swim.messages import Address, NodeStateType
from swim.shared import SharedCodec

_SAMPLE_TRIES = 32
_UNSET = object()
"""Rejection-sampling draws per wanted item before the exact O(n) fallback."""


def local_vsn(config: Config) -> tuple[int, ...]:
    """The six protocol-version bytes a node with ``config`` advertises (net.go ``Vsn``)."""
    return (
        PROTOCOL_VERSION_MIN,
        PROTOCOL_VERSION_MAX,
        config.protocol_version,
        config.delegate_protocol_min,
        config.delegate_protocol_max,
        config.delegate_protocol_version,
    )


_DEFAULT_VSN = local_vsn(Config.lan())


@dataclass(frozen=True, slots=True)
class SeedMember:
    """One member of a ``MembershipSnapshot``: alive, with these attributes."""

    name: str
    address: Address
    incarnation: int = 1
    meta: bytes = b""
    vsn: tuple[int, ...] = field(default=_DEFAULT_VSN)
    """Protocol versions it advertises; defaults to what a ``Config.lan()`` node sends."""


class MembershipSnapshot:
    """An immutable, shareable member list for ``Node.bootstrap``."""

    __slots__ = ("_by_addr", "_names", "_states", "codec")

    def __init__(
        self,
        names: tuple[str, ...],
        states: dict[str, MemberState],
        by_addr: dict[Address, MemberState],
    ) -> None:
        self._names = names
        self._states = states
        self._by_addr = by_addr
        """Each record by its address: one lookup per datagram finds the record itself."""
        self.codec = SharedCodec(states)
        """Push-pull work shared by the nodes bootstrapped from this snapshot."""

    @classmethod
    def build(cls, members: Sequence[SeedMember], now_ms: int = 0) -> MembershipSnapshot:
        """Validate and freeze ``members`` (all alive, state changed at ``now_ms``)."""
        states: dict[str, MemberState] = {}
        by_addr: dict[Address, MemberState] = {}
        for seed in members:
            _check_seed(seed)
            if seed.name in states:
                raise ValueError(f"duplicate member name {seed.name!r}")
            if seed.address in by_addr:
                held = by_addr[seed.address].name
                raise ValueError(f"{seed.name} and {held} share {seed.address}")
            states[seed.name] = state = MemberState(
                seed.name,
                seed.address,
                seed.meta,
                seed.incarnation,
                NodeStateType.ALIVE,
                now_ms,
                tuple(seed.vsn),
            )
            by_addr[seed.address] = state
        return cls(tuple(states), states, by_addr)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def get(self, name: str) -> Member | None:
        state = self._states.get(name)
        return None if state is None else state.snapshot()


def _check_seed(seed: SeedMember) -> None:
    """What ``Membership`` would refuse from the wire is refused here too, so that a base
    record is always one an alive message could have produced."""
    if not seed.name or len(seed.name.encode("utf-8", "surrogateescape")) > 512:
        raise ValueError("a seed member needs a non-empty name of at most 512 bytes")
    if not 0 <= seed.incarnation <= 0xFFFF_FFFF:
        raise ValueError(f"incarnation of {seed.name} out of range")
    if len(seed.meta) > 512:
        raise ValueError(f"metadata of {seed.name} exceeds 512 bytes")
    if len(seed.vsn) not in (0, 6):
        raise ValueError(f"vsn of {seed.name} must have 0 or 6 entries")
    if seed.vsn and not (0 < seed.vsn[0] <= seed.vsn[1] and all(0 <= v <= 255 for v in seed.vsn)):
        raise ValueError(f"vsn of {seed.name} is not a valid version range")
    seed.address.ip_bytes  # noqa: B018 -- validates the IP


class MemberTable:
    """One node's view: the shared base plus overrides, with O(1)/O(k) queries."""

    def __init__(self, local: MemberState) -> None:
        self.local_name = local.name
        self._base_names: tuple[str, ...] = ()
        self._base: dict[str, MemberState] = {}
        self._base_addr: dict[Address, MemberState] = {}
        self._own: dict[str, MemberState] = {local.name: local}
        self._gone: dict[str, None] = {}
        """Base members removed from this table (a dict: ordered, unlike a set)."""
        self._added: list[str] = [local.name]
        self._added_pos: dict[str, int] = {local.name: 0}
        self._addr: dict[Address, str | None] = {local.address: local.name}
        self._counts = [0, 0, 0, 0]
        self._counts[local.state] += 1
        self._size = 1
        self._drawn: set[str] = set()
        self._tail: list[str] | None = None
        self.codec: SharedCodec | None = None
        """The snapshot's shared codec once bootstrapped."""

    def bootstrap(self, snapshot: MembershipSnapshot) -> None:
        """Adopt ``snapshot`` as the base; our own entry stays ours."""
        if self._size != 1 or self._base_names:
            raise ValueError("bootstrap needs a fresh node (call it right after start())")
        local = self._own[self.local_name]
        base = snapshot._states
        holder = snapshot._by_addr.get(local.address)
        if holder is not None and holder.name != local.name:
            raise ValueError(f"{holder.name} in the snapshot has our address {local.address}")
        self._base_names, self._base, self._base_addr = snapshot._names, base, snapshot._by_addr
        self._counts = [0, 0, 0, 0]
        self._counts[NodeStateType.ALIVE] = len(base)
        self._counts[local.state] += 1
        self._size = len(base) + 1
        mine = base.get(local.name)
        if mine is not None:
            self._added, self._added_pos = [], {}
            self._counts[mine.state] -= 1
            self._size -= 1
            if mine.address != local.address:
                self._addr[mine.address] = None
        self._drawn.clear()
        self._tail = None
        self.codec = snapshot.codec

    # --- lookups ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def get(self, name: str) -> MemberState | None:
        """The member's record; may be shared with other nodes: read it, never write it."""
        state = self._own.get(name)
        if state is not None:
            return state
        if name in self._gone:
            return None
        return self._base.get(name)

    def mutable(self, name: str) -> MemberState:
        """The member's record, copied into our overrides first if it is the shared one."""
        state = self._own.get(name)
        if state is None:
            if name in self._gone:
                raise KeyError(name)
            state = self._base[name].copy()
            self._own[name] = state
        return state

    def by_address(self, address: Address) -> MemberState | None:
        # One hash of ``address`` per index and ``get`` inlined: a lookup per datagram.
        name = self._addr.get(address, _UNSET)
        if name is _UNSET:
            # Not in our own address index: the base record there, unless we changed or
            # removed that member (the base index holds the record, not its name, which
            # saves a lookup in the 10,000-entry base by name).
            base = self._base_addr.get(address)
            if base is None:
                return None
            name = base.name
            state = self._own.get(name)
            if state is not None:
                return state
            return None if name in self._gone else base
        if name is None:
            return None
        assert isinstance(name, str)
        state = self._own.get(name)
        if state is not None:
            return state
        if name in self._gone:
            return None
        return self._base.get(name)

    def count(self, state: NodeStateType) -> int:
        return self._counts[state]

    def __iter__(self) -> Iterator[MemberState]:
        """Every member: base order, then added members in insertion order."""
        own, gone = self._own, self._gone
        for name in self._base_names:
            state = own.get(name)
            if state is not None:
                yield state
            elif name not in gone:
                yield self._base[name]
        for name in self._added:
            yield own[name]

    def added_names(self) -> list[str]:
        """Members not in the base, in insertion order."""
        return list(self._added)

    def base_overrides(self) -> list[MemberState]:
        """Our own records of base members (changed, or ourselves), in insertion order."""
        base = self._base
        return [m for name, m in self._own.items() if name in base]

    def gone_names(self) -> list[str]:
        """Base members removed from this table."""
        return list(self._gone)

    def changed_names(self) -> list[str]:
        """Members whose record is not the shared base one: changed, added or removed."""
        return [*self._own, *self._gone]

    def untouched_base(self) -> int:
        """Base members still held as the shared record."""
        base = self._base
        return len(base) - len(self._gone) - sum(1 for name in self._own if name in base)

    def overrides(self) -> list[MemberState]:
        """Our own records (changed or added members), in insertion order."""
        return list(self._own.values())

    # --- changes ------------------------------------------------------------------------

    def insert(self, state: MemberState, rng: random.Random) -> None:
        name = state.name
        if self.get(name) is not None:
            raise ValueError(f"{name} is already in the table")
        self._own[name] = state
        if name in self._base:
            self._gone.pop(name, None)
        else:
            self._added_pos[name] = len(self._added)
            self._added.append(name)
        self._addr[state.address] = name
        self._counts[state.state] += 1
        self._size += 1
        if self._tail is not None:
            self._tail.insert(rng.randrange(len(self._tail) + 1), name)

    def remove(self, name: str) -> MemberState:
        state = self.get(name)
        if state is None or name == self.local_name:
            raise KeyError(name)
        self._own.pop(name, None)
        if name in self._base:
            self._gone[name] = None
        else:
            pos = self._added_pos.pop(name)
            last = self._added.pop()
            if last != name:
                self._added[pos] = last
                self._added_pos[last] = pos
        if self.by_address(state.address) is state:
            self._addr[state.address] = None
        self._counts[state.state] -= 1
        self._size -= 1
        self._drawn.discard(name)
        if self._tail is not None and name in self._tail:
            self._tail.remove(name)
        return state

    def set_state(self, state: MemberState, new: NodeStateType, now_ms: int) -> None:
        """Change a (mutable) record's state, keeping the counters right."""
        if state.state != new:
            self._counts[state.state] -= 1
            self._counts[new] += 1
            state.state = new
        state.state_change_ms = now_ms

    def set_address(self, state: MemberState, address: Address) -> None:
        """Move a (mutable) record to ``address``; the newest name at an address wins."""
        if state.address == address:
            return
        if self.by_address(state.address) is state:
            self._addr[state.address] = None
        state.address = address
        self._addr[address] = state.name

    # --- random choices -----------------------------------------------------------------

    def _name_at(self, index: int) -> str:
        nb = len(self._base_names)
        return self._base_names[index] if index < nb else self._added[index - nb]

    def _space(self) -> int:
        return len(self._base_names) + len(self._added)

    def random_members(
        self, k: int, exclude: Callable[[MemberState], bool], rng: random.Random
    ) -> list[MemberState]:
        """Up to k distinct members not excluded, uniformly at random (util.go
        ``kRandomNodes``): O(k) expected draws, then an exact scan if luck runs out."""
        if k <= 0:
            return []
        space = self._space()
        chosen: list[MemberState] = []
        seen: set[str] = set()
        if self._size > 2 * k:
            gone, own, base = self._gone, self._own, self._base
            base_names, added = self._base_names, self._added
            nb = len(base_names)
            getrandbits, bits = rng.getrandbits, space.bit_length()
            for _ in range(_SAMPLE_TRIES * k):
                i = getrandbits(bits)  # ``randrange(space)`` (see ``below``), inlined
                while i >= space:
                    i = getrandbits(bits)
                name = base_names[i] if i < nb else added[i - nb]  # ``_name_at``, ``get``
                if name in seen or name in gone:
                    continue
                seen.add(name)
                state = own.get(name)
                if state is None:
                    state = base.get(name)
                if state is not None and not exclude(state):
                    chosen.append(state)
                    if len(chosen) == k:
                        return chosen
        rest = [m for m in self if m.name not in seen and not exclude(m)]
        want = min(k - len(chosen), len(rest))
        chosen.extend(rest[i] for i in _sample_indexes(rng, len(rest), want))
        return chosen

    # --- probe rounds (SWIM §4.3) -------------------------------------------------------

    def undrawn(self) -> int:
        """Members not yet drawn in this probe round."""
        return self._size - len(self._drawn)

    def draw(self, rng: random.Random) -> MemberState:
        """The next member of this round, uniformly among those not yet drawn."""
        name = self._draw_name(rng)
        self._drawn.add(name)
        state = self.get(name)
        assert state is not None
        return state

    def _draw_name(self, rng: random.Random) -> str:
        if self._tail is not None:
            return self._tail.pop()
        space, drawn, gone = self._space(), self._drawn, self._gone
        for _ in range(_SAMPLE_TRIES):
            name = self._name_at(below(rng, space))
            if name not in drawn and name not in gone:
                return name
        tail = [m.name for m in self if m.name not in drawn]
        rng.shuffle(tail)
        self._tail = tail
        return tail.pop()

    def new_round(self) -> None:
        self._drawn.clear()
        self._tail = None

    def next_in_round(
        self,
        rng: random.Random,
        skip: Callable[[MemberState], bool],
        on_wrap: Callable[[], None],
    ) -> MemberState | None:
        """The next member of the round not skipped. When every member of the round has
        been drawn, ``on_wrap`` runs (reaping, state.go ``resetNodes``) and a new round
        begins; None if even a fresh round offers nobody."""
        wrapped = False
        while True:
            if self.undrawn() == 0:
                if wrapped:
                    return None
                on_wrap()
                self.new_round()
                wrapped = True
                continue
            m = self.draw(rng)
            if not skip(m):
                return m


def below(rng: random.Random, n: int) -> int:
    """``rng.randrange(n)`` for n ≥ 1: the same number from the same draws, as CPython
    computes it (``Random._randbelow_with_getrandbits``: the fewest bits that cover n,
    redrawn while out of range), without the two Python-level calls ``randrange`` makes
    per draw; the simulator draws millions. tests/swim/test_bootstrap.py checks the
    equality, so a Python that draws otherwise fails there, not silently."""
    if n < 1:
        raise ValueError(f"below needs n >= 1, got {n}")
    bits = n.bit_length()
    r = rng.getrandbits(bits)
    while r >= n:
        r = rng.getrandbits(bits)
    return r


def _sample_indexes(rng: random.Random, n: int, k: int) -> list[int]:
    """k distinct indexes of range(n), uniformly (a partial Fisher-Yates)."""
    if k >= n:
        order = list(range(n))
        rng.shuffle(order)
        return order
    return rng.sample(range(n), k)
