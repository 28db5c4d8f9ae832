"""The ``swim`` torchrun rendezvous backend: rounds whose member set is the gossip view.

    torchrun --rdzv-backend=swim --rdzv-endpoint=SEED_HOST:PORT --rdzv-id=JOB \\
             --nnodes=MIN:MAX --max-restarts=N ...      (SWIM_CONTROL=<local agent socket>)

Registration (torch's ``rendezvous/registry.py`` and ``api.py``, 2.13):
``create_handler`` is the zero-argument target of the ``torchrun.handlers`` entry point
(torch's ``rendezvous/registry.py`` *calls* the loaded object, so it returns the creator).

Rules:

- Discovery is the agents' job. ``--rdzv-endpoint`` names a seed agent: when the local agent
  knows nobody else, it is asked to ``join`` it (the endpoint may be the local agent itself).
- Each node's handler registers in job ``--rdzv-id`` through the local agent
  (``torchhook.client.Membership``), advertising the port of a TCPStore server it hosts.
  The job's view (alive-or-suspect members with a healthy registration, oldest registration
  first, the same order on every node; ``agent/jobs.py``) is the only source of members.
- The *leader* is the oldest member of the view. Its handler's store holds the rounds.
  Leadership only moves when the leader leaves the view (newcomers are always younger), and
  the next oldest then hosts rounds in its own store, which was never used for rounds: no
  stale state survives a leader, and a (leader, round) pair is never reused.
- Node ranks are positions in the sealed member list, i.e. join age: node rank 0 is the
  leader, so the workers' bootstrap store (below) lives on the oldest node.

Round protocol, on the leader's store (keys ``current``, ``r<N>/arrived``, ``r<N>/sealed``):

1. Read ``current`` = N (the leader sets ``0`` before it registers, so it always exists).
2. If ``r<N>/sealed`` exists and lists this node in a round it has not used yet, that round
   is the result. If it is sealed otherwise (without us, or it is the round we are leaving),
   advance with ``compare_set(current, N, N+1)``: conditional on the old value, so racing
   nodes cannot increment twice (a double increment makes ``store.get`` wait forever),
   then reread.
3. Otherwise append our name to ``r<N>/arrived`` and watch the view. The round may be
   sealed by anyone once every member of its view (the oldest ``max_nodes`` of them) has
   arrived and there are at least ``min_nodes``. When there is still room (fewer than
   ``max_nodes``), or nodes arrived that the sealer's view does not show yet (gossip lag),
   the condition must hold for a short last call first (``last_call_timeout``, 1 s, not
   c10d's 30 s), except in a round that only drops members of the previous
   one (the survivors of a failure have nobody new to wait for). The seal is
   ``compare_set(r<N>/sealed, "", members)``: one writer wins, everyone reads its list.
   Requiring *every view member* (not a count) is what stops a late joiner from forming a
   parallel job (split brain): a running member is in the late joiner's
   view, so the late joiner cannot seal without it, and the running member comes because
   ``num_nodes_waiting()`` reports the joiner.
4. Every wait is bounded by ``join_timeout`` (default 600 s) and wakes on each new view
   (or 50 ms); a leader change abandons the round and starts over on the new leader.
5. Before the round is handed to torchrun, this node waits (at most ``VIEW_LAG_S``) until
   its own view shows every member of the sealed round: a member can arrive before gossip
   brings its registration here, and until then ``num_nodes_waiting()`` would count it as
   departed and torchrun would restart the round it just formed. A member still missing
   after the wait has left: reporting it is then right.

``num_nodes_waiting()`` (called by torchrun every ``--monitor-interval``) returns view
members not in the current round (up to the room left below ``max_nodes``) plus round
members that left the view (dead, left, hung or unregistered). The second term is what makes
the stock agent restart survivors at once when a node dies or hangs: torchrun has no
scale-down path of its own (pytorch#111646; a hung node blocks the survivors
for the 30 min gloo timeout without it). It reads only the in-memory view: it never blocks.

Stores (``use_agent_store`` is False). With True, workers would connect to the handler's
store without a prefix (torch ``distributed/rendezvous.py`` ``_create_c10d_store``: "We
create a new TCPStore for every retry"), but ours outlives rounds, and reusing keys across
groups breaks them (docs/training.md §5); c10d's shared store was also seen to hang on
scale-up here. So torchrun's control store is ``PrefixStore("swim/<job>/r<N>")`` on
the leader's store, and ``RendezvousStoreInfo.build`` under that prefix makes worker rank 0
host a fresh TCPStore on a fresh port for every round.

Closing: ``set_closed()`` publishes the registration's group token ``closed``; every
handler that sees it in a view latches closed, and ``next_rendezvous`` then raises
``RendezvousClosedError``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta


def create_handler() -> RendezvousHandlerCreator:
    """The ``torchrun.handlers`` entry point: returns the creator (the registry calls it).

    Defined above the torch imports on purpose: importing torch's rendezvous package loads
    every ``torchrun.handlers`` entry point, this one included, so when this module is
    imported first the package finds it half-initialised and needs this name already.
    """
    return _creator


def _creator(params: RendezvousParameters) -> RendezvousHandler:
    return _create(params)


from torch._C._distributed_c10d import PrefixStore, Store, TCPStore  # noqa: E402
from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils.logging import get_logger  # noqa: E402

from agent.control import ControlClient, ControlError  # noqa: E402
from torchhook.client import JobMember, Membership, MembershipClosed, View  # noqa: E402
from torchhook.formation import Retry, connect_store  # noqa: E402

BACKEND = "swim"
CLOSED_GROUP = "closed"
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_LAST_CALL_S = 1.0
DEFAULT_READ_TIMEOUT_S = 60.0
PROTOCOL_TIMEOUT_S = 5.0
"""Store timeout for our own round operations (none of them waits for a key): a hung
leader costs at most this much before the view is consulted again."""
POLL_S = 0.05
RETRY_S = 0.5
VIEW_LAG_S = 5.0
"""How long a finished round waits for this node's view to show all of its members (rule 5);
gossip brings a registration in well under a second."""
DEFAULT_SEED_PORT = 7946

# Under torch's logger tree (as c10d's dynamic_rendezvous), so torchrun prints these with
# its own messages; the level follows LOGLEVEL.
log = get_logger("torch.distributed.elastic.rendezvous.swim")


@dataclass(frozen=True, slots=True)
class Settings:
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    last_call_s: float = DEFAULT_LAST_CALL_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    control: str | None = None
    local_addr: str | None = None

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> Settings:
        """``--rdzv-conf`` values arrive as strings."""
        return cls(
            float(params.get("join_timeout", DEFAULT_JOIN_TIMEOUT_S)),
            float(params.get("last_call_timeout", DEFAULT_LAST_CALL_S)),
            float(params.get("read_timeout", DEFAULT_READ_TIMEOUT_S)),
            params.get("control"),
            params.local_addr,
        )


@dataclass(frozen=True, slots=True)
class Round:
    leader: tuple[str, int]
    """(name, registered_ms) of the store host: a new registration is a new leader."""
    number: int
    members: tuple[str, ...]


class _Restart(Exception):
    """The leader changed or its store failed: start over from the latest view."""


def leader_key(member: JobMember) -> tuple[str, int]:
    return (member.name, member.registered_ms)


def seal_target(view: View, max_nodes: int) -> tuple[str, ...]:
    """Who a round sealed on ``view`` admits: the oldest ``max_nodes`` members."""
    return view.names[:max_nodes]


def ready_to_seal(
    target: tuple[str, ...],
    arrived: set[str],
    min_nodes: int,
    max_nodes: int,
    previous: tuple[str, ...] = (),
) -> tuple[bool, bool]:
    """(sealable, needs a last call first). A round that only loses members of this node's
    ``previous`` round needs no last call: nobody new was seen, and the survivors of a
    failure are the ones waiting."""
    if len(target) < min_nodes or not arrived.issuperset(target):
        return False, False
    if len(target) >= max_nodes:
        return True, False
    shrink_only = bool(previous) and set(target) <= set(previous) and arrived <= set(previous)
    return True, not shrink_only


def nodes_waiting(view: View, current: Round | None, max_nodes: int) -> int:
    """Joiners that fit below ``max_nodes`` plus members of ``current`` gone from the view."""
    if current is None:
        return 0
    names = set(view.names)
    departed = [m for m in current.members if m not in names]
    room = max_nodes - (len(current.members) - len(departed))
    joiners = [n for n in view.names if n not in current.members]
    return len(departed) + min(len(joiners), max(room, 0))


class SwimRendezvousHandler(RendezvousHandler):
    def __init__(
        self,
        run_id: str,
        endpoint: str,
        min_nodes: int,
        max_nodes: int,
        settings: Settings,
    ) -> None:
        self._run_id = run_id
        self._endpoint = endpoint
        self._min = min_nodes
        self._max = max_nodes
        self._settings = settings
        self._closed = False
        self._round: Round | None = None
        self._clients: dict[tuple[str, int], tuple[Store, Store]] = {}
        # Every handler can become the leader, so every handler hosts a store; "current"
        # exists before the registration makes this node visible.
        self._server = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=settings.read_timeout_s),
            multi_tenant=True,
        )
        self._server.set("current", "0")
        self._ensure_joined()
        self._membership = Membership(
            run_id, control=settings.control, register=True, store_port=self._server.port
        )
        self.node = self._membership.node
        self._membership.add_listener(self._latch_closed)

    # --- RendezvousHandler ------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True
        try:
            self._membership.set_group(CLOSED_GROUP)
        except MembershipClosed:
            log.warning("rendezvous %s: closed locally; the agent is gone", self._run_id)

    def num_nodes_waiting(self) -> int:
        if self._membership.closed is not None:
            return 1  # the registration is gone: re-rendezvous reports why
        return nodes_waiting(self._membership.view, self._round, self._max)

    def shutdown(self) -> bool:
        self._membership.close()
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._settings.join_timeout_s
        self._ensure_joined()
        while True:
            self._check_closed()
            view = self._wait_view(self._enough, deadline)
            leader = view.members[0]
            self._check_closed()
            try:
                sealed = self._run_rounds(leader, deadline)
                info = self._complete(sealed, leader)
                self._catch_up_view(sealed, deadline)
                return info
            except _Restart as why:
                log.info("rendezvous %s: starting over (%s)", self._run_id, why)
                self._wait_change(view, min(RETRY_S, self._left(deadline)))

    # --- rounds -----------------------------------------------------------------------

    def _run_rounds(self, leader: JobMember, deadline: float) -> Round:
        protocol, _ = self._stores(leader)
        key = leader_key(leader)
        try:
            number = int(protocol.get("current"))
            arrived_in: int | None = None
            ready: tuple[tuple[str, ...], float] | None = None
            while True:
                sealed = _read_sealed(protocol, number)
                if sealed is not None:
                    found = Round(key, number, sealed)
                    if self.node in sealed and found != self._round:
                        return found
                    protocol.compare_set("current", str(number), str(number + 1))
                    number = int(protocol.get("current"))
                    continue
                if arrived_in != number:
                    # Store.append exists at runtime but not in the 2.13 stub.
                    protocol.append(f"r{number}/arrived", self.node + "\n")  # type: ignore[attr-defined]
                    arrived_in, ready = number, None
                view = self._membership.view
                if not view.members or leader_key(view.members[0]) != key:
                    raise _Restart("the leader changed")
                ready = self._maybe_seal(protocol, number, view, ready)
                self._wait_change(view, min(POLL_S, self._left(deadline)))
        except RuntimeError as exc:  # torch's DistError family: the leader's store failed
            self._clients.pop(key, None)
            raise _Restart(f"store of leader {key[0]}: {exc}") from None

    def _maybe_seal(
        self,
        store: Store,
        number: int,
        view: View,
        ready: tuple[tuple[str, ...], float] | None,
    ) -> tuple[tuple[str, ...], float] | None:
        """Seal round ``number`` if its rule holds. ``ready``: the target the rule last held
        for and since when (the last call restarts whenever the target changes)."""
        arrived = set(store.get(f"r{number}/arrived").decode().split())
        target = seal_target(view, self._max)
        previous = self._round.members if self._round else ()
        ok, last_call = ready_to_seal(target, arrived, self._min, self._max, previous)
        if not ok:
            return None
        if ready is None or ready[0] != target:
            ready = (target, time.monotonic())
        if last_call and time.monotonic() - ready[1] < self._settings.last_call_s:
            return ready
        store.compare_set(f"r{number}/sealed", "", json.dumps(list(target)))
        return ready

    def _complete(self, sealed: Round, leader: JobMember) -> RendezvousInfo:
        rank = sealed.members.index(self.node)
        _, agent_store = self._stores(leader)
        round_store = PrefixStore(f"swim/{self._run_id}/r{sealed.number}", agent_store)
        me = self._membership.view.member(self.node)
        local_addr = self._settings.local_addr or (me.addr if me else None)
        try:
            bootstrap = RendezvousStoreInfo.build(rank, round_store, local_addr)
        except RuntimeError as exc:  # rank 0 died before publishing its address
            self._clients.pop(sealed.leader, None)
            raise _Restart(f"bootstrap of round {sealed.number}: {exc}") from None
        self._round = sealed
        log.info(
            "rendezvous %s: round %d of leader %s sealed: %s; this node is rank %d",
            self._run_id,
            sealed.number,
            sealed.leader[0],
            ",".join(sealed.members),
            rank,
        )
        return RendezvousInfo(round_store, rank, len(sealed.members), bootstrap)

    def _catch_up_view(self, sealed: Round, deadline: float) -> None:
        """Rule 5: wait, briefly, until the view shows every member of ``sealed``."""
        members = set(sealed.members)
        timeout_s = min(VIEW_LAG_S, self._left(deadline))
        if self._wait_for(lambda v: members <= set(v.names) or self._closed, timeout_s) is None:
            missing = sorted(members - set(self._membership.view.names))
            log.info("rendezvous %s: round members not in the view: %s", self._run_id, missing)

    def _stores(self, leader: JobMember) -> tuple[Store, Store]:
        """(protocol client, client handed to torchrun) for ``leader``'s store; cached.

        Two connections because they need different timeouts: our operations never wait
        for a key, torchrun's ``_assign_worker_ranks`` does (read_timeout, as c10d's)."""
        key = leader_key(leader)
        if key[0] == self.node and leader.store_port == self._server.port:
            return self._server, self._server
        cached = self._clients.get(key)
        if cached is None:
            if leader.store_port == 0:
                raise _Restart(f"leader {leader.name} advertises no store")
            try:
                cached = (
                    _client(leader, PROTOCOL_TIMEOUT_S),
                    _client(leader, self._settings.read_timeout_s),
                )
            except (Retry, RuntimeError) as exc:
                raise _Restart(f"cannot reach the store of {leader.name}: {exc}") from None
            self._clients[key] = cached
        return cached

    # --- views and waits --------------------------------------------------------------

    def _enough(self, view: View) -> bool:
        return self.node in view and len(view.members) >= self._min

    def _wait_for(self, predicate: Callable[[View], bool], timeout_s: float) -> View | None:
        """The first view that satisfies ``predicate`` within ``timeout_s``, or None; a
        watch that ended is a ``RendezvousConnectionError``."""
        try:
            return self._membership.wait(predicate, timeout_s)
        except TimeoutError:
            return None
        except MembershipClosed as exc:
            raise RendezvousConnectionError(str(exc)) from None

    def _wait_view(self, predicate: Callable[[View], bool], deadline: float) -> View:
        view = self._wait_for(lambda v: predicate(v) or self._closed, self._left(deadline))
        if view is None:
            raise RendezvousTimeoutError(
                f"rendezvous {self._run_id}: fewer than {self._min} nodes registered within "
                f"join_timeout={self._settings.join_timeout_s} s "
                f"(view: {', '.join(self._membership.view.names) or 'empty'})"
            )
        return view

    def _wait_change(self, seen: View, timeout_s: float) -> None:
        """Sleep until a new view arrives or ``timeout_s`` passes."""
        if timeout_s <= 0:
            raise RendezvousTimeoutError(
                f"rendezvous {self._run_id}: no round sealed within "
                f"join_timeout={self._settings.join_timeout_s} s"
            )
        self._wait_for(lambda v: v is not seen, timeout_s)

    def _left(self, deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _latch_closed(self, view: View) -> None:
        # Runs on the watch thread: only set a flag.
        if any(m.group == CLOSED_GROUP for m in view.members):
            self._closed = True

    def _check_closed(self) -> None:
        if self._closed:
            raise RendezvousClosedError(f"rendezvous {self._run_id} is closed")

    def _ensure_joined(self) -> None:
        """Ask the local agent to join the seed endpoint while it knows nobody else."""
        if not self._endpoint:
            return
        client = ControlClient(self._settings.control, timeout_s=PROTOCOL_TIMEOUT_S)
        try:
            members = client.request("members")
            if sum(1 for m in members if m.get("status") in ("alive", "suspect")) > 1:
                return
            client.request("join", addrs=[_with_port(self._endpoint)])
        except ControlError as exc:
            # The endpoint may be this very agent, or not up yet: the agent's own
            # --retry-join and later calls cover it, so this is not fatal.
            log.warning("rendezvous %s: join %s: %s", self._run_id, self._endpoint, exc)


def _read_sealed(store: Store, number: int) -> tuple[str, ...] | None:
    key = f"r{number}/sealed"
    if not store.check([key]):
        return None
    return tuple(json.loads(store.get(key)))


def _client(leader: JobMember, timeout_s: float) -> TCPStore:
    """Connect within ``STORE_CONNECT`` (a dead leader refuses, a stopped one never answers:
    either way the view, not a long connect timeout, decides what comes next), then use
    ``timeout_s`` for operations."""
    store = connect_store(leader.addr, leader.store_port, f"store of {leader.name}")
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _with_port(endpoint: str) -> str:
    host, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit() and host:
        return endpoint
    return f"{endpoint}:{DEFAULT_SEED_PORT}"


def _create(params: RendezvousParameters) -> SwimRendezvousHandler:
    return SwimRendezvousHandler(
        params.run_id,
        params.endpoint,
        params.min_nodes,
        params.max_nodes,
        Settings.from_params(params),
    )
