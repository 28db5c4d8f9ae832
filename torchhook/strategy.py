"""What a new process group looks like and how to get there: pure rules, no torch, no I/O.

The elastic engine (``torchhook.engine``, with its DDP, HSDP and FSDP strategies) consults
these functions and does the process-group plumbing; the tests iterate the tables.

Layout (``Layout.of``): a job's view lists nodes oldest registration first, each with its
number of local ranks; global ranks follow that order, then the local rank (node 0's
local ranks are 0..R0-1, node 1's come next, ...). Every member computes the same layout
from the same view. Global rank 0 is the oldest node's local rank 0. A node's ranks are
contiguous, so an HSDP mesh (replicate across nodes × shard within a node) is the layout
read as a ``nodes × ranks`` matrix.

Agreement: before a group forms, every rank of the new layout publishes a ``RankInfo`` in
the formation store (the token of the group it still holds, its step, whether it holds
state); the new rank 0 reads them all, calls :func:`decide` and publishes the ``Plan``;
every rank follows that one plan, so no two ranks can take different actions even when
their own histories differ (a node that was stopped and came back holds an older group).

Actions (``Plan.action``), by :data:`ACTIONS`:

- ``shrink``: the backend can shrink a communicator in place (NCCL ≥ 2.27:
  ``torch.distributed.shrink_group``, ``supports_shrinking``), every rank of the new layout
  still holds the *same* group (same token), and the new layout is that group minus some
  nodes. Only the survivors call ``shrink_group(plan.exclude, SHRINK_ABORT)``: it aborts
  what is in flight on the old communicator and keeps the survivors' connections, which
  is much cheaper than a new NCCL communicator (a full bootstrap over every rank).
  The survivors keep their relative order, which is also their age order, so a shrink
  and a fresh formation give every survivor the same new rank.
- ``reform``: anything else (gloo cannot shrink; a node joined; some rank no longer holds
  the old group; a node re-registered). Ranks that still hold a group tear it down first
  (``teardown_of``) and all form a fresh one on the formation store. A regrow is always a
  reform, at a step boundary.

Teardown (``teardown_of``, :data:`TEARDOWN`): after a planned switch (every rank answered
the step-boundary all-reduce, nothing is in flight) the old group is destroyed. After a
failure an op may still be stuck in it: NCCL aborts the communicator (``ncclCommAbort``
ends kernels waiting on a dead peer; nothing may run on it afterwards); gloo cannot abort
(its ``abort`` is a no-op in torch 2.13), so the group is kept alive, unused, in a
graveyard, because destroying it blocks until the stuck op times out. Gloo tears down *at
the failure*, before the plan is known (``TEARDOWN_AT_FAILURE``): closing its sockets
makes peers that were not wired to the dead rank fail at once instead of waiting for
the verdict; NCCL keeps its communicator until the plan says whether to shrink it.

State (``Plan.step``, ``Plan.source``, ``Plan.providers``): the newest state wins. Ranks
of one group differ by at most one step after a failure inside a step (some finished the
gradient reduction, some did not).

- DDP (every rank holds everything): the target is the highest step of a rank that holds
  state; its lowest such rank is the ``source``. Ranks that applied that same step in the
  same group as the source (``applied_in``) hold bit-identical state already (DDP's
  invariant); everyone else is a *receiver* and takes parameters, buffers, optimizer state
  and RNG from the source. After a failure between steps nobody receives, and the new
  group needs no state transfer at all. With no state anywhere (first formation), the
  source is rank 0 and everyone else takes its initial parameters.
- HSDP (``shards=R``: rank j of every node holds shard j): the state of shard j can come
  from any node's rank j. A step is applied only after a commit vote that every rank
  reached (``pending_in``: the rank holds fully reduced gradients of its step, reduced in
  that group, but has not applied them), so if anyone applied step s in group G, every
  rank of G holds step s's gradients: a rank at s-1 pending in G rolls forward by
  applying them (``Plan.roll_forward``). Gradients pending from another group (a rank
  that was stopped while the others went on) are never applied. ``providers[j]`` is the lowest rank
  of shard j at the target (after roll-forward); ranks of shard j that are behind or
  fresh receive shard j from it (``Plan.receivers``). A shard with no provider means the
  job lost every copy of it: ``restore = "checkpoint"``.

Sources: research on torch 2.13's c10d (``shrink_group``, ``_abort_process_group``,
gloo's no-op abort, destroy blocking on a stuck op) and torchft's per-step commit
(``should_commit``), summarised with their public references in docs/training.md §5.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

Action = Literal["shrink", "reform"]
Teardown = Literal["none", "destroy", "abort", "graveyard"]
Restore = Literal["memory", "fresh", "checkpoint"]

ACTIONS: tuple[Action, ...] = ("shrink", "reform")
RESTORES: tuple[Restore, ...] = ("memory", "fresh", "checkpoint")
TEARDOWN: Mapping[tuple[str, bool], Teardown] = {
    # (backend, the old group failed) -> what happens to it before a fresh formation
    ("gloo", False): "destroy",
    ("gloo", True): "graveyard",
    ("nccl", False): "destroy",
    ("nccl", True): "abort",
}
TEARDOWN_AT_FAILURE: Mapping[str, bool] = {"gloo": True, "nccl": False}
SHRINKS: Mapping[str, bool] = {"gloo": False, "nccl": True}
"""Whether a backend *may* shrink; NCCL also needs ``supports_shrinking`` at run time."""
PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
"""The peer in a gloo connection error: ``Connection closed by peer [10.0.0.7]:41234``."""
MAX_LOST_REPORT = 64
"""Nodes named in one lost-peer report (the agent's bound on a report, too)."""


class ViewMember(Protocol):
    """What a layout reads of a view's member (``agent.control.JobMember`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def registered_ms(self) -> int: ...
    @property
    def ranks(self) -> int: ...


class Node(NamedTuple):
    """One node of a layout. A named tuple, not a dataclass: every rank builds a layout's
    nodes from the leader's offer at each formation, and a tuple is built several times
    faster (``torchhook.formation_wire``)."""

    name: str
    registered_ms: int
    ranks: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Nodes in join-age order; global ranks follow them, then the local rank."""

    nodes: tuple[Node, ...]

    @classmethod
    def of(cls, members: Iterable[ViewMember]) -> Layout:
        return cls(tuple(Node(m.name, m.registered_ms, m.ranks) for m in members))

    @property
    def world_size(self) -> int:
        return sum(n.ranks for n in self.nodes)

    @property
    def ids(self) -> frozenset[tuple[str, int]]:
        return frozenset((n.name, n.registered_ms) for n in self.nodes)

    @property
    def uniform_ranks(self) -> int | None:
        """Local ranks per node if every node has the same number (an HSDP mesh), else None."""
        sizes = {n.ranks for n in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def ranks_of(self, name: str) -> range:
        first = 0
        for n in self.nodes:
            if n.name == name:
                return range(first, first + n.ranks)
            first += n.ranks
        raise KeyError(name)

    def rank_of(self, name: str, local_rank: int) -> int:
        ranks = self.ranks_of(name)
        if not 0 <= local_rank < len(ranks):
            raise KeyError(f"{name} has no local rank {local_rank}")
        return ranks[local_rank]

    def node_of(self, rank: int) -> tuple[str, int]:
        """(node name, local rank) of a global rank."""
        first = 0
        for n in self.nodes:
            if rank < first + n.ranks:
                return n.name, rank - first
            first += n.ranks
        raise KeyError(rank)

    def describe(self) -> str:
        """``a×2 b×2``: the nodes and their local ranks, for messages."""
        return " ".join(f"{n.name}×{n.ranks}" for n in self.nodes)


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What one rank of the new layout tells the new rank 0 before the group forms."""

    group: str
    """Token of the group this rank still holds ("" if it holds none)."""
    layout: Layout | None
    """That group's layout (None with no group)."""
    step: int
    has_state: bool
    """Holds model and optimizer state (a fresh process does not)."""
    applied_in: str = ""
    """Token of the group in which this rank applied its last step (or took its state)."""
    pending_in: str = ""
    """HSDP: token of the group in which this rank fully reduced the gradients of ``step``
    without applying them ("" if it holds none)."""


@dataclass(frozen=True, slots=True)
class Plan:
    action: Action
    exclude: tuple[int, ...]
    """Old global ranks that a shrink drops (empty for a reform)."""
    step: int
    """The step every rank continues from."""
    restore: Restore
    source: int
    """DDP: the rank whose full state the receivers take (HSDP: step and RNG)."""
    providers: tuple[int, ...] = ()
    """HSDP: per local rank j, the rank that holds shard j at ``step``."""
    receivers: tuple[int, ...] = ()
    """Ranks that take state from the source (DDP) or their shard's provider (HSDP):
    behind, fresh, or not known to be identical."""
    roll_forward: tuple[int, ...] = ()
    """HSDP: ranks that first apply their pending step (they are one step behind)."""


def teardown_of(backend: str, failed: bool) -> Teardown:
    """What to do with a group that a reform replaces (see the module docstring)."""
    return TEARDOWN[(_known(backend), failed)]


def tears_down_at_failure(backend: str) -> bool:
    return TEARDOWN_AT_FAILURE[_known(backend)]


def shrink_excludes(old: Layout, new: Layout) -> tuple[int, ...] | None:
    """Old global ranks to exclude if ``new`` is ``old`` minus whole nodes, else None."""
    if not new.nodes or not new.ids < old.ids:
        return None
    kept = new.ids
    excluded: list[int] = []
    first = 0
    for n in old.nodes:
        if (n.name, n.registered_ms) not in kept:
            excluded.extend(range(first, first + n.ranks))
        first += n.ranks
    return tuple(excluded)


def decide(
    new: Layout,
    infos: Sequence[RankInfo],
    *,
    backend: str,
    supports_shrinking: bool,
    shards: int | None = None,
) -> Plan:
    """The plan for forming ``new`` from every rank's info (``infos[r]`` is global rank r's).

    ``shards=None``: DDP (full state on every rank); ``shards=R``: HSDP with R local ranks
    per node (rank j of every node holds shard j)."""
    if len(infos) != new.world_size:
        raise ValueError(f"{len(infos)} rank infos for a world of {new.world_size}")
    if shards is not None and new.uniform_ranks != shards:
        raise ValueError(f"HSDP needs {shards} local ranks on every node: {new.describe()}")
    action: Action = "reform"
    exclude: tuple[int, ...] = ()
    tokens = {info.group for info in infos}
    old = infos[0].layout
    if SHRINKS[_known(backend)] and supports_shrinking and len(tokens) == 1 and "" not in tokens:
        # every rank holds the same group; shrink it if we only lost nodes
        candidate = shrink_excludes(old, new) if old is not None else None
        if candidate:
            action, exclude = "shrink", candidate
    if shards is None:
        return _ddp_state(action, exclude, infos)
    return _hsdp_state(action, exclude, infos, shards)


def _ddp_state(action: Action, exclude: tuple[int, ...], infos: Sequence[RankInfo]) -> Plan:
    everyone_else = tuple(range(1, len(infos)))
    holders = [r for r, info in enumerate(infos) if info.has_state]
    if not holders:
        return Plan(action, exclude, 0, "fresh", 0, receivers=everyone_else)
    step = max(infos[r].step for r in holders)
    source = min(r for r in holders if infos[r].step == step)
    # the same step applied in the same group: bit-identical to the source already
    token = infos[source].applied_in
    receivers = tuple(
        r for r in range(len(infos)) if r != source and not _same(infos[r], step, token)
    )
    return Plan(action, exclude, step, "memory", source, receivers=receivers)


def _same(info: RankInfo, step: int, token: str) -> bool:
    return info.has_state and info.step == step and bool(token) and info.applied_in == token


def _hsdp_state(
    action: Action, exclude: tuple[int, ...], infos: Sequence[RankInfo], shards: int
) -> Plan:
    holders = [r for r, info in enumerate(infos) if info.has_state]
    if not holders:
        return Plan(action, exclude, 0, "fresh", 0, providers=tuple(range(shards)))
    step = max(infos[r].step for r in holders)
    # gradients pending from group G are the ones applied at `step` only by a rank that
    # applied that step in G (a rank that came back from a stop holds older ones)
    applied = {infos[r].applied_in for r in holders if infos[r].step == step}
    roll = tuple(
        r
        for r in holders
        if infos[r].step == step - 1 and infos[r].pending_in and infos[r].pending_in in applied
    )
    at_step = {r for r in holders if infos[r].step == step} | set(roll)
    providers: list[int] = []
    for j in range(shards):
        shard_ranks = [r for r in at_step if r % shards == j]
        if not shard_ranks:
            return Plan(action, exclude, step, "checkpoint", 0)
        providers.append(min(shard_ranks))
    receivers = tuple(r for r in range(len(infos)) if r not in at_step)
    return Plan(
        action,
        exclude,
        step,
        "memory",
        providers[0],
        providers=tuple(providers),
        receivers=receivers,
        roll_forward=roll,
    )


def lost_peers(error: str, order: Sequence[str], me: str, addrs: Mapping[str, str]) -> list[str]:
    """The nodes of a group (``order``, node names) that a connection error names by
    address (``addrs``: node → gossip address), else every other node: all nodes of one
    host share an address, and the data network may not be the gossip network. A report
    is evidence for the agent to probe at once, never a verdict, so naming too many costs
    a few pings and naming none would cost the head start."""
    others = [n for n in order if n != me]
    hosts = set(PEER_ADDRESS.findall(error))
    named = [n for n in others if addrs.get(n) in hosts]
    return (named or others)[:MAX_LOST_REPORT]


def _known(backend: str) -> str:
    if backend not in SHRINKS:
        raise ValueError(f"backend {backend!r}: only 'gloo' and 'nccl' are supported")
    return backend
