"""Agreeing on a new process group through stores: who, under which token, by which plan.

Rules (the pitfalls are torch 2.13 facts, summarised in docs/training.md §5):

- Every formation uses a fresh store (reusing keys across groups breaks them), hosted by
  the view's oldest node's local rank 0, the *leader* (a store in a fixed trainer would
  die with it): local rank 0 of every node serves a small *directory* TCPStore whose port
  travels in its job registration; the leader creates a formation store per formation
  and offers it in its directory under ``formation``, with the layout of *its* view.
- One decider, one view: views differ for a while as gossip spreads (nodes completing
  their registrations, a verdict reaching agents at different times), so every rank
  forms on the leader's layout, not its own. A rank joins the offered formation if the
  layout lists its node, writes its ``RankInfo`` under ``info/<rank>`` and from then on
  is committed: it waits for ``plan`` and follows it whatever its own view says, because
  a rank that walked away after offering its info would leave the others hanging in the
  group's creation. A group formed on a stale view switches at its first step boundary.
- The leader waits for every rank's info, decides (``torchhook.strategy.decide``) and
  writes ``plan`` (or ``error: <why>`` for a job no plan can serve, which every rank then
  raises as ``ValueError``). It abandons the formation (``plan = retry``, so nobody waits for it)
  when a node of its layout leaves its view or an older node appears; gaining a newcomer
  is not a reason (the group switches to include it at its first step boundary, so a
  stream of arrivals cannot starve the formation).
- Every wait polls (``POLL_S``), keeps the heartbeat going, and gives up with ``Retry``
  when a store fails (a peer died), ``formation_timeout_s`` passes, or, before the
  commitment, the oldest node of this rank's view changes.
- A store client is built on a helper thread: TCPStore's constructor has no deadline
  against a peer whose process is stopped (its kernel still accepts the connection), and
  a trainer blocked there would stop heartbeating and be flagged hung itself. After
  ``STORE_CONNECT`` it gives up and retries through the view, which by then has dropped
  the stopped leader.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import TCPStore

from torchhook.client import View
from torchhook.strategy import Layout, Plan, RankInfo

POLL_S = 0.005
DIRECTORY_OP = timedelta(seconds=1)
"""A directory request to a stopped host blocks for this long before the view is rechecked."""
STORE_CONNECT = timedelta(seconds=0.5)
"""Connecting to a formation store or a directory: TCPStore retries a refused connection
until this runs out, and a gloo error can start a formation on a view that still lists a
dead leader; a short attempt, retried through the view, costs at most this after the
verdict."""


FORMATION_KEY = "formation"
"""In a leader's directory: the formation it runs now (fingerprint, store port, layout)."""
RETRY_PLAN = "retry"
ERROR_PLAN = "error: "


class Retry(Exception):
    """A formation attempt that must start over with the latest view. ``unreachable``: the
    leader could not be reached (dead, or stopped), so trying again before the view
    changes would only spin."""

    def __init__(self, why: str, *, unreachable: bool = False) -> None:
        super().__init__(why)
        self.unreachable = unreachable


@dataclass(frozen=True, slots=True)
class Agreement:
    store: TCPStore
    token: str
    plan: Plan
    layout: Layout
    """The leader's layout: the group forms on it (this rank's own view may differ)."""
    rank: int


