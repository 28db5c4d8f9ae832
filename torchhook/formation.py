"""Agreeing on a new process group through stores: who, under which token, by which plan.

Roles: the *leader* is local rank 0 of the view's oldest node; every other rank of its view
*follows*. Local rank 0 of every node serves a small *directory* store whose port travels
in its job registration (``JobMember.store_port``); the leader offers each formation there.
The pitfalls behind the rules are torch 2.13 facts, summarised in docs/training.md §5.

Rules (numbered as tests/torchhook/test_formation.py cites them; they run on an in-memory
store with every rank's real steps interleaved):

1. **Fresh store, fresh token.** Every formation gets a fresh store from the leader (keys
   reused across groups break them; a store in a fixed trainer would die with it) and a
   fresh random token, even for the same members. The leader writes the token into the
   store, then offers ``{fingerprint, port, token, layout}`` under ``formation`` in its
   directory, with the layout of *its* view (``choose``: with a target size, the
   training nodes that ``torchhook.roster`` picks; the leader's rank is its slot's).
2. **One decider's view.** Views differ for a while as gossip spreads, so every rank forms
   on the leader's layout, not its own: a follower whose view differs still joins. A group
   formed on a stale view switches at its first step boundary.
3. **Who joins.** A follower joins an offer only if its layout lists this node *with this
   registration* (``registered_ms``). A rank not listed (a late joiner, or a node that
   re-registered since the offer) writes nothing and waits for the next offer.
4. **Stale offers.** Before writing, a follower reads the token in the offered store: a
   store that is gone, or one on a reused port that carries another formation's token,
   means the offer is stale (``Retry``; nothing written).
5. **One claimant per rank.** A follower claims its rank with ``compare_set`` on
   ``info/<rank>`` (its ``RankInfo`` tagged with this process's nonce). The first claimant
   holds the rank; a second *process* claiming it (two trainers started with one
   ``LOCAL_RANK``) gets ``ValueError`` and the formation goes on without it; the same
   process claiming again (a lost reply, a retry on the same offer) is idempotent.
6. **Commitment.** Having claimed its rank, a follower follows the plan whatever its own
   view says meanwhile: a rank that walked away would leave the others hanging in the
   group's creation. It still gives up when the leader's store fails (the leader died) or
   ``formation_timeout_s`` passes (the leader is stopped).
7. **Deciding.** The leader waits for every rank's claim, withdraws its offer, then writes
   ``plan``: the decision of ``torchhook.strategy.decide``, ``retry`` (abandoned: nobody
   waits for it; followers raise ``Retry``) or ``error: <why>`` (a job no plan can serve;
   every rank raises ``ValueError``). Withdrawing *before* the plan means a rank that has
   read a plan can never see that formation's offer again and rejoin a decided formation.
8. **Abandoning.** The leader abandons (``retry``) when a node of its layout leaves its
   view or an older node appears, when a store fails, or at the timeout. Gaining a
   younger node is not a reason (the group switches to include it at its first step
   boundary, so a stream of arrivals cannot starve a formation). Before the commitment a
   follower abandons when the oldest node of its own view changes, or its leader's
   directory fails (``Retry``; a dead directory is connected afresh next time).
9. **Agreement.** From 1-8: every rank that returns from one formation holds the same
   plan, token and layout; every other rank of it gets ``Retry`` or the plan's
   ``ValueError``; no rank waits past ``formation_timeout_s`` (plus one wait slice and one
   connection attempt).
10. **Waiting.** A follower's waits are server-side store waits of at most
    ``WAIT_SLICE`` (no polling: n ranks cost the leader's stores O(n) requests per
    formation); the leader checks for all the claims in one request every ``POLL_S`` (so
    it notices a view change at once) and reads them in one ``multi_get``. A follower
    waits for the offer and the plan with TCPStore's ``get`` (a wait of at most
    ``WAIT_SLICE``, then the read, in one call: four calls per follower, six requests); a
    key that must not be waited for is read in one request (``read``). Between waits a
    rank heartbeats and rechecks its view and deadline. The records are
    ``torchhook.formation_wire``'s: packed integers, cheap for every rank to decode.
11. **Connecting** gives up after ``STORE_CONNECT`` (``torchhook.stores.connect_store``:
    a stopped peer's kernel still accepts connections; a refusal at once) and retries
    through the view, which by then has dropped the stopped or dead leader.
12. **A spare follows its drafter** (``leader``): listed in the offer of a member younger
    than its view's oldest, every older one's directory refusing (``torchhook.spares``), it
    follows that member, abandoning as in rule 8 when another becomes the oldest.

The stores are behind two small protocols, ``Store`` and ``Net``, which torch's TCPStore
satisfies (``Formation``, what the trainers use, is ``FormationOn`` over a ``TcpNet``).
``FormationOn.steps`` is the protocol one wait at a time (a generator of ``Wait``);
``agree`` drives it on real stores, the tests drive many ranks' steps on one in-memory
``Net`` with a fake clock.

Sources: PyTorch's ``torch/csrc/distributed/c10d/TCPStore.cpp`` (``compare_set`` on a
missing key, ``wait`` with a timeout and its cancellation, ``get`` as a wait and a read)
and ``TCPStoreLibUvBackend.cpp`` (the default server: a ``get`` of a key deleted after the
wait answers an empty value), checked against torch 2.13 on this machine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Generic, TypeVar

from torchhook import formation_wire as wire
from torchhook.client import JobMember, View
from torchhook.stores import (
    STORE_CONNECT,
    Clock,
    Net,
    Retry,
    Store,
    SystemClock,
    TcpNet,
    connect_store,
)
from torchhook.strategy import Layout, Plan, RankInfo

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

__all__ = [
    "STORE_CONNECT",
    "Agreement",
    "Formation",
    "FormationOn",
    "Retry",
    "Wait",
    "connect_store",
]
S = TypeVar("S", bound=Store)

POLL_S = 0.005
"""The leader checks for the claims this often (one request for all of them), and a
follower that sees an offer not meant for it (rule 3) looks again after this long."""
WAIT_SLICE = timedelta(seconds=1)
"""A follower's longest single store wait (rule 10): a key that arrives ends it at once;
at most this late, a follower waiting for an offer notices that its view's oldest node
changed, and heartbeats (the agent's threshold is seconds). Long because a TCPStore wait
that runs out logs two c10d warnings and looks up both socket addresses in DNS."""
DIRECTORY_OP = timedelta(seconds=1)
"""A directory request to a stopped host blocks for this long before the view is rechecked."""

FORMATION_KEY = "formation"
"""In a leader's directory: the formation it offers now (fingerprint, port, token, layout)."""
TOKEN_KEY = "token"
PLAN_KEY = "plan"
RETRY_PLAN = "retry"
ERROR_PLAN = "error: "


ABSENT = "\x00absent"


def info_key(rank: int) -> str:
    return f"info/{rank}"


def read(store: Store, key: str) -> bytes | None:
    """``key``'s value, or None if it is not there: one request that never waits (a
    TCPStore ``get`` waits for the key first: two). TCPStore's ``compare_set`` returns the
    current value when it is not ``expected``, and for a missing key with a non-empty
    ``expected`` returns ``expected`` and writes nothing."""
    raw = store.compare_set(key, ABSENT, ABSENT)
    return None if raw == ABSENT.encode() else raw


Ready = bool | bytes
"""What a ``Wait`` resumes with: False after a slice without its keys, else True (a
``poll``) or the value of its one key (a follower's wait; see ``Wait``)."""


@dataclass(frozen=True, slots=True)
class Wait(Generic[S]):
    """One step of ``Formation.steps``. A follower waits for one key and resumes with its
    value once it is there (one request that waits and reads: TCPStore's ``get``, so a
    rank resumes once per key it waits for instead of twice; b"" if the key was deleted
    in between), or with False after a slice without it. ``poll``: resume with True once
    ``keys`` are all in ``store``. No keys: a pause of ``POLL_S``, resumed with False."""

    store: S
    keys: tuple[str, ...]
    poll: bool = False
    """Check every ``POLL_S`` instead of waiting on the server (the leader's waits)."""


@dataclass(frozen=True, slots=True)
class Agreement(Generic[S]):
    store: S
    token: str
    plan: Plan
    layout: Layout
    """The leader's layout: the group forms on it (this rank's own view may differ)."""
    rank: int


class FormationOn(Generic[S]):
    """The store side of forming groups for one trainer (one instance per process), on
    the stores of ``net`` (``Formation``: torch's TCPStore)."""

    def __init__(
        self,
        view_now: Callable[[], View],
        *,
        local_rank: int,
        beat: Callable[[], None],
        timeout_s: float,
        store_host: str,
        op_timeout: timedelta,
        net: Net[S],
        clock: Clock | None = None,
        directory: S | None = None,
        choose: Callable[[View], Layout] | None = None,
    ) -> None:
        """``directory``: the directory store this process serves, made by the caller
        before it registers the store's port; None: local rank 0 serves one here.
        ``choose``: the layout a leader offers for its view (``torchhook.roster``);
        default: every member, oldest first."""
        self.view_now = view_now
        self.choose: Callable[[View], Layout] = choose or (lambda v: Layout.of(v.members))
        self.beat = beat
        self.timeout_s = timeout_s
        self.store_host = store_host
        self.net = net
        self.clock: Clock = SystemClock() if clock is None else clock
        self.nonce = os.urandom(8).hex()
        """Tags this process's rank claims (rule 5)."""
        # only local rank 0 can lead (its port is the node's registration's store_port)
        self.directory: S | None = directory
        if directory is None and local_rank == 0:
            self.directory = self.net.serve(store_host, op_timeout)
        self._dir_clients: dict[tuple[str, int], S] = {}

    @property
    def directory_port(self) -> int:
        return 0 if self.directory is None else self.directory.port

    def agree(
        self,
        view: View,
        node: str,
        local_rank: int,
        info: RankInfo,
        decide: Callable[[Layout, list[RankInfo]], Plan],
        leader: str | None = None,
    ) -> Agreement[S]:
        """Meet the other ranks on a fresh store, follow one plan (``leader``: rule 12)."""
        steps = self.steps(view, node, local_rank, info, decide, leader)
        try:
            wait = next(steps)
            while True:
                try:
                    ready = self._wait(wait)
                except (RuntimeError, OSError) as exc:
                    wait = steps.throw(exc)
                else:
                    wait = steps.send(ready)
        except StopIteration as done:
            agreement: Agreement[S] = done.value
            return agreement

    def steps(
        self,
        view: View,
        node: str,
        local_rank: int,
        info: RankInfo,
        decide: Callable[[Layout, list[RankInfo]], Plan],
        leader: str | None = None,
    ) -> Generator[Wait[S], Ready, Agreement[S]]:
        """``agree`` one wait at a time: yields each ``Wait``; a store error during it is
        thrown back in (``generator.throw``)."""
        deadline = self.clock.monotonic() + self.timeout_s
        if leader is None and view.members[0].name == node and local_rank == 0:
            return (yield from self._lead(view, info, decide, deadline))
        return (yield from self._follow(view, node, local_rank, info, deadline, leader))

    def _lead(
        self,
        view: View,
        info: RankInfo,
        decide: Callable[[Layout, list[RankInfo]], Plan],
        deadline: float,
    ) -> Generator[Wait[S], Ready, Agreement[S]]:
        directory = self.directory
        if directory is None:
            raise Retry("only local rank 0 leads")
        layout = self.choose(view)
        try:
            me = layout.rank_of(view.members[0].name, 0)
        except KeyError:
            raise Retry(f"the leader is not in the layout it chose: {layout.describe()}") from None
        token = os.urandom(8).hex()  # rule 1
        store = self.net.serve(self.store_host, timedelta(seconds=self.timeout_s))
        store.set(TOKEN_KEY, token)
        offer = wire.Offer(view.fingerprint, store.port, token, layout)
        directory.set(FORMATION_KEY, wire.encode_offer(offer))
        # the leader's rank: 0 unless a spare took the slot of rank 0 (torchhook.roster)
        keys = [info_key(r) for r in range(layout.world_size) if r != me]

        def still_leading() -> str | None:  # rule 8
            now = self.view_now()
            if not now.members or now.members[0].name != view.members[0].name:
                return "another node is the oldest now"
            gone = layout.ids - {(m.name, m.registered_ms) for m in now.members}
            return f"{sorted(n for n, _ in gone)} left the view" if gone else None

        try:
            try:
                if keys:
                    claims = Wait(store, tuple(keys), poll=True)
                    while not (yield claims):
                        self._check(still_leading, deadline, "every claim")
                infos = wire.decode_claims([_claim(raw) for raw in store.multi_get(keys)])
                infos.insert(me, info)
            finally:
                self._withdraw(directory)  # rule 7: before any plan
            plan = decide(layout, infos)
        except (Retry, RuntimeError, OSError) as exc:
            with contextlib.suppress(RuntimeError, OSError):
                store.set(PLAN_KEY, RETRY_PLAN)  # whoever joined must not wait for a plan
            unreachable = isinstance(exc, Retry) and exc.unreachable
            raise Retry(f"leading {view.fingerprint}: {exc}", unreachable=unreachable) from None
        except ValueError as exc:
            # a job no plan can serve (HSDP with uneven nodes): every rank says why
            with contextlib.suppress(RuntimeError, OSError):
                store.set(PLAN_KEY, ERROR_PLAN + str(exc))
            raise
        store.set(PLAN_KEY, wire.encode_plan(plan))
        return Agreement(store, token, plan, layout, me)

    def _withdraw(self, directory: S) -> None:
        # our own store: it fails only when this process is going down anyway
        with contextlib.suppress(RuntimeError, OSError):
            directory.delete_key(FORMATION_KEY)

    def _follow(
        self, view: View, node: str, local_rank: int, info: RankInfo, deadline: float,
        named: str | None = None,
    ) -> Generator[Wait[S], Ready, Agreement[S]]:  # fmt: skip
        """Join the formation our view's oldest node (or ``named``: rule 12) leads, on its view."""
        leader = view.members[0] if named is None else view.member(named)
        if leader is None:
            raise Retry(f"the leader {named} is not in view {view.fingerprint}")
        passed = {m.name for m in view.members[: view.members.index(leader)]}  # rule 12
        me = view.member(node)
        if me is None:
            raise Retry(f"{node} is not in view {view.fingerprint}")
        if leader.store_port == 0:
            raise Retry(f"the leader {leader.name} serves no directory", unreachable=True)

        def leader_changed() -> str | None:  # rule 8, before the commitment
            now = self.view_now()
            if next((m.name for m in now.members if m.name not in passed), None) != leader.name:
                return "another node is the oldest now"
            return None

        try:
            directory = self._directory_of(leader.addr, leader.store_port)
            offer = yield from self._offer_for(me, directory, leader_changed, deadline, leader)
        except (Retry, RuntimeError, OSError) as exc:
            # a broken connection stays broken: connect afresh next time
            self._dir_clients.pop((leader.addr, leader.store_port), None)
            if isinstance(exc, Retry):
                raise
            # the leader's directory reset or closed the connection: the leader is gone, and
            # trying again before the view changes would spend a connect timeout on it
            raise Retry(f"directory of {leader.name}: {exc}", unreachable=True) from None
        layout = offer.layout
        try:
            rank = layout.rank_of(node, local_rank)
        except KeyError:
            raise Retry(f"local rank {local_rank} is not in the offered layout") from None
        store = self.net.connect(leader.addr, offer.port, "formation store", self.beat)
        try:
            store.set_timeout(timedelta(seconds=self.timeout_s))
            if read(store, TOKEN_KEY) != offer.token.encode():  # rule 4
                raise Retry(f"stale offer {offer.fingerprint}: its store runs another formation")
            claim = f"{self.nonce}\n{wire.encode_claim(info)}"
            held = store.compare_set(info_key(rank), "", claim)
            if held != claim.encode():  # rule 5
                raise ValueError(
                    f"rank {rank} ({node} local rank {local_rank}) of formation "
                    f"{offer.fingerprint} is claimed by another process: two trainers "
                    "were started with the same LOCAL_RANK"
                )
            # committed (rule 6): the plan, whatever our own view says meanwhile
            op_timeout = timedelta(seconds=self.timeout_s)
            raw = yield from self._fetch(store, PLAN_KEY, lambda: None, deadline, "the plan")
            store.set_timeout(op_timeout)  # the process group's store from here on
        except (RuntimeError, OSError) as exc:
            raise Retry(f"formation store: {exc}") from None
        if raw is None or raw == RETRY_PLAN.encode():
            raise Retry(f"the leader abandoned formation {offer.fingerprint}")
        if raw.startswith(ERROR_PLAN.encode()):
            raise ValueError(raw[len(ERROR_PLAN) :].decode())
        return Agreement(store, offer.token, wire.decode_plan(raw), layout, rank)

    def _offer_for(
        self,
        me: JobMember,
        directory: S,
        abandon: Callable[[], str | None],
        deadline: float,
        leader: JobMember,
    ) -> Generator[Wait[S], Ready, wire.Offer]:
        """The leader's current offer, once it lists this node's registration (rule 3)."""
        what = f"a formation led by {leader.name}"
        while True:
            raw = yield from self._fetch(directory, FORMATION_KEY, abandon, deadline, what)
            directory.set_timeout(DIRECTORY_OP)
            offer = parse_offer(raw)  # None: withdrawn
            if offer is not None and (me.name, me.registered_ms) in offer.layout.ids:
                return offer
            # not for us (yet): look again shortly, without writing anything
            if not (yield Wait(directory, ())):
                self._check(abandon, deadline, what)

    def _fetch(
        self,
        store: S,
        key: str,
        abandon: Callable[[], str | None],
        deadline: float,
        what: str,
    ) -> Generator[Wait[S], Ready, bytes | None]:
        """``key``'s value once it is there (None: deleted meanwhile). The waits leave the
        store's operation timeout at ``WAIT_SLICE``: the caller sets its own again."""
        wait = Wait(store, (key,))
        while (ready := (yield wait)) is False:
            self._check(abandon, deadline, what)
        if not isinstance(ready, bytes):
            raise TypeError(f"a wait for {key} resumed without its value")
        return ready or None

    def _check(self, abandon: Callable[[], str | None], deadline: float, what: str) -> None:
        why = abandon()
        if why is not None:
            raise Retry(why)
        if self.clock.monotonic() > deadline:
            raise Retry(f"timed out waiting for {what}", unreachable=True)

    def _wait(self, wait: Wait[S]) -> Ready:
        """One wait on real stores (rule 10); store errors other than a slice that ran out
        propagate (``agree`` throws them into the steps)."""
        self.beat()
        if wait.poll and wait.keys and wait.store.check(list(wait.keys)):
            return True
        if wait.poll or not wait.keys:
            self.clock.sleep(POLL_S)
            return False
        try:
            # TCPStore's get: a server-side wait of at most the store's timeout, then the
            # read, in one call
            wait.store.set_timeout(WAIT_SLICE)
            return wait.store.get(wait.keys[0])
        except (RuntimeError, OSError) as exc:
            if self.net.timed_out(exc):
                return False
            raise

    def _directory_of(self, addr: str, port: int) -> S:
        client = self._dir_clients.get((addr, port))
        if client is None:
            client = self.connect(addr, port, "directory")
            client.set_timeout(DIRECTORY_OP)
            self._dir_clients[(addr, port)] = client
        return client

    def connect(self, addr: str, port: int, what: str) -> S:
        return self.net.connect(addr, port, what, self.beat)


class Formation(FormationOn["TCPStore"]):
    """Formation on torch's TCPStore: what the trainers use."""

    def __init__(
        self,
        view_now: Callable[[], View],
        *,
        local_rank: int,
        beat: Callable[[], None],
        timeout_s: float,
        store_host: str,
        op_timeout: timedelta,
        directory: TCPStore | None = None,
        choose: Callable[[View], Layout] | None = None,
    ) -> None:
        super().__init__(
            view_now,
            local_rank=local_rank,
            beat=beat,
            timeout_s=timeout_s,
            store_host=store_host,
            op_timeout=op_timeout,
            net=TcpNet(),
            directory=directory,
            choose=choose,
        )


def parse_offer(raw: bytes | None) -> wire.Offer | None:
    """The offer in a directory; None when there is none or it does not decode (this rank
    waits for the next one). An offer of another wire version raises ``WireVersionError``
    (a ``ValueError``: the job stops saying that its nodes run different torchhooks)."""
    if not raw:
        return None
    try:
        return wire.decode_offer(raw)
    except wire.WireVersionError:
        raise
    except wire.WireError:
        return None


def _claim(raw: bytes) -> bytes:
    """A claim is ``<nonce>\\n<RankInfo record>`` (rule 5): the record."""
    return raw.partition(b"\n")[2]