class Formation:
    """The store side of forming groups for one trainer (one instance per process)."""

    def __init__(
        self,
        view_now: Callable[[], View],
        *,
        local_rank: int,
        beat: Callable[[], None],
        timeout_s: float,
        store_host: str,
        op_timeout: timedelta,
    ) -> None:
        self.view_now = view_now
        self.beat = beat
        self.timeout_s = timeout_s
        self.store_host = store_host
        # only local rank 0 can lead (its port is the node's registration's store_port)
        self.directory: TCPStore | None = None
        if local_rank == 0:
            self.directory = TCPStore(
                store_host, 0, is_master=True, wait_for_workers=False, timeout=op_timeout
            )
        self._dir_clients: dict[tuple[str, int], TCPStore] = {}

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
    ) -> Agreement:
        """Meet the other ranks on a fresh store and follow one plan. Raises ``Retry``."""
        deadline = time.monotonic() + self.timeout_s
        leader = view.members[0]
        if leader.name == node and local_rank == 0:
            return self._lead(view, info, decide, deadline)
        return self._follow(view, node, local_rank, info, deadline)

    def _lead(
        self,
        view: View,
        info: RankInfo,
        decide: Callable[[Layout, list[RankInfo]], Plan],
        deadline: float,
    ) -> Agreement:
        assert self.directory is not None, "only local rank 0 leads"
        layout = Layout.of(view.members)
        store = TCPStore(
            self.store_host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        token = os.urandom(8).hex()  # a fresh token per formation, even for the same members
        store.set("token", token)
        store.set("info/0", info.encode())
        offer = {"fingerprint": view.fingerprint, "port": store.port, "layout": layout.encode()}
        self.directory.set(FORMATION_KEY, json.dumps(offer))
        keys = [f"info/{r}" for r in range(layout.world_size)]

        def still_leading() -> str | None:
            now = self.view_now()
            if not now.members or now.members[0].name != view.members[0].name:
                return "another node is the oldest now"
            gone = layout.ids - {(m.name, m.registered_ms) for m in now.members}
            return f"{sorted(n for n, _ in gone)} left the view" if gone else None

        try:
            self._poll(lambda: store.check(keys), still_leading, deadline, "every rank's info")
            infos = [RankInfo.decode(v) for v in store.multi_get(keys)]
            plan = decide(layout, infos)
        except (Retry, RuntimeError, OSError) as exc:
            with contextlib.suppress(RuntimeError, OSError):
                store.set("plan", RETRY_PLAN)  # whoever joined must not wait for a plan
            raise Retry(f"leading {view.fingerprint}: {exc}") from None
        except ValueError as exc:
            # a job no plan can serve (HSDP with uneven nodes): every rank says why
            with contextlib.suppress(RuntimeError, OSError):
                store.set("plan", ERROR_PLAN + str(exc))
            raise
        finally:
            # late arrivals must not join a formation that is decided or abandoned
            self.directory.delete_key(FORMATION_KEY)
        store.set("plan", plan.encode())
        return Agreement(store, token, plan, layout, 0)

    def _follow(
        self, view: View, node: str, local_rank: int, info: RankInfo, deadline: float
    ) -> Agreement:
        """Join the formation that the oldest node of our view leads, on *its* view: views
        differ while gossip spreads, and one decider's view is what everyone forms on (a
        group on a slightly stale view switches at its first step boundary)."""
        leader = view.members[0]
        me = view.member(node)
        assert me is not None
        if leader.store_port == 0:
            raise Retry(f"the leader {leader.name} serves no directory", unreachable=True)
        directory = self._directory_of(leader.addr, leader.store_port)
        offer: dict[str, Any] = {}

        def offered() -> bool:
            raw = directory.get(FORMATION_KEY) if directory.check([FORMATION_KEY]) else None
            try:
                offer.update(json.loads(raw) if raw else {})
            except ValueError:
                # seen once under load: an empty value while the leader withdrew its offer
                # (delete_key between our check and get); not an offer yet, poll again
                return False
            if "layout" not in offer:
                return False
            return [me.name, me.registered_ms] in [n[:2] for n in offer["layout"]]

        def leader_changed() -> str | None:
            now = self.view_now()
            if not now.members or now.members[0].name != leader.name:
                return "another node is the oldest now"
            return None

        try:
            self._poll(offered, leader_changed, deadline, f"a formation led by {leader.name}")
        except Retry:
            # a broken connection stays broken: connect afresh next time
            self._dir_clients.pop((leader.addr, leader.store_port), None)
            raise
        layout = Layout.decode(offer["layout"])
        rank = layout.rank_of(node, local_rank)
        store = self.connect(leader.addr, int(offer["port"]), "formation store")
        try:
            store.set_timeout(timedelta(seconds=self.timeout_s))
            store.set(f"info/{rank}", info.encode())
            # committed: having offered our info we follow the leader's plan whatever our
            # own view says meanwhile (a rank that left here would hang the others' init)
            self._poll(lambda: store.check(["plan"]), lambda: None, deadline, "the plan")
            raw = store.get("plan")
            if raw == RETRY_PLAN.encode():
                raise Retry(f"the leader abandoned formation {offer['fingerprint']}")
            if raw.startswith(ERROR_PLAN.encode()):
                raise ValueError(raw[len(ERROR_PLAN) :].decode())
            token = store.get("token").decode()
            return Agreement(store, token, Plan.decode(raw), layout, rank)
        except (RuntimeError, OSError) as exc:
            raise Retry(f"formation store: {exc}") from None

    def _directory_of(self, addr: str, port: int) -> TCPStore:
        client = self._dir_clients.get((addr, port))
        if client is None:
            client = self.connect(addr, port, "directory")
            client.set_timeout(DIRECTORY_OP)
            self._dir_clients[(addr, port)] = client
        return client

    def connect(self, addr: str, port: int, what: str) -> TCPStore:
        return connect_store(addr, port, what, beat=self.beat)

    def _poll(
        self,
        ready: Callable[[], bool],
        abandon: Callable[[], str | None],
        deadline: float,
        what: str,
    ) -> None:
        while True:
            try:
                if ready():
                    return
            except (RuntimeError, OSError) as exc:
                raise Retry(f"waiting for {what}: {exc}") from None
            why = abandon()
            if why is not None:
                raise Retry(why)
            if time.monotonic() > deadline:
                raise Retry(f"timed out waiting for {what}", unreachable=True)
            self.beat()
            time.sleep(POLL_S)


def connect_store(
    addr: str, port: int, what: str, *, beat: Callable[[], None] = lambda: None
) -> TCPStore:
    """A TCPStore client, built on a helper thread while this one keeps beating (see the
    module docstring): gives up with ``Retry(unreachable=True)`` after ``STORE_CONNECT``
    (a refused connection is retried by TCPStore until then; a stopped peer never
    answers). The abandoned thread ends when the peer resumes or dies. The client's
    timeout for later operations is the caller's to set (``set_timeout``)."""
    result: list[Any] = []

    def connect() -> None:
        try:
            result.append(TCPStore(addr, port, is_master=False, timeout=STORE_CONNECT))
        except (RuntimeError, OSError) as exc:
            result.append(exc)

    thread = threading.Thread(target=connect, name=f"connect-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + STORE_CONNECT.total_seconds()
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(POLL_S)
        beat()
    if not result:
        raise Retry(f"{what} at {addr}:{port}: no answer within {STORE_CONNECT}", unreachable=True)
    if isinstance(result[0], BaseException):
        raise Retry(f"{what} at {addr}:{port}: {result[0]}", unreachable=True)
    store: TCPStore = result[0]
    return store
